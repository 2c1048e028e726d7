"""A batch's permission metadata in the forms other libraries take (numpy arrays).

Every export describes the same relation as ``BatchLayout.allowed_key``: a valid query
attends to the earlier-or-equal keys of its own segment. Segments are numbered in
row-major order of the batch's valid cells ("the flattened batch"), so document ``i``
is tokens ``cu_seqlens[i]:cu_seqlens[i + 1]`` of ``batch.inputs[batch.token_valid]``:

- ``position_ids``: int64 ``[rows, T]``, each cell's local position (padding 0), the
  dtype PyTorch and transformers take;
- ``document_ids``: int32 ``[rows, T]``, each valid cell's document index in that order
  (transformers' ``seq_idx``), padding -1. The batch's ``segments`` field holds the
  global occurrence ordinals instead;
- ``seq_lens``: int32, each document's token count in that order;
- ``cu_seqlens``: int32 ``[documents + 1]``, a leading 0 then the running totals (the
  flash-attn varlen convention); a total of ``2**31`` or more is an error, since
  32-bit offsets would wrap;
- ``max_seqlen``: a Python int, the longest document (0 for an empty batch).
"""

from __future__ import annotations

import numpy as np

from .._arguments import INT32_MAX
from ..errors import InvalidInputError
from .batch import BatchLayout


def _batch(batch) -> BatchLayout:
    if not isinstance(batch, BatchLayout):
        raise InvalidInputError(f"expected a padded or packed batch, not {type(batch).__name__}")
    return batch


def _document_starts(batch: BatchLayout) -> np.ndarray:
    """Flat cell indices where a document begins (a valid cell at local position 0), row-major."""
    return np.flatnonzero((batch.positions == 0) & batch.token_valid)


def position_ids(batch) -> np.ndarray:
    """Local positions as int64 ``[rows, T]`` (padding 0), a fresh writeable array."""
    return _batch(batch).positions.astype(np.int64)


def document_ids(batch) -> np.ndarray:
    """Each valid cell's document index in row-major order, int32 ``[rows, T]``; padding -1."""
    batch = _batch(batch)
    flat = np.zeros(batch.cell_count, dtype=np.int32)
    flat[_document_starts(batch)] = 1
    ids = np.cumsum(flat, dtype=np.int32).reshape(batch.shape) - np.int32(1)
    ids[~batch.token_valid] = -1
    return ids


def seq_lens(batch) -> np.ndarray:
    """Token counts of the batch's documents, int32, in row-major order."""
    batch = _batch(batch)
    valid = np.flatnonzero(batch.token_valid)
    # Valid cells are row prefixes, so a document's cells are consecutive among them.
    begins = np.searchsorted(valid, _document_starts(batch))
    return np.diff(np.append(begins, valid.size)).astype(np.int32)


def cumulative_lengths(lengths) -> np.ndarray:
    """``[0, l0, l0 + l1, ...]`` as int32; :class:`InvalidInputError` when the total reaches 2**31."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total > INT32_MAX:
        raise InvalidInputError(
            f"the batch holds {total} valid tokens; cu_seqlens is int32 and holds at most {INT32_MAX} "
            f"(32-bit offsets would wrap): use smaller batches"
        )
    out = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def cu_seqlens(batch) -> np.ndarray:
    """int32 ``[documents + 1]``: 0, then the running token totals of the flattened batch."""
    return cumulative_lengths(seq_lens(batch))


def max_seqlen(batch) -> int:
    """The longest document's token count, a Python int (0 when the batch has none)."""
    lengths = seq_lens(batch)
    return int(lengths.max()) if lengths.size else 0
