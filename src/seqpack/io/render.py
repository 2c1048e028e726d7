"""Drawing a batch: each row's aligned cells beside its permission matrix, on a terminal or as SVG.

For every shown row, the cell table lists per column the input, target, local position,
segment and the three validity fields (input exists, target exists, supervised), and
the permission matrix marks which key columns (matrix columns) each query column
(matrix row) may attend to: exactly ``[segment_starts[r, q], q]`` for valid queries.
Padding shows as ``·``. Wide rows are cut to a window of columns (``columns``); the
matrix then covers the same window. The SVG has one ``class="cell"`` group per shown
storage cell and one ``class="edge"`` square per permitted (query, key) pair.
"""

from __future__ import annotations

import unicodedata
from html import escape
from itertools import zip_longest

import numpy as np

from .._arguments import is_int
from ..errors import InvalidInputError
from ..layout.batch import BatchLayout

FIELDS = (("input", "inputs"), ("target", "targets"), ("position", "positions"), ("segment", "segments"),
          ("input ok", "token_valid"), ("target ok", "target_valid"), ("supervised", "loss_mask"))
#: Colours of segments 0, 1, 2... (cycled), for the terminal (xterm-256) and the SVG.
TERMINAL_COLOURS = (33, 166, 34, 127, 136, 30, 160, 61)
SVG_COLOURS = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb", "#ee8866")
PAD = "·"


#: Escaped by :func:`printable` beside the control characters: the noncharacters, and the
#: bidirectional marks, embeddings, overrides and isolates.
UNSHOWN = frozenset([0xFFFE, 0xFFFF, 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)])


def printable(text: str) -> str:
    """``text`` with what a terminal or an XML file cannot show as it is written out as
    escapes: control characters and line or paragraph separators as ``\\n``, ``\\x1b``,
    ``\\u2028``..., the undecodable bytes of a file name (``os.fsdecode``'s surrogates) as
    ``\\xff``, the noncharacters U+FFFE and U+FFFF, and the bidirectional controls, which
    would reorder the rest of the line (``\\u202e``...). Everything else (spaces of any
    width, joiners, combining marks) is kept. For display only: a name may itself hold a
    backslash."""
    shown = []
    for character in text:
        code = ord(character)
        if 0xDC80 <= code <= 0xDCFF:
            shown.append(f"\\x{code - 0xDC00:02x}")
        elif unicodedata.category(character) in ("Cc", "Cs", "Zl", "Zp") or code in UNSHOWN:
            shown.append(repr(character)[1:-1])
        else:
            shown.append(character)
    return "".join(shown)


def shown_window(batch: BatchLayout, rows, columns) -> tuple[list[int], range]:
    """The rows (all by default) and the column window (all by default) to draw, checked."""
    count, width = batch.shape
    rows = list(range(count)) if rows is None else list(rows)
    if not rows:
        raise InvalidInputError("rows is empty: nothing to draw")
    for row in rows:
        if not is_int(row):
            raise InvalidInputError(f"a row must be an int, got {type(row).__name__}")
        if not 0 <= row < count:
            raise InvalidInputError(f"row {row} is outside this batch's rows [0, {count})")
    rows = [int(row) for row in rows]
    columns = range(width) if columns is None else columns
    if not isinstance(columns, range) or columns.step != 1:
        raise InvalidInputError(f"columns must be a range of consecutive columns, not {columns!r}")
    if columns.start < 0 or columns.stop > width or len(columns) == 0:
        raise InvalidInputError(f"columns [{columns.start}, {columns.stop}) are not inside [0, {width})")
    return rows, columns


def _cell_value(batch: BatchLayout, field: str, row: int, column: int) -> str:
    value = getattr(batch, field)[row, column]
    if field in ("token_valid", "target_valid", "loss_mask"):
        return "1" if value else "0"
    if not batch.token_valid[row, column] and field != "positions":
        return PAD
    return str(int(value))


def allowed_matrix(batch: BatchLayout, row: int, columns: range) -> np.ndarray:
    """bool ``[len(columns), len(columns)]``: query (row) may attend to key (column)."""
    queries = np.arange(columns.start, columns.stop)
    valid = queries < batch.valid_lengths[row]
    starts = batch.segment_starts[row, columns.start:columns.stop]
    return valid[:, None] & (queries[None, :] >= starts[:, None]) & (queries[None, :] <= queries[:, None])


def batch_text(batch: BatchLayout, *, rows=None, columns: range | None = None, colour: bool = False) -> str:
    """Every shown row's cell table beside its permission matrix, as terminal text."""
    rows, columns = shown_window(batch, rows, columns)
    cell_width = max(3, max(len(str(int(v))) for v in (batch.inputs.max(), batch.targets.max(),
                                                        batch.segments.max(), batch.shape[1])) + 1)
    name_width = max(len(name) for name, _ in FIELDS) + 1
    blocks = []
    for row in rows:
        def paint(text: str, column: int) -> str:
            if not colour or column >= batch.valid_lengths[row]:
                return text
            code = TERMINAL_COLOURS[int(batch.segments[row, column]) % len(TERMINAL_COLOURS)]
            return f"\x1b[38;5;{code}m{text}\x1b[0m"

        table = ["column".ljust(name_width) + "".join(str(c).rjust(cell_width) for c in columns)]
        for name, field in FIELDS:
            table.append(name.ljust(name_width) + "".join(
                paint(_cell_value(batch, field, row, c).rjust(cell_width), c) for c in columns))
        allowed = allowed_matrix(batch, row, columns)
        label = max(4, len(str(columns.stop - 1)))  # a query's column, in full
        matrix = ["keys".ljust(label + 1) + "".join(str(c % 10) for c in columns)]
        for q, column in enumerate(columns):
            marks = "".join(paint("■", column) if allowed[q, k] else PAD for k in range(len(columns)))
            matrix.append(f"{column:>{label}} {marks}")
        table_width = name_width + cell_width * len(columns)
        header = (f"row {row}: {int(batch.valid_lengths[row])} valid cells of {batch.shape[1]}"
                  + (f", columns {columns.start}..{columns.stop - 1} shown" if len(columns) < batch.shape[1] else ""))
        lines = [header]
        for left, right in zip_longest(table, matrix, fillvalue=""):
            lines.append(left + " " * (table_width - _plain_length(left) + 3) + right)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _plain_length(text: str) -> int:
    """Printed width of ``text`` without its colour escapes."""
    length, inside = 0, False
    for character in text:
        if character == "\x1b":
            inside = True
        elif inside and character == "m":
            inside = False
        elif not inside:
            length += 1
    return length


def batch_svg(batch: BatchLayout, *, rows=None, columns: range | None = None, title: str = "") -> str:
    """The shown rows as an SVG figure: cell tables (one ``class="cell"`` group per
    storage cell, coloured by segment) beside permission matrices."""
    rows, columns = shown_window(batch, rows, columns)
    cell_w, line_h, label_w, gap = 34, 15, 78, 30
    table_h = line_h * (len(FIELDS) + 1)
    square = max(6, min(16, 420 // len(columns)))
    matrix_h = square * len(columns)
    block_h = max(table_h, matrix_h) + 40
    table_w = label_w + cell_w * len(columns)
    width = table_w + gap + square * len(columns) + 30
    height = 40 + block_h * len(rows)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="DejaVu Sans Mono, Menlo, Consolas, monospace" font-size="11">',
        "<style>.label{fill:#333}.pad{fill:#f2f2f2}.head{font-weight:bold}</style>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="20" class="head">{escape(printable(title or "cells beside permission matrices"))}</text>',
    ]
    for block, row in enumerate(rows):
        top = 40 + block * block_h
        valid = int(batch.valid_lengths[row])
        parts.append(f'<g class="row" data-row="{row}"><text x="10" y="{top + 8}" class="head">row {row} '
                     f'({valid} valid of {batch.shape[1]})</text>')
        for line, (name, _) in enumerate(FIELDS):
            parts.append(f'<text x="10" y="{top + 20 + (line + 1) * line_h}" class="label">{name}</text>')
        for index, column in enumerate(columns):
            x = label_w + index * cell_w
            is_valid = column < valid
            fill = SVG_COLOURS[int(batch.segments[row, column]) % len(SVG_COLOURS)] if is_valid else None
            parts.append(f'<g class="cell" data-row="{row}" data-column="{column}">'
                         f'<rect x="{x}" y="{top + 12}" width="{cell_w - 2}" height="{table_h}" '
                         + (f'fill="{fill}" fill-opacity="0.25"' if fill else 'class="pad"') + "/>"
                         f'<text x="{x + cell_w / 2 - 1}" y="{top + 20 + 0 * line_h}" text-anchor="middle" '
                         f'class="label">{column}</text>')
            for line, (_, field) in enumerate(FIELDS):
                parts.append(f'<text x="{x + cell_w / 2 - 1}" y="{top + 20 + (line + 1) * line_h}" '
                             f'text-anchor="middle">{escape(_cell_value(batch, field, row, column))}</text>')
            parts.append("</g>")
        allowed = allowed_matrix(batch, row, columns)
        left = table_w + gap
        parts.append(f'<rect x="{left}" y="{top + 12}" width="{square * len(columns)}" height="{matrix_h}" '
                     'fill="none" stroke="#999"/>')
        for q, k in zip(*np.nonzero(allowed)):
            colour = SVG_COLOURS[int(batch.segments[row, columns[q]]) % len(SVG_COLOURS)]
            parts.append(f'<rect class="edge" x="{left + k * square}" y="{top + 12 + q * square}" '
                         f'width="{square - 1}" height="{square - 1}" fill="{colour}"/>')
        parts.append("</g>")
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
