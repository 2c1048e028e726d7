"""JSON lines: one object a line, each a record of one kind: a text, token IDs (with
supervision masks beside them), a prompt-completion pair, a conversation or a
preference pair (TRL 1.16's dataset formats). Each record's kind and masks follow from
its own fields (:mod:`.records`); a record of another kind than the file's first is an
error naming its line. A reader splits at line boundaries into pieces whose errors
still name the file's own lines; chunks end at ``CHUNK_BYTES`` or ``CHUNK_DOCUMENTS``,
records whole.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from functools import cached_property
from itertools import chain

import numpy as np

from ..._arguments import INT64_MAX, check_int, check_optional_int
from ...data.supervision import NO_LABEL, first_reserved_label
from ...errors import InvalidInputError, SeqpackError
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
from .records import MASK_COLUMNS, RecordFields, check_messages, find_record_fields, json_kind, template_fields
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


def _utf8(value: str, what: str, where: Input, number: int) -> str:
    """``value``, refused when it holds a lone surrogate (a ``\\ud800`` escape decodes to
    one): it has no UTF-8 encoding."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise where.error(number, f"{what} holds {value[error.start]!r} (a lone surrogate) "
                                      f"at character {error.start}: it has no UTF-8 encoding") from None
    return value


def _string(record: dict, field: str, where: Input, number: int) -> str:
    value = record[field]
    if not isinstance(value, str):
        raise where.error(number, f"field {field!r} is not a string")
    return _utf8(value, f"field {field!r}", where, number)


def _integers(record: dict, field: str, where: Input, number: int, *, bools: bool = False) -> list:
    """The field's list of ints; with ``bools`` (a 0/1 mask, which TRL reads either way) true
    and false count as 1 and 0."""
    value = record[field]
    kinds = (int, bool) if bools else (int,)
    if not isinstance(value, list) or not all(type(v) in kinds for v in value):
        raise where.error(number, f"field {field!r} is not a list of ints")
    return [int(v) for v in value] if bools else value


def _text(record: dict, fields: RecordFields, where: Input, number: int) -> str:
    return _string(record, fields.fields[0], where, number)


def _ids(record: dict, fields: RecordFields, where: Input, number: int) -> tuple[list, dict]:
    """The IDs and each mask the record has, every mask as long as the IDs."""
    ids = _integers(record, fields.fields[0], where, number)
    masks = {mask: _integers(record, mask, where, number, bools=mask != "labels") for mask in fields.masks}
    for mask, values in masks.items():
        if len(values) != len(ids):
            raise where.error(number, f"field {mask!r} has {len(values)} values; field "
                                      f"{fields.fields[0]!r} has {len(ids)} IDs")
    return ids, masks


def _strings(record: dict, fields: RecordFields, where: Input, number: int) -> tuple:
    """Each field's string (a prompt and its completion, a pair's texts)."""
    return tuple(_string(record, field, where, number) for field in fields.fields)


def _id_lists(record: dict, fields: RecordFields, where: Input, number: int) -> tuple:
    """Each field's list of token IDs (a pre-tokenized pair's)."""
    return tuple(_integers(record, field, where, number) for field in fields.fields)


def _messages(record: dict, fields: RecordFields, where: Input, number: int) -> tuple:
    """Each field's messages (every key kept), then what the record gives the template."""
    at = where.where(number)
    values = []
    for field in fields.fields:
        messages = check_messages(record[field], field, at)
        for index, message in enumerate(messages):
            if isinstance(message.get("content"), str):
                _utf8(message["content"], f"{field}[{index}]['content']", where, number)
        values.append(messages)
    return (*values, *template_fields(record, at))


def _take(fields: RecordFields):
    """The function that takes a record of ``fields``' kind, checked."""
    if fields.conversational:
        return _messages
    return {"text": _text, "ids": _ids, "preference-ids": _id_lists}.get(fields.kind, _strings)


def _blank(line: bytes) -> bool:
    """Whether a line holds nothing but white space (after a UTF-8 byte order mark, which
    json reads past too)."""
    return not line.strip().removeprefix(b"\xef\xbb\xbf").strip()


class RepeatedKey(ValueError):
    """A key that appears twice in one JSON object."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list) -> dict:
    """A JSON object's dict; a repeated key (which ``json`` resolves silently to its last
    value) is a :class:`RepeatedKey`."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen = set()
        raise RepeatedKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return record


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


class JsonLines(RecordReader):
    """A JSONL file: one JSON object a line, each a record of one kind, by the field
    given (``text_field``: a string; ``ids_field``: a list of token IDs; not both), else
    by its own fields in TRL's precedence (:func:`~.records.find_record_fields`):
    ``"input_ids"`` (a list of token IDs) with the :data:`MASK_COLUMNS` that record has
    (lists of ints as long as its IDs); ``"prompt_ids"``, ``"chosen_ids"`` and
    ``"rejected_ids"`` (lists of token IDs); ``"prompt"`` and ``"completion"``;
    ``"prompt"``, ``"chosen"`` and ``"rejected"``; ``"chosen"`` and ``"rejected"``
    (strings, or each a non-empty list of objects with a string ``"role"``, every key
    kept); ``"messages"`` (such a list); ``"text"``. Beside messages, ``"tools"`` and
    ``"chat_template_kwargs"`` are read. Every record must be of the kind of the file's
    first record. Blank lines are skipped; lines count from 1.

    ``record_kind`` says what the records are (found on first use: this reads the
    file's first record).

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
        self.start = check_int("start", start, minimum=0, maximum=INT64_MAX)
        self.stop = check_optional_int("stop", stop, minimum=self.start, maximum=INT64_MAX)
        self.first_line = check_int("first_line", first_line, maximum=INT64_MAX)
        self.inputs = [Input(str(path), "jsonl", "line")]

    @cached_property
    def record_fields(self) -> RecordFields:
        """The fields of the file's first record (whatever piece this reader reads), by
        the field given, else :func:`~.records.find_record_fields`; text when it names none."""
        try:
            with open(self.path, "rb") as handle:
                for number, line in enumerate(handle, start=1):
                    if not _blank(line):
                        record = self._parse(line, number)
                        return self._fields(record if isinstance(record, dict) else {}, number)
        except OSError as error:
            raise cannot_read(self.path, error) from None
        return RecordFields("text", ("text",))

    def _fields(self, record: dict, number: int) -> RecordFields:
        """One record's fields: its kind and the masks and template fields it carries."""
        fields = find_record_fields(record, self.text_field, self.ids_field, where=self.inputs[0].where(number))
        if fields is None:
            return RecordFields("text", ("text",))
        if fields.message_field is not None and isinstance(record.get(fields.message_field), list):
            return fields.as_conversational()
        return fields

    def _parse(self, line: bytes, number: int):
        where = self.inputs[0].where(number)
        try:
            return _DECODER.decode(line.decode("utf-8-sig", "surrogatepass"))  # (as json.loads decodes bytes)
        except RepeatedKey as repeated:
            raise InvalidInputError(f"{where}: field {repeated.key!r} appears twice in one object (JSON readers "
                                    f"keep only the last; Parquet and pyarrow refuse it)") from None
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

    def _checked_fields(self, record: dict, number: int) -> RecordFields:
        """The record's fields, which must name a record of the file's kind, all there."""
        first, fields = self.record_fields, self._fields(record, number)
        where = self.inputs[0].where(number)
        if fields.kind != first.kind:
            if fields.kind == "text" and "text" not in record:  # none of the kinds' fields
                missing = next((field for field in first.fields if field not in record), first.fields[0])
                raise InvalidInputError(f"{where}: no field {missing!r} (the first record is {first.a_record}: "
                                        f"every record must be one)")
            raise InvalidInputError(f"{where}: {fields.a_record}, but the first record is {first.a_record}: every "
                                    f"record of an input must be of one kind")
        for field in fields.fields:
            if field not in record:
                hint = "; name one with --text-field or --ids-field" \
                    if self.text_field is None and not fields.preference else ""
                if fields.kind == "text" and "input_ids" in record:
                    hint = " (the line has 'input_ids': pass --ids-field input_ids)"
                raise InvalidInputError(f"{where}: no field {field!r}{hint}")
        return fields

    def chunks(self, first_input: int) -> Iterator[DocumentChunk]:
        values, lines, size, known = [], [], 0, {}
        where = self.inputs[0]
        remaining = None if self.stop is None else self.stop - self.start
        with open(self.path, "rb") as handle:
            handle.seek(self.start)
            for number, line in enumerate(handle, start=self.first_line):
                if remaining is not None:
                    if remaining <= 0:
                        break
                    remaining -= len(line)
                if _blank(line):
                    continue
                try:
                    values.append(self._record(line, number, known))
                except SeqpackError as error:
                    where.located(error, number)   # its message names the line; now its fields too
                    raise
                lines.append(number)
                size += len(line)
                if size >= CHUNK_BYTES or len(values) >= CHUNK_DOCUMENTS:
                    yield self._chunk(first_input, values, lines, size)
                    values, lines, size = [], [], 0
        if values:
            yield self._chunk(first_input, values, lines, size)

    def _record(self, line: bytes, number: int, known: dict):
        """The values of line ``number``'s record (``known``: the fields of each record shape met)."""
        record = self._parse(line, number)
        where = self.inputs[0]
        if not isinstance(record, dict):
            raise where.error(number, f"a JSON {json_kind(record)}, not an object with "
                                      f"{self.record_fields.described()}")
        # Records of one shape share their fields: checked once per shape, not per record.
        shape = (*record, isinstance(record.get("prompt"), list), isinstance(record.get("chosen"), list))
        fields = known.get(shape) or known.setdefault(shape, self._checked_fields(record, number))
        return _take(fields)(record, fields, where, number)

    def _chunk(self, first_input: int, values: list, lines: list, size: int) -> DocumentChunk:
        locations = np.array(lines, dtype=np.int64)
        inputs = np.full(len(values), first_input, dtype=np.int64)
        fields = self.record_fields
        if fields.kind == "text":
            return DocumentChunk(inputs, locations, size, texts=values)
        if fields.kind == "ids":
            return self._ids_chunk(inputs, locations, size, values, lines)
        if fields.kind == "preference-ids":
            pair_ids = {}
            for field, rows in zip(fields.fields, zip(*values)):
                offsets = np.zeros(len(rows) + 1, dtype=np.int64)
                np.cumsum([len(row) for row in rows], out=offsets[1:])
                pair_ids[field] = self._flat(rows, lines, field, offsets), offsets
            return DocumentChunk(inputs, locations, size, pair_ids=pair_ids)
        columns = list(zip(*values))
        template = {}
        if fields.conversational:  # rendered by a chat template
            *columns, tools, options = columns
            template = {"tools": list(tools) if any(t is not None for t in tools) else None,
                        "template_kwargs": list(options) if any(options) else None}
        return DocumentChunk.of_records(inputs, locations, size, dict(zip(fields.fields, columns)),
                                        conversational=fields.conversational, **template)

    def _ids_chunk(self, inputs: np.ndarray, locations: np.ndarray, size: int, values: list,
                   lines: list) -> DocumentChunk:
        """Token-ID records with the masks any of them has."""
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum([len(v[0]) for v in values], out=offsets[1:])
        ids = self._flat([v[0] for v in values], lines, self.record_fields.fields[0], offsets)
        present = [mask for mask in MASK_COLUMNS if any(mask in v[1] for v in values)]
        if not present:
            return DocumentChunk(inputs, locations, size, ids=(ids, offsets))
        masks = {}
        for mask in present:  # a record without the mask: 1s (no effect), or NO_LABEL (its masks decide)
            rows = [v[1].get(mask) for v in values]
            column = self._flat([row if row is not None else () for row in rows], lines, mask, offsets,
                                np.array([row is not None for row in rows]))
            masks[mask] = column
            if mask == "labels":
                self._check_reserved(column, ids, offsets, lines)
            absent = np.repeat(np.array([row is None for row in rows]), np.diff(offsets))
            column[absent] = NO_LABEL if mask == "labels" else 1
        masked = np.array([bool(v[1]) for v in values])
        return DocumentChunk(inputs, locations, size, ids=(ids, offsets), masks=masks, masked=masked)

    def _check_reserved(self, labels: np.ndarray, ids: np.ndarray, offsets: np.ndarray, lines: list) -> None:
        """A record's own label -101 (:data:`~seqpack.data.supervision.NO_LABEL`, this
        reader's mark of a record without labels) is refused by its line, as any label
        other than -100 and its token is."""
        at = first_reserved_label(labels, offsets)
        if at is not None:
            record = int(np.searchsorted(offsets, at, side="right")) - 1
            raise self.inputs[0].error(
                lines[record], f"labels[{at - int(offsets[record])}] is {NO_LABEL}, neither -100 nor its input_ids "
                               f"token {int(ids[at])}: a packed document's targets are its own tokens")

    def _flat(self, rows: list, lines: list, field: str, offsets: np.ndarray, present=None) -> np.ndarray:
        """The rows' integers back to back (int64; an absent row, per ``present``, takes
        its document's place with zeros); one outside int64 is named by its line."""
        lengths = np.diff(offsets)
        try:
            if present is None:
                return np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))
            flat = np.zeros(int(offsets[-1]), dtype=np.int64)
            flat[np.repeat(present, lengths)] = np.fromiter(chain.from_iterable(rows), dtype=np.int64,
                                                            count=int(lengths[present].sum()))
            return flat
        except OverflowError:  # only on this error path: find the line
            low, high = np.iinfo(np.int64).min, np.iinfo(np.int64).max
            line, value = next((line, v) for line, row in zip(lines, rows) for v in row if not low <= v <= high)
            what = "token ID" if field == self.record_fields.fields[0] and self.record_fields.kind == "ids" \
                else f"field {field!r} value"
            raise self.inputs[0].error(line, f"{what} {value} does not fit int64") from None
