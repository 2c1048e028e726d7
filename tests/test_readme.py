"""The README's Python examples run as written."""

import re
from pathlib import Path


import seqpack as sp

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run():
    """Each block runs on its own, as a reader would paste it into a fresh interpreter."""
    blocks = python_blocks()
    assert len(blocks) >= 3
    namespaces = []
    for block in blocks:
        namespaces.append({})
        exec(compile(block, str(README), "exec"), namespaces[-1])
    batch = next(namespace["batch"] for namespace in namespaces if "abc" in namespace)
    assert isinstance(batch, sp.PackedBatch)
    assert batch.segments.tolist() == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]


def test_from_raw_text_is_short_and_packs_every_prediction():
    """The "From raw text" example: under 10 lines, every prediction of every text packed once."""
    block = python_blocks()[0]
    assert "from_texts" in block and len([line for line in block.splitlines() if line.strip()]) < 10
    namespace = {}
    exec(compile(block, str(README), "exec"), namespace)
    epoch, texts = namespace["epoch"], namespace["texts"]
    predictions = sum(len(text.encode()) + 1 for text in texts)  # content plus EOS, BOS is no target
    assert epoch.target_count == predictions
    assert len(namespace["table"]) > len(texts)  # the long text was cut, not truncated


def test_readme_commands_are_the_setup_commands():
    text = README.read_text()
    assert 'pip install . && seqpack pack --sample --out stdlib/ && seqpack verify stdlib/' in text
    assert 'pip install ".[test]" && pytest' in text
