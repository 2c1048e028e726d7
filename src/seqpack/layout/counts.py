"""Storage and attention counts of batches: what a layout stores and what attention computes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._arguments import INT32_MAX
from ..errors import InvalidInputError


@dataclass(frozen=True)
class LayoutCounts:
    """Storage and attention counts of one or more batches (attention counts are per head).

    ``dense_score_positions`` is ``rows * T * T`` summed over batches: what a dense
    kernel computes. ``permitted_edges`` is ``l * (l + 1) / 2`` summed over
    occurrences of prediction length ``l``: the pairs the permission rule allows.
    """

    storage_cells: int
    valid_targets: int
    dense_score_positions: int
    permitted_edges: int

    @property
    def valid_density(self) -> float:
        return self.valid_targets / self.storage_cells if self.storage_cells else 0.0

    @property
    def permitted_fraction(self) -> float:
        return self.permitted_edges / self.dense_score_positions if self.dense_score_positions else 0.0

    @classmethod
    def total(cls, batches: Sequence) -> "LayoutCounts":
        """The counts of several batches added up."""
        counts = [batch.counts() for batch in batches]
        return cls(*(sum(getattr(c, name) for c in counts) for name in
                     ("storage_cells", "valid_targets", "dense_score_positions", "permitted_edges")))

    def as_dict(self) -> dict:
        return {
            "storage_cells": self.storage_cells,
            "valid_targets": self.valid_targets,
            "valid_density": self.valid_density,
            "dense_score_positions": self.dense_score_positions,
            "permitted_edges": self.permitted_edges,
        }


def permitted_edges(lengths: np.ndarray) -> int:
    """The sum of ``n * (n + 1) // 2`` over ``lengths`` (integers in ``[0, 2**31)``, as a
    row's capacity bounds them), exact: the edges causal segments of those lengths
    permit. Each term is split at bit 32 and at most 2**31 terms are summed at once, so
    no uint64 sum can wrap (an int64 sum of 2**20 segments of 2**22 would)."""
    n = np.asarray(lengths, dtype=np.int64).ravel()
    if n.size and not 0 <= int(n.min()) <= int(n.max()) <= INT32_MAX:
        raise InvalidInputError(f"segment lengths must lie in [0, {INT32_MAX}]")
    total = 0
    for first in range(0, n.size, 1 << 31):
        part = n[first:first + (1 << 31)].astype(np.uint64)
        terms = part * (part + np.uint64(1)) // np.uint64(2)  # < 2**61
        total += int((terms >> np.uint64(32)).sum(dtype=np.uint64)) << 32
        total += int((terms & np.uint64(0xFFFFFFFF)).sum(dtype=np.uint64))
    return total
