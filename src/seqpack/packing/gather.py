"""Token ranges gathered back to back, in the order given (see ``pyx/packing/_gather.pyx``)."""

from __future__ import annotations

import numpy as np

from .._limits import integer_array
from ..errors import InvalidInputError
from . import _gather

TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.int32))


def gather_ranges(source: np.ndarray, begins, ends, dtype=np.int32, out: np.ndarray | None = None) -> np.ndarray:
    """``source[begins[i]:ends[i]]`` for every ``i``, back to back in one ``dtype`` array.

    ``source`` is a 1-D uint16 or int32 array (a memory map too); ``dtype`` is uint16 or
    int32 (a uint16 result must hold every gathered value: the caller knows its
    vocabulary). ``out``, when given, is a C-contiguous ``dtype`` array of exactly the
    gathered length. Every range must lie inside ``source``.
    """
    dtype = np.dtype(dtype)
    if not isinstance(source, np.ndarray) or source.ndim != 1 or source.dtype not in TOKEN_DTYPES:
        raise InvalidInputError("source must be a 1-D uint16 or int32 array")
    if dtype not in TOKEN_DTYPES:
        raise InvalidInputError(f"dtype must be uint16 or int32, not {dtype}")
    begins = integer_array("begins", begins, np.int64, 1)
    ends = integer_array("ends", ends, np.int64, 1)
    if begins.shape != ends.shape:
        raise InvalidInputError(f"begins has {begins.shape[0]} entries, ends {ends.shape[0]}")
    lengths = ends - begins
    bad = np.flatnonzero((begins < 0) | (lengths < 0) | (ends > source.shape[0]))
    if bad.size:
        i = int(bad[0])
        raise InvalidInputError(
            f"range {i} [{begins[i]}, {ends[i]}) is not inside the source of {source.shape[0]} tokens"
        )
    total = int(lengths.sum())
    if out is None:
        out = np.empty(total, dtype=dtype)
    elif not isinstance(out, np.ndarray) or out.dtype != dtype or out.shape != (total,) \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidInputError(f"out must be a writable C-contiguous {dtype} array of {total} tokens")
    _gather.gather_ranges(np.ascontiguousarray(source), begins, ends, out)
    return out
