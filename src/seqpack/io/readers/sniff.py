"""What a file is by its first bytes, its last bytes and its suffix.

Compressed data (gzip, bzip2, xz, zstd, zip) and the binary formats seqpack reads with
readers of their own (Parquet, Arrow, Feather, Megatron) are refused when read as text
or JSONL, whatever their names. This module only recognizes bytes handed to it; it opens
no file.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import InvalidInputError

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
#: A datatrove tokenized shard's files (uint16 tokens, uint64 document ends), by name ending.
DATATROVE_ENDINGS = (".ds", ".ds.index", ".ds.metadata")
#: A Megatron dataset's two files, each by the other's suffix.
MEGATRON_PARTNERS = {".idx": ".bin", ".bin": ".idx"}


def compression(head: bytes) -> str | None:
    """The codec whose data begins with ``head`` (gzip, bzip2, xz, zstd, zip), or None."""
    if head[:3] == b"BZh" and b"1" <= head[3:4] <= b"9" and head[4:10] in BZIP2_MARKS:
        return "bzip2"
    return next((codec for magic, codec in COMPRESSED_MAGIC if head.startswith(magic)), None)


def binary_format(head: bytes, tail: bytes) -> str | None:
    """The name of the :data:`BINARY_FORMATS` entry whose first and last bytes ``head``
    and ``tail`` hold (such as "a Parquet file"), or None."""
    return next((what for first, last, what in BINARY_FORMATS
                 if head.startswith(first) and (last is None or tail.endswith(last))), None)


def check_text_file(name, head: bytes, tail: bytes, kind: str) -> None:
    """Refuse a file read as ``kind`` (text or JSONL) whose first bytes ``head`` and last
    bytes ``tail`` (``MAGIC_BYTES`` of each when the file has that many) mark it as gzip,
    bzip2, xz, zstd or zip data, or as a Parquet, Arrow, Feather or Megatron file,
    whatever its name; and a ``.jsonl``, ``.ndjson``, ``.bin`` or ``.idx`` file, or a
    datatrove shard's (:data:`DATATROVE_ENDINGS`), read as text (a directory's file:
    Megatron's and datatrove's token data have no magic of their own)."""
    found = compression(head)
    if found is not None:
        raise InvalidInputError(f"{name}: {found}-compressed; decompress it first")
    binary = binary_format(head, tail)
    suffix = Path(name).suffix.lower()
    if binary is None and kind == "text" and suffix in JSONL_SUFFIXES:
        binary = "a JSONL file"
    if binary is None and kind == "text" and suffix in MEGATRON_PARTNERS:
        binary = f"a {suffix} file (half of a Megatron dataset, by its name)"
    if kind == "text" and str(name).lower().endswith(DATATROVE_ENDINGS):
        raise InvalidInputError(f"{name}: a datatrove tokenized shard's file (by its name), not text; seqpack does "
                                f"not read datatrove shards: pack their source documents (--glob leaves them out)")
    if binary is not None:
        raise InvalidInputError(
            f"{name}: {binary}, not {kind}: give it as an input of its own, named by its extension (a "
            f"directory's files are read as text; --glob leaves others out)"
        )

