"""Storage and attention counts of batches: what a layout stores and what attention computes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
