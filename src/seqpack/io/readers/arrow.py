"""Parquet, Arrow IPC files and streams, Feather, ``pyarrow.Table`` and
``datasets.Dataset``: record batches handed over as their buffers, with no Python object
per document or token. pyarrow (the ``corpus`` extra) is imported by
:func:`import_pyarrow` when data is opened, never when this module is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ...errors import InvalidInputError
from .base import DocumentChunk, Input, check_fields, missing_extra, not_a_file


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


def _column_field(schema_names, text_field: str | None, ids_field: str | None, name: str) -> tuple[str, bool]:
    """The column to read and whether it holds IDs: ``ids_field`` if given, else
    ``text_field`` (default ``"text"``), else ``"input_ids"`` when that is the column there is."""
    check_fields(name, text_field, ids_field)
    if ids_field is not None:
        chosen, ids = ids_field, True
    elif text_field is not None:
        chosen, ids = text_field, False
    elif "text" in schema_names:
        chosen, ids = "text", False
    elif "input_ids" in schema_names:
        chosen, ids = "input_ids", True
    else:
        raise InvalidInputError(f"{name}: no 'text' or 'input_ids' column; name one with --text-field or --ids-field")
    if chosen not in schema_names:
        raise InvalidInputError(f"{name}: no column {chosen!r} (columns: {', '.join(schema_names)})")
    if list(schema_names).count(chosen) > 1:
        raise InvalidInputError(f"{name}: {list(schema_names).count(chosen)} columns are named {chosen!r}")
    return chosen, ids


def _first_null(array) -> int:
    """The index of the first null in an Arrow array that has one."""
    return int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])


def arrow_chunk(array, input_index: int, first_row: int, where: Input, ids: bool) -> DocumentChunk:
    """One chunk from an Arrow string or list array (a column of a record batch).

    Strings are handed over as their UTF-8 buffer and offsets, lists as their flat
    values and offsets: no Python object per document or token.
    """
    pa = import_pyarrow()
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        row = first_row + _first_null(array)
        raise InvalidInputError(f"{where.where(row)}: the document is null")
    count = len(array)
    locations = np.arange(first_row, first_row + count, dtype=np.int64)
    inputs = np.full(count, input_index, dtype=np.int64)
    kind = array.type
    if ids:
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) \
                or not pa.types.is_integer(kind.value_type):
            raise InvalidInputError(f"{where.name}: column type {kind} is not a list of integers")
        lengths = pa.compute.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
        offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = array.flatten()
        if values.null_count:
            row = first_row + int(np.searchsorted(offsets, _first_null(values), side="right")) - 1
            raise InvalidInputError(f"{where.where(row)}: a token ID is null")
        flat = values.to_numpy(zero_copy_only=False)
        return DocumentChunk(inputs, locations, flat.nbytes, ids=(flat, offsets))
    if pa.types.is_string(kind) or pa.types.is_binary(kind):
        offset_type = np.int32
    elif pa.types.is_large_string(kind) or pa.types.is_large_binary(kind):
        offset_type = np.int64
    else:
        raise InvalidInputError(f"{where.name}: column type {kind} is not a string column")
    _, offset_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offset_buffer, dtype=offset_type)[array.offset: array.offset + count + 1]
    offsets = offsets.astype(np.int64)
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    data = data[offsets[0]: offsets[-1]]
    return DocumentChunk(inputs, locations, int(data.shape[0]), text_buffer=(data, offsets - offsets[0]))


class ArrowBatches:
    """Record batches of a Parquet file, an Arrow IPC file or stream, a ``pyarrow.Table`` or a
    ``datasets.Dataset``; rows count from 0. The column is ``ids_field`` (a list of
    integer IDs), or ``text_field`` (strings), or by default ``"text"``, else ``"input_ids"``."""

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

    def _batches(self):
        """``(column names, iterator of record batches or tables)``."""
        pa = import_pyarrow()
        source = self.source
        if isinstance(source, (str, os.PathLike)):
            path = str(source)
            try:
                if self.inputs[0].kind == "parquet":
                    handle = pa.parquet.ParquetFile(path, memory_map=True)
                    names = handle.schema_arrow.names
                    column, _ = _column_field(names, self.text_field, self.ids_field, path)
                    return names, handle.iter_batches(batch_size=self.BATCH_ROWS, columns=[column])
                with open(path, "rb") as handle:
                    feather_v1 = handle.read(4) == b"FEA1"
                if feather_v1:  # no IPC framing: pyarrow's feather module reads it whole
                    table = pa.feather.read_table(path, memory_map=True)
                    return table.column_names, iter(table.to_batches(max_chunksize=self.BATCH_ROWS))
                try:
                    reader = pa.ipc.open_file(path)
                    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                except pa.ArrowInvalid:
                    reader = pa.ipc.open_stream(path)
                    batches = iter(reader)
                return reader.schema.names, batches
            except (pa.ArrowInvalid, OSError) as error:
                raise InvalidInputError(f"{path}: cannot read as {self.inputs[0].kind}: {error}") from None
        if isinstance(source, pa.Table):
            return source.column_names, iter(source.to_batches(max_chunksize=self.BATCH_ROWS))
        if hasattr(source, "with_format") and hasattr(source, "column_names"):  # datasets.Dataset
            names = source.column_names
            if isinstance(names, dict):
                raise InvalidInputError(f"{type(source).__name__} of splits {sorted(names)}: give one split, "
                                        f"such as dataset[{next(iter(names))!r}]")
            if names is None:
                raise InvalidInputError(f"{type(source).__name__} with unknown columns (no features): "
                                        f"give it features, or a Dataset")
            return names, source.with_format("arrow").iter(batch_size=self.BATCH_ROWS)
        raise InvalidInputError(
            f"expected a path, a pyarrow.Table or a datasets.Dataset, not {type(source).__name__}"
        )

    def reads_ids(self) -> bool:
        """Whether the column read holds token IDs (by the fields given, else by the
        columns there are: this opens the file)."""
        names, _ = self._batches()
        return _column_field(names, self.text_field, self.ids_field, self.inputs[0].name)[1]

    def chunks(self, first_input: int) -> Iterator[DocumentChunk]:
        names, batches = self._batches()
        where = self.inputs[0]
        column, ids = _column_field(names, self.text_field, self.ids_field, where.name)
        yield from batch_chunks(batches, column, ids, first_input, 0, where)


def batch_chunks(batches, column: str, ids: bool, first_input: int, first_row: int,
                 where: Input) -> Iterator[DocumentChunk]:
    """The chunks of record ``batches`` (``column`` of each; rows from ``first_row``);
    damage found while reading them (a truncated file, a corrupt page) is one error naming
    the file and the first row of the read that failed."""
    pa = import_pyarrow()
    row = first_row
    try:
        for batch in batches:
            if batch.num_rows:
                yield arrow_chunk(batch.column(column), first_input, row, where, ids)
            row += batch.num_rows
    except (pa.ArrowInvalid, OSError) as error:
        raise InvalidInputError(f"{where.where(row)}: cannot read as {where.kind}: {error}") from None

