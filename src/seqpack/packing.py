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
    ExampleList,
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
# tracemalloc, rounded up): one batch's object, dict and nine array headers; a
# call's plan entries (first row, bounds, counts, list slot).
BATCH_OBJECT_BYTES = 3 * 1024
CALL_OVERHEAD_BYTES = 8 * 1024
PLAN_BYTES_PER_CALL = 128


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


def packing_requirement(
    count: int, row_count: int, call_count: int, largest_call_rows: int, largest_gather: int, capacity: int
) -> int:
    """Exact-integer bytes the packer holds at its peak.

    The planner arrays, the examples tuple and occurrence records (per
    occurrence); every row's field arrays; every call's objects and plan
    entries; and the largest call's gathering temporaries (``largest_gather``,
    from :func:`gather_bytes`). Raises ``InvalidInputError`` when a call's
    field arrays could not be indexed with int64.
    """
    if largest_call_rows * capacity > INT64_MAX // CELL_BYTES:
        raise InvalidInputError(
            f"a call of {largest_call_rows} rows x {capacity} columns cannot be indexed"
        )
    per_occurrence = planner_bytes(1) + ExampleList.held_bytes_per_occurrence + OCCURRENCE_DTYPE.itemsize
    per_row = capacity * CELL_BYTES + ROW_BYTES
    per_call = BATCH_OBJECT_BYTES + PLAN_BYTES_PER_CALL
    return (count * per_occurrence + row_count * per_row + call_count * per_call
            + largest_gather + CALL_OVERHEAD_BYTES)


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
    source = ExampleList(examples)
    reject_longer(source, lengths, config.capacity, "capacity")
    placement = place(lengths, config.capacity)
    call_count = -(-placement.row_count // config.max_rows_per_batch)
    largest_call_rows = min(config.max_rows_per_batch, placement.row_count)
    cells = largest_call_rows * config.capacity
    if cells > config.max_cells:
        raise CapacityError(
            f"a model call of {largest_call_rows} rows x {config.capacity} columns has {cells} cells; "
            f"max_cells is {config.max_cells}",
            cells=cells,
            maximum=config.max_cells,
        )
    # Next-fit rows are non-decreasing in input order, so each call owns a contiguous span.
    first_rows = np.arange(call_count, dtype=np.int64) * config.max_rows_per_batch
    bounds = np.append(np.searchsorted(placement.rows, first_rows), len(examples))
    occurrences = np.diff(bounds)
    source_tokens = np.add.reduceat(lengths, bounds[:-1]) + occurrences
    required = packing_requirement(
        len(examples), placement.row_count, call_count, largest_call_rows,
        int(source.gather_bytes(source_tokens, occurrences).max()), config.capacity,
    )
    enforce_metadata(required, config.max_metadata_bytes)

    records = np.empty(len(examples), dtype=OCCURRENCE_DTYPE)
    records["ordinal"] = np.arange(len(examples))
    records["row"] = placement.rows
    records["start"] = placement.starts
    records["stop"] = placement.starts + lengths
    records["segment"] = records["ordinal"]
    batches = []
    for call, (first, end) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        span = records[first:end]
        span["row"] -= first_rows[call]
        rows = min(config.max_rows_per_batch, placement.row_count - int(first_rows[call]))
        batches.append(PackedBatch(partition, binding, source, span, (rows, config.capacity)))
    return PackedBatchEpoch(batches, placement.row_count, len(examples), required)
