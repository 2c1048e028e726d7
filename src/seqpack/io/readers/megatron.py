"""Megatron indexed datasets (``PREFIX.idx`` and ``PREFIX.bin``): the index checked
field by field before any token is read, the tokens memory-mapped, and sequences
chunked by ``CHUNK_DOCUMENTS`` and ``CHUNK_BYTES``. ``MEGATRON_MAGIC`` and
``MEGATRON_PARTNERS`` live in :mod:`.sniff`, which recognizes these files too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ...errors import InvalidInputError
from .base import (
    CHUNK_BYTES,
    CHUNK_DOCUMENTS,
    DocumentChunk,
    Input,
    input_path,
    not_a_file,
)
from .sniff import MEGATRON_MAGIC, MEGATRON_PARTNERS

MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                   7: np.float32, 8: np.uint16}
#: The fields of a Megatron index header after its magic: name, first byte, width in
#: bytes (little-endian unsigned integers), and the header's size.
MEGATRON_HEADER = (("version", 9, 8), ("dtype code", 17, 1), ("sequence count", 18, 8), ("document count", 26, 8))
MEGATRON_HEADER_BYTES = 34


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
            raise where.error(index, problem)
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

