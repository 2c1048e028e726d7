"""Parquet, Arrow IPC files and streams, Feather, ``pyarrow.Table`` and
``datasets.Dataset``: record batches read by their columns' names, as
:func:`~.records.find_record_fields` finds them (``input_ids`` with its mask columns,
a preference pair's ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``, ``prompt`` and
``completion``, a preference pair's ``prompt``, ``chosen`` and ``rejected`` or ``chosen``
and ``rejected``, ``messages``, ``text``). Text, token IDs and masks are handed over as
their buffers (flat values and offsets: no Python object per document or token);
prompts, completions, a pair's texts and messages become Python objects, one per
record. pyarrow (the ``corpus`` extra) is imported by :func:`import_pyarrow` when data
is opened, never when this module is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import numpy as np

from ...data.supervision import NO_LABEL, first_reserved_label
from ...errors import InvalidInputError, SeqpackError
from .base import DocumentChunk, Input, RecordReader, cannot_read, check_fields, missing_extra, not_a_file
from .records import RecordFields, check_messages, find_record_fields, template_fields
from .sniff import MAGIC_BYTES, binary_format, compression


def import_pyarrow():
    """pyarrow (the ``corpus`` extra), or an error naming the extra."""
    try:
        import pyarrow
        import pyarrow.compute  # noqa: F401
        import pyarrow.feather  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise missing_extra("reading Parquet or Arrow data", "corpus") from None
    return pyarrow


def open_parquet(name: str):
    """The ``pyarrow.parquet.ParquetFile`` at ``name``, memory-mapped; a file pyarrow
    cannot read as Parquet is an :class:`InvalidInputError` naming it."""
    pa = import_pyarrow()
    try:
        return pa.parquet.ParquetFile(name, memory_map=True)
    except (pa.ArrowInvalid, OSError) as error:
        raise InvalidInputError(f"cannot read as parquet: {error}").within(name, path=name) from None


def record_columns(schema, text_field: str | None, ids_field: str | None, name: str) -> RecordFields:
    """The columns an input's records are read from (:func:`~.records.find_record_fields`
    on a pyarrow ``schema``'s names; a list-typed ``prompt`` column, or ``chosen`` for
    an implicit prompt, makes the records conversational); each must be there, once."""
    check_fields(name, text_field, ids_field)
    names = list(schema.names)
    found = find_record_fields(names, text_field, ids_field, where=name)
    if found is None:
        raise InvalidInputError(f"{name}: no 'text' or 'input_ids' column (nor 'prompt' and 'completion', nor "
                                f"'chosen' and 'rejected', nor 'messages'); name one with --text-field or --ids-field")
    for column in found.read:
        if column not in names:
            raise InvalidInputError(f"{name}: no column {column!r} (columns: {', '.join(names)})")
        if names.count(column) > 1:
            raise InvalidInputError(f"{name}: {names.count(column)} columns are named {column!r}")
    if found.message_field is not None and _is_list(import_pyarrow(), schema.field(found.message_field).type):
        return found.as_conversational()
    return found


#: How an Arrow IPC stream ends (a continuation marker and a zero length; Arrow 0.15 and
#: later, 2019). Its reader takes the end of the file for the end of the stream, so a
#: stream cut between two record batches would read as a shorter whole.
STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def check_stream_end(path) -> None:
    """Refuse a file that is not an Arrow stream (named by what its bytes make it, such as
    a Parquet file or an Arrow file cut short), and an Arrow stream that does not end with
    its end-of-stream marker."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(MAGIC_BYTES)
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(size - MAGIC_BYTES, 0))
            tail = handle.read()
    except OSError as error:
        raise cannot_read(path, error) from None
    if head.startswith(b"ARROW1"):
        cut = "" if tail.endswith(b"ARROW1") else ": cut short (no footer: an interrupted copy or a full disk?)"
        raise InvalidInputError(f"{path}: an Arrow file pyarrow cannot read{cut}")
    if not head.startswith(STREAM_END[:4]):
        codec = compression(head)
        if codec is not None:
            raise InvalidInputError(f"{path}: {codec}-compressed; decompress it first")
        found = binary_format(head, tail)
        if found is None:
            raise InvalidInputError(f"{path}: not an Arrow file or stream (it begins with neither 'ARROW1' nor a "
                                    f"stream's first message)")
        raise InvalidInputError(f"{path}: {found}, not an Arrow file or stream: name it by its own extension")
    if not tail.endswith(STREAM_END):
        raise InvalidInputError(f"{path}: an Arrow stream without its end-of-stream marker: cut short (an "
                                f"interrupted copy or a full disk?); its record batches so far would read as the "
                                f"whole")


def _first_null(array) -> int:
    """The index of the first null in an Arrow array that has one."""
    return int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])


def _row_of(offsets: np.ndarray, index: int) -> int:
    """The row (0-based, within the batch) whose values hold flat value ``index``."""
    return int(np.searchsorted(offsets, index, side="right")) - 1


def _is_list(pa, kind) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _is_string(pa, kind) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _plain(pa, array):
    """``array`` in the plain layout of its values, at any depth (a message's fields too):
    dictionary-encoded values (a pandas ``Categorical``) decoded, ``string_view`` and
    ``binary_view`` values as large strings or binary. Parquet stores them as plain
    strings; only pyarrow's schema hint in the file asks for these layouts, which
    ``datasets`` reads as strings. (``list_view`` columns are left as they are, refused:
    pyarrow 26 casts them to lists wrongly.)"""
    plain = _plain_type(pa, array.type)
    return array if plain == array.type else array.cast(plain)


def _plain_type(pa, kind):
    """``kind`` with its dictionary and view types of strings and binary replaced (see :func:`_plain`)."""
    if pa.types.is_dictionary(kind):
        return _plain_type(pa, kind.value_type)
    views = {"string_view": pa.large_string, "binary_view": pa.large_binary}
    if str(kind) in views:
        return views[str(kind)]()
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        field = kind.value_field
        plain = field.with_type(_plain_type(pa, field.type))
        return pa.list_(plain) if pa.types.is_list(kind) else pa.large_list(plain)
    if pa.types.is_struct(kind):
        return pa.struct([field.with_type(_plain_type(pa, field.type)) for field in kind])
    return kind


def _offsets(pa, array) -> np.ndarray:
    """Int64 offsets of a list array's rows into its flattened values (from 0)."""
    lengths = pa.compute.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(len(array) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _integer_lists(pa, array, column: str, what: str, first_row: int, where: Input,
                   bools: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A list-of-integers column's flat values (its own dtype) and int64 offsets; a null
    value is named by its row (as ``what``: a token ID, a mask's value). With ``bools`` (a
    0/1 mask, which TRL reads either way) a list of booleans gives int8 values."""
    kind = array.type
    boolean = bools and _is_list(pa, kind) and pa.types.is_boolean(kind.value_type)
    # Every list empty: pyarrow and datasets type the column list<null>, which holds no value.
    empty = _is_list(pa, kind) and pa.types.is_null(kind.value_type) and len(array.flatten()) == 0
    if not _is_list(pa, kind) or not (pa.types.is_integer(kind.value_type) or boolean or empty):
        raise InvalidInputError(f"{where.name}: column {column!r} of type {kind} is not a list of integers")
    offsets = _offsets(pa, array)
    if empty:
        return np.zeros(0, dtype=np.int64), offsets
    values = array.flatten()
    if values.null_count:
        raise where.error(first_row + _row_of(offsets, _first_null(values)), f"{what} is null")
    flat = values.to_numpy(zero_copy_only=False)
    return (flat.astype(np.int8) if boolean else flat), offsets


def _python_strings(array, column: str, first_row: int, where: Input, offsets: np.ndarray | None = None) -> list:
    """A string array as a list of ``str``; bytes that are not UTF-8 are named by their
    row (``offsets`` map the array's values to rows, for values of lists)."""
    try:
        return array.to_pylist()
    except UnicodeDecodeError:  # only on this error path: find the value
        index = next(i for i in range(len(array)) if not _decodes(array[i]))
        row = index if offsets is None else _row_of(offsets, index)
        raise where.error(first_row + row, f"column {column!r} is not valid UTF-8") from None


def _decodes(scalar) -> bool:
    try:
        scalar.as_py()
    except UnicodeDecodeError:
        return False
    return True


def _conversations(pa, array, column: str, first_row: int, where: Input) -> list:
    """A column of conversations (lists of structs with a string ``role``) as lists of
    message dicts, every field kept (a field another message of the table has is None);
    a conversation that is empty, or a message or role that is null, is named by its row."""
    kind = array.type
    message = kind.value_type if _is_list(pa, kind) else None
    if message is None or not pa.types.is_struct(message) or message.get_field_index("role") < 0 \
            or not _is_string(pa, message.field("role").type):
        raise InvalidInputError(f"{where.name}: column {column!r} of type {kind} is not a list of messages "
                                f"(structs with a string 'role')")
    conversations = _python_strings(array, column, first_row, where)
    for row, conversation in enumerate(conversations):
        try:
            check_messages(conversation, column, where.where(first_row + row))
        except SeqpackError as error:
            where.located(error, first_row + row)   # its message names the row; now its fields too
            raise
    return conversations


def _template_fields(pa, columns: dict, fields: RecordFields, first_row: int, where: Input) -> dict:
    """Each record's ``tools`` and ``chat_template_kwargs`` (None when no record has any)."""
    rows = [{} for _ in range(len(next(iter(columns.values()))))]
    for extra in fields.extras:
        for record, value in zip(rows, _python_strings(columns[extra], extra, first_row, where)):
            record[extra] = value
    pairs = []
    for row, record in enumerate(rows):
        try:
            pairs.append(template_fields(record, where.where(first_row + row)))
        except SeqpackError as error:
            where.located(error, first_row + row)
            raise
    tools = [tools for tools, _ in pairs]
    options = [options for _, options in pairs]
    return {"tools": tools if any(t is not None for t in tools) else None,
            "template_kwargs": options if any(options) else None}


def _text_buffer(pa, array, column: str, where: Input) -> tuple[np.ndarray, np.ndarray]:
    """A string or binary column's UTF-8 bytes and int64 offsets (from 0)."""
    kind = array.type
    if pa.types.is_string(kind) or pa.types.is_binary(kind):
        offset_type = np.int32
    elif pa.types.is_large_string(kind) or pa.types.is_large_binary(kind):
        offset_type = np.int64
    else:
        raise InvalidInputError(f"{where.name}: column {column!r} of type {kind} is not a string column")
    count = len(array)
    _, offset_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offset_buffer, dtype=offset_type)[array.offset: array.offset + count + 1]
    offsets = offsets.astype(np.int64)
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    return data[offsets[0]: offsets[-1]], offsets - offsets[0]


def arrow_chunk(batch, fields: RecordFields, input_index: int, first_row: int, where: Input) -> DocumentChunk:
    """One chunk from a record batch (or table): its records by ``fields``.

    Text is handed over as its UTF-8 buffer and offsets; IDs and masks as their flat
    values and offsets, every mask row as long as its IDs row (a pair's IDs: each
    column's); prompts, completions and a pair's texts as lists of ``str``, messages as
    lists of ``{"role", "content"}`` dicts. A null record or value, a wrong type or a
    mask of another length is named by its row.
    """
    pa = import_pyarrow()
    columns = {}
    for column in fields.read:
        array = batch.column(column)
        columns[column] = _plain(pa, array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array)
        if columns[column].null_count and column not in fields.extras:
            what = "the document" if fields.kind in ("text", "ids") and column == fields.fields[0] \
                else f"column {column!r}"
            raise where.error(first_row + _first_null(columns[column]), f"{what} is null")
    count = batch.num_rows
    inputs = np.full(count, input_index, dtype=np.int64)
    locations = np.arange(first_row, first_row + count, dtype=np.int64)
    if fields.kind == "text":
        data, offsets = _text_buffer(pa, columns[fields.fields[0]], fields.fields[0], where)
        return DocumentChunk(inputs, locations, int(data.shape[0]), text_buffer=(data, offsets))
    if fields.kind == "ids":
        ids = fields.fields[0]
        flat, offsets = _integer_lists(pa, columns[ids], ids, "a token ID", first_row, where)
        masks = {mask: _mask(pa, columns[mask], mask, ids, offsets, first_row, where) for mask in fields.masks}
        if "labels" in masks:
            _check_reserved(masks["labels"], flat, offsets, first_row, where)
        nbytes = flat.nbytes + sum(values.nbytes for values in masks.values())
        masked = np.ones(count, dtype=bool) if masks else None
        return DocumentChunk(inputs, locations, nbytes, ids=(flat, offsets), masks=masks or None, masked=masked)
    if fields.kind == "preference-ids":
        pair_ids = {column: _integer_lists(pa, columns[column], column, f"a {column!r} value", first_row, where)
                    for column in fields.fields}
        return DocumentChunk(inputs, locations, sum(flat.nbytes for flat, _ in pair_ids.values()), pair_ids=pair_ids)
    nbytes = sum(int(array.nbytes) for array in columns.values())
    if fields.conversational:
        values = {column: _conversations(pa, columns[column], column, first_row, where) for column in fields.fields}
        return DocumentChunk.of_records(inputs, locations, nbytes, values, conversational=True,
                                        **_template_fields(pa, columns, fields, first_row, where))
    for column in fields.fields:
        if not _is_string(pa, columns[column].type):
            raise InvalidInputError(f"{where.name}: column {column!r} of type {columns[column].type} is not a "
                                    f"string column")
    values = {column: _python_strings(columns[column], column, first_row, where) for column in fields.fields}
    return DocumentChunk.of_records(inputs, locations, nbytes, values)


def _mask(pa, array, mask: str, ids: str, offsets: np.ndarray, first_row: int, where: Input) -> np.ndarray:
    """A mask column's flat values, each row as long as its IDs row (``offsets``)."""
    values, mask_offsets = _integer_lists(pa, array, mask, f"a {mask!r} value", first_row, where,
                                          bools=mask != "labels")
    differ = np.flatnonzero(np.diff(mask_offsets) != np.diff(offsets))
    if differ.size:
        row = int(differ[0])
        raise where.error(first_row + row, f"column {mask!r} has {int(mask_offsets[row + 1] - mask_offsets[row])} "
                                           f"values; column {ids!r} has {int(offsets[row + 1] - offsets[row])} IDs")
    return values


def _check_reserved(labels: np.ndarray, ids: np.ndarray, offsets: np.ndarray, first_row: int, where: Input) -> None:
    """A row's own label -101 (:data:`~seqpack.data.supervision.NO_LABEL`, the mark of a
    record without labels) is refused by its row, as any label other than -100 and its
    token is."""
    at = first_reserved_label(labels, offsets)
    if at is not None:
        row = _row_of(offsets, at)
        raise where.error(first_row + row, f"labels[{at - int(offsets[row])}] is {NO_LABEL}, neither -100 nor "
                                           f"its input_ids token {int(ids[at])}: a packed document's targets are its "
                                           f"own tokens")


class ArrowBatches(RecordReader):
    """Record batches of a Parquet file, an Arrow IPC file or stream, a ``pyarrow.Table`` or a
    ``datasets.Dataset``; rows count from 0. The columns are ``ids_field`` (lists of
    integer IDs) or ``text_field`` (strings), else found by name as
    :func:`record_columns` finds them: ``input_ids``; ``prompt_ids``, ``chosen_ids`` and
    ``rejected_ids`` (lists of integers); ``prompt`` and ``completion``; ``prompt``,
    ``chosen`` and ``rejected``; ``chosen`` and ``rejected`` (strings, or lists of
    ``{role, content}`` structs of strings); ``messages`` (such lists); else ``text``.
    Beside IDs, the mask columns there (``completion_mask``, ``assistant_masks``,
    ``labels``) are read, each row as long as its IDs.

    ``record_kind`` and ``record_fields`` say what the records are (found on first
    use: this opens the file)."""

    BATCH_ROWS = 4096

    def __init__(self, source, *, text_field: str | None = None, ids_field: str | None = None, name=None):
        self.source = source
        self.text_field, self.ids_field = text_field, ids_field
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            if not path.is_file():
                raise not_a_file(path)
            kind = "parquet" if path.suffix.lower() == ".parquet" else "arrow"
            self.inputs = [Input(str(path), kind, "row")]
        else:
            self.inputs = [Input(name or type(source).__name__, "table", "row")]
        check_fields(self.inputs[0].name, text_field, ids_field)

    @cached_property
    def record_fields(self) -> RecordFields:
        """The columns read (:func:`record_columns`)."""
        return self._open()[0]

    def _fields(self, schema) -> RecordFields:
        return record_columns(schema, self.text_field, self.ids_field, self.inputs[0].name)

    def _open(self) -> tuple[RecordFields, Iterator]:
        """``(the columns read, an iterator of record batches or tables holding them)``."""
        pa = import_pyarrow()
        source = self.source
        if isinstance(source, (str, os.PathLike)):
            path = str(source)
            try:
                if self.inputs[0].kind == "parquet":
                    handle = open_parquet(path)
                    fields = self._fields(handle.schema_arrow)
                    return fields, handle.iter_batches(batch_size=self.BATCH_ROWS, columns=list(fields.read))
                with open(path, "rb") as handle:
                    feather_v1 = handle.read(4) == b"FEA1"
                if feather_v1:  # no IPC framing: pyarrow's feather module reads it whole
                    table = pa.feather.read_table(path, memory_map=True)
                    return self._fields(table.schema), iter(table.to_batches(max_chunksize=self.BATCH_ROWS))
                try:
                    reader = pa.ipc.open_file(path)
                    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                except pa.ArrowInvalid:
                    check_stream_end(path)
                    reader = pa.ipc.open_stream(path)
                    batches = iter(reader)
                return self._fields(reader.schema), batches
            except (pa.ArrowInvalid, OSError) as error:
                raise InvalidInputError(f"{path}: cannot read as {self.inputs[0].kind}: {error}") from None
        if isinstance(source, pa.Table):
            return self._fields(source.schema), iter(source.to_batches(max_chunksize=self.BATCH_ROWS))
        if hasattr(source, "with_format") and hasattr(source, "column_names"):  # datasets.Dataset
            names = source.column_names
            if isinstance(names, dict):
                raise InvalidInputError(f"{type(source).__name__} of splits {sorted(names)}: give one split, "
                                        f"such as dataset[{next(iter(names))!r}]")
            if names is None or not hasattr(source, "data"):   # a datasets.IterableDataset: no Arrow table
                raise InvalidInputError(f"{type(source).__name__}: give a datasets.Dataset (a table), not a stream "
                                        f"of rows" + (" with unknown columns (no features)" if names is None else ""))
            return self._fields(source.data.schema), source.with_format("arrow").iter(batch_size=self.BATCH_ROWS)
        raise InvalidInputError(
            f"expected a path, a pyarrow.Table or a datasets.Dataset, not {type(source).__name__}"
        )

    def chunks(self, first_input: int) -> Iterator[DocumentChunk]:
        fields, batches = self._open()
        yield from record_chunks(batches, fields, first_input, 0, self.inputs[0])


def record_chunks(batches, fields: RecordFields, first_input: int, first_row: int,
                  where: Input) -> Iterator[DocumentChunk]:
    """The chunks of record ``batches`` (their ``fields`` columns; rows from
    ``first_row``); damage found while reading them (a truncated file, a corrupt page)
    is one error naming the input and the first row of the read that failed."""
    pa = import_pyarrow()
    row = first_row
    try:
        for batch in batches:
            if batch.num_rows:
                yield arrow_chunk(batch, fields, first_input, row, where)
            row += batch.num_rows
    except (pa.ArrowInvalid, OSError) as error:
        raise where.error(row, f"cannot read as {where.kind}: {error}") from None
