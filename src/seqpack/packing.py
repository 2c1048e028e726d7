"""Sequence packing: whole examples placed into shared rows, by next-fit in input order by default.

Each placed occurrence keeps its own segment (its global ordinal, which follows
the input order under every policy) and local positions restarting at zero; a
query may use only keys of its own segment at earlier-or-equal positions.
Nothing is split, truncated or joined: an example longer than the capacity is an
error, and every limit (cells per model call, metadata bytes) is checked before
anything large is allocated. Packing can be eager (``pack_examples``), planned
and materialized one call at a time (``plan_packing``), or streamed
(``stream_packed_batches``); all three give identical batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable, Iterator, Sequence
from typing import Union

import numpy as np

from .batch import (
    CELL_BYTES,
    INT32_MAX,
    OCCURRENCE_DTYPE,
    ROW_BYTES,
    BatchLayout,
    ExampleList,
    FieldArrays,
    Placements,
    check_arguments,
    check_examples,
    check_owner,
    fill_fields,
    reject_longer,
)
from ._checks import check_int
from .binding import BatchBinding, Partition
from .errors import CapacityError, InvalidInputError, MetadataBudgetError
from .examples import SequenceExample
from . import _placement
from .placement import POLICIES, place, placement_bytes
from .table import ExampleTable

INT64_MAX = 2**63 - 1

# Python-object allowances, counted so the budget stays honest (measured with
# tracemalloc, rounded up): one batch's object, dict and nine array headers; a
# call's plan entries (first row, bounds, list slots); the fixed objects of a call.
BATCH_OBJECT_BYTES = 3 * 1024
PLAN_BYTES_PER_CALL = 128
CALL_OVERHEAD_BYTES = 8 * 1024
# Gathering temporaries an eager epoch allows one fill run (unless a single call needs more).
FILL_BLOCK_BYTES = 64 * 2**20
# An eager epoch's temporaries per occurrence: ordinals and input-order indices
# (int64), segments (int32), call-local rows, lengths and a run's row shift (int64).
EPOCH_BYTES_PER_OCCURRENCE = 8 + 8 + 4 + 8 + 8 + 8

Examples = Union[Sequence[SequenceExample], ExampleTable]


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


class PackedBatchEpoch:
    """The packed model calls of one ``pack_examples`` call, stored as one set of arrays.

    ``fields`` maps each field name to one read-only array over all ``row_count``
    rows (call ``i`` holds rows ``[i * max_rows_per_batch, ...)``), ready to hand to
    a trainer whole; ``batches`` is the sequence of model calls, each a view of
    those arrays made on first access, so keeping any batch keeps the epoch's
    arrays alive (``plan_packing`` builds calls one at a time instead).
    ``metadata_peak`` is the byte requirement that was checked against the budget:
    everything the packer holds at its peak, batches included.
    """

    def __init__(self, plan: "PackingPlan", fields: FieldArrays, placements: Placements, metadata_peak: int):
        # Internal: built by PackingPlan.epoch; ``placements`` rows are call-local.
        self.batches = EpochCalls(plan, fields, placements)
        self.fields = fields.named()
        self.row_count = plan.row_count
        self.occurrence_count = plan.occurrence_count
        self.metadata_peak = metadata_peak
        self.policy = plan.policy

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def target_count(self) -> int:
        """Supervised targets of the whole epoch."""
        return int(np.count_nonzero(self.fields["loss_mask"]))


class EpochCalls(Sequence):
    """The model calls of an eager epoch: views of its arrays, each made once, on first access."""

    def __init__(self, plan: "PackingPlan", fields: FieldArrays, placements: Placements):
        self._partition, self._binding, self._source = plan.partition, plan.binding, plan._source
        self._rows_per_call = plan.config.max_rows_per_batch
        self._bounds = plan._bounds
        self._fields = fields
        self._placements = placements
        self._made = [None] * plan.call_count

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        call = range(len(self))[index]  # IndexError (or TypeError) like a list's
        batch = self._made[call]
        if batch is None:
            first, end = self._bounds[call], self._bounds[call + 1]
            first_row = call * self._rows_per_call
            batch = PackedBatch(self._partition, self._binding, self._source,
                                Placements(*(p[first:end] for p in self._placements)),
                                self._fields.rows(first_row, first_row + self._rows_per_call))
            self._made[call] = batch
        return batch


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


def check_call_cells(rows: int, config: PackConfig) -> None:
    """A model call of ``rows`` rows must hold at most ``max_cells`` cells."""
    cells = rows * config.capacity
    if cells > config.max_cells:
        raise CapacityError(
            f"a model call of {rows} rows x {config.capacity} columns has {cells} cells; "
            f"max_cells is {config.max_cells}",
            cells=cells,
            maximum=config.max_cells,
        )


def call_bytes(rows: int, occurrences: int, capacity: int) -> int:
    """Bytes one materialized call holds: field arrays, occurrence records, objects.

    Raises ``InvalidInputError`` when its field arrays could not be indexed with int64.
    """
    if rows * capacity > INT64_MAX // CELL_BYTES:
        raise InvalidInputError(f"a call of {rows} rows x {capacity} columns cannot be indexed")
    return rows * (capacity * CELL_BYTES + ROW_BYTES) + occurrences * OCCURRENCE_DTYPE.itemsize + BATCH_OBJECT_BYTES


def packing_requirement(
    plan_bytes: int, count: int, row_count: int, call_count: int, largest_call_rows: int,
    fill_gather: int, capacity: int,
) -> int:
    """Exact-integer bytes an eager epoch holds at its peak.

    The plan, the epoch's fields and records, its per-occurrence temporaries
    (ordinals, segments, call-local rows, lengths, a fill run's row shift), every
    call's view objects and list slot, and the largest fill run's gathering.
    """
    call_bytes(largest_call_rows, 0, capacity)  # every call is at most this wide
    return (plan_bytes + row_count * (capacity * CELL_BYTES + ROW_BYTES)
            + count * (OCCURRENCE_DTYPE.itemsize + EPOCH_BYTES_PER_OCCURRENCE)
            + call_count * (BATCH_OBJECT_BYTES + 8) + fill_gather)


def _source(partition, examples, binding) -> tuple[object, np.ndarray]:
    """The examples' source and prediction lengths, validated against partition and binding."""
    if isinstance(examples, ExampleTable):
        check_arguments(partition, binding)
        check_owner("the example table", examples.binding, examples.partition, binding, partition)
        if len(examples) == 0:
            raise InvalidInputError("a batch needs at least one example")
        return examples, examples.lengths
    lengths = check_examples(partition, examples, binding)
    return ExampleList(examples), lengths


def call_batch(partition, binding, source, ordinals, rows, starts, lengths, shape, buffers=None) -> PackedBatch:
    """A packed call from its occurrences' global ordinals, call-local rows, starts and lengths."""
    placements = Placements(ordinals, rows, starts, lengths, ordinals.astype(np.int32))
    return PackedBatch.filled(partition, binding, source, placements, shape, buffers)


class PackingPlan:
    """Where every example goes, with its model calls materialized on demand.

    The plan holds O(examples) arrays (lengths, rows, starts, the visiting order
    for the decreasing policies); ``batch(i)`` builds call ``i`` and iterating
    builds them one at a time, so an epoch never needs to sit in memory at once;
    ``epoch()`` builds them all at once, as ``pack_examples`` does.
    ``metadata_peak`` covers the plan plus one materialized call (the largest).
    """

    def __init__(self, partition, binding, config, policy, source, lengths, placement, plan_bytes):
        # Internal: plan_packing validates.
        self.partition = partition
        self.binding = binding
        self.config = config
        self.policy = policy
        self._source = source
        self._lengths = lengths
        self.row_count = placement.row_count
        self.occurrence_count = lengths.shape[0]
        capacity, per_call = config.capacity, config.max_rows_per_batch
        self.call_count = -(-self.row_count // per_call)
        if policy == "next-fit":
            # Next-fit rows never decrease in input order: sorted order is input order.
            self._order = None
            self._rows, self._starts = placement.rows, placement.starts
        else:
            order = np.argsort(placement.rows * capacity + placement.starts, kind="stable")
            self._order = order
            self._rows, self._starts = placement.rows[order], placement.starts[order]
        first_rows = np.arange(self.call_count, dtype=np.int64) * per_call
        self._bounds = np.append(np.searchsorted(self._rows, first_rows), self.occurrence_count)
        occurrences = np.diff(self._bounds)
        sorted_lengths = lengths if self._order is None else lengths[self._order]
        tokens = np.add.reduceat(sorted_lengths, self._bounds[:-1]) + occurrences
        self._call_gather = source.gather_bytes(tokens, occurrences)
        self.largest_gather = int(self._call_gather.max())
        self.largest_call_occurrences = int(occurrences.max())
        self.largest_call_rows = min(per_call, self.row_count)
        self.plan_bytes = plan_bytes + self.call_count * PLAN_BYTES_PER_CALL
        self.metadata_peak = (self.plan_bytes + self.largest_gather
                              + call_bytes(self.largest_call_rows, self.largest_call_occurrences, capacity))

    def __len__(self) -> int:
        return self.call_count

    def call_rows(self, call: int) -> int:
        """Rows of model call ``call``: ``max_rows_per_batch`` except for a smaller final call."""
        per_call = self.config.max_rows_per_batch
        return min(per_call, self.row_count - call * per_call)

    def batch(self, call: int) -> PackedBatch:
        """Materialize model call ``call`` (rows local to it, ordinals and segments global)."""
        if isinstance(call, bool) or not isinstance(call, (int, np.integer)) or not 0 <= call < self.call_count:
            raise InvalidInputError(f"call {call!r} is outside this plan's {self.call_count} calls")
        return self._batch(int(call), None)

    def _batch(self, call: int, buffers) -> PackedBatch:
        first, end = int(self._bounds[call]), int(self._bounds[call + 1])
        local = np.arange(first, end) if self._order is None else self._order[first:end]
        return call_batch(
            self.partition, self.binding, self._source, local + self._source.first_ordinal,
            self._rows[first:end] - call * self.config.max_rows_per_batch, self._starts[first:end],
            self._lengths[local], (self.call_rows(call), self.config.capacity), buffers,
        )

    def batches(self, reuse_buffers: bool = False) -> Iterator[PackedBatch]:
        """Every model call in order, built one at a time.

        With ``reuse_buffers=True`` all calls share one set of field arrays (sized for
        the largest call): each batch is valid only until the next one is requested,
        and no call pays for fresh memory.
        """
        buffers = FieldArrays.allocate(self.largest_call_rows, self.config.capacity) if reuse_buffers else None
        for call in range(self.call_count):
            yield self._batch(call, buffers)

    def __iter__(self) -> Iterator[PackedBatch]:
        return self.batches()

    def fill_blocks(self) -> list[tuple[int, int]]:
        """Runs ``[first, end)`` of calls filled together by an eager epoch.

        A run gathers at most ``max(FILL_BLOCK_BYTES, largest_gather)`` bytes of
        temporaries, so a table (nothing to copy) fills in one run and a list of
        examples in bounded pieces.
        """
        limit = max(FILL_BLOCK_BYTES, self.largest_gather)
        total = np.cumsum(self._call_gather)
        cuts = [0]
        while cuts[-1] < self.call_count:
            done = int(total[cuts[-1] - 1]) if cuts[-1] else 0
            cuts.append(int(np.searchsorted(total, done + limit, side="right")))
        return list(zip(cuts[:-1], cuts[1:]))

    def fill_block_bytes(self) -> int:
        """The largest gather of any run of ``fill_blocks``."""
        total = np.concatenate(([0], np.cumsum(self._call_gather)))
        return max(int(total[end] - total[first]) for first, end in self.fill_blocks())

    def epoch_requirement(self) -> int:
        """Bytes ``epoch()`` holds at its peak: ``packing_requirement`` of this plan."""
        return packing_requirement(
            self.plan_bytes, self.occurrence_count, self.row_count, self.call_count, self.largest_call_rows,
            self.fill_block_bytes(), self.config.capacity,
        )

    def epoch(self) -> PackedBatchEpoch:
        """Every call at once: epoch-wide field arrays filled run by run, calls as views of them.

        Raises ``MetadataBudgetError`` before allocating when ``epoch_requirement()``
        exceeds ``max_metadata_bytes``.
        """
        required = self.epoch_requirement()
        enforce_metadata(required, self.config.max_metadata_bytes)
        per_call = self.config.max_rows_per_batch
        local = np.arange(self.occurrence_count) if self._order is None else self._order
        ordinals = local + self._source.first_ordinal
        placements = Placements(ordinals, self._rows, self._starts, self._lengths[local], ordinals.astype(np.int32))
        fields = FieldArrays.allocate(self.row_count, self.config.capacity)
        for first_call, end_call in self.fill_blocks():
            a, b = int(self._bounds[first_call]), int(self._bounds[end_call])
            first_row = first_call * per_call
            block = Placements(ordinals[a:b], placements.rows[a:b] - first_row, *(p[a:b] for p in placements[2:]))
            fill_fields(self._source, block, fields.rows(first_row, end_call * per_call))
        fields.freeze()
        return PackedBatchEpoch(self, fields, placements._replace(rows=self._rows % per_call), required)

    def call_targets(self) -> np.ndarray:
        """Valid targets of every call (the loss denominators), without materializing any."""
        ordered = self._lengths if self._order is None else self._lengths[self._order]
        return np.add.reduceat(ordered, self._bounds[:-1]) if self.call_count else np.zeros(0, np.int64)

    def report(self) -> "EfficiencyReport":
        """Storage and attention efficiency of the planned epoch."""
        lengths = self._lengths
        return EfficiencyReport(
            policy=self.policy,
            capacity=self.config.capacity,
            rows=self.row_count,
            calls=self.call_count,
            cells=self.row_count * self.config.capacity,
            valid_targets=int(lengths.sum()),
            permitted_edges=int((lengths * (lengths + 1) // 2).sum()),
            dense_score_positions=self.row_count * self.config.capacity**2,
            call_targets=tuple(self.call_targets().tolist()),
        )


@dataclass(frozen=True)
class EfficiencyReport:
    """What packing stores and computes: rows, cells, real targets, padding, attention edges.

    ``call_targets`` are the valid-target counts of each model call, the
    denominators a trainer needs before the forward pass. Attention counts are per head.
    """

    policy: str
    capacity: int
    rows: int
    calls: int
    cells: int
    valid_targets: int
    permitted_edges: int
    dense_score_positions: int
    call_targets: tuple

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
        return {
            "policy": self.policy, "capacity": self.capacity, "rows": self.rows, "calls": self.calls,
            "cells": self.cells, "valid_targets": self.valid_targets,
            "real_target_fraction": self.real_target_fraction, "padding_cells": self.padding_cells,
            "permitted_edges": self.permitted_edges, "dense_score_positions": self.dense_score_positions,
            "permitted_fraction": self.permitted_fraction,
        }


def efficiency_report(packed: Union[PackingPlan, PackedBatchEpoch]) -> EfficiencyReport:
    """The efficiency report of a plan or an eager epoch."""
    if isinstance(packed, PackingPlan):
        return packed.report()
    if not isinstance(packed, PackedBatchEpoch):
        raise InvalidInputError(f"expected a PackingPlan or PackedBatchEpoch, not {type(packed).__name__}")
    counts = [batch.counts() for batch in packed.batches]
    capacity = packed.batches[0].shape[1]
    return EfficiencyReport(
        policy=packed.policy,
        capacity=capacity,
        rows=packed.row_count,
        calls=len(packed.batches),
        cells=sum(c.storage_cells for c in counts),
        valid_targets=sum(c.valid_targets for c in counts),
        permitted_edges=sum(c.permitted_edges for c in counts),
        dense_score_positions=sum(c.dense_score_positions for c in counts),
        call_targets=tuple(c.valid_targets for c in counts),
    )


def plan_packing(
    partition: Partition, examples: Examples, binding: BatchBinding, config: PackConfig,
    policy: str = "next-fit",
) -> PackingPlan:
    """Place every example and check every limit; materialize nothing yet.

    ``examples`` is a sequence of SequenceExample or an ExampleTable. Errors: an
    example longer than ``capacity``; a call over ``max_cells`` (``CapacityError``);
    the plan plus its largest call over ``max_metadata_bytes``
    (``MetadataBudgetError``, checked before placement and again after it).
    """
    plan = _placed(partition, examples, binding, config, policy)
    enforce_metadata(plan.metadata_peak, config.max_metadata_bytes)
    return plan


def _placed(partition, examples, binding, config, policy) -> PackingPlan:
    """Validate, check the plan's own bytes, place: a plan whose calls are not yet budgeted."""
    if not isinstance(config, PackConfig):
        raise InvalidInputError(f"config must be a PackConfig, not {type(config).__name__}")
    if policy not in POLICIES:
        raise InvalidInputError(f"unknown packing policy {policy!r}; choose one of {', '.join(POLICIES)}")
    source, lengths = _source(partition, examples, binding)
    count = lengths.shape[0]
    check_occurrence_count(count)
    reject_longer(source, lengths, config.capacity, "capacity")
    # Lengths (list path), the source's references, placement outputs and workspaces,
    # the decreasing policies' visiting order and sorted rows and starts, a bool scan.
    plan_bytes = (count * (source.held_bytes_per_occurrence + 1 + (24 if policy != "next-fit" else 0))
                  + placement_bytes(lengths, config.capacity, policy) + CALL_OVERHEAD_BYTES)
    enforce_metadata(plan_bytes, config.max_metadata_bytes)
    placement = place(lengths, config.capacity, policy)
    check_call_cells(min(config.max_rows_per_batch, placement.row_count), config)
    return PackingPlan(partition, binding, config, policy, source, lengths, placement, plan_bytes)


def pack_examples(
    partition: Partition,
    examples: Examples,
    binding: BatchBinding,
    config: PackConfig,
    policy: str = "next-fit",
) -> PackedBatchEpoch:
    """Pack ``examples`` into model calls of at most ``max_rows_per_batch`` rows of ``capacity`` columns.

    ``policy="next-fit"`` (the default, the chapter's policy): in input order, an
    example that does not fit the current row's remaining cells starts a new row;
    earlier rows are never revisited and an exact fill opens no empty row.
    ``"first-fit-decreasing"`` and ``"best-fit-decreasing"`` place longest first
    (see ``seqpack.place``) and usually need fewer rows. Under every policy,
    occurrence ``i`` (the ``i``-th supplied example, duplicates included) gets
    segment ``i``. ``examples`` is a sequence of SequenceExample or an
    ExampleTable. Errors: an example longer than ``capacity``; a call over
    ``max_cells`` (``CapacityError``); a metadata requirement over
    ``max_metadata_bytes`` (``MetadataBudgetError``), checked before placement and
    again before any batch array is allocated.
    """
    return _placed(partition, examples, binding, config, policy).epoch()


class _StreamSource:
    """Several sources whose ordinal ranges follow each other, seen as one."""

    def __init__(self, sources):
        self._sources = sources
        self._firsts = np.array([source.first_ordinal for source in sources], dtype=np.int64)
        self.first_ordinal = sources[0].first_ordinal

    def __len__(self) -> int:
        return sum(len(source) for source in self._sources)

    def _source_of(self, ordinal: int):
        return self._sources[int(np.searchsorted(self._firsts, ordinal, side="right")) - 1]

    def example(self, ordinal: int) -> SequenceExample:
        return self._source_of(ordinal).example(ordinal)

    def example_id(self, ordinal: int) -> str:
        return self._source_of(ordinal).example_id(ordinal)

    @staticmethod
    def gather_bytes(source_tokens: np.ndarray, occurrences: np.ndarray) -> np.ndarray:
        """Joining the parts may copy every token: the list path's bound applies."""
        return ExampleList.gather_bytes(source_tokens, occurrences)

    def gather(self, ordinals: np.ndarray):
        """Each source's part, with token arrays joined (once, when the sources differ)."""
        which = np.searchsorted(self._firsts, ordinals, side="right") - 1
        parts = [self._sources[i].gather(ordinals[which == i]) for i in np.unique(which).tolist()]
        if all(tokens is parts[0][0] for tokens, _, _ in parts):
            return parts[0][0], np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])
        shift = np.cumsum([0] + [len(tokens) for tokens, _, _ in parts[:-1]])
        return (
            np.concatenate([tokens for tokens, _, _ in parts]),
            np.concatenate([b + k for (_, b, _), k in zip(parts, shift)]),
            np.concatenate([e + k for (_, _, e), k in zip(parts, shift)]),
        )


def stream_packed_batches(
    partition: Partition,
    examples: Iterable[Union[SequenceExample, ExampleTable]],
    binding: BatchBinding,
    config: PackConfig,
) -> Iterator[PackedBatch]:
    """Next-fit over a stream of SequenceExample objects and/or ExampleTable chunks.

    Yields each model call once no later example can join it, so memory is bounded
    by one call plus the open row; ordinals count across the whole stream and empty
    chunks are skipped. The
    batches equal ``pack_examples`` on the concatenated input. Each call's bytes
    (fields, records, gathering) are checked against ``max_metadata_bytes`` before
    it is built.
    """
    if not isinstance(config, PackConfig):
        raise InvalidInputError(f"config must be a PackConfig, not {type(config).__name__}")
    capacity, per_call = config.capacity, config.max_rows_per_batch
    pending = []  # (source, ordinals, global rows, starts, lengths) of the current call
    call, open_row, used, ordinal = 0, -1, -1, 0

    def flush(last_row: int) -> PackedBatch:
        if len(pending) == 1:  # the call lies inside one piece: no joining
            source, ordinals, rows, starts, lengths = pending[0]
        else:
            sources = list({id(p[0]): p[0] for p in pending}.values())
            source = sources[0] if len(sources) == 1 else _StreamSource(sources)
            ordinals, rows, starts, lengths = (np.concatenate([p[k] for p in pending]) for k in range(1, 5))
        call_rows = last_row + 1 - call * per_call
        check_call_cells(call_rows, config)
        tokens = np.array([int(lengths.sum()) + len(lengths)])
        required = call_bytes(call_rows, len(lengths), capacity) + int(
            source.gather_bytes(tokens, np.array([len(lengths)]))[0])
        if required > config.max_metadata_bytes:
            raise MetadataBudgetError(
                f"model call {call} needs {required} metadata bytes; max_metadata_bytes is "
                f"{config.max_metadata_bytes}", required=required, maximum=config.max_metadata_bytes)
        return call_batch(partition, binding, source, ordinals, rows - call * per_call, starts, lengths,
                          (call_rows, capacity))

    for item in examples:
        if isinstance(item, ExampleTable):
            if len(item) == 0:
                continue
            source, lengths = _source(partition, item.chunk(0, len(item)), binding)
            source.first_ordinal = ordinal
        else:
            lengths = check_examples(partition, [item], binding)
            source = ExampleList([item], first_ordinal=ordinal)
        check_occurrence_count(ordinal + len(lengths))
        reject_longer(source, lengths, capacity, "capacity")
        rows = np.empty(len(lengths), dtype=np.int64)
        starts = np.empty(len(lengths), dtype=np.int64)
        _, used = _placement.next_fit(lengths, capacity, rows, starts, used)
        rows += max(open_row, 0)  # the kernel numbers the open row (or the first new one) 0
        ordinals = np.arange(ordinal, ordinal + len(lengths), dtype=np.int64)
        ordinal += len(lengths)
        # Calls that this piece completes: every call before the one holding its last row.
        # Rows never decrease, so each call's examples are one slice of the piece.
        calls = rows // per_call
        cuts = np.searchsorted(calls, np.arange(call, int(calls[-1]) + 2)).tolist()
        for finished, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]), start=call):
            pending.append((source, ordinals[a:b], rows[a:b], starts[a:b], lengths[a:b]))
            if finished < int(calls[-1]):
                yield flush((finished + 1) * per_call - 1)
                pending, call = [], finished + 1
        open_row = int(rows[-1])
    if pending:
        yield flush(open_row)
