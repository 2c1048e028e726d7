"""Plain text files, one document each: every file read whole as bytes, its first and
last bytes checked (:mod:`.sniff`), directories expanded by :mod:`.walk`, and the files
chunked by ``CHUNK_BYTES`` and ``CHUNK_DOCUMENTS``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np

from ...errors import InvalidInputError
from ..format import is_packed_dataset
from .base import (
    CHUNK_BYTES,
    CHUNK_DOCUMENTS,
    DocumentChunk,
    Input,
    cannot_read,
    input_path,
    not_a_file,
)
from .sniff import MAGIC_BYTES, check_text_file
from .walk import _files_under


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
        if not isinstance(paths, Iterable) or isinstance(paths, bytes):
            raise InvalidInputError(f"paths must be a path or a list of paths, not {type(paths).__name__}")
        if pattern is not None and (not isinstance(pattern, str) or not pattern or "/" in pattern or os.sep in pattern):
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

