"""A real corpus on every machine with Python: the standard library's own ``.py`` files.

Each file is one document, tokenized with the byte tokenizer. Documents longer
than a row are not truncated: they are cut into the overlapping ranges of
:func:`~seqpack.data.window_ranges` (``ExampleTable.from_texts(..., long="cut")``).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from .._arguments import check_optional_int
from ..errors import InvalidInputError
from .binding import BatchBinding, Partition
from .table import ExampleTable


def stdlib_sources() -> list[Path]:
    """The standard library's non-empty ``.py`` files, sorted (third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py")
        if "site-packages" not in p.parts and p.is_file() and p.stat().st_size > 0
    )


def stdlib_table(binding: BatchBinding, *, capacity: int, partition: Partition = Partition.TRAIN,
                 limit: int | None = None) -> ExampleTable:
    """The standard library as an ExampleTable of ranges fitting ``capacity`` predictions.

    ``binding`` must carry a ByteTokenizer (it encodes the files). ``limit`` keeps the
    first files only. Example ids are ``"path/inside/stdlib.py[start:stop]"``.
    """
    if not isinstance(binding, BatchBinding) or binding.tokenizer is None:
        raise InvalidInputError("stdlib_table needs a binding with a ByteTokenizer to encode the files")
    limit = check_optional_int("limit", limit)  # a negative or bool limit would slice silently
    paths = stdlib_sources()[:limit]
    root = Path(sysconfig.get_paths()["stdlib"])
    return ExampleTable.from_texts([path.read_bytes() for path in paths], binding, capacity=capacity,
                                   long="cut", partition=partition,
                                   ids=[str(p.relative_to(root)) for p in paths])
