"""Sequence packing: whole examples placed into shared rows by next-fit in input order.

Each placed occurrence keeps its own segment (its global ordinal) and local
positions restarting at zero; a query may use only keys of its own segment at
earlier-or-equal positions. Nothing is sorted, split, truncated or joined: an
example longer than the capacity is an error, and every limit (cells per model
call, metadata bytes) is checked before anything large is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .batch import (
    CELL_BYTES,
    INT32_MAX,
    OCCURRENCE_DTYPE,
    ROW_BYTES,
    BatchLayout,
    check_examples,
    reject_longer,
)
from ._checks import check_int
from .binding import BatchBinding, Partition
from .errors import CapacityError, InvalidInputError, MetadataBudgetError
from .examples import SequenceExample
from .placement import place

INT64_MAX = 2**63 - 1

# Python-object allowances, counted so the budget stays honest (measured with
# tracemalloc, rounded up): one batch's object, dict and nine array headers; the
# per-occurrence view objects and list slots that gather a batch's source tokens.
BATCH_OBJECT_BYTES = 3 * 1024
GATHER_BYTES_PER_OCCURRENCE = 256
CALL_OVERHEAD_BYTES = 8 * 1024


@dataclass(frozen=True)
class PackConfig:
    """Row capacity (predictions per row), rows per model call, cells per call, metadata bytes."""

    capacity: int
    max_rows_per_batch: int
    max_cells: int
    max_metadata_bytes: int

    def __post_init__(self):
        for name in ("capacity", "max_rows_per_batch", "max_cells", "max_metadata_bytes"):
            check_int(name, getattr(self, name))
        if self.capacity > INT32_MAX:
            raise InvalidInputError(
                f"capacity {self.capacity} exceeds {INT32_MAX}: positions and columns are int32"
            )
        if self.max_cells < self.capacity:
            raise InvalidInputError(
                f"max_cells {self.max_cells} is below capacity {self.capacity}: no row would fit"
            )


class PackedBatch(BatchLayout):
    """One model call of packed rows, exactly ``capacity`` columns wide.

    The fields, permission helpers and ``verify()`` are the padded batch's;
    ``occurrences`` are ``(ordinal, row, columns, segment)`` with ``row`` local to
    this call and ``segment == ordinal``, the global occurrence index in the epoch.
    """


@dataclass
class PackedBatchEpoch:
    """The packed model calls of one ``pack_examples`` call.

    ``metadata_peak`` is the byte requirement that was checked against the budget:
    everything the packer holds at its peak, batches included.
    """

    batches: list
    row_count: int
    occurrence_count: int
    metadata_peak: int

    @property
    def target_count(self) -> int:
        return sum(batch.target_count for batch in self.batches)


def check_occurrence_count(count: int) -> None:
    """Segment IDs are int32 ordinals: at most 2**31 occurrences."""
    if count > INT32_MAX + 1:
        raise InvalidInputError(
            f"{count} occurrences exceed the int32 segment namespace of {INT32_MAX + 1}"
        )


def enforce_metadata(required: int, maximum: int) -> None:
    if required > maximum:
        raise MetadataBudgetError(
            f"packing needs {required} metadata bytes; max_metadata_bytes is {maximum}",
            required=required,
            maximum=maximum,
        )


def planner_bytes(count: int) -> int:
    """Bytes of the planner arrays: lengths, rows and starts (int64) plus a bool scan temporary."""
    return count * (3 * 8 + 1)


def call_rows(row_count: int, max_rows_per_batch: int) -> list[int]:
    """Rows of each model call: full calls, then the final one with the rest."""
    full, rest = divmod(row_count, max_rows_per_batch)
    return [max_rows_per_batch] * full + ([rest] if rest else [])


def packing_requirement(
    count: int, batch_rows: Sequence[int], batch_occurrences: Sequence[int],
    batch_tokens: Sequence[int], capacity: int,
) -> int:
    """Exact-integer bytes the packer holds at its peak.

    Planner arrays, the examples tuple, occurrence records, every call's field
    arrays and objects, the batch list, and the largest call's gathering
    temporaries (source tokens, offsets, record copies, views). Raises
    ``InvalidInputError`` when a call's shape cannot be indexed with int64.
    """
    held = planner_bytes(count) + 8 * count + OCCURRENCE_DTYPE.itemsize * count + CALL_OVERHEAD_BYTES
    gathering = 0
    for rows, occurrences, tokens in zip(batch_rows, batch_occurrences, batch_tokens):
        cells = rows * capacity
        if cells > INT64_MAX // CELL_BYTES:
            raise InvalidInputError(f"a call of {rows} rows x {capacity} columns cannot be indexed")
        held += cells * CELL_BYTES + rows * ROW_BYTES + BATCH_OBJECT_BYTES + 8
        gathering = max(
            gathering,
            4 * tokens + 8 * (occurrences + 1) + 20 * occurrences
            + GATHER_BYTES_PER_OCCURRENCE * occurrences,
        )
    return held + gathering


def pack_examples(
    partition: Partition,
    examples: Sequence[SequenceExample],
    binding: BatchBinding,
    config: PackConfig,
) -> PackedBatchEpoch:
    """Pack ``examples`` by next-fit in input order into calls of at most ``max_rows_per_batch`` rows.

    An example that does not fit the current row's remaining cells starts a new
    row; earlier rows are never revisited and an exact fill opens no empty row.
    Occurrence ``i`` (the ``i``-th supplied example, duplicates included) gets
    segment ``i``. Errors: an example longer than ``capacity``; a call whose
    ``rows * capacity`` exceeds ``max_cells`` (``CapacityError``); a metadata
    requirement over ``max_metadata_bytes`` (``MetadataBudgetError``), checked
    before the planner arrays and again before any batch array is allocated.
    """
    if not isinstance(config, PackConfig):
        raise InvalidInputError(f"config must be a PackConfig, not {type(config).__name__}")
    check_occurrence_count(len(examples))
    enforce_metadata(planner_bytes(len(examples)), config.max_metadata_bytes)
    lengths = check_examples(partition, examples, binding)
    reject_longer(examples, lengths, config.capacity, "capacity")
    placement = place(lengths, config.capacity)
    rows_per_call = call_rows(placement.row_count, config.max_rows_per_batch)
    cells = rows_per_call[0] * config.capacity
    if cells > config.max_cells:
        raise CapacityError(
            f"a model call of {rows_per_call[0]} rows x {config.capacity} columns has {cells} cells; "
            f"max_cells is {config.max_cells}",
            cells=cells,
            maximum=config.max_cells,
        )
    # Next-fit rows are non-decreasing in input order, so each call owns a contiguous span.
    first_rows = np.arange(len(rows_per_call), dtype=np.int64) * config.max_rows_per_batch
    bounds = np.searchsorted(placement.rows, np.append(first_rows, placement.row_count)).tolist()
    occurrences = np.diff(bounds)
    source_tokens = np.add.reduceat(lengths, bounds[:-1]) + occurrences
    required = packing_requirement(
        len(examples), rows_per_call, occurrences.tolist(), source_tokens.tolist(), config.capacity
    )
    enforce_metadata(required, config.max_metadata_bytes)

    examples = tuple(examples)
    records = np.empty(len(examples), dtype=OCCURRENCE_DTYPE)
    records["ordinal"] = np.arange(len(examples))
    records["row"] = placement.rows
    records["start"] = placement.starts
    records["stop"] = placement.starts + lengths
    records["segment"] = records["ordinal"]
    batches = []
    for call, rows in enumerate(rows_per_call):
        span = records[bounds[call] : bounds[call + 1]]
        span["row"] -= first_rows[call]
        batches.append(PackedBatch(partition, binding, examples, span, (rows, config.capacity)))
    return PackedBatchEpoch(batches, placement.row_count, len(examples), required)
