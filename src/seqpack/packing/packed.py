"""Packed batches, and the eager epoch that stores every batch of a plan in one set of arrays."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..layout.batch import BatchLayout
from ..layout.fields import FieldArrays, Placements
from .._arguments import batch_index, batch_range
from .._read_only import ReadOnlyArrays
from .epoch import Epoch


class PackedBatch(BatchLayout):
    """One batch of packed rows, exactly ``capacity`` columns wide.

    The fields, permission helpers and ``verify()`` are the padded batch's;
    ``occurrences`` are ``(ordinal, row, columns, segment)`` with ``row`` local to
    this batch and ``segment == ordinal``, the example's index in the packed input.
    With ``pairs`` a pair's chosen and rejected sequences share one row, side by side.
    """

    pair_shares_row = True


def packed_batch(partition, binding, source, ordinals, rows, starts, lengths, shape,
                 buffers=None, pairs: bool = False, threads: int | None = None) -> PackedBatch:
    """A packed batch from its occurrences' ordinals, batch-local rows, starts and lengths,
    filled on ``threads`` (None: the default)."""
    placements = Placements(ordinals, rows, starts, lengths, ordinals.astype(np.int32))
    return PackedBatch.filled(partition, binding, source, placements, shape, buffers, pairs, threads)


class EpochBatches(ReadOnlyArrays, Sequence):
    """The batches of an eager epoch: views of its arrays, each made once, on first access.

    Batch ``i`` holds rows ``[i * rows_per_batch, ...)`` and occurrences
    ``[bounds[i], bounds[i + 1])`` of ``placements`` (whose rows are batch-local).
    """

    def __init__(self, partition, binding, source, rows_per_batch: int, bounds: np.ndarray,
                 fields: FieldArrays, placements: Placements, pairs: bool):
        self._partition, self._binding, self._source = partition, binding, source
        self._pairs = pairs
        self._rows_per_batch = rows_per_batch
        self._bounds = bounds
        self._fields = fields
        self._placements = placements
        self._made = [None] * (len(bounds) - 1)

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in batch_range(index, len(self), "this epoch")]
        number = batch_index(index, len(self), "this epoch")
        batch = self._made[number]
        if batch is None:
            first_row = number * self._rows_per_batch
            batch = PackedBatch(self._partition, self._binding, self._source,
                                self._placements.slice(int(self._bounds[number]), int(self._bounds[number + 1])),
                                self._fields.rows(first_row, first_row + self._rows_per_batch), self._pairs)
            self._made[number] = batch
        return batch


class PackedEpoch(Epoch):
    """Every packed batch of one ``seqpack.pack`` call, stored as one set of arrays.

    ``fields`` maps each field name to one read-only array over all ``row_count``
    rows (batch ``i`` holds rows ``[i * rows_per_batch, ...)``), ready to hand to a
    trainer whole; ``batches`` is the sequence of batches, each a view of those
    arrays made on first access, so keeping any batch keeps the epoch's arrays alive
    (``seqpack.plan`` builds batches one at a time instead). ``memory_peak`` is the
    byte requirement that was checked against the budget: everything packing held at
    its peak, batches included. ``report()`` is the plan's efficiency report.
    ``pairs``: the examples were packed as preference pairs.
    """

    def __init__(self, batches: EpochBatches, fields: FieldArrays, report, occurrence_count: int,
                 memory_peak: int, pairs: bool):
        # Internal: built by PackingPlan.epoch.
        super().__init__(batches, memory_peak, pairs)
        self.fields = fields.named()
        self.row_count = int(fields.valid_lengths.shape[0])
        self.occurrence_count = occurrence_count
        self.policy = report.policy
        self._report = report

    @property
    def target_count(self) -> int:
        """Supervised targets of the whole epoch."""
        return int(np.count_nonzero(self.fields["loss_mask"]))

    def batch_targets(self) -> np.ndarray:
        """Supervised targets of every batch (the loss denominators)."""
        return np.asarray(self._report.batch_targets, dtype=np.int64)

    def report(self):
        """Storage and attention efficiency of the epoch (an ``EfficiencyReport``)."""
        return self._report
