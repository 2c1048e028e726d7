"""Range attention: the fused edge-only kernels' numpy API, and attention ops on the tape.

The rule (ch05): in row ``r``, a valid query at column ``t < valid_lengths[r]`` attends
to exactly the keys ``segment_starts[r, t] .. t`` (inclusive); segments are contiguous,
so every query of a segment has the segment's first column as its start. Starts of
inactive queries (``t >= valid_lengths[r]``) are ignored. Inactive queries get a zero
output, a zero log-sum-exp and zero gradients, and their q/k/v never enter any valid
result. Scores are scaled by ``1/sqrt(head_dim)`` unless a ``scale`` is given. Query
heads may share key/value heads (grouped-query attention).

The kernels only visit permitted edges (see ``seqpack.nn._attention``); results are
bitwise identical for any thread count and CPU path. The compiled module is loaded on
first use, so ``import seqpack`` stays light.

On the tape (float64 :class:`~seqpack.nn.autograd.Tensor` values): the chapters' three
variants :func:`causal_attention_with_ranges` (per-row valid length and per-query
segment start, for packed rows), :func:`causal_attention_with_lengths` (valid prefix
only, for padded rows) and :func:`causal_attention` (every query valid), computed with
dense score grids and the range softmax; :func:`fused_range_attention` computes the
first with the edge-only kernels instead.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from .._arguments import regular_array
from .._threads import kernel_threads
from ..errors import InvalidInputError, OutOfMemoryError
from .autograd import Tensor, as_tensor, record
from .kernel_arguments import floats, layout_arrays, outputs, scale_of
from .ops import batched_matmul, scale, swap_last_axes
from .softmax import causal_layout, range_softmax

_kernels = None


def _kernel():
    global _kernels
    if _kernels is None:
        from . import _attention

        _kernels = _attention
    return _kernels


def _check_status(status, row, column, lengths, starts):
    """Raise the error a kernel's status (``seqpack.nn._attention.Status``) stands for,
    naming the first offending row and column; return for ``LAYOUT_OK``."""
    Status = _kernel().Status
    if status == Status.LAYOUT_OK:
        return
    if status == Status.OUT_OF_MEMORY:
        raise OutOfMemoryError("range attention could not allocate its work plan or scratch")
    width = starts.shape[1]
    start = starts[row, column] if width else 0
    previous = max(column - 1, 0)
    raise InvalidInputError({
        Status.BAD_LENGTH: f"valid_lengths[{row}] = {lengths[row]} is outside [0, {width}]",
        Status.BAD_START: f"segment_starts[{row}, {column}] = {start} for valid query {column} "
        f"of row {row} is outside [0, {column}]",
        Status.BROKEN_SEGMENT: f"segment_starts[{row}, {column}] = {start} neither starts a "
        f"segment at column {column} nor continues the segment of column {previous} (start "
        f"{starts[row, previous] if width else 0}): segments must be contiguous",
    }[status])


def segment_spans(valid_lengths, segment_starts) -> np.ndarray:
    """The segments of a layout as an ``[n, 3]`` intp array of (row, start, end), row order.

    ``end`` is exclusive; the kernels work per (row, head, segment). Raises
    :class:`InvalidInputError` for a layout that breaks the module's rule.
    """
    starts = regular_array("segment_starts", segment_starts)
    if starts.ndim != 2:
        raise InvalidInputError(f"segment_starts must be [rows, T], got shape {starts.shape}")
    rows, width = starts.shape
    lengths, starts = layout_arrays(valid_lengths, starts, rows, width)
    spans = np.empty((rows * width + 1, 3), dtype=np.intp)
    status, row, column, count = _kernel().plan_layout(lengths, starts, spans)
    _check_status(status, row, column, lengths, starts)
    return spans[:count].copy()


def range_attention_forward(q, k, v, valid_lengths, segment_starts, *, threads=None,
                            out=None, lse=None, scale=None):
    """Range attention: ``out = softmax(scale * q k^T) v`` over permitted keys.

    ``q``: ``[rows, heads, T, head_dim]``; ``k, v``: ``[rows, kv_heads, T, head_dim]``
    with ``heads`` a multiple of ``kv_heads`` (grouped-query attention: query head ``h``
    reads key/value head ``h // (heads // kv_heads)``; K and V are never repeated in
    memory); all float32 or all float64. Arrays whose last axis is contiguous and whose
    other strides are non-negative are used in place (e.g. ``x.transpose(0, 2, 1, 3)`` of
    ``[rows, T, heads, head_dim]`` storage: the cell stride is the tile products' row stride);
    others are copied to C order.
    ``valid_lengths`` ``[rows]`` and ``segment_starts`` ``[rows, T]``: any integer dtype.
    ``scale``: the score factor, None for ``1/sqrt(head_dim)`` (rounded to the dtype).
    Returns ``out`` ``[rows, heads, T, head_dim]`` and the per-query log-sum-exp of the
    scaled scores ``lse`` ``[rows, heads, T]`` (0 for inactive queries). ``out`` and
    ``lse`` may be given to skip fresh allocations: writeable, matching, strided as the
    inputs may be without a copy (so ``out`` can be a view of ``[rows, T, heads,
    head_dim]`` storage), and sharing no memory with itself, any input or each other. ``threads``: None for the default of
    ``seqpack._threads.default_threads()``; results do not depend on it. Ctrl-C
    interrupts the call (``KeyboardInterrupt``; outputs then undefined).
    """
    threads = kernel_threads(threads)
    given = {"q": q, "k": k, "v": v, "valid_lengths": valid_lengths, "segment_starts": segment_starts}
    q, k, v = floats(("q", "k", "v"), (q, k, v))
    rows, heads, width, head_dim = q.shape
    scale = scale_of(scale, head_dim, q.dtype)
    lengths, starts = layout_arrays(valid_lengths, segment_starts, rows, width)
    out, lse = outputs({"out": (out, q.shape), "lse": (lse, q.shape[:3])}, q.dtype, given)
    if out.size == 0:
        segment_spans(lengths, starts)
        lse.fill(0)
        return out, lse
    status, row, column = _kernel().forward(q, k, v, lengths, starts, out, lse, threads, scale)
    _check_status(status, row, column, lengths, starts)
    return out, lse


def range_attention_backward(q, k, v, out, lse, dout, valid_lengths, segment_starts, *,
                             threads=None, dq=None, dk=None, dv=None, scale=None):
    """Gradients ``dq`` (shaped as q) and ``dk, dv`` (shaped as k) of range attention,
    from the forward's ``out`` and ``lse``.

    ``dout`` is the gradient of the objective with respect to ``out``; everything else
    is as in :func:`range_attention_forward` (same dtype for all six arrays, the same
    ``scale``). With grouped-query heads, dK and dV of a key/value head sum over the
    query heads of its group in head order (the same bits for any thread count).
    Gradients are zero at inactive cells; ``dq, dk, dv`` may be given as buffers, strided
    as ``out`` may be (sharing no memory with themselves, any input or each other).
    """
    threads = kernel_threads(threads)
    given = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout,
             "valid_lengths": valid_lengths, "segment_starts": segment_starts}
    q, k, v, out, lse, dout = floats(
        ("q", "k", "v", "out", "lse", "dout"), (q, k, v, out, lse, dout)
    )
    rows, heads, width, head_dim = q.shape
    scale = scale_of(scale, head_dim, q.dtype)
    lengths, starts = layout_arrays(valid_lengths, segment_starts, rows, width)
    dq, dk, dv = outputs(
        {"dq": (dq, q.shape), "dk": (dk, k.shape), "dv": (dv, k.shape)}, q.dtype, given
    )
    if dq.size == 0:
        segment_spans(lengths, starts)
        dk.fill(0)
        dv.fill(0)
        return dq, dk, dv
    status, row, column = _kernel().backward(
        q, k, v, out, lse, dout, lengths, starts, dq, dk, dv, threads, scale
    )
    _check_status(status, row, column, lengths, starts)
    return dq, dk, dv


@contextlib.contextmanager
def _profile():
    """Time the kernels called inside the block: a dict, filled when the block ends, of
    thread-seconds per bucket (``forward_gemm``, ``forward_other``, ``dS_gemm``, ...,
    ``dV_other``: tile products against everything else per phase, and each pass's
    ``*_setup`` on the calling thread). Off by default; results are bitwise unchanged.
    Not thread-safe: for benchmarks and tests."""
    kernel = _kernel()
    report = {}
    kernel.profile_start()
    try:
        yield report
    finally:
        report.update(kernel.profile_stop())


# --- on the autograd tape ---


def causal_attention_with_ranges(q: Tensor, k: Tensor, v: Tensor, lengths, starts) -> Tensor:
    """Scaled range-causal attention of ``q, k, v`` ``[rows, (heads,) T, d]``.

    ``lengths`` ``[rows]`` and ``starts`` ``[rows, T]`` are shared by every head: valid
    query ``t`` of row ``r`` attends to keys ``[starts[r, t], t]``; queries at or past
    ``lengths[r]`` give a zero mixture. Scores are ``q @ k^T / sqrt(d)``.

    The products are dense over each row, and ``0 * NaN`` is NaN: padding is zeroed first,
    and a non-finite q, k or v in a valid cell is an error (it would reach the other
    segments of its row; the fused kernels never read across segments).
    """
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    lengths, starts = _per_row(q, lengths, starts)
    _check_keys_values(q, k, v)
    rows, width = q.shape[0], q.shape[-2]
    keep = (np.arange(width) < lengths[:, None]).reshape((rows,) + (1,) * (q.value.ndim - 3) + (width, 1))
    q, k, v = (_keep_cells(x, keep) for x in (q, k, v))
    for name, x in (("q", q), ("k", k), ("v", v)):
        bad = np.argwhere(~np.isfinite(x.value))
        if bad.size:
            raise InvalidInputError(
                f"{name} holds {x.value[tuple(bad[0])]} at row {bad[0][0]}, cell {bad[0][-2]}: the reference "
                "attention needs finite values in valid cells (its dense products would carry it into "
                "other segments)"
            )
    shared = int(np.prod(q.shape[1:-2], dtype=np.int64))
    lengths, starts = np.repeat(lengths, shared), np.repeat(starts, shared, axis=0)
    scores = scale(batched_matmul(q, swap_last_axes(k)), 1.0 / math.sqrt(q.shape[-1]))
    # The output's gradient at an inactive query is dropped: a NaN there would reach dv.
    return _keep_cells(batched_matmul(range_softmax(scores, lengths, starts), v), keep)


def _check_keys_values(q: Tensor, k: Tensor, v: Tensor) -> None:
    """``k`` and ``v`` must have q's rows and T (and k q's d); a head axis may be 1 (shared)."""
    for name, x in (("k", k), ("v", v)):
        shape = x.shape
        if (len(shape) != len(q.shape) or shape[0] != q.shape[0] or shape[-2] != q.shape[-2]
                or (name == "k" and shape[-1] != q.shape[-1])
                or any(a not in (b, 1) for a, b in zip(shape[1:-2], q.shape[1:-2]))):
            raise InvalidInputError(
                f"{name} has shape {shape}; expected [rows, (heads,) T, d] matching q {q.shape}"
            )


def _keep_cells(x: Tensor, keep: np.ndarray) -> Tensor:
    """``x`` where ``keep`` (broadcast) is true, exact zeros elsewhere, zero gradient there."""

    def backward(grad):
        x.accumulate(np.where(keep, grad, 0.0))

    return record(np.where(keep, x.value, 0.0), (x,), backward)


def causal_attention_with_lengths(q: Tensor, k: Tensor, v: Tensor, lengths) -> Tensor:
    """Padded attention: valid prefix ``lengths`` ``[rows]``, every valid query sees keys ``[0, t]``."""
    return causal_attention_with_ranges(q, k, v, lengths, np.zeros(q.shape[:1] + q.shape[-2:-1], dtype=np.int32))


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Plain causal attention: every query of every row is valid."""
    return causal_attention_with_lengths(q, k, v, np.full(q.shape[0], q.shape[-2], dtype=np.int64))


def fused_range_attention(q: Tensor, k: Tensor, v: Tensor, lengths, starts) -> Tensor:
    """:func:`causal_attention_with_ranges` through the edge-only kernel above.

    ``q, k, v`` are ``[rows, heads, T, d]``; the kernel saves the output and per-query
    log-sum-exp and recomputes scores in the backward.
    """
    q, k, v = as_tensor(q), as_tensor(k), as_tensor(v)
    lengths, starts = _per_row(q, lengths, starts)
    out, lse = range_attention_forward(q.value, k.value, v.value, lengths, starts)

    def backward(grad):
        dq, dk, dv = range_attention_backward(
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

