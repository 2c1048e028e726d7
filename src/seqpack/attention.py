"""Fused range attention over a batch's valid lengths and per-query segment starts.

The rule (ch05): in row ``r``, a valid query at column ``t < valid_lengths[r]`` attends
to exactly the keys ``segment_starts[r, t] .. t`` (inclusive); segments are contiguous,
so every query of a segment has the segment's first column as its start. Starts of
inactive queries (``t >= valid_lengths[r]``) are ignored. Inactive queries get a zero
output, a zero log-sum-exp and zero gradients, and their q/k/v never enter any valid
result. Scores are scaled by ``1/sqrt(head_dim)``.

The kernels only visit permitted edges (see ``seqpack._attention``); results are
bitwise identical for any thread count. The compiled module (and scipy's BLAS behind
it) is loaded on first use, so ``import seqpack`` stays light.
"""

from __future__ import annotations

import numpy as np

from ._threads import kernel_threads
from .errors import InvalidInputError

__all__ = ["range_attention_backward", "range_attention_forward", "segment_spans"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_INTP = np.dtype(np.intp)
# Kernel status codes (see seqpack._attention) and the messages they become.
_LAYOUT_ERRORS = {
    1: "valid_lengths[{row}] = {length} is outside [0, {width}]",
    2: "segment_starts[{row}, {column}] = {start} for valid query {column} of row {row} "
    "is outside [0, {column}]",
    3: "segment_starts[{row}, {column}] = {start} neither starts a segment at column "
    "{column} nor continues the segment of column {previous} (start {previous_start}): "
    "segments must be contiguous",
}
_OUT_OF_MEMORY = 4
_kernels = None


def _kernel():
    global _kernels
    if _kernels is None:
        from . import _attention

        _kernels = _attention
    return _kernels


def _thread_count(threads) -> int:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, (int, np.integer))
                                or threads < 1):
        raise InvalidInputError(f"threads must be an integer >= 1, got {threads!r}")
    return kernel_threads(None if threads is None else int(min(threads, 1 << 16)))


def _layout_arrays(valid_lengths, segment_starts, rows: int, width: int):
    """Integer layout arrays coerced to C-contiguous intp after shape and dtype checks."""
    lengths = np.asarray(valid_lengths)
    starts = np.asarray(segment_starts)
    if lengths.dtype.kind not in "iu":
        raise InvalidInputError(f"valid_lengths must have an integer dtype, got {lengths.dtype}")
    if starts.dtype.kind not in "iu":
        raise InvalidInputError(f"segment_starts must have an integer dtype, got {starts.dtype}")
    if lengths.shape != (rows,):
        raise InvalidInputError(f"valid_lengths has shape {lengths.shape}; expected ({rows},)")
    if starts.shape != (rows, width):
        raise InvalidInputError(
            f"segment_starts has shape {starts.shape}; expected ({rows}, {width})"
        )
    if lengths.dtype != _INTP or not lengths.flags.c_contiguous:
        lengths = np.ascontiguousarray(lengths, dtype=_INTP)
    if starts.dtype != _INTP or not starts.flags.c_contiguous:
        starts = np.ascontiguousarray(starts, dtype=_INTP)
    return lengths, starts


def _raise_for(status, row, column, lengths, starts):
    if status == _OUT_OF_MEMORY:
        raise MemoryError("range attention could not allocate its work plan or scratch")
    width = starts.shape[1]
    previous = max(column - 1, 0)
    raise InvalidInputError(
        _LAYOUT_ERRORS[status].format(
            row=row,
            column=column,
            length=lengths[row],
            width=width,
            start=starts[row, column] if width else 0,
            previous=previous,
            previous_start=starts[row, previous] if width else 0,
        )
    )


def segment_spans(valid_lengths, segment_starts) -> np.ndarray:
    """The segments of a layout as an ``[n, 3]`` intp array of (row, start, end), row order.

    ``end`` is exclusive; the kernels work per (row, head, segment). Raises
    :class:`InvalidInputError` for a layout that breaks the module's rule.
    """
    starts = np.asarray(segment_starts)
    if starts.ndim != 2:
        raise InvalidInputError(f"segment_starts must be [rows, T], got shape {starts.shape}")
    rows, width = starts.shape
    lengths, starts = _layout_arrays(valid_lengths, starts, rows, width)
    spans = np.empty((rows * width + 1, 3), dtype=_INTP)
    status, row, column, count = _kernel().plan_layout(lengths, starts, spans)
    if status:
        _raise_for(status, row, column, lengths, starts)
    return spans[:count].copy()


def _floats(names, arrays):
    """Same-dtype float32/float64 arrays in C order with the shape of the first (4-D)."""
    # Plain loops and attribute checks: this runs on every call, tiny inputs included.
    first = arrays[0] if type(arrays[0]) is np.ndarray else np.asarray(arrays[0])
    dtype, shape = first.dtype, first.shape
    if dtype not in _FLOATS:
        raise InvalidInputError(f"q must be float32 or float64, got {dtype}")
    if len(shape) != 4:
        raise InvalidInputError(f"q must be [rows, heads, T, head_dim], got shape {shape}")
    if shape[3] < 1:
        raise InvalidInputError("head_dim must be at least 1")
    coerced = []
    for name, array in zip(names, arrays):
        if type(array) is not np.ndarray:
            array = np.asarray(array)
        if array.dtype != dtype:
            raise InvalidInputError(f"{name} has dtype {array.dtype}; q has {dtype}")
        if array.shape != (shape[:3] if name == "lse" else shape):
            expected = shape[:3] if name == "lse" else shape
            raise InvalidInputError(f"{name} has shape {array.shape}; expected {expected}")
        coerced.append(array if array.flags.c_contiguous else np.ascontiguousarray(array))
    return coerced


def _output(name, given, shape, dtype):
    """A caller's output buffer after checks, or a fresh one."""
    if given is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(given, np.ndarray):
        raise InvalidInputError(f"{name} must be a numpy array, got {type(given).__name__}")
    if given.shape != shape or given.dtype != dtype:
        raise InvalidInputError(
            f"{name} has shape {given.shape} and dtype {given.dtype}; expected {shape} {dtype}"
        )
    if not (given.flags.c_contiguous and given.flags.writeable):
        raise InvalidInputError(f"{name} must be C-contiguous and writeable")
    return given


def range_attention_forward(q, k, v, valid_lengths, segment_starts, *, threads=None,
                            out=None, lse=None):
    """Range attention: ``out = softmax(q k^T / sqrt(head_dim)) v`` over permitted keys.

    ``q, k, v``: ``[rows, heads, T, head_dim]``, all float32 or all float64 (any
    strides; copied to C order when needed). ``valid_lengths`` ``[rows]`` and
    ``segment_starts`` ``[rows, T]``: any integer dtype. Returns ``out``
    ``[rows, heads, T, head_dim]`` and the per-query log-sum-exp of the scaled scores
    ``lse`` ``[rows, heads, T]`` (0 for inactive queries). ``out`` and ``lse`` may be
    given (C-contiguous, writeable, matching) to skip fresh allocations. ``threads``:
    OpenMP threads, None for all available cores (always 1 in a forked child);
    results do not depend on it.
    """
    threads = _thread_count(threads)
    q, k, v = _floats(("q", "k", "v"), (q, k, v))
    rows, heads, width, _ = q.shape
    lengths, starts = _layout_arrays(valid_lengths, segment_starts, rows, width)
    out = _output("out", out, q.shape, q.dtype)
    lse = _output("lse", lse, q.shape[:3], q.dtype)
    if out.size == 0:
        segment_spans(lengths, starts)
        lse.fill(0)
        return out, lse
    status, row, column = _kernel().forward(q, k, v, lengths, starts, out, lse, threads)
    if status:
        _raise_for(status, row, column, lengths, starts)
    return out, lse


def range_attention_backward(q, k, v, out, lse, dout, valid_lengths, segment_starts, *,
                             threads=None, dq=None, dk=None, dv=None):
    """Gradients ``dq, dk, dv`` of range attention from the forward's ``out`` and ``lse``.

    ``dout`` is the gradient of the objective with respect to ``out``; everything else
    is as in :func:`range_attention_forward` (same dtype for all six arrays). Gradients
    are zero at inactive cells; ``dq, dk, dv`` may be given as buffers.
    """
    threads = _thread_count(threads)
    q, k, v, out, lse, dout = _floats(
        ("q", "k", "v", "out", "lse", "dout"), (q, k, v, out, lse, dout)
    )
    rows, heads, width, _ = q.shape
    lengths, starts = _layout_arrays(valid_lengths, segment_starts, rows, width)
    dq = _output("dq", dq, q.shape, q.dtype)
    dk = _output("dk", dk, q.shape, q.dtype)
    dv = _output("dv", dv, q.shape, q.dtype)
    if dq.size == 0:
        segment_spans(lengths, starts)
        return dq, dk, dv
    status, row, column = _kernel().backward(
        q, k, v, out, lse, dout, lengths, starts, dq, dk, dv, threads
    )
    if status:
        _raise_for(status, row, column, lengths, starts)
    return dq, dk, dv
