"""Corpus readers: documents from text files, JSONL, Parquet/Arrow, in-memory tables and Megatron datasets.

Every reader yields :class:`DocumentChunk` objects of bounded size (about
``CHUNK_BYTES`` of input), in input order, each naming where its documents came from
(file and line, row, or sequence), so that any later error names the document's place in
its input. Text arrives as raw bytes or ``str``; pre-tokenized documents as one flat ID
array with offsets, read from Arrow list columns and Megatron ``.bin`` files through their
flat values (no Python loop per token). pyarrow is imported only by the readers that need
it (the ``corpus`` extra).
"""

from __future__ import annotations

import copy
import errno
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Protocol

import numpy as np

from .._limits import check_int, check_optional_int
from ..errors import InvalidInputError
from .format import is_packed_dataset

#: Input bytes a chunk holds (about; one document may exceed it).
CHUNK_BYTES = 8 << 20
#: Documents a chunk holds at most.
CHUNK_DOCUMENTS = 4096

#: The first bytes of compressed files and the format each marks. bzip2's are checked
#: apart: "BZh", a block size 1-9, then one of ``BZIP2_MARKS`` (a block, or the end of an
#: empty stream), since "BZh" alone can begin a text.
COMPRESSED_MAGIC = (
    (b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"PK\x03\x04", "zip"), (b"PK\x05\x06", "zip"),
)
BZIP2_MARKS = (b"\x31\x41\x59\x26\x53\x59", b"\x17\x72\x45\x38\x50\x90")
#: Leading bytes enough to recognize every compressed format above.
MAGIC_BYTES = 10

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
#: The binary corpus formats seqpack reads by their own readers: their first bytes, their
#: last bytes (None: any), and their name. A text that merely begins with ``PAR1`` is text.
BINARY_FORMATS = ((b"PAR1", b"PAR1", "a Parquet file"), (b"ARROW1", b"ARROW1", "an Arrow file"),
                  (b"FEA1", b"FEA1", "a Feather (version 1) file"),
                  (b"\xff\xff\xff\xff", None, "an Arrow stream (a datasets.save_to_disk shard is one)"),
                  (MEGATRON_MAGIC, None, "a Megatron index"))
#: Suffixes of files that hold JSON lines: read as JSONL when given, refused inside a directory.
JSONL_SUFFIXES = (".jsonl", ".ndjson")
#: A Megatron dataset's two files, each by the other's suffix.
MEGATRON_PARTNERS = {".idx": ".bin", ".bin": ".idx"}
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                   7: np.float32, 8: np.uint16}
#: The fields of a Megatron index header after its magic: name, first byte, width in
#: bytes (little-endian unsigned integers), and the header's size.
MEGATRON_HEADER = (("version", 9, 8), ("dtype code", 17, 1), ("sequence count", 18, 8), ("document count", 26, 8))
MEGATRON_HEADER_BYTES = 34


def missing_extra(what: str, extra: str) -> InvalidInputError:
    return InvalidInputError(f"{what} needs the {extra!r} extra: pip install 'seqpack[{extra}]'")


def input_path(value) -> Path:
    """``value`` (a ``str`` or ``os.PathLike``) as a ``Path``; anything else is an
    :class:`InvalidInputError`."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidInputError(f"expected a path (str or os.PathLike), got {type(value).__name__}")
    return Path(value)


#: What a path is when resolving it meets a symbolic link that loops (``ELOOP``).
LINK_LOOP = "a symbolic link that loops (it points, directly or through others, back to itself)"


def link_loop(path) -> str | None:
    """What is wrong when resolving ``path`` meets a symbolic link that loops (the path
    itself, or a directory on its way), else ``None``. ``Path.exists`` says ``False`` for
    such a path, as for a missing one."""
    try:
        os.stat(path)
        return None
    except OSError as error:
        if error.errno != errno.ELOOP:
            return None
    try:
        os.lstat(path)
    except OSError:  # a directory on the way loops, not the last name
        return f"its path goes through {LINK_LOOP}"
    return LINK_LOOP


def not_a_file(path, what: str = "no such file") -> InvalidInputError:
    """The error for an input path that is not a regular file: missing (``what``), a
    symbolic link that loops, or a pipe, a device or a socket (``/dev/stdin``,
    ``<(...)``), which seqpack cannot read twice or seek in."""
    path = Path(path)
    if (loop := link_loop(path)) is not None:
        return InvalidInputError(f"{path}: {loop}")
    if path.exists():
        return InvalidInputError(f"{path}: not a regular file (a pipe, a device or a socket): write the data to "
                                 f"a file first")
    return InvalidInputError(f"{path}: {what}")


def cannot_read(path, error: OSError) -> InvalidInputError:
    """The one-line error for a file or directory that cannot be read."""
    return InvalidInputError(f"{path}: cannot read: {error.strerror or error}")


def check_text_file(name, head: bytes, tail: bytes, kind: str) -> None:
    """Refuse a file read as ``kind`` (text or JSONL) whose first bytes ``head`` and last
    bytes ``tail`` (``MAGIC_BYTES`` of each when the file has that many) mark it as gzip,
    bzip2, xz, zstd or zip data, or as a Parquet, Arrow, Feather or Megatron file,
    whatever its name; and a ``.jsonl``, ``.ndjson``, ``.bin`` or ``.idx`` file read as
    text (a directory's file: Megatron's token data has no magic of its own)."""
    bzip2 = head[:3] == b"BZh" and b"1" <= head[3:4] <= b"9" and head[4:10] in BZIP2_MARKS
    found = "bzip2" if bzip2 else next((codec for magic, codec in COMPRESSED_MAGIC if head.startswith(magic)), None)
    if found is not None:
        raise InvalidInputError(f"{name}: {found}-compressed; decompress it first")
    binary = next((what for first, last, what in BINARY_FORMATS
                   if head.startswith(first) and (last is None or tail.endswith(last))), None)
    suffix = Path(name).suffix.lower()
    if binary is None and kind == "text" and suffix in JSONL_SUFFIXES:
        binary = "a JSONL file"
    if binary is None and kind == "text" and suffix in MEGATRON_PARTNERS:
        binary = f"a {suffix} file (half of a Megatron dataset, by its name)"
    if binary is not None:
        raise InvalidInputError(
            f"{name}: {binary}, not {kind}: give it as an input of its own, named by its extension (a "
            f"directory's files are read as text; --glob leaves others out)"
        )


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


@dataclass(frozen=True)
class Input:
    """One input: its name (a path, or a description of an in-memory table), the unit
    that locates a document in it (``"line"`` 1-based, ``"row"`` and ``"sequence"``
    0-based, or ``None`` for a file that is one document), and ``within``: the input
    directory it was found in, for a file found by walking one."""

    name: str
    kind: str
    unit: str | None
    within: str | None = None

    def where(self, location: int) -> str:
        """``path:line``, ``name row 12``, ``name sequence 3`` or the file's name."""
        if self.unit is None:
            return self.name
        if self.unit == "line":
            return f"{self.name}:{location}"
        return f"{self.name} {self.unit} {location}"


@dataclass
class DocumentChunk:
    """Consecutive documents of one input.

    Exactly one of ``texts`` (a list of ``str`` or ``bytes``), ``text_buffer`` (UTF-8
    bytes as a uint8 array and int64 offsets) or ``ids`` (flat integer IDs and int64
    offsets, one document each) is set. ``inputs`` and ``locations`` (int64) name each
    document's input (an index into the readers' inputs) and its place there; ``nbytes``
    counts the input bytes read.
    """

    inputs: np.ndarray
    locations: np.ndarray
    nbytes: int
    texts: list | None = None
    text_buffer: tuple[np.ndarray, np.ndarray] | None = None
    ids: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.locations.shape[0])

    def text_list(self) -> list:
        """The texts as a list (``str`` or ``bytes``)."""
        if self.texts is not None:
            return self.texts
        data, offsets = self.text_buffer
        raw = data.tobytes()
        bounds = offsets.tolist()
        return [raw[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def joined_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """The texts' UTF-8 bytes back to back (uint8) with int64 offsets."""
        if self.text_buffer is not None:
            return self.text_buffer
        encoded = [t.encode("utf-8") if isinstance(t, str) else t for t in self.texts]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in encoded], out=offsets[1:])
        return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


class Reader(Protocol):
    """Documents chunk by chunk: ``inputs`` lists what the reader reads, and
    ``chunks(first_input)`` yields chunks whose input indices count from ``first_input``."""

    inputs: list[Input]

    def chunks(self, first_input: int) -> Iterator[DocumentChunk]: ...


class Exclusive:
    """``chunks`` shared by two threads: ``next`` and ``close`` never overlap (a close waits
    for a read in progress), and once closed it is exhausted."""

    def __init__(self, chunks: Iterator):
        self._chunks, self._lock, self._closed = chunks, threading.Lock(), False

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            if self._closed:
                raise StopIteration
            return next(self._chunks)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()


def read_ahead(chunks: Iterator[DocumentChunk], enabled: bool = True) -> Iterator[DocumentChunk]:
    """The chunks of ``chunks``; when ``enabled``, each next one is read on a helper thread
    while the caller works on the one it has (reading that releases the GIL, such as
    Parquet decoding or file reads, then overlaps tokenizing and validation). Order,
    chunks and errors are unchanged; at most one chunk is read ahead. Closing this
    generator stops the helper and closes ``chunks``, after any read in progress: a
    signal's exception (Ctrl-C, SIGTERM) can strike while the helper thread starts, where
    the pool no longer knows the thread, which may then be inside ``chunks``.
    """
    chunks = Exclusive(chunks)
    try:
        if not enabled:
            yield from chunks
            return
        end = object()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="seqpack-read-ahead") as pool:
            pending = pool.submit(next, chunks, end)
            while (chunk := pending.result()) is not end:
                pending = pool.submit(next, chunks, end)
                yield chunk
    finally:
        chunks.close()


def _directory_key(path: str) -> tuple[int, int]:
    """``(device, inode)`` of a directory, links followed."""
    status = os.stat(path)
    return status.st_dev, status.st_ino


def _walk_error(error: OSError):
    """A directory that cannot be listed is an error, not skipped."""
    raise cannot_read(error.filename, error)


def _files_under(path: Path, pattern: str | None) -> tuple[list[Path], list[Path]]:
    """``(files, datasets)``: the regular files under a directory, sorted, hidden names
    skipped, matching ``pattern``, and the packed datasets left out of them (subdirectories
    :func:`~seqpack.io.format.is_packed_dataset` recognizes). Linked directories are
    followed; a link to a directory's own ancestor (a cycle), a directory reached a second
    time through links (its files would be inputs twice), or a matching name that is not a
    regular file (a dangling link, a link that loops, a pipe), is an error."""
    found, datasets = [], []
    top = os.fspath(path)
    ancestors = {top: {_directory_key(top): top}}  # each directory to visit: the directories above it and itself
    reached = {_directory_key(top): top}  # every directory met so far
    for root, dirs, files in os.walk(top, onerror=_walk_error, followlinks=True):
        above = ancestors.pop(root)
        visible = sorted(d for d in dirs if not d.startswith("."))
        packed = [d for d in visible if is_packed_dataset(Path(root, d))]
        datasets.extend(Path(root, d) for d in packed)
        dirs[:] = [d for d in visible if d not in packed]
        for name in dirs:
            directory = os.path.join(root, name)
            key = _directory_key(directory)
            if key in above:
                raise InvalidInputError(f"{directory}: a directory link cycle (it leads back to {above[key]})")
            if key in reached:  # found now, not after walking every path to it (2**depth of them)
                raise InvalidInputError(f"{directory}: the directory {reached[key]} again, through a link: its "
                                        f"files would be inputs twice")
            reached[key] = directory
            ancestors[directory] = {**above, key: directory}
        for name in sorted(files):
            if name.startswith(".") or (pattern and not Path(name).match(pattern)):
                continue
            candidate = Path(root) / name
            if not candidate.is_file():
                what = link_loop(candidate) or "not a regular file (a dangling link, a pipe or a device)"
                raise InvalidInputError(f"{candidate}: {what}; remove it or leave it out with --glob")
            found.append(candidate)
    return found, datasets


class TextFiles:
    """Plain text files, one document each; ``paths`` is one path or a list of them. A
    directory stands for every file under it (sorted, hidden names skipped, ``pattern``
    such as ``"*.py"`` filtering names; a pattern that matches no file there is an error).
    A packed dataset inside a directory is not text: it is left out with everything under
    it and listed in ``skipped`` (the command line reports each); a packed dataset given
    itself is an error. An empty file is an empty document: skipped and counted when
    packing, as every empty document is. A compressed file (gzip, bzip2, xz, zstd, zip)
    or a Parquet, Arrow or Megatron file, known by its first bytes, is an error when read."""

    def __init__(self, paths, pattern: str | None = None):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if pattern is not None and (not isinstance(pattern, str) or "/" in pattern or os.sep in pattern):
            raise InvalidInputError(f"the pattern {pattern!r} must be a file name pattern such as '*.py' (it "
                                    f"matches names in every subdirectory, not paths)")
        self.paths, self.inputs, self.skipped = [], [], []
        for path in map(input_path, paths):
            if path.is_dir():
                if is_packed_dataset(path):
                    raise InvalidInputError(f"{path}: a packed dataset, not text files")
                files, datasets = _files_under(path, pattern)
                if pattern and not files:
                    raise InvalidInputError(f"{path}: no file matches --glob {pattern!r}")
                self.skipped.extend(datasets)
                within = str(path)
            elif path.is_file():
                files, within = [path], None
            else:
                raise not_a_file(path, "no such file or directory")
            self.paths.extend(files)
            self.inputs.extend(Input(str(p), "text", None, within) for p in files)

    def chunks(self, first_input: int) -> Iterator[DocumentChunk]:
        texts, first, size = [], 0, 0
        for index, path in enumerate(self.paths):
            try:
                texts.append(path.read_bytes())
            except OSError as error:
                raise cannot_read(path, error) from None
            check_text_file(path, texts[-1][:MAGIC_BYTES], texts[-1][-MAGIC_BYTES:], "text")
            size += len(texts[-1])
            if size >= CHUNK_BYTES or len(texts) >= CHUNK_DOCUMENTS or index == len(self.paths) - 1:
                inputs = np.arange(first_input + first, first_input + index + 1, dtype=np.int64)
                yield DocumentChunk(inputs, np.ones(len(texts), np.int64), size, texts=texts)
                first, texts, size = index + 1, [], 0


def check_fields(name: str, text_field: str | None, ids_field: str | None) -> None:
    """A text field and an IDs field together are an error: one of them would be ignored."""
    if text_field is not None and ids_field is not None:
        raise InvalidInputError(f"{name}: give a text field ({text_field!r}) or an IDs field ({ids_field!r}), "
                                f"not both")


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



def megatron_file(prefix: Path, suffix: str) -> Path:
    """``PREFIX`` + ``suffix`` (``.idx`` or ``.bin``) as it is spelled on disk, the suffix
    in any case; the lower-case name when there is none (to be reported missing), and an
    error when two spellings are there."""
    try:
        found = [entry for entry in os.scandir(prefix.parent or ".")
                 if entry.name.startswith(prefix.name) and entry.name[len(prefix.name):].lower() == suffix]
    except OSError:
        found = []
    if len(found) > 1:
        names = ", ".join(sorted(entry.name for entry in found))
        raise InvalidInputError(f"{prefix}: {names} each name its {suffix} file: keep one")
    return prefix.parent / found[0].name if found else Path(f"{prefix}{suffix}")


class Megatron:
    """A Megatron indexed dataset (``PREFIX.idx`` and ``PREFIX.bin``), memory-mapped; each
    sequence is one document of pre-tokenized IDs (sequences count from 0). ``path`` is
    the prefix or either file; both suffixes match in any case."""

    def __init__(self, path):
        path = input_path(path)
        suffix = path.suffix.lower()
        if suffix in MEGATRON_PARTNERS:
            other = megatron_file(path.with_suffix(""), MEGATRON_PARTNERS[suffix])
            self.index_path, self.data_path = (path, other) if suffix == ".idx" else (other, path)
        else:
            self.index_path, self.data_path = megatron_file(path, ".idx"), megatron_file(path, ".bin")
        for required in (self.data_path, self.index_path) if suffix == ".bin" else (self.index_path, self.data_path):
            if not required.is_file():  # the file given first
                raise not_a_file(required, "no such file (a Megatron dataset is PREFIX.idx + PREFIX.bin)")
        self.inputs = [Input(str(self.data_path), "megatron", "sequence")]
        self.lengths, self.pointers, self.dtype = read_megatron_index(self.index_path)

    def _check(self, size: int) -> None:
        """Every sequence has a length of at least 0 and lies inside the ``.bin`` file
        (``size`` bytes, whole tokens) at a byte pointer that is a multiple of the token size."""
        where, itemsize = self.inputs[0], self.dtype.itemsize
        lengths, pointers = self.lengths, self.pointers
        outside = (pointers < 0) | (pointers > size - lengths * itemsize)  # no end computed: it could wrap
        bad = np.flatnonzero((lengths < 0) | outside | (pointers % itemsize != 0))
        if bad.size:
            index = int(bad[0])
            if lengths[index] < 0:
                problem = f"negative length {int(lengths[index])}"
            elif outside[index]:
                problem = f"lies outside {self.data_path} ({size} bytes)"
            else:
                problem = f"byte pointer {int(pointers[index])} is not a multiple of the {self.dtype} token size"
            raise InvalidInputError(f"{where.where(index)}: {problem}")
        if size % itemsize:
            raise InvalidInputError(f"{self.data_path}: {size} bytes is not a whole number of {self.dtype} tokens")

    def chunks(self, first_input: int) -> Iterator[DocumentChunk]:
        size = os.path.getsize(self.data_path)
        itemsize = self.dtype.itemsize
        self._check(size)
        tokens = np.memmap(self.data_path, dtype=self.dtype, mode="r") if size else np.zeros(0, self.dtype)
        first, count = 0, self.lengths.shape[0]
        while first < count:
            # At most CHUNK_DOCUMENTS sequences and CHUNK_BYTES of tokens (one longer sequence alone).
            window = self.lengths[first: min(first + CHUNK_DOCUMENTS, count)]
            ends = np.cumsum(window)
            stop = first + max(1, int(np.searchsorted(ends, CHUNK_BYTES // itemsize, side="right")))
            lengths = self.lengths[first:stop]
            begins = self.pointers[first:stop] // itemsize
            offsets = np.zeros(stop - first + 1, dtype=np.int64)
            offsets[1:] = ends[: stop - first]
            if np.array_equal(begins, begins[0] + offsets[:-1]):  # stored back to back: one slice
                flat = np.asarray(tokens[begins[0]: begins[0] + offsets[-1]])
            else:
                flat = np.concatenate([tokens[b: b + n] for b, n in zip(begins.tolist(), lengths.tolist())])
            yield DocumentChunk(np.full(stop - first, first_input, dtype=np.int64),
                                np.arange(first, stop, dtype=np.int64), int(offsets[-1]) * itemsize,
                                ids=(flat, offsets))
            first = stop


def read_megatron_index(path: Path) -> tuple[np.ndarray, np.ndarray, np.dtype]:
    """``(sequence lengths int64, byte pointers int64, token dtype)`` of a Megatron ``.idx`` file.

    After the magic come the fields of ``MEGATRON_HEADER`` (a version that must be 1, a
    dtype code of ``MEGATRON_DTYPES`` naming an integer type, the sequence and document
    counts), then lengths int32[sequences], byte pointers int64[sequences] and the
    document index int64[documents], and nothing more but Megatron's multimodal modes
    (int8[sequences]). A field that breaks this is named, with the numbers involved.
    """
    size = os.path.getsize(path)
    data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    if bytes(data[:len(MEGATRON_MAGIC)]) != MEGATRON_MAGIC:
        raise InvalidInputError(f"{path}: not a Megatron index (no MMIDIDX header)")
    if size < MEGATRON_HEADER_BYTES:
        field = next(name for name, first, width in MEGATRON_HEADER if size < first + width)
        raise InvalidInputError(f"{path}: a truncated Megatron index: its {size} bytes end inside the header's "
                                f"{field} (the header is {MEGATRON_HEADER_BYTES} bytes)")
    header = bytes(data[:MEGATRON_HEADER_BYTES])
    version, code, count, documents = (int.from_bytes(header[first:first + width], "little")
                                       for _, first, width in MEGATRON_HEADER)
    if version != 1:
        raise InvalidInputError(f"{path}: Megatron index version {version} is not supported (seqpack reads version 1)")
    if code not in MEGATRON_DTYPES:
        raise InvalidInputError(f"{path}: unknown Megatron dtype code {code} (the codes are "
                                f"{min(MEGATRON_DTYPES)} to {max(MEGATRON_DTYPES)})")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    if dtype.kind not in "iu":
        raise InvalidInputError(f"{path}: dtype code {code} is {dtype}, not an integer token type")
    sequences_end = MEGATRON_HEADER_BYTES + 12 * count
    need = sequences_end + 8 * documents
    if sequences_end > size:
        raise InvalidInputError(f"{path}: sequence count {count} needs {sequences_end} bytes of index (the header "
                                f"and 12 per sequence); the file has {size}")
    if need > size:
        raise InvalidInputError(f"{path}: document count {documents} needs {need} bytes of index (the header, "
                                f"{count} sequences and 8 per document); the file has {size}")
    if size not in (need, need + count):
        raise InvalidInputError(f"{path}: {size} bytes, but sequence count {count} and document count {documents} "
                                f"account for {need} ({need + count} with a mode per sequence): the counts are "
                                f"wrong or bytes follow the index")
    lengths = np.frombuffer(data, dtype="<i4", count=count, offset=MEGATRON_HEADER_BYTES).astype(np.int64)
    pointers = np.frombuffer(data, dtype="<i8", count=count, offset=MEGATRON_HEADER_BYTES + 4 * count).astype(np.int64)
    starts = np.frombuffer(data, dtype="<i8", count=documents, offset=sequences_end)
    # The document index: where each document's sequences start, from 0 up to the count
    # (each sequence is packed as a document of its own; a broken index marks a broken file).
    if documents and (starts[0] != 0 or starts[-1] != count or (np.diff(starts) < 0).any()):
        raise InvalidInputError(f"{path}: a broken document index (it must rise from 0 to the {count} "
                                f"sequences; it holds {documents} entries from {int(starts[0])} to {int(starts[-1])})")
    return lengths, pointers, dtype


def reader_for(path, *, text_field=None, ids_field=None, pattern=None) -> Reader:
    """The reader of one input path, by its kind: a directory or other file is text,
    ``.jsonl``/``.ndjson``/``.json`` JSON lines, ``.parquet`` Parquet, ``.arrow``/``.arrows``/``.feather`` Arrow,
    ``.idx``/``.bin`` a Megatron dataset (the other file must be beside it), and a path
    that does not exist but names ``PATH.idx`` or ``PATH.bin`` a Megatron prefix;
    suffixes match in any case."""
    path = input_path(path)
    suffix = path.suffix.lower()
    if path.is_dir():
        return TextFiles([path], pattern)
    if not path.exists() and any(megatron_file(path, end).is_file() for end in MEGATRON_PARTNERS):
        return Megatron(path)
    if suffix in (*JSONL_SUFFIXES, ".json"):
        return JsonLines(path, text_field=text_field, ids_field=ids_field)
    if suffix in (".parquet", ".arrow", ".arrows", ".feather"):
        return ArrowBatches(path, text_field=text_field, ids_field=ids_field)
    if suffix in MEGATRON_PARTNERS:
        return Megatron(path)
    return TextFiles([path], pattern)
