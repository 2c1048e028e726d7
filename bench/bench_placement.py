"""Placement throughput and real-target fraction of the three policies, measured in one run.

Workload: example prediction lengths drawn lognormal (median 250, sigma 1,
``numpy.random.default_rng(0)``), rounded and clipped to [1, capacity], capacity 2048.
Each compiled policy places ``--n`` examples; the plain-Python next-fit reference
(``seqpack._reference.next_fit_placements``, on a list) places the first
``--reference-n`` of them and is reported per example. Times are the median of
``--repeat`` calls of ``seqpack.place`` after one untimed call (validation, sorting and
output allocation included). Run ``python bench/bench_placement.py [--n 10000000]``; the same measurements
run under pytest-benchmark with ``pytest bench/test_bench_placement.py``.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
from timing import conditions, median_seconds, positive

from seqpack.packing import lower_bound_rows, place, real_target_fraction
from seqpack.packing.placement import POLICIES

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the plain-Python references
from reference import next_fit_placements  # noqa: E402

CAPACITY = 2048
MEDIAN_LENGTH = 250


def lognormal_lengths(count, capacity=CAPACITY, seed=0):
    """Example prediction lengths: lognormal around ``MEDIAN_LENGTH``, sigma 1, in [1, capacity]."""
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(mean=np.log(MEDIAN_LENGTH), sigma=1.0, size=count)
    return np.clip(np.rint(draws), 1, capacity).astype(np.int64)


def measure(count, reference_count, repeat, capacity=CAPACITY):
    """One row per method: seconds, examples/s, rows and real-target fraction."""
    lengths = lognormal_lengths(count, capacity)
    bound = lower_bound_rows(lengths, capacity)
    best = real_target_fraction(lengths, bound, capacity)
    results = []
    for policy in POLICIES:
        row_count = place(lengths, capacity, policy).row_count  # also the untimed warm-up call
        seconds = median_seconds(lambda: place(lengths, capacity, policy), repeat)
        results.append(
            {
                "method": policy,
                "examples": count,
                "seconds": seconds,
                "rate": count / seconds,
                "rows": row_count,
                "fraction": real_target_fraction(lengths, row_count, capacity),
                "best": best,
            }
        )
    sample = lengths[:reference_count].tolist()
    reference_rows = next_fit_placements(sample, capacity)[-1][0] + 1
    seconds = median_seconds(lambda: next_fit_placements(sample, capacity), repeat)
    results.append(
        {
            "method": "python next-fit",
            "examples": reference_count,
            "seconds": seconds,
            "rate": reference_count / seconds,
            "rows": reference_rows,
            "fraction": real_target_fraction(sample, reference_rows, capacity),
            "best": real_target_fraction(sample, lower_bound_rows(sample, capacity), capacity),
        }
    )
    return results, bound, best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=positive, default=10_000_000, help="examples placed by each policy")
    parser.add_argument("--reference-n", type=positive, default=1_000_000, help="examples for the Python loop")
    parser.add_argument("--repeat", type=positive, default=3, help="calls per method (median reported)")
    args = parser.parse_args()
    reference_count = min(args.n, args.reference_n)
    results, bound, best = measure(args.n, reference_count, args.repeat)
    python_rate = results[-1]["rate"]
    next_fit_rate = results[0]["rate"]
    print(conditions())
    print(f"lognormal lengths (median {MEDIAN_LENGTH}, sigma 1), capacity {CAPACITY}, "
          f"median of {args.repeat} calls")
    print(f"lower bound: {bound} rows, best possible real-target fraction {best:.6f}")
    header = (
        "method", "examples", "seconds", "examples/s", "vs python", "vs next-fit", "rows", "fraction", "/ its best"
    )
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in results:
        cells = (
            row["method"],
            f"{row['examples']:,}",
            f"{row['seconds']:.4f}",
            f"{row['rate'] / 1e6:.2f}M",
            f"{row['rate'] / python_rate:.1f}x",
            f"{row['rate'] / next_fit_rate:.3f}x",
            f"{row['rows']:,}",
            f"{row['fraction']:.6f}",
            f"{row['fraction'] / row['best']:.6f}",
        )
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
