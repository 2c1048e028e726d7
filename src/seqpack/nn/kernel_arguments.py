"""The range-attention kernels' array arguments, checked and coerced once.

What the kernels take, and trust: q, k, v (and the backward's out, lse, dout) of one
float dtype, shaped ``[rows, heads, T, head_dim]`` and ``[rows, kv_heads, T, head_dim]``
with ``heads`` a multiple of ``kv_heads``, each used in place when its last axis is
contiguous and its other strides non-negative (else copied to C order); integer layout
arrays as C-contiguous intp; a finite scale that stays finite in the dtype; and output
buffers that are writeable, strided as an input may be, and share no memory with
themselves, an input or each other.
"""

from __future__ import annotations

import math

import numpy as np

from .._arguments import check_disjoint, check_scale, integer_array, query_starts, regular_array
from ..errors import InvalidInputError

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_INTP = np.dtype(np.intp)

#: The largest head_dim (``seqpack.nn._attention.MAX_HEAD_DIM``): query tiles shrink as
#: head_dim grows so that a tile's operands stay in cache, down to 8 queries at this size.
MAX_HEAD_DIM = 4096


def layout_arrays(valid_lengths, segment_starts, rows: int, width: int):
    """Integer layout arrays coerced to C-contiguous intp after shape and dtype checks."""
    lengths = regular_array("valid_lengths", valid_lengths)
    starts = regular_array("segment_starts", segment_starts)
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
    lengths = integer_array("valid_lengths", lengths, _INTP)
    return lengths, query_starts("segment_starts", starts, lengths, _INTP)


def floats(names, arrays):
    """Same-dtype float32/float64 arrays the kernels can read where they are (others are
    copied to C order): ``q`` and what is shaped like it ([rows, heads, T, head_dim];
    ``lse`` [rows, heads, T]), ``k``, ``v`` shaped like ``k`` ([rows, kv_heads, T,
    head_dim] with ``heads`` a multiple of ``kv_heads``)."""
    # Plain loops and attribute checks: this runs on every call, tiny inputs included.
    first = _native(names[0], arrays[0])
    dtype, shape = first.dtype, first.shape
    if dtype not in _FLOATS:
        raise InvalidInputError(f"q must be float32 or float64, got {dtype}")
    if len(shape) != 4:
        raise InvalidInputError(f"q must be [rows, heads, T, head_dim], got shape {shape}")
    if shape[3] < 1:
        raise InvalidInputError("head_dim must be at least 1")
    if shape[3] > MAX_HEAD_DIM:
        raise InvalidInputError(
            f"head_dim {shape[3]} exceeds {MAX_HEAD_DIM}: past it even a tile of 8 queries no longer "
            f"fits the kernel's cache budget"
        )
    coerced = []
    kv_shape = None
    for name, array in zip(names, arrays):
        array = _native(name, array)
        if array.dtype != dtype:
            raise InvalidInputError(f"{name} has dtype {array.dtype}; q has {dtype}")
        if name == "k":
            kv_shape = _kv_shape(array.shape, shape)
        expected = shape[:3] if name == "lse" else kv_shape if name in _KV_NAMES else shape
        if array.shape != expected:
            raise InvalidInputError(f"{name} has shape {array.shape}; expected {expected}")
        flags = array.flags
        in_place = (flags.c_contiguous and flags.aligned) or _in_place(array)
        coerced.append(array if in_place else np.ascontiguousarray(array))
    return coerced


def _native(name: str, values) -> np.ndarray:
    """``values`` as an array, floats in this machine's byte order (a byte-swapped one copied)."""
    array = values if type(values) is np.ndarray else regular_array(name, values)
    if array.dtype.kind == "f" and not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    return array


# The arrays shaped like k: [rows, kv_heads, T, head_dim].
_KV_NAMES = ("k", "v", "dk", "dv")


def _kv_shape(kv_shape, q_shape):
    """``k``'s shape after the grouped-query check: its head count divides q's."""
    if len(kv_shape) != 4 or kv_shape[:1] + kv_shape[2:] != q_shape[:1] + q_shape[2:]:
        raise InvalidInputError(
            f"k has shape {kv_shape}; expected (rows, kv_heads, T, head_dim) = "
            f"({q_shape[0]}, kv_heads, {q_shape[2]}, {q_shape[3]}) as q {q_shape}"
        )
    heads, kv_heads = q_shape[1], kv_shape[1]
    if heads % kv_heads if kv_heads else heads:
        raise InvalidInputError(
            f"q has {heads} heads, not a multiple of the {kv_heads} key/value heads of k"
        )
    return kv_shape


def scale_of(scale, head_dim: int, dtype) -> float:
    """The score scale as a Python float: ``1/sqrt(head_dim)`` for None, else finite, also
    once rounded to ``dtype`` (the kernels multiply in it)."""
    value = check_scale("scale", scale)
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    with np.errstate(over="ignore"):
        rounded = dtype.type(value)
    if not np.isfinite(rounded):
        raise InvalidInputError(f"scale {value} overflows {dtype} (the dtype of q)")
    return value


def _in_place(array: np.ndarray) -> bool:
    """Whether the kernels take ``array`` as it is: aligned, its last axis contiguous, its
    other strides non-negative multiples of the item size, and for [rows, heads, T,
    head_dim] a cell stride (the row stride of the tile products) of at least head_dim
    elements. Axes of length 1 have no stride that matters."""
    if not array.flags.aligned:
        return False
    if array.flags.c_contiguous:
        return True
    itemsize, shape, strides = array.itemsize, array.shape, array.strides
    if shape[-1] > 1 and strides[-1] != itemsize:
        return False
    for length, stride in zip(shape[:-1], strides[:-1]):
        if length > 1 and (stride < 0 or stride % itemsize):
            return False
    return len(shape) != 4 or shape[2] < 2 or shape[3] * itemsize <= strides[2]


def _overlaps_itself(array: np.ndarray) -> bool:
    """Whether two elements of ``array`` may share memory (judged from its strides: each
    axis, shortest stride first, must step past everything the shorter ones span)."""
    if array.size == 0:
        return False
    span = array.itemsize
    for stride, length in sorted((stride, length) for length, stride in zip(array.shape, array.strides) if length > 1):
        if stride < span:
            return True
        span = stride * (length - 1) + span
    return False


def outputs(specs: dict, dtype, inputs: dict) -> list:
    """Output arrays: each caller's buffer after checks (shape, dtype, writeable, strides
    the kernels take, no memory shared with itself, an input or another output), a fresh
    C-ordered array for the rest.

    ``specs`` maps each output's name to ``(given or None, shape)``.
    """
    for name, (given, shape) in specs.items():
        if given is None:
            continue
        if not isinstance(given, np.ndarray):
            raise InvalidInputError(f"{name} must be a numpy array, got {type(given).__name__}")
        if given.shape != shape or given.dtype != dtype:
            raise InvalidInputError(
                f"{name} has shape {given.shape} and dtype {given.dtype}; expected {shape} {dtype}"
            )
        flags = given.flags
        if not (flags.writeable and ((flags.c_contiguous and flags.aligned) or _in_place(given))):
            raise InvalidInputError(
                f"{name} must be writeable, with a contiguous last axis and non-negative, "
                f"aligned strides; got strides {given.strides}"
            )
        if not flags.c_contiguous and _overlaps_itself(given):
            raise InvalidInputError(f"{name} overlaps itself in memory (strides {given.strides})")
    check_disjoint({name: given for name, (given, _) in specs.items()}, inputs)
    return [np.empty(shape, dtype=dtype) if given is None else given for given, shape in specs.values()]
