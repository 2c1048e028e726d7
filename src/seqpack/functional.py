"""Differentiable ops on the :mod:`seqpack.autograd` tape, and the range causal softmax API.

Every op takes and returns :class:`~seqpack.autograd.Tensor` values (float64) and records
a backward that adds into its parents' gradients. The heavy ops call the compiled
kernels: :func:`embedding` (masked gather and scatter, PAD_CELL rows are zero and never
read) and :func:`range_softmax` (a valid query normalizes over keys ``[start, query]``
only; inactive queries stay exactly zero).

Attention comes in the chapter's three variants: :func:`causal_attention_with_ranges`
(per-row valid length and per-query segment start, for packed rows),
:func:`causal_attention_with_lengths` (valid prefix only, for padded rows) and
:func:`causal_attention` (every query valid). :func:`fused_range_attention` computes the
first with ``seqpack.attention``'s edge-only kernel instead of dense score grids.
"""

from __future__ import annotations

import math

import numpy as np

from . import _embedding, _softmax
from .autograd import Tensor, as_tensor, record
from .errors import InvalidInputError

ROTARY_BASE = 10000.0


# --- elementwise and linear ops ---


def add(a: Tensor, b: Tensor) -> Tensor:
    """``a + b`` for arrays of one shape (``b`` may be a constant array)."""
    a, b = as_tensor(a), as_tensor(b)

    def backward(grad):
        a.accumulate(grad)
        b.accumulate(grad)

    return record(a.value + b.value, (a, b), backward)


def mul(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise ``a * b`` for arrays of one shape."""
    a, b = as_tensor(a), as_tensor(b)

    def backward(grad):
        a.accumulate(grad * b.value)
        b.accumulate(grad * a.value)

    return record(a.value * b.value, (a, b), backward)


def scale(x: Tensor, factor: float) -> Tensor:
    """``x * factor`` for a Python float ``factor``."""

    def backward(grad):
        x.accumulate(grad * factor)

    return record(x.value * factor, (x,), backward)


def transpose(w: Tensor) -> Tensor:
    """The transpose of a matrix."""

    def backward(grad):
        w.accumulate(grad.T)

    return record(w.value.T, (w,), backward)


def matmul(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w`` for activations ``x`` ``[..., n]`` and a matrix ``w`` ``[n, m]``."""
    inner = w.shape[0]

    def backward(grad):
        x.accumulate(grad @ w.value.T)
        w.accumulate(x.value.reshape(-1, inner).T @ grad.reshape(-1, w.shape[1]))

    return record(x.value @ w.value, (x, w), backward)


def batched_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` over matching leading axes: ``[..., n, m] @ [..., m, p]``."""

    def backward(grad):
        a.accumulate(grad @ np.swapaxes(b.value, -1, -2))
        b.accumulate(np.swapaxes(a.value, -1, -2) @ grad)

    return record(a.value @ b.value, (a, b), backward)


def swap_last_axes(x: Tensor) -> Tensor:
    """Swap the last two axes (``k`` to ``k^T`` per head)."""

    def backward(grad):
        x.accumulate(np.swapaxes(grad, -1, -2))

    return record(np.swapaxes(x.value, -1, -2), (x,), backward)


def silu(x: Tensor) -> Tensor:
    """``x * sigmoid(x)``, with the sigmoid as ``(1 + tanh(x / 2)) / 2`` (no overflow)."""
    sigmoid = 0.5 * (1.0 + np.tanh(0.5 * x.value))

    def backward(grad):
        x.accumulate(grad * sigmoid * (1.0 + x.value * (1.0 - sigmoid)))

    return record(x.value * sigmoid, (x,), backward)


def rmsnorm(x: Tensor, gain: Tensor, eps: float = 1e-5) -> Tensor:
    """``x / sqrt(mean(x**2) + eps) * gain`` over the last axis."""
    rms = np.sqrt(np.mean(x.value * x.value, axis=-1, keepdims=True) + eps)
    normed = x.value / rms

    def backward(grad):
        dnormed = grad * gain.value
        gain.accumulate(np.sum((grad * normed).reshape(-1, gain.shape[0]), axis=0))
        projection = np.mean(dnormed * normed, axis=-1, keepdims=True)
        x.accumulate((dnormed - normed * projection) / rms)

    return record(normed * gain.value, (x, gain), backward)


def select_cells(x: Tensor, active: np.ndarray) -> Tensor:
    """Keep active cells of ``x`` ``[rows, T, ...]`` and put exact zeros elsewhere.

    A selection, not a multiplication: a NaN in an inactive cell does not survive, and
    the gradient into inactive cells is exactly zero.
    """
    keep = np.asarray(active, dtype=bool).reshape(active.shape + (1,) * (x.value.ndim - active.ndim))

    def backward(grad):
        x.accumulate(np.where(keep, grad, 0.0))

    return record(np.where(keep, x.value, 0.0), (x,), backward)


# --- embedding ---


def embedding(table: Tensor, ids: np.ndarray) -> Tensor:
    """Rows of ``table`` ``[V, D]`` for int32 ``ids`` ``[...]``; PAD_CELL cells give zero rows.

    ``ids`` must already be checked (see :func:`check_token_ids`).
    """
    flat = np.ascontiguousarray(ids, dtype=np.int32).reshape(-1)
    width = table.shape[1]
    out = np.empty((flat.shape[0], width))
    _embedding.embedding_forward(np.ascontiguousarray(table.value), flat, out)

    def backward(grad):
        dtable = np.zeros_like(table.value)
        _embedding.embedding_backward(np.ascontiguousarray(grad).reshape(-1, width), flat, dtable)
        table.accumulate(dtable)

    return record(out.reshape(ids.shape + (width,)), (table,), backward)


def check_token_ids(ids: np.ndarray, vocabulary_size: int) -> np.ndarray:
    """Return ``ids`` as int32 after checking every cell is PAD_CELL or in ``[0, V)``.

    Raises :class:`InvalidInputError` naming the first offending cell, before any lookup.
    """
    array = np.asarray(ids)
    if array.dtype.kind not in "iu":
        raise InvalidInputError(f"token IDs must be integers, got dtype {array.dtype}")
    # Clipping keeps every invalid ID invalid while making it fit int32.
    clipped = np.clip(array.reshape(-1), -2, vocabulary_size)
    flat = np.ascontiguousarray(clipped, dtype=np.int32)
    bad = _embedding.first_invalid_token(flat, vocabulary_size)
    if bad >= 0:
        raise InvalidInputError(
            f"token ID {int(array.reshape(-1)[bad])} at cell "
            f"{tuple(int(i) for i in np.unravel_index(bad, array.shape))} is neither "
            f"PAD_CELL (-1) nor below the vocabulary size {vocabulary_size}"
        )
    return flat.reshape(array.shape)


# --- rotary position embedding ---


def rotary(x: Tensor, positions: np.ndarray, active: np.ndarray) -> Tensor:
    """Rotate-half rotary embedding of ``x`` ``[rows, heads, T, d]`` at ``positions`` ``[rows, T]``.

    With ``x1, x2`` the two halves of the last axis and angle
    ``position * 10000 ** (-2i/d)``: ``concat(x1*cos - x2*sin, x1*sin + x2*cos)``.
    Inactive cells (``active`` false) are left as they are.
    """
    half = x.shape[-1] // 2
    frequencies = ROTARY_BASE ** (-2.0 * np.arange(half) / x.shape[-1])
    angles = np.asarray(positions, dtype=np.float64)[:, None, :, None] * frequencies  # [rows, 1, T, half]
    cos, sin = np.cos(angles), np.sin(angles)
    keep = np.asarray(active, dtype=bool)[:, None, :, None]

    def rotate(value, sign):
        first, second = value[..., :half], value[..., half:]
        return np.concatenate(
            (first * cos - sign * second * sin, sign * first * sin + second * cos), axis=-1
        )

    def backward(grad):
        x.accumulate(np.where(keep, rotate(grad, -1.0), grad))

    return record(np.where(keep, rotate(x.value, 1.0), x.value), (x,), backward)


# --- heads ---


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``[rows, T, D]`` to ``[rows, heads, T, D/heads]``: head ``h`` owns column block ``h``."""
    rows, width, model = x.shape

    def backward(grad):
        x.accumulate(grad.transpose(0, 2, 1, 3).reshape(rows, width, model))

    return record(x.value.reshape(rows, width, heads, model // heads).transpose(0, 2, 1, 3), (x,), backward)


def merge_heads(x: Tensor) -> Tensor:
    """``[rows, heads, T, d]`` back to ``[rows, T, heads * d]``."""
    rows, heads, width, depth = x.shape

    def backward(grad):
        x.accumulate(grad.reshape(rows, width, heads, depth).transpose(0, 2, 1, 3))

    return record(x.value.transpose(0, 2, 1, 3).reshape(rows, width, heads * depth), (x,), backward)


# --- range causal softmax ---


def causal_layout(
    grids: int, queries: int, lengths=None, starts=None
) -> tuple[np.ndarray, np.ndarray]:
    """Check and coerce a softmax layout: int64 ``lengths`` ``[grids]``, int32 ``starts`` ``[grids, T]``.

    ``lengths`` defaults to ``T`` (every query valid) and ``starts`` to 0 (plain causal).
    Each length lies in ``[0, T]``; each valid query's start lies in ``[0, query]``.
    Errors name the grid and query.
    """
    if lengths is None:
        lengths = np.full(grids, queries, dtype=np.int64)
    lengths = _integers(lengths, "lengths")
    if lengths.shape != (grids,):
        raise InvalidInputError(f"expected {grids} causal lengths (one per grid), got shape {lengths.shape}")
    outside = (lengths < 0) | (lengths > queries)
    if outside.any():
        grid = int(np.argmax(outside))
        raise InvalidInputError(f"grid {grid} has causal length {int(lengths[grid])}; T is {queries}")
    if starts is None:
        return lengths, np.zeros((grids, queries), dtype=np.int32)
    starts = _integers(starts, "starts")
    if starts.shape != (grids, queries):
        raise InvalidInputError(
            f"expected range starts of shape {(grids, queries)} (one per query), got {starts.shape}"
        )
    column = np.arange(queries)
    valid = column < lengths[:, None]
    bad = valid & ((starts < 0) | (starts > column))
    if bad.any():
        grid, query = np.unravel_index(int(np.argmax(bad)), bad.shape)
        raise InvalidInputError(
            f"grid {grid} query {query} has range start {int(starts[grid, query])}; "
            f"a start must lie in [0, {query}]"
        )
    return lengths, np.ascontiguousarray(np.where(valid, starts, 0), dtype=np.int32)


def _integers(values, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise InvalidInputError(f"{name} must be integers, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.int64)


def range_softmax_forward(scores: np.ndarray, lengths=None, starts=None, out: np.ndarray | None = None) -> np.ndarray:
    """Range causal softmax of float64 ``scores`` ``[..., T, T]``.

    ``lengths`` holds one valid prefix length per grid (``scores.shape[:-2]``) and
    ``starts`` one first key column per query (``scores.shape[:-1]``); see
    :func:`causal_layout`. ``out`` (C-contiguous float64, the shape of ``scores``) is
    written in full and returned; by default a new array is allocated.
    """
    grid_scores, lengths, starts = _grid_layout(scores, lengths, starts)
    result = _softmax_grids(grid_scores, lengths, starts, _output(out, np.shape(scores)))
    return result.reshape(np.shape(scores))


def range_softmax_backward(
    probabilities: np.ndarray, dprobabilities: np.ndarray, lengths=None, starts=None, out: np.ndarray | None = None
) -> np.ndarray:
    """Score gradient of :func:`range_softmax_forward` from its output and the upstream gradient.

    ``out`` works as in :func:`range_softmax_forward`.
    """
    grid_probabilities, lengths, starts = _grid_layout(probabilities, lengths, starts)
    result = _softmax_grids_backward(
        grid_probabilities, dprobabilities, lengths, starts, _output(out, np.shape(probabilities))
    )
    return result.reshape(np.shape(probabilities))


def _output(out, shape):
    """A caller's output buffer viewed as grids, or None."""
    if out is None:
        return None
    if out.dtype != np.float64 or out.shape != tuple(shape) or not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidInputError(
            f"out must be a writable C-contiguous float64 array of shape {tuple(shape)}, "
            f"got {out.dtype} {out.shape}"
        )
    return out.reshape(-1, shape[-1], shape[-1])


def range_softmax(scores: Tensor, lengths=None, starts=None) -> Tensor:
    """Tape op of :func:`range_softmax_forward` over ``[..., T, T]`` score grids."""
    grid_scores, lengths, starts = _grid_layout(scores.value, lengths, starts)
    probabilities = _softmax_grids(grid_scores, lengths, starts)

    def backward(grad):
        dscores = _softmax_grids_backward(probabilities, grad, lengths, starts)
        scores.accumulate(dscores.reshape(scores.shape))

    return record(probabilities.reshape(scores.shape), (scores,), backward)


def _grid_layout(scores, lengths, starts):
    array = np.ascontiguousarray(scores, dtype=np.float64)
    if array.ndim < 2 or array.shape[-1] != array.shape[-2] or array.shape[-1] == 0:
        raise InvalidInputError(f"scores must be square grids [..., T, T] with T > 0, got shape {array.shape}")
    queries = array.shape[-1]
    grids = array.size // (queries * queries)
    lengths = _flatten_leading(lengths, array.shape[:-2], (grids,))
    starts = _flatten_leading(starts, array.shape[:-1], (grids, queries))
    lengths, starts = causal_layout(grids, queries, lengths, starts)
    return array.reshape(grids, queries, queries), lengths, starts


def _flatten_leading(values, shape, flat_shape):
    """Reshape ``values`` of ``shape`` to ``flat_shape``; any other shape is left for the check."""
    if values is None:
        return None
    values = np.asarray(values)
    return values.reshape(flat_shape) if values.shape == shape else values


def _softmax_grids(grid_scores, lengths, starts, out=None):
    probabilities = np.empty_like(grid_scores) if out is None else out  # [grids, T, T]
    _softmax.range_softmax_forward(grid_scores, lengths, starts, probabilities)
    return probabilities


def _softmax_grids_backward(probabilities, dprobabilities, lengths, starts, out=None):
    upstream = np.ascontiguousarray(dprobabilities, dtype=np.float64).reshape(probabilities.shape)
    dscores = np.empty_like(probabilities) if out is None else out  # [grids, T, T]
    _softmax.range_softmax_backward(probabilities, upstream, lengths, starts, dscores)
    return dscores


# --- attention ---


def causal_attention_with_ranges(q: Tensor, k: Tensor, v: Tensor, lengths, starts) -> Tensor:
    """Scaled range-causal attention of ``q, k, v`` ``[rows, (heads,) T, d]``.

    ``lengths`` ``[rows]`` and ``starts`` ``[rows, T]`` are shared by every head: valid
    query ``t`` of row ``r`` attends to keys ``[starts[r, t], t]``; queries at or past
    ``lengths[r]`` give a zero mixture. Scores are ``q @ k^T / sqrt(d)``.
    """
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    lengths, starts = _per_grid(q, lengths, starts)
    scores = scale(batched_matmul(q, swap_last_axes(k)), 1.0 / math.sqrt(q.shape[-1]))
    return batched_matmul(range_softmax(scores, lengths, starts), v)


def causal_attention_with_lengths(q: Tensor, k: Tensor, v: Tensor, lengths) -> Tensor:
    """Padded attention: valid prefix ``lengths`` ``[rows]``, every valid query sees keys ``[0, t]``."""
    return causal_attention_with_ranges(q, k, v, lengths, np.zeros(q.shape[:1] + q.shape[-2:-1], dtype=np.int32))


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Plain causal attention: every query of every row is valid."""
    return causal_attention_with_lengths(q, k, v, np.full(q.shape[0], q.shape[-2], dtype=np.int64))


def fused_range_attention(q: Tensor, k: Tensor, v: Tensor, lengths, starts) -> Tensor:
    """:func:`causal_attention_with_ranges` through ``seqpack.attention``'s edge-only kernel.

    ``q, k, v`` are ``[rows, heads, T, d]``; the kernel saves the output and per-query
    log-sum-exp and recomputes scores in the backward.
    """
    from . import attention

    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    lengths, starts = _per_row(q, lengths, starts)
    out, lse = attention.range_attention_forward(q.value, k.value, v.value, lengths, starts)

    def backward(grad):
        dq, dk, dv = attention.range_attention_backward(
            q.value, k.value, v.value, out, lse, np.ascontiguousarray(grad), lengths, starts
        )
        q.accumulate(dq)
        k.accumulate(dk)
        v.accumulate(dv)

    return record(out, (q, k, v), backward)


def _per_row(q: Tensor, lengths, starts) -> tuple[np.ndarray, np.ndarray]:
    """Check a per-row layout for ``q`` ``[rows, ..., T, d]`` (see :func:`causal_layout`)."""
    if q.value.ndim < 3 or q.shape[-1] == 0:
        raise InvalidInputError(f"attention inputs must be [rows, (heads,) T, d] with d > 0, got {q.shape}")
    return causal_layout(q.shape[0], q.shape[-2], lengths, starts)


def _per_grid(q: Tensor, lengths, starts) -> tuple[np.ndarray, np.ndarray]:
    """Repeat a per-row layout over the middle (head) axes, one entry per score grid."""
    lengths, starts = _per_row(q, lengths, starts)
    shared = int(np.prod(q.shape[1:-2], dtype=np.int64))
    return np.repeat(lengths, shared), np.repeat(starts, shared, axis=0)
