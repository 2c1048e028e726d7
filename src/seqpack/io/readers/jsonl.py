"""JSON lines: one object a line, the document in one field (text or token IDs). A
reader splits at line boundaries into pieces whose errors still name the file's own
lines; chunks end at ``CHUNK_BYTES`` or ``CHUNK_DOCUMENTS``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from itertools import chain

import numpy as np

from ..._limits import check_int, check_optional_int
from ...errors import InvalidInputError
from .base import (
    CHUNK_BYTES,
    CHUNK_DOCUMENTS,
    DocumentChunk,
    Input,
    cannot_read,
    check_fields,
    input_path,
    not_a_file,
)
from .sniff import MAGIC_BYTES, check_text_file


def _line_boundary(handle, offset: int, stop: int) -> int:
    """The first line start at or after ``offset`` (``stop`` if none is before it)."""
    if offset <= 0:
        return 0
    position = offset - 1
    handle.seek(position)
    while position < stop:
        block = handle.read(min(1 << 16, stop - position))
        if not block:
            break
        newline = block.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(block)
    return stop


def _count_newlines(handle, start: int, stop: int, block_bytes: int) -> int:
    """Newlines in bytes ``[start, stop)`` of ``handle``, counted a block at a time."""
    handle.seek(start)
    count, position = 0, start
    while position < stop:
        block = handle.read(min(block_bytes, stop - position))
        if not block:
            break
        count += block.count(b"\n")
        position += len(block)
    return count


def _json_kind(value) -> str:
    """The JSON name of a parsed value's type (array, string, number...)."""
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    return "null" if value is None else "number"


class JsonLines:
    """A JSONL file: one JSON object a line, the document in ``text_field`` (a string;
    ``"text"`` when neither field is given) or ``ids_field`` (a list of token IDs), not
    both. Blank lines are skipped; lines count from 1.

    A piece of the file is the lines in bytes ``[start, stop)`` (``stop=None``: to the
    end), where ``start`` is a line boundary and ``first_line`` is the number of the line
    it begins; :meth:`split` makes such pieces, and errors name the file's own lines. A
    compressed or binary file (known by its first bytes, as for :class:`TextFiles`) is refused."""

    #: Bytes read at a time when looking for line boundaries and counting lines.
    SCAN_BYTES = 16 << 20

    def __init__(self, path, *, text_field: str | None = None, ids_field: str | None = None, start: int = 0,
                 stop: int | None = None, first_line: int = 1):
        self.path = input_path(path)
        if not self.path.is_file():
            raise not_a_file(path)
        check_fields(str(path), text_field, ids_field)
        try:
            with open(self.path, "rb") as handle:
                head = handle.read(MAGIC_BYTES)
                handle.seek(max(0, os.fstat(handle.fileno()).st_size - MAGIC_BYTES))
                check_text_file(path, head, handle.read(MAGIC_BYTES), "JSONL")
        except OSError as error:
            raise cannot_read(path, error) from None
        self.field = ids_field if ids_field is not None else text_field if text_field is not None else "text"
        self.pretokenized = ids_field is not None
        self.start = check_int("start", start, minimum=0)
        self.stop = check_optional_int("stop", stop, minimum=self.start)
        self.first_line = check_int("first_line", first_line)
        self.inputs = [Input(str(path), "jsonl", "line")]

    def split(self, cuts) -> list[JsonLines]:
        """This reader's lines as consecutive pieces, cut at the first line boundary at or
        after each byte offset in ``cuts`` (ascending); empty pieces are dropped. Each piece
        is a copy of this reader (its class and settings) over its bytes. One pass
        over the bytes before the last cut counts the lines (``bytes.count`` on blocks of
        ``SCAN_BYTES``: no Python step per line)."""
        stop = os.path.getsize(self.path) if self.stop is None else self.stop
        bounds, numbers = [self.start], [self.first_line]
        with open(self.path, "rb") as handle:
            for cut in cuts:
                boundary = _line_boundary(handle, max(int(cut), bounds[-1]), stop)
                if bounds[-1] < boundary < stop:
                    numbers.append(numbers[-1] + _count_newlines(handle, bounds[-1], boundary, self.SCAN_BYTES))
                    bounds.append(boundary)
        return [self._piece(first, last, number) for first, last, number in zip(bounds, [*bounds[1:], stop], numbers)]

    def _piece(self, start: int, stop: int, first_line: int) -> JsonLines:
        """A copy of this reader (of its class, with its settings) over bytes ``[start, stop)``."""
        piece = copy.copy(self)
        piece.start, piece.stop, piece.first_line = start, stop, first_line
        return piece

    def chunks(self, first_input: int) -> Iterator[DocumentChunk]:
        values, lines, size = [], [], 0
        where = self.inputs[0]
        remaining = None if self.stop is None else self.stop - self.start
        with open(self.path, "rb") as handle:
            handle.seek(self.start)
            for number, line in enumerate(handle, start=self.first_line):
                if remaining is not None:
                    if remaining <= 0:
                        break
                    remaining -= len(line)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as error:
                    hint = (" (a .json input is read as JSON lines: one object per line)"
                            if self.path.suffix.lower() == ".json" else "")
                    raise InvalidInputError(f"{where.where(number)}: not valid JSON: {error}{hint}") from None
                except RecursionError:
                    raise InvalidInputError(f"{where.where(number)}: JSON nested too deeply to read") from None
                if not isinstance(record, dict):
                    raise InvalidInputError(f"{where.where(number)}: a JSON {_json_kind(record)}, not an object "
                                            f"with field {self.field!r}")
                if self.field not in record:
                    hint = (" (the line has 'input_ids': pass --ids-field input_ids)"
                            if not self.pretokenized and "input_ids" in record
                            else "; name one with --text-field or --ids-field")
                    raise InvalidInputError(f"{where.where(number)}: no field {self.field!r}{hint}")
                value = record[self.field]
                if self.pretokenized:
                    if not isinstance(value, list) or not all(type(v) is int for v in value):
                        raise InvalidInputError(f"{where.where(number)}: field {self.field!r} is not a list of ints")
                elif not isinstance(value, str):
                    raise InvalidInputError(f"{where.where(number)}: field {self.field!r} is not a string")
                elif not value.isascii():  # a \ud800 escape decodes to a lone surrogate: no UTF-8 for it
                    try:
                        value.encode("utf-8")
                    except UnicodeEncodeError as error:
                        raise InvalidInputError(
                            f"{where.where(number)}: field {self.field!r} holds {value[error.start]!r} (a lone "
                            f"surrogate) at character {error.start}: it has no UTF-8 encoding") from None
                values.append(value)
                lines.append(number)
                size += len(line)
                if size >= CHUNK_BYTES or len(values) >= CHUNK_DOCUMENTS:
                    yield self._chunk(first_input, values, lines, size)
                    values, lines, size = [], [], 0
        if values:
            yield self._chunk(first_input, values, lines, size)

    def _chunk(self, first_input: int, values: list, lines: list, size: int) -> DocumentChunk:
        locations = np.array(lines, dtype=np.int64)
        inputs = np.full(len(values), first_input, dtype=np.int64)
        if not self.pretokenized:
            return DocumentChunk(inputs, locations, size, texts=values)
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(v) for v in values], out=offsets[1:])
        try:
            flat = np.fromiter(chain.from_iterable(values), dtype=np.int64, count=int(offsets[-1]))
        except OverflowError:  # an ID outside int64: find its line (only on this error path)
            low, high = np.iinfo(np.int64).min, np.iinfo(np.int64).max
            line, token = next((line, v) for line, value in zip(lines, values) for v in value if not low <= v <= high)
            raise InvalidInputError(f"{self.inputs[0].where(line)}: token ID {token} does not fit int64") from None
        return DocumentChunk(inputs, locations, size, ids=(flat, offsets))

