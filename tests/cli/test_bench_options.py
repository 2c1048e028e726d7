"""The benchmark scripts' option types refuse what would run forever or measure nothing."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timing import positive, positive_size  # noqa: E402


def test_sizes_are_positive_and_finite():
    # bench_ray.py --megabytes inf wrote until the disk was full; -5 ran 13 s before failing (review).
    assert positive_size("0.5") == 0.5 and positive_size("16") == 16.0
    for bad in ("inf", "nan", "-5", "0", "lots"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"expected a positive finite number, got '{bad}'"):
            positive_size(bad)
    assert positive("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive integer"):
        positive("0")
