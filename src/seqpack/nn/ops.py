"""Differentiable ops on the :mod:`seqpack.nn.autograd` tape: linear algebra, norms, embedding, rotary.

Every op takes and returns :class:`~seqpack.nn.autograd.Tensor` values (float64) and
records a backward that adds into its parents' gradients. The embedding calls the
compiled masked gather and scatter: PAD_CELL cells get zero rows and are never read
from or written to the table. Attention lives in :mod:`seqpack.nn.attention`, the range
causal softmax in :mod:`seqpack.nn.softmax`.
"""

from __future__ import annotations

import numpy as np

from .._arguments import INT32_MAX, regular_array
from ..errors import InvalidInputError
from . import _embedding
from .autograd import Tensor, as_tensor, record

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
        a.accumulate(_summed_to(grad @ np.swapaxes(b.value, -1, -2), a.shape))
        b.accumulate(_summed_to(np.swapaxes(a.value, -1, -2) @ grad, b.shape))

    return record(a.value @ b.value, (a, b), backward)


def _summed_to(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``grad`` summed over the axes along which an operand of ``shape`` was broadcast."""
    grad = grad.sum(axis=tuple(range(grad.ndim - len(shape)))) if grad.ndim > len(shape) else grad
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=axes, keepdims=True) if axes else grad


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
    """Rows of ``table`` ``[V, D]`` for integer ``ids`` ``[...]``; PAD_CELL cells give zero
    rows. Every ID is checked before any lookup (:func:`check_token_ids`)."""
    if len(table.shape) != 2:
        raise InvalidInputError(f"the embedding table must be [V, D], got shape {table.shape}")
    ids = check_token_ids(ids, table.shape[0])
    flat = ids.reshape(-1)
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
    array = regular_array("token IDs", ids)
    if array.dtype.kind not in "iu":
        raise InvalidInputError(f"token IDs must be integers, got dtype {array.dtype}")
    if vocabulary_size > INT32_MAX:  # (IDs are looked up as int32)
        raise InvalidInputError(f"the vocabulary has {vocabulary_size} entries; the embedding takes at most "
                                f"{INT32_MAX}")
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
