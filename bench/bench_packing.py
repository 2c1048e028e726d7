"""seqpack.pack against the plain-Python next-fit reference, measured in one run.

    python bench/bench_packing.py            # table of examples/s, cells/s and ratios
    pytest bench/bench_packing.py            # the same workloads under pytest-benchmark

Lengths are lognormal (median 40 predictions, sigma 0.6, seed 0) at capacity 512,
8 rows per model call, as in the packing issue's budget measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from timing import conditions, median_seconds, positive

import seqpack as sp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the plain-Python references
import reference as _reference  # noqa: E402

CAPACITY = 512
ROWS_PER_CALL = 8


def workload(count: int, seed: int = 0):
    """``count`` examples whose prediction lengths are lognormal around 40."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(40), 0.6, count)), 1, CAPACITY).astype(np.int64)
    binding = sp.BatchBinding.fixture()
    body = rng.integers(2, 258, size=int(lengths.sum()), dtype=np.int32)
    ends = np.cumsum(lengths)
    examples = []
    for i, (start, end) in enumerate(zip(ends - lengths, ends)):
        document = sp.BatchDocument(f"d{i}", np.concatenate(([0], body[start:end], [1])))
        examples.append(sp.SequenceExample.from_range(f"e{i}", document, (0, end - start + 1), binding))
    return binding, examples


def pack(binding, examples):
    config = sp.PackConfig(CAPACITY, ROWS_PER_CALL, ROWS_PER_CALL * CAPACITY, 1 << 36)
    return sp.pack(examples, config, partition=sp.Partition.TRAIN, binding=binding)


def reference(examples):
    return _reference.packed_rows([e.source_tokens.tolist() for e in examples], CAPACITY, ROWS_PER_CALL)


def counts_list(text: str) -> list[int]:
    """An ``argparse`` type: positive example counts, comma-separated."""
    return [positive(part) for part in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="30000,200000", type=counts_list, help="example counts, comma-separated")
    parser.add_argument("--repeats", type=positive, default=3)
    args = parser.parse_args(argv)
    print(conditions())
    print(f"{'examples':>9} {'method':<22} {'median s':>9} {'examples/s':>12} {'cells/s':>12} {'vs reference':>13}")
    for count in args.counts:
        binding, examples = workload(count)
        cells = sum(b.cell_count for b in pack(binding, examples).batches)
        fast = median_seconds(lambda: pack(binding, examples), args.repeats)
        slow = median_seconds(lambda: reference(examples), 1)
        for name, value in (("seqpack.pack", fast), ("plain-Python reference", slow)):
            print(f"{count:>9} {name:<22} {value:>9.4f} {count / value:>12.0f} {cells / value:>12.0f} {slow / value:>12.1f}x")
    return 0


def test_pack_30k(benchmark):
    binding, examples = workload(30_000)
    epoch = benchmark(pack, binding, examples)
    assert epoch.occurrence_count == 30_000


def test_reference_30k(benchmark):
    _, examples = workload(30_000)
    calls = benchmark.pedantic(reference, args=(examples,), rounds=1, iterations=1)
    assert sum(len(c["occurrences"]) for c in calls) == 30_000


if __name__ == "__main__":
    raise SystemExit(main())
