"""The batch view: a padded or packed batch's fields, its permission relation and ``verify``.

A valid query ``t`` of row ``r`` may attend to exactly the keys
``[segment_starts[r, t], t]`` of its row: its own segment, at earlier-or-equal local
positions. Permission is represented by ``valid_lengths`` and those per-query starts
(derived from the local positions), never by a dense mask; ``dense_mask()`` exists for
inspection and interop only.
"""

from __future__ import annotations

from functools import cached_property
from typing import NamedTuple

import numpy as np

from .._arguments import DEFAULT_MEMORY_BYTES, check_int, shown
from .._read_only import ReadOnlyArrays
from .counts import permitted_edges
from ..data.binding import BatchBinding, Partition
from ..data.examples import SequenceExample
from ..errors import BindingError, InvalidInputError, MemoryBudgetError, VerificationError
from .counts import LayoutCounts
from .fields import FieldArrays, Placements, fill_fields, supervision_bytes
from . import _fill


class Occurrence(NamedTuple):
    """One supplied use of an example: where it lives and which segment it owns."""

    ordinal: int
    row: int
    columns: range
    segment: int


def _violation_message(code: int, row: int, column: int, batch: "BatchLayout") -> str:
    V = _fill.Violation
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
    V = _fill.Violation
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
        V.OCCURRENCE_SUPERVISION: "loss_mask differs from the example's supervision of its target",
    }[code]
    return f"{name}, column {column}: {what}"


class BatchLayout(ReadOnlyArrays):
    """The cell arrays of a padded or packed batch, filled by one kernel from placements.

    Field attributes (read-only numpy arrays): ``inputs``, ``targets``,
    ``positions``, ``segments`` (int32 ``[rows, T]``), ``token_valid``,
    ``target_valid``, ``loss_mask`` (bool ``[rows, T]``) and ``valid_lengths``
    (int64 ``[rows]``); ``segment_starts`` (int32 ``[rows, T]``) is derived from
    them. A valid query ``t`` of row ``r`` may use exactly the keys
    ``[segment_starts[r, t], t]``. ``segments`` holds, in every valid cell, the
    ordinal of its example in the input that built the batch (or its epoch);
    ``occurrences`` lists where each example sits. ``pairs`` is True when the examples
    are preference pairs: the occurrences then come as whole pairs, each chosen
    (ordinal ``2p``) directly followed by its rejected (``2p + 1``).
    """

    #: Whether a preference pair's rejected sequence sits right after its chosen in the same
    #: row (packing), rather than in the next row (padding: one sequence per row).
    pair_shares_row = False

    def __init__(self, partition: Partition, binding: BatchBinding, source, placements: Placements,
                 fields: FieldArrays, pairs: bool = False):
        # Internal: ``fields`` are filled and read-only (see ``filled``); ``source``
        # (an ExampleSource) supplies the examples by ordinal.
        self.partition = partition
        self.binding = binding
        self.pairs = pairs
        self._source = source
        self._placements = placements
        for name, array in fields.named().items():
            setattr(self, name, array)

    @classmethod
    def filled(cls, partition, binding, source, placements: Placements, shape: tuple[int, int],
               buffers: FieldArrays | None = None, pairs: bool = False, threads: int | None = None):
        """A batch of ``shape`` whose fields are written from ``placements``.

        Internal: callers (padding, packing) validated everything.
        ``buffers`` (at least ``shape`` large), when given, hold the fields: the
        batch views their first rows, until the next batch built on them. ``threads``:
        as :func:`~seqpack.layout.fields.fill_fields` takes them.
        """
        fields = FieldArrays.allocate(*shape) if buffers is None else buffers.rows(0, shape[0])
        fill_fields(source, placements, fields, threads)
        fields.freeze()
        return cls(partition, binding, source, placements, fields, pairs)

    @cached_property
    def _records(self) -> np.ndarray:
        """The occurrences as ``OCCURRENCE_DTYPE`` records (built on first use)."""
        return self._placements.records()

    @property
    def occurrence_records(self) -> np.ndarray:
        """The occurrences as one read-only structured array (``ordinal``, ``row``, ``start``,
        ``stop`` int64 and ``segment`` int32) in the order of ``occurrences``: sorted by
        row, then start. Built once, with no Python object per occurrence."""
        return self._records

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
    def example_ids(self) -> tuple[str, ...]:
        """The ID of each occurrence's example, in record order (without building the examples)."""
        return tuple(self._source.example_id(ordinal) for ordinal in self._records["ordinal"].tolist())

    @property
    def examples(self) -> list[SequenceExample]:
        """The example of each occurrence, in record order."""
        return [self._source.example(i) for i in self._records["ordinal"].tolist()]

    def counts(self) -> LayoutCounts:
        """Storage cells, valid targets (supervised or not), dense score positions and
        permitted edges of this batch."""
        rows, width = self.shape
        lengths = self._placements.lengths
        return LayoutCounts(
            storage_cells=rows * width,
            valid_targets=int(self.valid_lengths.sum()),
            dense_score_positions=rows * width * width,
            permitted_edges=permitted_edges(lengths),
        )

    def ensure_binding(self, expected: BatchBinding) -> None:
        """Raise BindingError unless this batch was built under ``expected``."""
        if not isinstance(expected, BatchBinding):
            raise InvalidInputError(f"binding must be a BatchBinding, not {type(expected).__name__}")
        if self.binding is not expected and self.binding != expected:
            raise BindingError("the batch was built under a different binding")

    def _check_cell(self, name: str, value, limit: int) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < limit:
            raise InvalidInputError(f"{name} {shown(value)} is outside this batch's range [0, {limit})")
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

    def dense_mask(self, max_memory_bytes: int = DEFAULT_MEMORY_BYTES) -> np.ndarray:
        """The permission relation as a bool ``[rows, T, T]`` array (inspection and interop only).

        Building it takes about ``4 * rows * T * T`` bytes (the mask and three temporaries);
        more than ``max_memory_bytes`` (default 8 GiB) is a ``MemoryBudgetError``, raised
        before any is allocated."""
        rows, width = self.shape
        required, maximum = 4 * rows * width * width, check_int("max_memory_bytes", max_memory_bytes)
        if required > maximum:
            raise MemoryBudgetError(f"the dense mask of a batch of {rows} x {width} cells needs {required} bytes; "
                                    f"max_memory_bytes is {maximum}", required=required, maximum=maximum)
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
        segments are distinct, and each row's occurrences cover its valid prefix. A batch
        of ``pairs`` holds whole pairs, each chosen directly followed by its rejected.
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
        code, row, column = _fill.first_row_violation(
            c(self.inputs), c(self.targets), c(self.positions), c(self.segments),
            c(self.token_valid).view(np.uint8), c(self.target_valid).view(np.uint8),
            c(self.loss_mask).view(np.uint8), c(self.segment_starts), c(self.valid_lengths),
        )
        if code != _fill.Violation.OK:
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
        tokens, supervised, begins, ends = self._source.gather(ordinals)
        predictions = ends - begins - 1
        wrong = np.flatnonzero(records["stop"] - records["start"] != predictions)
        if wrong.size:
            record = records[wrong[0]]
            raise VerificationError(
                f"occurrence {record['ordinal']}: columns [{record['start']}, {record['stop']}) "
                f"differ from its example's {predictions[wrong[0]]} predictions",
                int(record["row"]),
            )
        code, index, column = _fill.first_occurrence_violation(
            tokens, supervision_bytes(supervised), begins, ends, c(records["row"]), c(records["start"]),
            c(records["segment"]), c(self.inputs), c(self.targets), c(self.positions), c(self.segments),
            c(self.loss_mask).view(np.uint8), c(self.valid_lengths), np.zeros(rows, dtype=np.int64),
        )
        if code != _fill.Violation.OK:
            row = index if code == _fill.Violation.ROW_COVERAGE else int(records["row"][index])
            raise VerificationError(
                _occurrence_message(code, index, column, self), row, column if column >= 0 else None
            )
        if self.pairs:
            self._verify_pairs(records)

    def _verify_pairs(self, records: np.ndarray) -> None:
        """Whole pairs in record order: each chosen (ordinal ``2p``) directly followed by its
        rejected (``2p + 1``), placed as ``pair_shares_row`` says."""
        if records.shape[0] % 2:
            raise VerificationError(f"the batch holds {records.shape[0]} occurrences: not whole preference pairs")
        chosen, rejected = records[0::2], records[1::2]
        if self.pair_shares_row:
            beside = (rejected["row"] == chosen["row"]) & (rejected["start"] == chosen["stop"])
        else:
            beside = (rejected["row"] == chosen["row"] + 1) & (rejected["start"] == 0)
        broken = np.flatnonzero((chosen["ordinal"] % 2 != 0) | (rejected["ordinal"] != chosen["ordinal"] + 1) | ~beside)
        if broken.size:
            a, b = chosen[broken[0]], rejected[broken[0]]
            raise VerificationError(
                f"occurrences {a['ordinal']} (row {a['row']}, columns [{a['start']}, {a['stop']})) and "
                f"{b['ordinal']} (row {b['row']}, columns [{b['start']}, {b['stop']})) are not one preference "
                f"pair's chosen and rejected sequences side by side",
                int(a["row"]),
            )
