"""What packing stores and computes: the efficiency report of a plan or an epoch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..layout.counts import permitted_edges


@dataclass(frozen=True)
class EfficiencyReport:
    """Rows, cells, real targets, padding and attention edges of a packed epoch.

    ``valid_targets`` counts the cells that hold a target, ``supervised_targets`` those
    that count in the loss; ``batch_targets`` are each batch's supervised targets, the
    loss denominators a trainer needs before the forward pass. Attention counts are per head.
    ``pairs`` counts the preference pairs (0 unless packed with ``pairs=True``).
    """

    policy: str
    capacity: int
    rows: int
    batches: int
    cells: int
    valid_targets: int
    supervised_targets: int
    permitted_edges: int
    dense_score_positions: int
    batch_targets: tuple
    pairs: int = 0

    @classmethod
    def of(cls, policy: str, capacity: int, rows: int, lengths: np.ndarray, batch_targets: np.ndarray,
           pairs: int = 0):
        """The report of ``rows`` rows of ``capacity`` holding examples of ``lengths``
        predictions (int64), whose batches have ``batch_targets`` supervised targets, and
        ``pairs`` preference pairs."""
        return cls(
            policy=policy,
            capacity=capacity,
            rows=rows,
            batches=int(batch_targets.shape[0]),
            cells=rows * capacity,
            valid_targets=int(lengths.sum()),
            supervised_targets=int(batch_targets.sum()),
            permitted_edges=permitted_edges(lengths),
            dense_score_positions=rows * capacity**2,
            batch_targets=tuple(batch_targets.tolist()),
            pairs=pairs,
        )

    @property
    def real_target_fraction(self) -> float:
        return self.valid_targets / self.cells if self.cells else 0.0

    @property
    def padding_cells(self) -> int:
        return self.cells - self.valid_targets

    @property
    def permitted_fraction(self) -> float:
        return self.permitted_edges / self.dense_score_positions if self.dense_score_positions else 0.0

    def as_dict(self) -> dict:
        """The report's counts, as :func:`report_counts` gives them."""
        return report_counts(self.policy, self.capacity, self.rows, self.batches, self.valid_targets,
                             self.supervised_targets, self.permitted_edges, self.pairs)


def report_counts(policy: str, capacity: int, rows: int, batches: int, valid_targets: int,
                  supervised_targets: int, permitted_edges: int, pairs: int = 0) -> dict:
    """The counts of a report (of a plan, an epoch or a dataset's manifest) as a dict, the
    fractions derived here; ``supervised_targets`` appears only when some target is not
    supervised and ``pairs`` only when there are preference pairs (so a report without
    supervision or pairs reads as it always has)."""
    cells, dense = rows * capacity, rows * capacity**2
    counts = {
        "policy": policy, "capacity": capacity, "rows": rows, "batches": batches,
        "cells": cells, "valid_targets": valid_targets,
        "real_target_fraction": valid_targets / cells if cells else 0.0, "padding_cells": cells - valid_targets,
        "permitted_edges": permitted_edges, "dense_score_positions": dense,
        "permitted_fraction": permitted_edges / dense if dense else 0.0,
    }
    if supervised_targets != valid_targets:
        counts["supervised_targets"] = supervised_targets
    if pairs:
        counts["pairs"] = pairs
    return counts
