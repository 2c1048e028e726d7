"""The stored fields of a batch and the kernel pass that fills them from placements.

A batch is a rectangle of cells. Every cell carries an input, a target, a local
position, a segment, and three separate flags: the input exists, the target exists,
the target is supervised. ``PAD_CELL`` (-1) is a storage marker, never a token;
padding cells have segment ``NO_SEGMENT`` (-1), position 0 and all flags false. The
valid cells of a row are a prefix of it. The fields are two planar blocks, int32
``[4, rows, T]`` and bool ``[3, rows, T]``, plus int64 ``valid_lengths`` ``[rows]``,
so each field is its own C-contiguous ``[rows, T]`` plane.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._threads import kernel_threads
from ..errors import InvalidInputError
from . import _fill

PAD_CELL = -1
NO_SEGMENT = -1

#: The stored cell fields, in storage order (``valid_lengths`` is per row, int64).
CELL_FIELDS = ("inputs", "targets", "positions", "segments")
FLAG_FIELDS = ("token_valid", "target_valid", "loss_mask")

#: One record per placed occurrence of an example; ``ordinal`` indexes the examples.
OCCURRENCE_DTYPE = np.dtype(
    [("ordinal", np.int64), ("row", np.int64), ("start", np.int64), ("stop", np.int64), ("segment", np.int32)]
)

# Fills of at least this many cells use every kernel thread; smaller ones (one batch)
# are not worth waking them. The cells are the same either way.
PARALLEL_CELLS = 1 << 20


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

    def slice(self, first: int, end: int) -> "Placements":
        """Entries ``[first, end)``, as views."""
        return Placements(*(p[first:end] for p in self))


def _check_inside(placements: Placements, begins: np.ndarray, ends: np.ndarray, fields: FieldArrays) -> None:
    """Refuse placements the fill kernel would write outside ``fields`` with (it trusts
    them): one entry per occurrence everywhere, rows in order and inside, every
    occurrence's cells inside its row. O(occurrences), against the fill's O(cells)."""
    rows, width = fields.valid_lengths.shape[0], fields.cells.shape[2]
    count = placements.rows.shape[0]
    if any(array.shape != (count,) for array in (*placements, begins, ends)):
        raise InvalidInputError(f"placements must give one entry per occurrence ({count}) in every array")
    stops = placements.starts + (ends - begins - 1)
    bad = np.flatnonzero((placements.rows < 0) | (placements.rows >= rows) | (placements.starts < 0)
                         | (stops > width) | (stops < placements.starts))
    if bad.size:
        i = int(bad[0])
        raise InvalidInputError(f"occurrence {i} at row {int(placements.rows[i])}, columns "
                                f"[{int(placements.starts[i])}, {int(stops[i])}) is not inside the {rows} x {width} "
                                f"fields")
    if count > 1 and np.any(placements.rows[1:] < placements.rows[:-1]):
        raise InvalidInputError("placements must be sorted by row")


def fill_fields(source, placements: Placements, fields: FieldArrays, threads: int | None = None) -> None:
    """Write every cell of ``fields`` from ``placements`` of ``source``'s examples.

    ``threads`` (checked by the caller; None for the default) splits the rows of a
    fill of at least ``PARALLEL_CELLS`` cells; smaller fills run on one thread.
    """
    tokens, supervised, begins, ends = source.gather(placements.ordinals)
    _check_inside(placements, begins, ends, fields)
    threads = kernel_threads(threads) if fields.cells[0].size >= PARALLEL_CELLS else 1
    _fill.fill_rows(tokens, supervision_bytes(supervised), begins, ends, placements.rows, placements.starts,
                    placements.segments, fields.cells, fields.flags.view(np.uint8), fields.valid_lengths,
                    threads)


def supervision_bytes(supervised: np.ndarray | None) -> np.ndarray:
    """A source's supervision as the kernels take it: uint8, empty when every target is supervised."""
    return _ALL_SUPERVISED if supervised is None else supervised.view(np.uint8)


_ALL_SUPERVISED = np.zeros(0, np.uint8)
