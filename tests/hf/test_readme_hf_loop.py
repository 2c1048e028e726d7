"""The README's Hugging Face blocks, the training loop and the evaluation, run as written (they
are fenced ``python hf`` so the plain README test needs neither PyTorch nor transformers)."""

import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("torch", reason="seqpack.hf needs PyTorch: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")

README = Path(__file__).resolve().parents[2] / "README.md"


def hf_blocks() -> list[str]:
    blocks = re.findall(r"```python hf\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert len(blocks) == 2  # the training loop, then the evaluation
    return blocks


@pytest.mark.slow
def test_the_hugging_face_loop_runs_and_learns(capsys):
    exec(compile(hf_blocks()[0], str(README), "exec"), {})  # noqa: S102 (the README block is the test)
    losses = [float(line.split()[3]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0]


def test_the_evaluation_block_runs_and_counts_every_example(capsys):
    namespace = {}
    exec(compile(hf_blocks()[1], str(README), "exec"), namespace)  # noqa: S102 (the README block is the test)
    (line,) = capsys.readouterr().out.splitlines()
    match = re.fullmatch(r"(\d+\.\d{3}) nats per target over (\d+) targets, 24 examples", line)
    assert match, line
    scores, plan = namespace["scores"], namespace["plan"]
    assert int(match[2]) == scores.total_targets == plan.report().supervised_targets
    assert float(match[1]) == pytest.approx(scores.nll_sums.sum() / scores.total_targets, abs=5e-4)
