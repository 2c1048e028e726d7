"""Token ranges gathered into one array, back to back or each at a given place (``pyx/packing/_gather.pyx``)."""

from __future__ import annotations

import numpy as np

from .._arguments import INT64_MAX, check_disjoint, integer_array
from ..errors import InvalidInputError
from . import _gather

TOKEN_DTYPES = (np.dtype(np.uint16), np.dtype(np.int32))


def gather_ranges(source: np.ndarray, begins, ends, dtype=np.int32, out: np.ndarray | None = None,
                  at=None) -> np.ndarray:
    """``source[begins[i]:ends[i]]`` for every ``i`` in one ``dtype`` array: back to back,
    or range ``i`` at ``out[at[i]:]``.

    ``source`` is a 1-D uint16 or int32 array (a memory map too); ``dtype`` is uint16 or
    int32 (a uint16 result must hold every gathered value: the caller knows its
    vocabulary). ``out``, when given, is a writable C-contiguous ``dtype`` array: exactly
    the gathered length, or with ``at`` long enough for every range at its place. Every
    range must lie inside ``source``, and ``out`` must not overlap it.
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
    at_given = at
    if at is None:
        at = np.zeros(begins.shape[0], dtype=np.int64)
        np.cumsum(lengths[:-1], out=at[1:])
        need = int(lengths.sum())
    else:
        at = integer_array("at", at, np.int64, 1)
        if at.shape != begins.shape or (at.size and at.min() < 0):
            raise InvalidInputError("at must hold one non-negative place per range")
        past = np.flatnonzero(at > INT64_MAX - lengths)  # at + lengths would wrap
        if past.size:
            i = int(past[0])
            raise InvalidInputError(f"range {i} at place {at[i]} would end past {INT64_MAX}")
        _check_places_disjoint(at, lengths)
        need = int((at + lengths).max()) if at.size else 0
    if out is None:
        # With places, cells between ranges belong to none: zeros, never uninitialized memory.
        out = np.empty(need, dtype=dtype) if at_given is None else np.zeros(need, dtype=dtype)
    elif not isinstance(out, np.ndarray) or out.dtype != dtype or out.ndim != 1 or out.shape[0] < need \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidInputError(f"out must be a writable C-contiguous {dtype} array of at least {need} tokens")
    # The caller's source, not a contiguous copy of it, is what ``out`` must not overlap.
    check_disjoint({"out": out}, {"source": source, "begins": begins, "ends": ends, "at": at})
    source = np.ascontiguousarray(source)
    _gather.gather_ranges(source, begins, ends, out, at)
    return out


def _check_places_disjoint(at: np.ndarray, lengths: np.ndarray) -> None:
    """No two non-empty ranges may be placed over the same cells of ``out``."""
    ranges = np.flatnonzero(lengths > 0)
    if ranges.size < 2:
        return
    places = at[ranges]
    if np.any(places[1:] < places[:-1]):
        ranges = ranges[np.argsort(places, kind="stable")]
        places = at[ranges]
    clash = np.flatnonzero(places[:-1] + lengths[ranges[:-1]] > places[1:])
    if clash.size:
        i, j = int(ranges[clash[0]]), int(ranges[clash[0] + 1])
        raise InvalidInputError(
            f"range {i} at place {at[i]} ({lengths[i]} tokens) overlaps range {j} at place {at[j]} in out"
        )
