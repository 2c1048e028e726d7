"""``bench/bench_dpo.py`` run as a user runs it, at the smallest size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
@pytest.mark.bench
def test_bench_dpo_json_times_both_steps_and_their_losses_agree():
    pytest.importorskip("trl", reason="bench_dpo.py's TRL step needs the bench extra: pip install 'seqpack[bench]'")
    result = subprocess.run([sys.executable, str(BENCH / "bench_dpo.py"), "--pairs", "2", "--repeats", "1",
                             "--threads", "1", "--json"], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["matmul_peak_gflops"] > 0  # measured in the run (review)
    methods = {"TRL padded", "seqpack packed"}
    assert set(report["seconds"]) == methods and all(len(times) == 1 and times[0] > 0
                                                     for times in report["seconds"].values())
    assert report["seqpack_speedup"][0] == pytest.approx(report["seconds"]["TRL padded"][0]
                                                         / report["seconds"]["seqpack packed"][0])
    # float32 on both sides; the reference differs from the policy, so the loss is not log 2
    assert report["loss_relative_difference"] < 1e-3 and abs(report["loss"]["TRL padded"] - 0.6931472) > 1e-3
    assert max(report["logps_max_relative_difference"].values()) < 1e-4
    cells = report["cells"]
    assert cells["TRL padded"]["rows"] == 4 and cells["seqpack packed"]["width"] == 2048
    # Every sequence's tokens in TRL's rows; one cell fewer per sequence in seqpack's (its last token is only a target)
    assert cells["TRL padded"]["real"] - cells["seqpack packed"]["real"] == 4
    assert set(report["step_peak_memory"]) == methods
    assert all(probe["extra_bytes"] > 0 for probe in report["step_peak_memory"].values())
