"""pytest-benchmark form of ``bench_placement.py``: ``pytest bench/test_bench_placement.py``.

``SEQPACK_BENCH_PLACEMENT_N`` sets the examples per policy (default 10,000,000); the
plain-Python next-fit reference places a tenth of them. Each test records examples/s and the
real-target fraction in the benchmark's ``extra_info``.
"""

import os
import sys
from pathlib import Path

import pytest

from bench_placement import CAPACITY, lognormal_lengths
from seqpack.packing import lower_bound_rows, place, real_target_fraction
from seqpack.packing.placement import POLICIES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the plain-Python references
from reference import next_fit_placements  # noqa: E402

COUNT = int(os.environ.get("SEQPACK_BENCH_PLACEMENT_N", "10000000"))


@pytest.fixture(scope="module")
def lengths():
    return lognormal_lengths(COUNT)


@pytest.mark.parametrize("policy", POLICIES)
def test_place(benchmark, lengths, policy):
    placement = benchmark.pedantic(
        place, args=(lengths, CAPACITY, policy), rounds=5, iterations=1, warmup_rounds=1
    )
    fraction = real_target_fraction(lengths, placement.row_count, CAPACITY)
    best = real_target_fraction(lengths, lower_bound_rows(lengths, CAPACITY), CAPACITY)
    benchmark.extra_info.update(
        examples=COUNT,
        examples_per_second=COUNT / benchmark.stats.stats.median,
        rows=placement.row_count,
        real_target_fraction=fraction,
        fraction_of_best=fraction / best,
    )
    if policy == "best-fit-decreasing":
        assert fraction >= 0.99 * best


def test_python_next_fit(benchmark, lengths):
    sample = lengths[: max(1, COUNT // 10)].tolist()
    placements = benchmark.pedantic(next_fit_placements, args=(sample, CAPACITY), rounds=3, iterations=1)
    placement = place(sample, CAPACITY)
    assert placements == list(zip(placement.rows.tolist(), placement.starts.tolist()))
    benchmark.extra_info.update(
        examples=len(sample),
        examples_per_second=len(sample) / benchmark.stats.stats.median,
        rows=placement.row_count,
    )
