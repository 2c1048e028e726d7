"""Tables of random examples with chosen prediction counts, and their padded and packed batches."""

from __future__ import annotations

import numpy as np

import seqpack as sp

BINDING = sp.BatchBinding.fixture()
PRINTABLE = (34, 129)  # token IDs of printable ASCII bytes (byte + 2) in the fixture vocabulary


def table(predictions, seed: int = 0) -> sp.ExampleTable:
    """One example per entry with that many predictions: the range ``[0, n + 1)`` (BOS and
    ``n`` content tokens) of a document ``[BOS, content..., EOS]``."""
    rng = np.random.default_rng(seed)
    documents = [[0, *rng.integers(*PRINTABLE, size=int(n)).tolist(), 1] for n in predictions]
    offsets = np.cumsum([0] + [len(d) for d in documents])
    ranges = [(0, int(n) + 1) for n in predictions]
    return sp.ExampleTable.from_arrays(np.concatenate(documents), offsets, BINDING, ranges=ranges)


def random_predictions(rng, count: int, longest: int) -> list[int]:
    """``count`` prediction counts in ``[1, longest]``, a third of them 1 or 2 (short edge cases)."""
    counts = rng.integers(1, longest + 1, size=count)
    counts[rng.random(count) < 0.33] = rng.integers(1, 3)
    return counts.tolist()


def packed_plan(predictions, capacity: int, rows_per_batch: int = 2, seed: int = 0, policy="next-fit"):
    return sp.plan(table(predictions, seed), sp.PackConfig(capacity, rows_per_batch=rows_per_batch),
                   partition=sp.Partition.TRAIN, binding=BINDING, policy=policy)


def padded_epoch(predictions, rows_per_batch: int = 2, seed: int = 0):
    return sp.pad(table(predictions, seed), sp.PadConfig(rows_per_batch=rows_per_batch),
                  partition=sp.Partition.TRAIN, binding=BINDING)
