"""Right-padded batches, and the row layout that padded and packed batches share.

A batch is a rectangle of cells. Every cell carries an input, a target, a local
position, a segment, and three separate fields: the input exists, the target
exists, the target is supervised. ``PAD_CELL`` (-1) is a storage marker, never a
token; padding cells have segment ``NO_SEGMENT`` (-1), position 0, all fields
false, and are never attended nor used as targets. The valid cells of a row are
a prefix of it; permission is represented by ``valid_lengths`` and the first
permitted key of each query (``segment_starts``), never by a dense mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Sequence

import numpy as np

from . import _layout
from ._threads import kernel_threads
from ._checks import check_int
from .binding import BatchBinding, Partition
from .errors import BindingError, CapacityError, InvalidInputError, VerificationError
from .examples import SequenceExample

PAD_CELL = -1
NO_SEGMENT = -1
INT32_MAX = 2**31 - 1

#: One record per placed occurrence of an example; ``ordinal`` indexes the examples.
OCCURRENCE_DTYPE = np.dtype(
    [("ordinal", np.int64), ("row", np.int64), ("start", np.int64), ("stop", np.int64), ("segment", np.int32)]
)



class Occurrence(NamedTuple):
    """One supplied use of an example: where it lives and which segment it owns."""

    ordinal: int
    row: int
    columns: range
    segment: int


@dataclass(frozen=True)
class VariableBatchConfig:
    """Rows per batch, the cell limit of one batch, and an optional prediction width limit."""

    batch_size: int
    max_cells: int
    max_width: int | None = None

    def __post_init__(self):
        check_int("batch_size", self.batch_size)
        check_int("max_cells", self.max_cells)
        if self.max_width is not None:
            check_int("max_width", self.max_width)


def check_arguments(partition: Partition, binding: BatchBinding) -> None:
    """The partition and binding a batch is built for must be of the right types."""
    if not isinstance(partition, Partition):
        raise InvalidInputError(f"partition must be a Partition, not {partition!r}")
    if not isinstance(binding, BatchBinding):
        raise InvalidInputError(f"binding must be a BatchBinding, not {type(binding).__name__}")


def check_owner(what: str, owner_binding, owner_partition, binding: BatchBinding, partition: Partition) -> None:
    """``what`` (an example or a table) must share the batch's binding (by value) and partition."""
    if owner_binding is not binding and owner_binding != binding:
        raise BindingError(f"{what} was built under a different binding")
    if owner_partition is not partition:
        raise BindingError(
            f"{what} belongs to partition {owner_partition.value!r}, not {partition.value!r}"
        )


def check_examples(
    partition: Partition, examples: Sequence[SequenceExample], binding: BatchBinding
) -> np.ndarray:
    """Validate examples against the partition and binding; return their prediction lengths."""
    check_arguments(partition, binding)
    if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence):
        raise InvalidInputError("examples must be a list or tuple of SequenceExample")
    if len(examples) == 0:
        raise InvalidInputError("a batch needs at least one example")
    for index, example in enumerate(examples):
        if not isinstance(example, SequenceExample):
            raise InvalidInputError(
                f"example {index} is a {type(example).__name__}, not a SequenceExample"
            )
        check_owner(f"example {example.id!r} (index {index})", example.binding, example.partition,
                    binding, partition)
    return np.fromiter((len(example) for example in examples), dtype=np.int64, count=len(examples))


class ExampleList:
    """SequenceExample objects as the token source of batches.

    Sources give batches, by occurrence ordinal: each example, its id, and the
    example source tokens as ``tokens[begins[i]:ends[i]]`` for the fill kernel.
    """

    __slots__ = ("_examples", "first_ordinal")

    #: Bytes held per occurrence beyond the placement arrays: its length and tuple slot.
    held_bytes_per_occurrence = 16

    def __init__(self, examples: Sequence[SequenceExample], first_ordinal: int = 0):
        self._examples = tuple(examples)
        self.first_ordinal = first_ordinal

    def __len__(self) -> int:
        return len(self._examples)

    def example(self, ordinal: int) -> SequenceExample:
        return self._examples[ordinal - self.first_ordinal]

    def example_id(self, ordinal: int) -> str:
        return self._examples[ordinal - self.first_ordinal].id

    def gather(self, ordinals: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flat int32 source tokens of ``ordinals``' examples with their int64 begins and ends."""
        base = self.first_ordinal
        selected = [self._examples[i - base].source_tokens for i in ordinals.tolist()]
        ends = np.cumsum([len(tokens) for tokens in selected], dtype=np.int64)
        begins = np.concatenate(([0], ends[:-1])).astype(np.int64) if selected else ends.copy()
        tokens = np.concatenate(selected).astype(np.int32, copy=False) if selected else np.empty(0, np.int32)
        return tokens, begins, ends

    @staticmethod
    def gather_bytes(source_tokens: np.ndarray, occurrences: np.ndarray) -> np.ndarray:
        """Temporaries of one ``gather`` plus the fill's record copies: tokens, bounds, views."""
        return 4 * source_tokens + (16 + 20 + 256) * occurrences + 64


def _violation_message(code: int, row: int, column: int, batch: "BatchLayout") -> str:
    V = _layout.Violation
    at = f"row {row}, column {column}"
    if code == V.ROW_LENGTH:
        return f"row {row}: valid length {batch.valid_lengths[row]} is outside [0, {batch.shape[1]}]"
    if code == V.VALID_FLAG:
        fields = (batch.token_valid[row, column], batch.target_valid[row, column], batch.loss_mask[row, column])
        side = "inside" if column < batch.valid_lengths[row] else "outside"
        return (
            f"{at}: (input exists, target exists, supervised) = {tuple(bool(f) for f in fields)} "
            f"{side} the row's valid prefix of {batch.valid_lengths[row]} cells"
        )
    if code == V.PAD_VALUE:
        if column < batch.valid_lengths[row]:
            return f"{at}: a valid cell holds PAD_CELL as its input or target"
        return (
            f"{at}: padding must hold input/target PAD_CELL, position 0, NO_SEGMENT and "
            f"segment start 0, found input {batch.inputs[row, column]}, target "
            f"{batch.targets[row, column]}, position {batch.positions[row, column]}, segment "
            f"{batch.segments[row, column]}, start {batch.segment_starts[row, column]}"
        )
    if code == V.SEGMENT_MISSING:
        return f"{at}: a valid cell has no segment"
    if code == V.POSITION_STEP:
        return (
            f"{at}: local position {batch.positions[row, column]} does not step by one from 0 "
            f"inside segment {batch.segments[row, column]}"
        )
    if code == V.SEGMENT_START:
        return (
            f"{at}: segment start {batch.segment_starts[row, column]} is not the first column "
            f"of segment {batch.segments[row, column]}"
        )
    raise AssertionError(f"unknown row violation code {code}")


def _occurrence_message(code: int, index: int, column: int, batch: "BatchLayout") -> str:
    V = _layout.Violation
    if code == V.ROW_COVERAGE:
        return (
            f"row {index}: its occurrences do not cover exactly its valid prefix of "
            f"{batch.valid_lengths[index]} cells"
        )
    record = batch._records[index]
    name = (f"occurrence {record['ordinal']} (example {batch._source.example_id(record['ordinal'])!r}, "
            f"row {record['row']})")
    if code == V.OCCURRENCE_BOUNDS:
        return f"{name}: columns [{record['start']}, {record['stop']}) lie outside the row's valid prefix"
    what = {
        V.OCCURRENCE_SEGMENT: f"segment differs from the record's {record['segment']}",
        V.OCCURRENCE_POSITION: "local position differs from its offset in the example",
        V.OCCURRENCE_TOKEN: "input or target differs from the example's source range",
    }[code]
    return f"{name}, column {column}: {what}"


#: The stored cell fields of a batch, in storage order (``valid_lengths`` is per row, int64).
CELL_FIELDS = ("inputs", "targets", "positions", "segments")
FLAG_FIELDS = ("token_valid", "target_valid", "loss_mask")
# Bytes a batch holds per cell (the int32 and bool fields) and per row (valid length, int64).
CELL_BYTES = 4 * len(CELL_FIELDS) + len(FLAG_FIELDS)
ROW_BYTES = 8


class FieldArrays(NamedTuple):
    """A batch's stored fields as three arrays, each field one plane of them.

    ``cells`` is int32 ``[4, rows, T]`` (inputs, targets, positions, segments),
    ``flags`` bool ``[3, rows, T]`` (token_valid, target_valid, loss_mask) and
    ``valid_lengths`` int64 ``[rows]``; each plane is a C-contiguous ``[rows, T]`` array.
    """

    cells: np.ndarray
    flags: np.ndarray
    valid_lengths: np.ndarray

    @classmethod
    def allocate(cls, rows: int, width: int) -> "FieldArrays":
        """Fresh, uninitialized fields of a ``rows`` x ``width`` batch."""
        return cls(np.empty((len(CELL_FIELDS), rows, width), np.int32),
                   np.empty((len(FLAG_FIELDS), rows, width), np.bool_), np.empty(rows, np.int64))

    def rows(self, start: int, stop: int) -> "FieldArrays":
        """The fields of rows ``[start, stop)``, as views."""
        return FieldArrays(self.cells[:, start:stop], self.flags[:, start:stop], self.valid_lengths[start:stop])

    def named(self) -> dict[str, np.ndarray]:
        """Every field by name."""
        fields = dict(zip(CELL_FIELDS, self.cells))
        fields.update(zip(FLAG_FIELDS, self.flags))
        fields["valid_lengths"] = self.valid_lengths
        return fields

    def freeze(self) -> None:
        """Make every array read-only (views made afterwards are read-only too)."""
        for array in self:
            array.flags.writeable = False


class Placements(NamedTuple):
    """Where a batch's occurrences sit, one entry each, sorted by row then start.

    ``ordinals`` (int64) name the examples in the batch's source; ``rows`` (local
    to the fields being filled) and ``starts`` are contiguous int64, ``lengths``
    int64 prediction counts, ``segments`` contiguous int32.
    """

    ordinals: np.ndarray
    rows: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    segments: np.ndarray

    def records(self) -> np.ndarray:
        """The occurrences as read-only ``OCCURRENCE_DTYPE`` records."""
        records = np.empty(len(self.ordinals), dtype=OCCURRENCE_DTYPE)
        records["ordinal"] = self.ordinals
        records["row"] = self.rows
        records["start"] = self.starts
        records["stop"] = self.starts + self.lengths
        records["segment"] = self.segments
        records.flags.writeable = False
        return records


# Fills of at least this many cells use every kernel thread; smaller ones (a model
# call) are not worth waking them. The cells are the same either way.
PARALLEL_CELLS = 1 << 20


def fill_fields(source, placements: Placements, fields: FieldArrays) -> None:
    """Write every cell of ``fields`` from ``placements`` of ``source``'s examples."""
    tokens, begins, ends = source.gather(placements.ordinals)
    threads = kernel_threads() if fields.cells[0].size >= PARALLEL_CELLS else 1
    _layout.fill_rows(tokens, begins, ends, placements.rows, placements.starts, placements.segments,
                      fields.cells, fields.flags.view(np.uint8), fields.valid_lengths, threads)


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
    def total(cls, batches: Sequence["BatchLayout"]) -> "LayoutCounts":
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


class BatchLayout:
    """The cell arrays of a padded or packed batch, filled by one kernel from placements.

    Field attributes (read-only numpy arrays): ``inputs``, ``targets``,
    ``positions``, ``segments`` (int32 ``[rows, T]``), ``token_valid``,
    ``target_valid``, ``loss_mask`` (bool ``[rows, T]``) and ``valid_lengths``
    (int64 ``[rows]``); ``segment_starts`` (int32 ``[rows, T]``) is derived from
    them. A valid query ``t`` of row ``r`` may use exactly the keys
    ``[segment_starts[r, t], t]``.
    """

    def __init__(self, partition: Partition, binding: BatchBinding, source, placements: Placements,
                 fields: FieldArrays):
        # Internal: ``fields`` are filled and read-only (see ``filled``); ``source``
        # (an ExampleList or ExampleTable) supplies the examples by ordinal.
        self.partition = partition
        self.binding = binding
        self._source = source
        self._placements = placements
        for name, array in fields.named().items():
            setattr(self, name, array)

    @classmethod
    def filled(cls, partition, binding, source, placements: Placements, shape: tuple[int, int],
               buffers: FieldArrays | None = None):
        """A batch of ``shape`` whose fields are written from ``placements``.

        Internal: callers (VariableBatch.build, packing) validated everything.
        ``buffers`` (at least ``shape`` large), when given, hold the fields: the
        batch views their first rows, until the next batch built on them.
        """
        fields = FieldArrays.allocate(*shape) if buffers is None else buffers.rows(0, shape[0])
        fill_fields(source, placements, fields)
        fields.freeze()
        return cls(partition, binding, source, placements, fields)

    @cached_property
    def _records(self) -> np.ndarray:
        """The occurrences as ``OCCURRENCE_DTYPE`` records (built on first use)."""
        return self._placements.records()

    @cached_property
    def segment_starts(self) -> np.ndarray:
        """The first permitted key column of every query, int32 ``[rows, T]``, read-only.

        A valid cell's segment began ``position`` columns earlier, so its start is
        its column minus its local position; padding has start 0. Derived (once,
        on first access) rather than stored: it costs no bytes per cell until used.
        """
        columns = np.arange(self.shape[1], dtype=np.int32)
        starts = np.where(self.token_valid, columns - self.positions, np.int32(0))
        starts.flags.writeable = False
        return starts

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, columns)``."""
        return self.inputs.shape

    @property
    def cell_count(self) -> int:
        return self.inputs.size

    @property
    def target_count(self) -> int:
        """Supervised targets: the loss denominator."""
        return int(np.count_nonzero(self.loss_mask))

    @property
    def occurrences(self) -> list[Occurrence]:
        """Placement records ``(ordinal, row, columns, segment)``, built on access."""
        return [
            Occurrence(int(o), int(r), range(int(a), int(b)), int(s))
            for o, r, a, b, s in self._records.tolist()
        ]

    @property
    def examples(self) -> list[SequenceExample]:
        """The example of each occurrence, in record order."""
        return [self._source.example(i) for i in self._records["ordinal"].tolist()]

    def counts(self) -> LayoutCounts:
        """Storage cells, valid targets, dense score positions and permitted edges of this batch."""
        rows, width = self.shape
        lengths = self._placements.lengths
        return LayoutCounts(
            storage_cells=rows * width,
            valid_targets=self.target_count,
            dense_score_positions=rows * width * width,
            permitted_edges=int((lengths * (lengths + 1) // 2).sum()),
        )

    def ensure_binding(self, expected: BatchBinding) -> None:
        """Raise BindingError unless this batch was built under ``expected``."""
        if self.binding is not expected and self.binding != expected:
            raise BindingError("the batch was built under a different binding")

    def _check_cell(self, name: str, value, limit: int) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < limit:
            raise InvalidInputError(f"{name} {value!r} is outside this batch's range [0, {limit})")
        return int(value)

    def allowed_key(self, row: int, query: int, key: int) -> bool:
        """Whether ``query`` may attend to ``key`` in ``row``.

        Both cells valid, the same segment, and the key's local position no later
        than the query's. Coordinates outside the batch are an error.
        """
        rows, width = self.shape
        row = self._check_cell("row", row, rows)
        query = self._check_cell("query", query, width)
        key = self._check_cell("key", key, width)
        return bool(
            self.token_valid[row, query]
            and self.token_valid[row, key]
            and self.segments[row, query] == self.segments[row, key]
            and self.positions[row, key] <= self.positions[row, query]
        )

    def allowed_keys(self, row: int) -> list[list[int]]:
        """Permitted key columns of every query column of ``row`` (``[]`` for inactive queries)."""
        row = self._check_cell("row", row, self.shape[0])
        valid = int(self.valid_lengths[row])
        starts = self.segment_starts[row].tolist()
        return [list(range(starts[q], q + 1)) if q < valid else [] for q in range(self.shape[1])]

    def dense_mask(self) -> np.ndarray:
        """The permission relation as a bool ``[rows, T, T]`` array (inspection and interop only)."""
        valid = self.token_valid
        same = self.segments[:, :, None] == self.segments[:, None, :]
        causal = self.positions[:, None, :] <= self.positions[:, :, None]
        return valid[:, :, None] & valid[:, None, :] & same & causal

    def verify(self) -> None:
        """Check every invariant a trainer relies on, in O(cells); raise VerificationError.

        Valid cells form a row prefix, carry a segment whose local positions step
        by one from 0 and whose queries start at the segment's first column;
        padding carries PAD_CELL, NO_SEGMENT, position 0 and all-false fields;
        each occurrence record matches its cells and its example's source tokens,
        segments are distinct, and each row's occurrences cover its valid prefix.
        """
        rows, width = self.shape
        for name, array, dtype, shape in (
            ("inputs", self.inputs, np.int32, (rows, width)),
            ("targets", self.targets, np.int32, (rows, width)),
            ("positions", self.positions, np.int32, (rows, width)),
            ("segments", self.segments, np.int32, (rows, width)),
            ("segment_starts", self.segment_starts, np.int32, (rows, width)),
            ("token_valid", self.token_valid, np.bool_, (rows, width)),
            ("target_valid", self.target_valid, np.bool_, (rows, width)),
            ("loss_mask", self.loss_mask, np.bool_, (rows, width)),
            ("valid_lengths", self.valid_lengths, np.int64, (rows,)),
        ):
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape:
                raise VerificationError(f"field {name} is not a {np.dtype(dtype).name} array of shape {shape}")
        c = np.ascontiguousarray
        code, row, column = _layout.first_row_violation(
            c(self.inputs), c(self.targets), c(self.positions), c(self.segments),
            c(self.token_valid).view(np.uint8), c(self.target_valid).view(np.uint8),
            c(self.loss_mask).view(np.uint8), c(self.segment_starts), c(self.valid_lengths),
        )
        if code != _layout.Violation.OK:
            raise VerificationError(_violation_message(code, row, column, self), row, column if column >= 0 else None)
        records = self._records
        segments = np.sort(records["segment"])
        if segments.size > 1 and np.any(segments[1:] == segments[:-1]):
            duplicate = int(segments[1:][segments[1:] == segments[:-1]][0])
            raise VerificationError(f"segment {duplicate} is claimed by more than one occurrence")
        ordinals = records["ordinal"]
        first = self._source.first_ordinal
        if ordinals.size and (ordinals.min() < first or ordinals.max() >= first + len(self._source)):
            raise VerificationError("an occurrence record names an example outside this batch's examples")
        tokens, begins, ends = self._source.gather(ordinals)
        predictions = ends - begins - 1
        wrong = np.flatnonzero(records["stop"] - records["start"] != predictions)
        if wrong.size:
            record = records[wrong[0]]
            raise VerificationError(
                f"occurrence {record['ordinal']}: columns [{record['start']}, {record['stop']}) "
                f"differ from its example's {predictions[wrong[0]]} predictions",
                int(record["row"]),
            )
        code, index, column = _layout.first_occurrence_violation(
            tokens, begins, ends, c(records["row"]), c(records["start"]), c(records["segment"]),
            c(self.inputs), c(self.targets), c(self.positions), c(self.segments),
            c(self.valid_lengths), np.zeros(rows, dtype=np.int64),
        )
        if code != _layout.Violation.OK:
            row = index if code == _layout.Violation.ROW_COVERAGE else int(records["row"][index])
            raise VerificationError(
                _occurrence_message(code, index, column, self), row, column if column >= 0 else None
            )


class VariableBatch(BatchLayout):
    """A right-padded batch: one example per row, in supplied order, padded to the longest.

    Row ``r`` holds example ``r`` from column 0 with segment ``r``; the batch is
    as wide as its longest example's prediction count.
    """

    @classmethod
    def build(
        cls,
        partition: Partition,
        examples: Sequence[SequenceExample],
        binding: BatchBinding,
        config: VariableBatchConfig,
    ) -> "VariableBatch":
        """Validate ``examples`` against ``partition``, ``binding`` and ``config``, then pad them."""
        source, lengths, bounds = _padded_plan(partition, examples, binding, config)
        if len(bounds) > 1:
            raise InvalidInputError(
                f"{len(source)} examples do not fit a batch of {config.batch_size} rows"
            )
        return cls._from_span(partition, binding, source, lengths, 0, len(source))

    @classmethod
    def _from_span(cls, partition, binding, source, lengths: np.ndarray, first: int, end: int) -> "VariableBatch":
        rows = end - first
        local = np.arange(rows, dtype=np.int64)
        placements = Placements(np.arange(first, end, dtype=np.int64), local, np.zeros(rows, np.int64),
                                lengths[first:end], local.astype(np.int32))
        return cls.filled(partition, binding, source, placements, (rows, int(lengths[first:end].max())))


def reject_longer(source, lengths: np.ndarray, limit: int, limit_name: str) -> None:
    """Raise CapacityError naming the first example with more than ``limit`` predictions."""
    too_long = np.flatnonzero(lengths > limit)
    if too_long.size:
        index = int(too_long[0])
        ordinal = source.first_ordinal + index
        raise CapacityError(
            f"example {source.example_id(ordinal)!r} (index {ordinal}) has {lengths[index]} "
            f"predictions; {limit_name} is {limit}",
            cells=int(lengths[index]),
            maximum=limit,
        )


def _padded_plan(partition, examples, binding, config):
    """Validate everything; return the examples' source, their lengths and each batch's span."""
    if not isinstance(config, VariableBatchConfig):
        raise InvalidInputError(f"config must be a VariableBatchConfig, not {type(config).__name__}")
    lengths = check_examples(partition, examples, binding)
    source = ExampleList(examples)
    if config.max_width is not None:
        reject_longer(source, lengths, config.max_width, "max_width")
    bounds = [(first, min(first + config.batch_size, len(source)))
              for first in range(0, len(source), config.batch_size)]
    for number, (first, end) in enumerate(bounds):
        width = int(lengths[first:end].max())
        cells = (end - first) * width
        if cells > config.max_cells:
            raise CapacityError(
                f"batch {number} (examples {first}..{end - 1}) has {end - first} rows x {width} "
                f"columns = {cells} cells; max_cells is {config.max_cells}",
                cells=cells,
                maximum=config.max_cells,
            )
    return source, lengths, bounds


class VariableBatchEpoch:
    """Padded batches of ``batch_size`` consecutive examples in supplied order.

    The final batch keeps its actual row count; no all-padding rows are added.
    Everything is validated before any batch is built.
    """

    def __init__(self, batches: list[VariableBatch]):
        self.batches = batches

    @classmethod
    def build(
        cls,
        partition: Partition,
        examples: Sequence[SequenceExample],
        binding: BatchBinding,
        config: VariableBatchConfig,
    ) -> "VariableBatchEpoch":
        source, lengths, bounds = _padded_plan(partition, examples, binding, config)
        return cls([
            VariableBatch._from_span(partition, binding, source, lengths, first, end)
            for first, end in bounds
        ])

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def target_count(self) -> int:
        return sum(batch.target_count for batch in self.batches)
