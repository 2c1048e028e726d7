"""JSON lines: one object a line, each a record of one kind: a text, token IDs (with
supervision masks beside them), a prompt-completion pair or a conversation (TRL 1.16's
dataset formats). The first record sets the kind and the mask fields; every record must
have them. A reader splits at line boundaries into pieces whose errors still name the
file's own lines; chunks end at ``CHUNK_BYTES`` or ``CHUNK_DOCUMENTS``, records whole.

:func:`find_record_fields` is the rule the Arrow readers share: which kind a record (or a
table) is, by the fields given or by its field names.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np

from ..._limits import check_int, check_optional_int
from ...errors import InvalidInputError
from .base import (
    CHUNK_BYTES,
    CHUNK_DOCUMENTS,
    DocumentChunk,
    Input,
    RecordReader,
    cannot_read,
    check_fields,
    input_path,
    not_a_file,
)
from .sniff import MAGIC_BYTES, check_text_file

#: The supervision fields read beside token IDs, by name: ``completion_mask`` and
#: ``assistant_masks`` (1 = supervised), ``labels`` (-100 = unsupervised).
MASK_COLUMNS = ("completion_mask", "assistant_masks", "labels")
#: The record kinds found by their field names, in the order they are looked for.
KIND_FIELDS = {"text": ("text",), "prompt-completion": ("prompt", "completion"), "conversation": ("messages",)}


@dataclass(frozen=True)
class RecordFields:
    """What an input's records are: ``kind`` (``"text"``, ``"ids"``,
    ``"prompt-completion"`` or ``"conversation"``), ``fields`` (the text or IDs field,
    ``prompt`` and ``completion``, or ``messages``) and ``masks`` (the
    :data:`MASK_COLUMNS` beside the IDs, in that order; empty for other kinds)."""

    kind: str
    fields: tuple[str, ...]
    masks: tuple[str, ...] = ()

    @property
    def read(self) -> tuple[str, ...]:
        """Every field read: the record's own, then its masks."""
        return self.fields + self.masks

    def described(self) -> str:
        """``field 'text'`` or ``fields 'prompt' and 'completion'``."""
        names = " and ".join(map(repr, self.fields))
        return f"field{'s' if len(self.fields) > 1 else ''} {names}"


def find_record_fields(names, text_field: str | None, ids_field: str | None, *,
                       ids_default: str | None = None) -> RecordFields | None:
    """The fields of records whose field names are ``names``: ``ids_field`` (with the
    :data:`MASK_COLUMNS` among ``names``), or ``text_field``, or the first kind of
    :data:`KIND_FIELDS` whose fields are all there (text, then prompt and completion,
    then messages), or ``ids_default`` with its masks when it is there; else ``None``."""
    masks = tuple(mask for mask in MASK_COLUMNS if mask in names)
    if ids_field is not None:
        return RecordFields("ids", (ids_field,), masks)
    if text_field is not None:
        return RecordFields("text", (text_field,))
    for kind, fields in KIND_FIELDS.items():
        if all(field in names for field in fields):
            return RecordFields(kind, fields)
    if ids_default is not None and ids_default in names:
        return RecordFields("ids", (ids_default,), masks)
    return None


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
    """The JSON name of a parsed value's type (object, array, string, number...)."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    return "null" if value is None else "number"


def _utf8(value: str, what: str, where: Input, number: int) -> str:
    """``value``, refused when it holds a lone surrogate (a ``\\ud800`` escape decodes to
    one): it has no UTF-8 encoding."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidInputError(f"{where.where(number)}: {what} holds {value[error.start]!r} (a lone surrogate) "
                                    f"at character {error.start}: it has no UTF-8 encoding") from None
    return value


def _string(record: dict, field: str, where: Input, number: int) -> str:
    value = record[field]
    if not isinstance(value, str):
        raise InvalidInputError(f"{where.where(number)}: field {field!r} is not a string")
    return _utf8(value, f"field {field!r}", where, number)


def _integers(record: dict, field: str, where: Input, number: int) -> list:
    value = record[field]
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise InvalidInputError(f"{where.where(number)}: field {field!r} is not a list of ints")
    return value


def _text(record: dict, fields: RecordFields, where: Input, number: int) -> str:
    return _string(record, fields.fields[0], where, number)


def _ids(record: dict, fields: RecordFields, where: Input, number: int) -> tuple[list, ...]:
    """The IDs and each mask, every mask as long as the IDs."""
    ids = _integers(record, fields.fields[0], where, number)
    masks = tuple(_integers(record, mask, where, number) for mask in fields.masks)
    for mask, values in zip(fields.masks, masks):
        if len(values) != len(ids):
            raise InvalidInputError(f"{where.where(number)}: field {mask!r} has {len(values)} values; field "
                                    f"{fields.fields[0]!r} has {len(ids)} IDs")
    return (ids, *masks)


def _prompt_completion(record: dict, fields: RecordFields, where: Input, number: int) -> tuple[str, str]:
    return _string(record, "prompt", where, number), _string(record, "completion", where, number)


def _conversation(record: dict, fields: RecordFields, where: Input, number: int) -> list[dict]:
    """The messages as ``{"role", "content"}`` dicts (other keys left out): a non-empty
    list of objects whose role and content are strings."""
    value = record["messages"]
    if not isinstance(value, list) or not value:
        what = "an empty array" if isinstance(value, list) else f"a JSON {_json_kind(value)}"
        raise InvalidInputError(f"{where.where(number)}: field 'messages' is {what}, not a non-empty list of "
                                f"messages")
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidInputError(f"{where.where(number)}: messages[{index}] is a JSON {_json_kind(message)}, not "
                                    f"an object with 'role' and 'content'")
        for key in ("role", "content"):
            if key not in message:
                raise InvalidInputError(f"{where.where(number)}: messages[{index}] has no {key!r}")
            if not isinstance(message[key], str):
                raise InvalidInputError(f"{where.where(number)}: messages[{index}][{key!r}] is not a string")
            _utf8(message[key], f"messages[{index}][{key!r}]", where, number)
    return [{"role": message["role"], "content": message["content"]} for message in value]


#: Each record kind's value from a record that has its fields, checked.
_TAKE = {"text": _text, "ids": _ids, "prompt-completion": _prompt_completion, "conversation": _conversation}


class JsonLines(RecordReader):
    """A JSONL file: one JSON object a line, each a record of one kind, by the field
    given (``text_field``: a string; ``ids_field``: a list of token IDs; not both), else
    by the fields of the first record: ``"text"``; ``"prompt"`` and ``"completion"``
    (strings); ``"messages"`` (a non-empty list of objects with string ``"role"`` and
    ``"content"``); ``"input_ids"`` (a list of token IDs, as in Parquet); text when it
    has none of them. Beside IDs, the :data:`MASK_COLUMNS`
    the first record has are read (lists of ints as long as its IDs). Every record must
    have its kind's fields and those masks. Blank lines are skipped; lines count from 1.

    ``record_kind`` (``"text"``, ``"ids"``, ``"prompt-completion"`` or
    ``"conversation"``) and ``mask_columns`` say what the records are (found on first use:
    this reads the first record).

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
        self.text_field, self.ids_field = text_field, ids_field
        self.field = ids_field if ids_field is not None else text_field if text_field is not None else "text"
        self.start = check_int("start", start, minimum=0)
        self.stop = check_optional_int("stop", stop, minimum=self.start)
        self.first_line = check_int("first_line", first_line)
        self.inputs = [Input(str(path), "jsonl", "line")]

    @cached_property
    def record_fields(self) -> RecordFields:
        """The records' fields (:func:`find_record_fields`), by the field given, else by the
        file's first record (``input_ids`` when it names no other kind, as in Parquet); text
        when it names none."""
        names = () if self.text_field is not None else self._first_record_names()
        return (find_record_fields(names, self.text_field, self.ids_field, ids_default="input_ids")
                or RecordFields("text", ("text",)))

    def _first_record_names(self) -> tuple[str, ...]:
        """The field names of the file's first record (whatever piece this reader reads),
        or none when it is not an object."""
        try:
            with open(self.path, "rb") as handle:
                for number, line in enumerate(handle, start=1):
                    if line.strip():
                        record = self._parse(line, number)
                        return tuple(record) if isinstance(record, dict) else ()
        except OSError as error:
            raise cannot_read(self.path, error) from None
        return ()

    def _parse(self, line: bytes, number: int):
        where = self.inputs[0].where(number)
        try:
            return json.loads(line)
        except ValueError as error:
            hint = (" (a .json input is read as JSON lines: one object per line)"
                    if self.path.suffix.lower() == ".json" else "")
            raise InvalidInputError(f"{where}: not valid JSON: {error}{hint}") from None
        except RecursionError:
            raise InvalidInputError(f"{where}: JSON nested too deeply to read") from None

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

    def _missing(self, record: dict, field: str, number: int) -> InvalidInputError:
        """The error for a record without ``field``, saying why the record needs it."""
        fields = self.record_fields
        kinds = {**KIND_FIELDS, "token-ID": ("input_ids",)}  # what a first record without a field name can be
        other = next((kind for kind, names in kinds.items() if all(n in record for n in names)), None)
        if field in fields.masks:
            hint = f" (the first record has it beside {fields.fields[0]!r}: every record must)"
        elif fields.kind in ("prompt-completion", "conversation"):
            hint = f" (the first record is a {fields.kind} record: every record must be one)"
        elif self.text_field is None and self.ids_field is None and other is not None:
            hint = f" (the line is a {other} record, but the first record is text: every record must be of one kind)"
        elif fields.kind == "text" and "input_ids" in record:
            hint = " (the line has 'input_ids': pass --ids-field input_ids)"
        else:
            hint = "; name one with --text-field or --ids-field"
        return InvalidInputError(f"{self.inputs[0].where(number)}: no field {field!r}{hint}")

    def chunks(self, first_input: int) -> Iterator[DocumentChunk]:
        fields = self.record_fields
        take = _TAKE[fields.kind]
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
                record = self._parse(line, number)
                if not isinstance(record, dict):
                    raise InvalidInputError(f"{where.where(number)}: a JSON {_json_kind(record)}, not an object "
                                            f"with {fields.described()}")
                for field in fields.read:
                    if field not in record:
                        raise self._missing(record, field, number)
                values.append(take(record, fields, where, number))
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
        fields = self.record_fields
        if fields.kind == "text":
            return DocumentChunk(inputs, locations, size, texts=values)
        if fields.kind == "prompt-completion":
            return DocumentChunk(inputs, locations, size, prompts=[v[0] for v in values],
                                 completions=[v[1] for v in values])
        if fields.kind == "conversation":
            return DocumentChunk(inputs, locations, size, conversations=values)
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(v[0]) for v in values], out=offsets[1:])
        columns = [self._flat([v[i] for v in values], lines, name, offsets)
                   for i, name in enumerate(fields.read)]
        masks = dict(zip(fields.masks, columns[1:])) if fields.masks else None
        return DocumentChunk(inputs, locations, size, ids=(columns[0], offsets), masks=masks)

    def _flat(self, rows: list, lines: list, field: str, offsets: np.ndarray) -> np.ndarray:
        """The rows' integers back to back (int64); one outside int64 is named by its line."""
        try:
            return np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))
        except OverflowError:  # only on this error path: find the line
            low, high = np.iinfo(np.int64).min, np.iinfo(np.int64).max
            line, value = next((line, v) for line, row in zip(lines, rows) for v in row if not low <= v <= high)
            what = "token ID" if field == self.record_fields.fields[0] else f"field {field!r} value"
            raise InvalidInputError(f"{self.inputs[0].where(line)}: {what} {value} does not fit int64") from None
