"""The README's "Training a Hugging Face model" loop runs as written (its block is fenced
``python hf`` so the plain README test needs neither PyTorch nor transformers)."""

import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("torch", reason="seqpack.hf needs PyTorch: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_the_hugging_face_loop_runs_and_learns(capsys):
    blocks = re.findall(r"```python hf\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) == 1
    exec(compile(blocks[0], str(README), "exec"), {})  # noqa: S102 (the README block is the test)
    losses = [float(line.split()[3]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0]
