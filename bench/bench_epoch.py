"""A full packed epoch from a columnar table against the list-of-SequenceExample path, and policy fractions.

    python bench/bench_epoch.py               # both tables below, one run
    pytest bench/bench_epoch.py               # the same workloads under pytest-benchmark

Workload: 200k examples whose token counts are lognormal (median 250, sigma 1,
``numpy.random.default_rng(0)``), rounded and clipped to [2, 2049] tokens, so each has
1..2048 predictions; capacity 2048, 8 rows per model call. Example ``i`` is the range
``[0, t_i)`` of a framed document of ``t_i + 1`` tokens (random content IDs).

1. Epoch build, eager ``seqpack.pack`` with next-fit: the columnar path times
   ``ExampleTable.from_arrays`` plus packing; the list path times packing a prebuilt
   list of SequenceExample, and separately building that list (each document validated).
   Median seconds over ``--repeats`` (after one untimed build), cells/s, and the traced
   peak memory of each (tracemalloc, in a separate untimed run). For context, also the
   columnar packing alone (table prebuilt), the lazy epoch (``seqpack.plan``, each
   call materialized and dropped in turn) and ``seqpack.stream`` over the whole
   table as one item and as 1000-example chunks.
2. Real-target fraction of next-fit, first-fit-decreasing and best-fit-decreasing on those
   lengths and on the standard-library corpus at capacity 2048, against the best possible
   fraction: total predictions over ``ceil(total / capacity)`` rows.
"""

from __future__ import annotations

import argparse
import os
import tracemalloc

import numpy as np

import seqpack as sp
from timing import conditions, median_seconds, positive
from seqpack.data.corpus import stdlib_table

from seqpack.packing.placement import POLICIES

CAPACITY = 2048
ROWS_PER_CALL = 8
MEDIAN_TOKENS = 250
TRAIN = sp.Partition.TRAIN
COUNT = int(os.environ.get("SEQPACK_BENCH_EPOCH_N", "200000"))


def config() -> sp.PackConfig:
    return sp.PackConfig(CAPACITY, ROWS_PER_CALL, ROWS_PER_CALL * CAPACITY, 1 << 40)


def workload(count: int, seed: int = 0):
    """``(token_ids, offsets, ranges)``: ``count`` documents and one range example over each."""
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.rint(rng.lognormal(np.log(MEDIAN_TOKENS), 1.0, count)), 2, CAPACITY + 1).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes + 1)))
    tokens = rng.integers(2, 266, size=int(offsets[-1]), dtype=np.int32)
    tokens[offsets[:-1]] = 0
    tokens[offsets[1:] - 1] = 1
    ranges = np.stack([np.zeros_like(sizes), sizes], axis=1)
    return tokens, offsets, ranges


def columnar_epoch(binding, tokens, offsets, ranges):
    table = sp.ExampleTable.from_arrays(tokens, offsets, binding, ranges=ranges)
    return sp.pack(table, config(), partition=TRAIN, binding=binding)


def columnar_pack(binding, table):
    return sp.pack(table, config(), partition=TRAIN, binding=binding)


def columnar_stream_of_calls(binding, table):
    """Plan, then materialize each call and drop it: the lazy epoch's whole cost."""
    plan = sp.plan(table, config(), partition=TRAIN, binding=binding)
    return sum(batch.target_count for batch in plan)


def columnar_reused(binding, tokens, offsets, ranges):
    """Table, plan, and every call built in turn on one reused set of field buffers."""
    table = sp.ExampleTable.from_arrays(tokens, offsets, binding, ranges=ranges)
    plan = sp.plan(table, config(), partition=TRAIN, binding=binding)
    return sum(1 for _ in plan.batches(reuse_buffers=True))


def columnar_stream(binding, items):
    """Streaming next-fit over ``items`` (tables or chunks), each call dropped once counted."""
    return sum(batch.target_count for batch in sp.stream(items, config(), partition=TRAIN, binding=binding))


def example_objects(binding, tokens, offsets, ranges):
    """The same examples as SequenceExample objects over their own BatchDocument."""
    bounds = offsets.tolist()
    stops = ranges[:, 1].tolist()
    return [
        sp.SequenceExample.from_range(f"#{i}", sp.BatchDocument(f"d{i}", tokens[bounds[i]:bounds[i + 1]]),
                                      (0, stops[i]), binding)
        for i in range(len(stops))
    ]


def list_epoch(binding, examples):
    return sp.pack(examples, config(), partition=TRAIN, binding=binding)


def traced_peak(function) -> int:
    """Peak bytes traced while ``function`` runs (its result released before returning)."""
    tracemalloc.start()
    function()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def epoch_rows(count: int, repeats: int) -> list[dict]:
    binding = sp.BatchBinding.fixture()
    arrays = workload(count)
    cells = columnar_epoch(binding, *arrays).row_count * CAPACITY
    columnar = median_seconds(lambda: columnar_epoch(binding, *arrays), repeats)
    table = sp.ExampleTable.from_arrays(*arrays[:2], binding, ranges=arrays[2])
    packing = median_seconds(lambda: columnar_pack(binding, table), repeats)
    lazy = median_seconds(lambda: columnar_stream_of_calls(binding, table), repeats)
    reused = median_seconds(lambda: columnar_reused(binding, *arrays), repeats)
    chunks = [table.chunk(i, min(i + 1000, count)) for i in range(0, count, 1000)]
    streamed = median_seconds(lambda: columnar_stream(binding, [table]), repeats)
    streamed_chunks = median_seconds(lambda: columnar_stream(binding, chunks), repeats)
    examples = example_objects(binding, *arrays)
    listed = median_seconds(lambda: list_epoch(binding, examples), repeats)
    peaks = {
        "columnar": traced_peak(lambda: columnar_epoch(binding, *arrays)),
        "packing": traced_peak(lambda: columnar_pack(binding, table)),
        "lazy": traced_peak(lambda: columnar_stream_of_calls(binding, table)),
        "reused": traced_peak(lambda: columnar_reused(binding, *arrays)),
        "list": traced_peak(lambda: list_epoch(binding, examples)),
    }
    examples = None  # released before the next measurement

    def objects_then_pack():
        list_epoch(binding, example_objects(binding, *arrays))

    listed_total = median_seconds(objects_then_pack, repeats)
    peaks["objects and list"] = traced_peak(objects_then_pack)
    rows = [
        ("columnar: from_arrays + pack", columnar, peaks["columnar"]),
        ("columnar: pack (table built)", packing, peaks["packing"]),
        ("columnar: plan + lazy calls", lazy, peaks["lazy"]),
        ("columnar: from_arrays + plan, reused buffers", reused, peaks["reused"]),
        ("columnar: stream, one table", streamed, traced_peak(lambda: columnar_stream(binding, [table]))),
        ("columnar: stream, 1k chunks", streamed_chunks, traced_peak(lambda: columnar_stream(binding, chunks))),
        ("list: seqpack.pack", listed, peaks["list"]),
        ("list: build objects + pack", listed_total, peaks["objects and list"]),
    ]
    return [{"path": path, "seconds": seconds, "cells": cells, "peak": peak, "ratio": listed_total / seconds}
            for path, seconds, peak in rows]


def fraction_rows(name: str, lengths: np.ndarray) -> list[dict]:
    """Rows and real-target fraction of each policy on ``lengths``, against the lower bound."""
    total = int(lengths.sum())
    bound = sp.packing.lower_bound_rows(lengths, CAPACITY)
    best = total / (bound * CAPACITY)
    rows = []
    for policy in POLICIES:
        placement = sp.place(lengths, CAPACITY, policy)
        fraction = sp.packing.real_target_fraction(lengths, placement.row_count, CAPACITY)
        rows.append({"workload": name, "policy": policy, "rows": placement.row_count, "bound": bound,
                     "fraction": fraction, "best": best, "of_best": fraction / best})
    return rows


def workload_lengths(count: int) -> np.ndarray:
    _, _, ranges = workload(count)
    return ranges[:, 1] - 1


def stdlib_lengths() -> np.ndarray:
    return stdlib_table(sp.BatchBinding.fixture(), capacity=CAPACITY).lengths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=positive, default=COUNT, help="examples in the epoch workload")
    parser.add_argument("--repeats", type=positive, default=3)
    args = parser.parse_args(argv)
    print(conditions())
    print(f"epoch build: {args.count} examples, capacity {CAPACITY}, {ROWS_PER_CALL} rows per call")
    print(f"{'path':<44} {'median s':>9} {'cells/s':>14} {'traced peak MiB':>17} {'list path / this':>17}")
    for row in epoch_rows(args.count, args.repeats):
        print(f"{row['path']:<44} {row['seconds']:>9.3f} {row['cells'] / row['seconds']:>14.4g} "
              f"{row['peak'] / 2**20:>17.1f} {row['ratio']:>16.2f}x")
    print(f"\nreal-target fraction at capacity {CAPACITY} (best: total / (ceil(total / capacity) * capacity))")
    print(f"{'workload':<18} {'policy':<22} {'rows':>8} {'bound':>8} {'fraction':>9} {'best':>9} {'of best':>8}")
    for name, lengths in ((f"lognormal {args.count // 1000}k", workload_lengths(args.count)),
                          ("stdlib corpus", stdlib_lengths())):
        for row in fraction_rows(name, lengths):
            print(f"{row['workload']:<18} {row['policy']:<22} {row['rows']:>8} {row['bound']:>8} "
                  f"{row['fraction']:>9.5f} {row['best']:>9.5f} {row['of_best']:>8.5f}")
    return 0


def test_columnar_epoch(benchmark):
    binding = sp.BatchBinding.fixture()
    arrays = workload(COUNT)
    epoch = benchmark.pedantic(columnar_epoch, args=(binding, *arrays), rounds=3, iterations=1, warmup_rounds=1)
    cells = epoch.row_count * CAPACITY
    benchmark.extra_info.update(examples=COUNT, cells_per_second=cells / benchmark.stats.stats.median)
    assert epoch.occurrence_count == COUNT


def test_list_epoch(benchmark):
    binding = sp.BatchBinding.fixture()
    examples = example_objects(binding, *workload(COUNT))
    epoch = benchmark.pedantic(list_epoch, args=(binding, examples), rounds=3, iterations=1, warmup_rounds=1)
    cells = epoch.row_count * CAPACITY
    benchmark.extra_info.update(examples=COUNT, cells_per_second=cells / benchmark.stats.stats.median)
    assert epoch.occurrence_count == COUNT


def test_policy_fractions(benchmark):
    rows = benchmark.pedantic(
        lambda: fraction_rows("lognormal", workload_lengths(COUNT)) + fraction_rows("stdlib", stdlib_lengths()),
        rounds=1, iterations=1,
    )
    benchmark.extra_info.update({f"{r['workload']} {r['policy']}": r["fraction"] for r in rows})
    for row in rows:
        if row["policy"] == "best-fit-decreasing":
            assert row["of_best"] >= 0.99, row


if __name__ == "__main__":
    raise SystemExit(main())
