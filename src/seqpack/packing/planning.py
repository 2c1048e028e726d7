"""Packing plans: whole examples placed into shared rows, every limit checked before building.

Each placed occurrence keeps its own segment (its ordinal, which follows the input
order under every policy) and local positions restarting at zero; a query may use
only keys of its own segment at earlier-or-equal positions. Nothing is split,
truncated or joined: an example longer than the capacity is an error, and every
limit (cells per batch, memory bytes) is checked before anything large is allocated.
A plan builds its batches one at a time (``plan``), all at once into one set of
arrays (``pack``, ``PackingPlan.epoch``), or a stream packs as it reads (``stream``);
all give identical batches.

With ``pairs=True`` examples ``2p`` and ``2p + 1`` are preference pair ``p``'s chosen and
rejected sequences: the policy places each pair as one item, both sequences side by
side in one row (see :mod:`seqpack.packing.placement`), so a pair never spans rows or
batches; each sequence keeps its own segment and positions, as any example does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Union

import numpy as np

from .._arguments import batch_index, batch_number, batch_range, check_bool
from .._threads import check_threads
from ..data.binding import BatchBinding, Partition
from ..data.examples import SequenceExample
from ..data.table import ExampleTable
from ..errors import CapacityError, InvalidInputError
from ..layout.fields import FieldArrays, Placements, fill_fields
from ..layout.sources import check_example_count, pair_name, reject_longer, source_of
from . import budget
from .config import PackConfig
from .packed import EpochBatches, PackedBatch, PackedEpoch, packed_batch
from .placement import check_policy, checked_pair_lengths, placed, placed_pairs, stable_order
from .report import EfficiencyReport

Examples = Union[Sequence[SequenceExample], ExampleTable]


def batch_at(batches, index, owner: str):
    """``batches[index]`` for anything with ``len`` and ``batch(i)`` (``owner`` names it in
    errors): one batch (a negative number counts from the end), or a list of them for a
    slice."""
    if isinstance(index, slice):
        return [batches.batch(i) for i in batch_range(index, len(batches), owner)]
    return batches.batch(batch_index(index, len(batches), owner))


class PackingPlan:
    """Where every example goes, with its batches built on demand.

    The plan holds O(examples) arrays (lengths, rows, starts, the visiting order of
    the decreasing policies); ``batch(i)`` builds batch ``i``, iterating builds them
    one at a time, and ``epoch()`` builds them all into one set of arrays.
    ``memory_peak`` covers the plan plus one built batch (the largest): a loop that still
    holds the last batch while the next is built (``for batch in plan``) holds two, and
    ``batches(reuse_buffers=True)`` one. ``pairs``: the
    examples are preference pairs (``batch_pairs()`` counts them per batch).
    """

    def __init__(self, partition, binding, config: PackConfig, policy: str, source, lengths, targets,
                 placement, plan_bytes: int, threads: int | None, pairs: bool):
        # Internal: seqpack.plan validates.
        self.threads = threads
        self.pairs = pairs
        self.partition = partition
        self.binding = binding
        self.config = config
        self.policy = policy
        self._source = source
        self._lengths = lengths
        self._targets = targets  # supervised targets per example (``lengths`` itself without supervision)
        self.row_count = placement.row_count
        self.occurrence_count = int(lengths.shape[0])
        capacity, per_batch = config.capacity, config.rows_per_batch
        self.batch_count = -(-self.row_count // per_batch)
        if policy == "next-fit":
            # Next-fit rows never decrease in input order: sorted order is input order.
            self._order = None
            self._rows, self._starts = placement.rows, placement.starts
        else:
            order = stable_order(placement.rows * capacity + placement.starts, self.row_count * capacity)
            self._order = order
            self._rows, self._starts = placement.rows[order], placement.starts[order]
        first_rows = np.arange(self.batch_count, dtype=np.int64) * per_batch
        self._bounds = np.append(np.searchsorted(self._rows, first_rows), self.occurrence_count)
        occurrences = np.diff(self._bounds)
        tokens = np.add.reduceat(self._sorted(self._lengths), self._bounds[:-1]) + occurrences
        self._batch_gather = budget.gather_bytes(source.copies_tokens, tokens, occurrences)
        self.largest_gather = int(self._batch_gather.max())
        self.largest_batch_rows = min(per_batch, self.row_count)
        largest_batch = budget.batch_bytes(self.largest_batch_rows, int(occurrences.max()), capacity)
        self.plan_bytes = plan_bytes + self.batch_count * budget.PLAN_BYTES_PER_BATCH
        self.memory_peak = self.plan_bytes + self.largest_gather + largest_batch

    def _sorted(self, per_example: np.ndarray) -> np.ndarray:
        """``per_example`` (by ordinal) in placement order."""
        return per_example if self._order is None else per_example[self._order]

    def __len__(self) -> int:
        return self.batch_count

    def _number(self, number) -> int:
        """``number`` as a Python int in ``[0, batch_count)``, else InvalidInputError naming it."""
        return batch_number(number, self.batch_count, "this plan")

    def batch_rows(self, number: int) -> int:
        """Rows of batch ``number``: ``rows_per_batch`` except for a smaller final batch."""
        per_batch = self.config.rows_per_batch
        return min(per_batch, self.row_count - self._number(number) * per_batch)

    def batch(self, number: int) -> PackedBatch:
        """Build batch ``number`` (rows local to it, ordinals and segments global)."""
        return self._batch(self._number(number), None)

    def __getitem__(self, index):
        """``plan[i]``: batch ``i`` (negative counts from the end); a slice gives a list."""
        return batch_at(self, index, "this plan")

    def _batch(self, number: int, buffers) -> PackedBatch:
        first, end = int(self._bounds[number]), int(self._bounds[number + 1])
        local = np.arange(first, end) if self._order is None else self._order[first:end]
        return packed_batch(
            self.partition, self.binding, self._source, local + self._source.first_ordinal,
            self._rows[first:end] - number * self.config.rows_per_batch, self._starts[first:end],
            self._lengths[local], (self.batch_rows(number), self.config.capacity), buffers, self.pairs,
            self.threads,
        )

    def batches(self, reuse_buffers: bool = False) -> Iterator[PackedBatch]:
        """Every batch in order, built one at a time.

        With ``reuse_buffers=True`` all batches share one set of field arrays (sized for
        the largest batch): each batch is valid only until the next one is requested,
        and no batch pays for fresh memory.
        """
        reuse = check_bool("reuse_buffers", reuse_buffers)
        buffers = FieldArrays.allocate(self.largest_batch_rows, self.config.capacity) if reuse else None
        for number in range(self.batch_count):
            yield self._batch(number, buffers)

    def __iter__(self) -> Iterator[PackedBatch]:
        return self.batches()

    def fill_blocks(self) -> list[tuple[int, int]]:
        """Runs ``[first, end)`` of batches filled together by an eager epoch.

        A run gathers at most ``max(FILL_BLOCK_BYTES, largest_gather)`` bytes of
        temporaries, so a table (nothing to copy) fills in one run and a list of
        examples in bounded pieces.
        """
        limit = max(budget.FILL_BLOCK_BYTES, self.largest_gather)
        total = np.cumsum(self._batch_gather)
        cuts = [0]
        while cuts[-1] < self.batch_count:
            done = int(total[cuts[-1] - 1]) if cuts[-1] else 0
            cuts.append(int(np.searchsorted(total, done + limit, side="right")))
        return list(zip(cuts[:-1], cuts[1:]))

    def fill_block_bytes(self) -> int:
        """The largest gather of any run of ``fill_blocks``."""
        total = np.concatenate(([0], np.cumsum(self._batch_gather)))
        return max(int(total[end] - total[first]) for first, end in self.fill_blocks())

    def epoch_requirement(self) -> int:
        """Bytes ``epoch()`` holds at its peak (see :func:`seqpack.packing.budget.epoch_bytes`)."""
        return budget.epoch_bytes(self.plan_bytes, self.occurrence_count, self.row_count, self.batch_count,
                                  self.largest_batch_rows, self.fill_block_bytes(), self.config.capacity)

    def epoch(self, *, threads: int | None = None) -> PackedEpoch:
        """Every batch at once: epoch-wide field arrays filled run by run, batches as views of them.

        ``threads`` (default: the plan's) split the rows of the fill; the result never
        depends on it. Raises ``MemoryBudgetError`` before allocating when
        ``epoch_requirement()`` exceeds ``max_memory_bytes``.
        """
        threads = self.threads if threads is None else check_threads(threads)
        required = self.epoch_requirement()
        budget.require(required, self.config.max_memory_bytes, "the packed epoch")
        budget.field_bytes(self.row_count, self.config.capacity)  # one array must hold every row
        per_batch = self.config.rows_per_batch
        local = np.arange(self.occurrence_count) if self._order is None else self._order
        ordinals = local + self._source.first_ordinal
        placements = Placements(ordinals, self._rows, self._starts, self._lengths[local], ordinals.astype(np.int32))
        fields = FieldArrays.allocate(self.row_count, self.config.capacity)
        for first_batch, end_batch in self.fill_blocks():
            a, b = int(self._bounds[first_batch]), int(self._bounds[end_batch])
            first_row = first_batch * per_batch
            run = placements.slice(a, b)
            fill_fields(self._source, run._replace(rows=run.rows - first_row),
                        fields.rows(first_row, end_batch * per_batch), threads)
        fields.freeze()
        batches = EpochBatches(self.partition, self.binding, self._source, per_batch, self._bounds, fields,
                               placements._replace(rows=self._rows % per_batch), self.pairs)
        return PackedEpoch(batches, fields, self.report(), self.occurrence_count, required, self.pairs)

    def batch_targets(self) -> np.ndarray:
        """Supervised targets of every batch (the loss denominators), without building any."""
        if not self.batch_count:
            return np.zeros(0, np.int64)
        return np.add.reduceat(self._sorted(self._targets), self._bounds[:-1])

    def batch_pairs(self) -> np.ndarray:
        """Preference pairs of every batch (int64, all zero unless ``pairs``), without building any."""
        return np.diff(self._bounds) // 2 if self.pairs else np.zeros(self.batch_count, np.int64)

    def report(self) -> EfficiencyReport:
        """Storage and attention efficiency of the planned epoch."""
        return EfficiencyReport.of(self.policy, self.config.capacity, self.row_count, self._lengths,
                                   self.batch_targets(), self.occurrence_count // 2 if self.pairs else 0)


def check_batch_cells(rows: int, config: PackConfig) -> None:
    """A batch of ``rows`` rows must hold at most ``max_cells`` cells."""
    cells = rows * config.capacity
    if cells > config.max_cells:
        raise CapacityError(
            f"a batch of {rows} rows x {config.capacity} columns has {cells} cells; "
            f"max_cells is {config.max_cells}",
            cells=cells,
            maximum=config.max_cells,
        )


def check_config(config) -> PackConfig:
    if not isinstance(config, PackConfig):
        raise InvalidInputError(f"config must be a PackConfig, not {type(config).__name__}")
    return config


def placed_plan(examples, config, partition, binding, policy, threads, pairs) -> PackingPlan:
    """Validate everything, check the plan's own bytes and place: a plan whose batches
    are not yet budgeted."""
    config = check_config(config)
    threads = check_threads(threads)
    check_policy(policy, config.capacity)
    pairs = check_bool("pairs", pairs)
    source, lengths, targets = source_of(examples, partition, binding)
    check_example_count(lengths.shape[0])
    reject_longer(source, lengths, config.capacity, "capacity")
    pair_lengths = checked_pair_lengths(lengths, config.capacity, pair_name(source)) if pairs else None
    before = budget.plan_bytes(lengths, config.capacity, policy, source.held_bytes_per_example, pair_lengths)
    if targets is not lengths:
        before += targets.nbytes
    budget.require(before, config.max_memory_bytes, "the packing plan")
    if pairs:
        placement = placed_pairs(lengths, pair_lengths, config.capacity, policy)
    else:
        placement = placed(lengths, config.capacity, policy)
    check_batch_cells(min(config.rows_per_batch, placement.row_count), config)
    return PackingPlan(partition, binding, config, policy, source, lengths, targets, placement, before, threads,
                       pairs)


def plan(
    examples: Examples, config: PackConfig, *, partition: Partition, binding: BatchBinding,
    policy: str = "next-fit", threads: int | None = None, pairs: bool = False,
) -> PackingPlan:
    """Place every example and check every limit; build nothing yet.

    ``examples`` is a list of ``SequenceExample`` or an ``ExampleTable``, all made
    under ``binding`` for ``partition`` (checked). ``policy`` is ``"next-fit"`` (the
    default, the chapter's policy), ``"first-fit-decreasing"`` or
    ``"best-fit-decreasing"`` (see :func:`seqpack.place`). ``pairs=True`` reads the
    examples as preference pairs (``2p`` chosen, ``2p + 1`` rejected; an odd count is an
    error) and places each pair whole, in one row. Errors: an example, or a pair,
    longer than ``capacity`` or a batch over ``max_cells`` (``CapacityError``); the plan
    plus its largest batch over ``max_memory_bytes`` (``MemoryBudgetError``, checked
    before placement and again after it). ``threads`` (None: the default of
    ``seqpack._threads.default_threads``) is what ``epoch()`` and large builds use.
    """
    result = placed_plan(examples, config, partition, binding, policy, threads, pairs)
    budget.require(result.memory_peak, result.config.max_memory_bytes, "the packing plan and its largest batch")
    return result


def pack(
    examples: Examples, config: PackConfig, *, partition: Partition, binding: BatchBinding,
    policy: str = "next-fit", threads: int | None = None, pairs: bool = False,
) -> PackedEpoch:
    """Pack ``examples`` into batches of at most ``rows_per_batch`` rows of ``capacity`` columns.

    ``policy="next-fit"`` (the default, the chapter's policy): in input order, an
    example that does not fit the current row's remaining cells starts a new row;
    earlier rows are never revisited and an exact fill opens no empty row.
    ``"first-fit-decreasing"`` and ``"best-fit-decreasing"`` place longest first
    (see ``seqpack.place``) and usually need fewer rows. Under every policy, the
    ``i``-th supplied example (duplicates included) gets segment ``i``. With
    ``pairs=True`` the policy places preference pairs instead of examples, as
    :func:`plan` says. Errors are those of :func:`plan`, and the whole epoch's bytes
    over ``max_memory_bytes`` (``MemoryBudgetError``), checked before any batch array
    is allocated. ``threads`` (None: ``seqpack._threads.default_threads()``) split
    the fill; the result never depends on it.
    """
    return placed_plan(examples, config, partition, binding, policy, threads, pairs).epoch()


def efficiency_report(packed: Union[PackingPlan, PackedEpoch]) -> EfficiencyReport:
    """The efficiency report of a plan or an eager epoch."""
    if not isinstance(packed, (PackingPlan, PackedEpoch)):
        raise InvalidInputError(f"expected a PackingPlan or PackedEpoch, not {type(packed).__name__}")
    return packed.report()
