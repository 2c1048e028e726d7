"""A real corpus on every machine with Python: the standard library's own ``.py`` files.

Each file is one document, tokenized with the byte tokenizer. Documents longer
than a row are not truncated: they are cut into explicit source ranges of at most
``capacity + 1`` tokens that overlap by one token, so every prediction of the
document appears exactly once and no range adds BOS or EOS.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from .binding import BatchBinding, Partition
from .table import ExampleTable


def stdlib_sources() -> list[Path]:
    """The standard library's non-empty ``.py`` files, sorted (third-party packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py")
        if "site-packages" not in p.parts and p.is_file() and p.stat().st_size > 0
    )


def window_ranges(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-document ranges of at most ``capacity + 1`` tokens covering every prediction once.

    Returns ``(documents, ranges)``: document ``d`` of ``n`` tokens supplies the ranges
    ``[s, min(s + capacity + 1, n))`` for ``s = 0, capacity, 2 * capacity, ...`` while
    ``s + 1 < n``.
    """
    pieces = np.maximum(0, -(-(lengths - 1) // capacity))  # ceil((n - 1) / capacity) predictions blocks
    documents = np.repeat(np.arange(len(lengths), dtype=np.int64), pieces)
    first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
    starts = (np.arange(len(documents), dtype=np.int64) - first_piece) * capacity
    stops = np.minimum(starts + capacity + 1, lengths[documents])
    return documents, np.stack([starts, stops], axis=1)


def stdlib_table(binding: BatchBinding, capacity: int, partition: Partition = Partition.TRAIN,
                 limit: int | None = None) -> ExampleTable:
    """The standard library as an ExampleTable of ranges fitting ``capacity`` predictions.

    ``binding`` must carry a ByteTokenizer (it encodes the files). ``limit`` keeps the
    first files only. Example ids are ``"path/inside/stdlib.py[start:stop]"``.
    """
    tokenizer = binding.tokenizer
    paths = stdlib_sources()[:limit]
    documents = [tokenizer.encode_document(path.read_bytes()) for path in paths]
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    which, ranges = window_ranges(lengths, capacity)
    root = Path(sysconfig.get_paths()["stdlib"])
    names = [str(p.relative_to(root)) for p in paths]
    ids = [f"{names[d]}[{a}:{b}]" for d, (a, b) in zip(which.tolist(), ranges.tolist())]
    return ExampleTable.from_arrays(np.concatenate(documents), offsets, binding, partition=partition,
                                    ranges=ranges, documents=which, ids=ids)
