"""The README's "Training with PyTorch" loop runs as written (its blocks are fenced
``python torch`` so the plain README test does not need PyTorch)."""

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="seqpack.torch needs PyTorch: pip install 'seqpack[torch]'")

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.slow
def test_the_training_loop_runs_and_learns(capsys):
    blocks = re.findall(r"```python torch\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    namespace = {}
    torch.manual_seed(0)
    exec(compile(blocks[0], str(README), "exec"), namespace)
    losses = [float(line.split()[3]) for line in capsys.readouterr().out.splitlines()]
    assert len(losses) == 2 and losses[1] < losses[0]
    state = namespace["resume_from"]
    assert state["epoch"] == 1 and state["position"] == len(namespace["dataset"]) > 2
