"""The benchmark scripts' option types refuse what would run forever or measure nothing."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timing import check_agreement, positive, positive_size  # noqa: E402


def test_sizes_are_positive_and_finite():
    # bench_ray.py --megabytes inf wrote until the disk was full; -5 ran 13 s before failing (review).
    assert positive_size("0.5") == 0.5 and positive_size("16") == 16.0
    for bad in ("inf", "nan", "-5", "0", "lots"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected a positive finite number, got '{bad}'"):
            positive_size(bad)
    assert positive("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive integer"):
        positive("0")


def test_scripts_refuse_to_report_methods_that_disagree():
    # bench_score.py and bench_dpo.py printed the difference but timed a disagreeing method (review).
    check_agreement({"HF per example": 5e-9, "HF padded": 1e-6}, 1e-6, "per-example NLL sums")
    with pytest.raises(SystemExit, match=r"HF padded: per-example NLL sums differ from the reference by 2\.0e-06 "
                                         r"\(relative\), more than 1e-06; .* no timing is reported"):
        check_agreement({"HF per example": 5e-9, "HF padded": 2e-6}, 1e-6, "per-example NLL sums")
    with pytest.raises(SystemExit, match="seqpack packed: losses differ from the reference by nan"):
        check_agreement({"seqpack packed": float("nan")}, 1e-3, "losses")
