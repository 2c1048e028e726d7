"""The range causal softmax: a valid query normalizes over keys ``[start, query]`` only.

``range_softmax_forward`` / ``range_softmax_backward`` are the numpy API over square
score grids ``[..., T, T]`` (the compiled kernels behind them never read an entry
outside a permitted range, so NaN there is harmless; inactive queries give exactly
zero rows); ``range_softmax`` is the same as an op on the autograd tape.
"""

from __future__ import annotations

import numpy as np

from .._arguments import check_disjoint, integer_array, query_starts, regular_array
from ..errors import InvalidInputError
from . import _softmax
from .autograd import Tensor, record


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
    try:
        starts = np.asarray(starts)
    except (ValueError, TypeError) as error:  # ragged nesting
        raise InvalidInputError(f"starts is not a regular array: {error}") from None
    if starts.shape != (grids, queries):
        raise InvalidInputError(
            f"expected range starts of shape {(grids, queries)} (one per query), got {starts.shape}"
        )
    starts = query_starts("starts", starts, lengths, np.int64)
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
    return integer_array(name, values, np.int64)


def _grids(name: str, values) -> np.ndarray:
    """Real ``values`` as C-contiguous float64 (complex, bool and non-numeric rejected)."""
    array = regular_array(name, values)
    if array.dtype.kind not in "fiu":
        raise InvalidInputError(f"{name} must hold real numbers, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype=np.float64)


def range_softmax_forward(scores: np.ndarray, lengths=None, starts=None, out: np.ndarray | None = None) -> np.ndarray:
    """Range causal softmax of float64 ``scores`` ``[..., T, T]``.

    ``lengths`` holds one valid prefix length per grid (``scores.shape[:-2]``) and
    ``starts`` one first key column per query (``scores.shape[:-1]``); see
    :func:`causal_layout`. ``out`` (C-contiguous float64, the shape of ``scores``,
    sharing no memory with the inputs) is written in full and returned; by default a
    new array is allocated.
    """
    check_disjoint({"out": out}, {"scores": scores, "lengths": lengths, "starts": starts})
    grid_scores, lengths, starts = _grid_layout(_grids("scores", scores), lengths, starts)
    result = _softmax_grids(grid_scores, lengths, starts, _output(out, grid_scores.shape, np.shape(scores)))
    return result.reshape(np.shape(scores))


def range_softmax_backward(
    probabilities: np.ndarray, dprobabilities: np.ndarray, lengths=None, starts=None, out: np.ndarray | None = None
) -> np.ndarray:
    """Score gradient of :func:`range_softmax_forward` from its output and the upstream gradient.

    ``out`` works as in :func:`range_softmax_forward`.
    """
    check_disjoint({"out": out}, {"probabilities": probabilities, "dprobabilities": dprobabilities,
                                  "lengths": lengths, "starts": starts})
    grid_probabilities, lengths, starts = _grid_layout(probabilities, lengths, starts, "probabilities")
    upstream = _grids("dprobabilities", dprobabilities)
    if upstream.shape != np.shape(probabilities):
        raise InvalidInputError(
            f"dprobabilities has shape {upstream.shape}; probabilities have {np.shape(probabilities)}"
        )
    result = _softmax_grids_backward(
        grid_probabilities, upstream, lengths, starts, _output(out, grid_probabilities.shape, np.shape(probabilities))
    )
    return result.reshape(np.shape(probabilities))


def _output(out, grid_shape, shape):
    """A caller's output buffer viewed as grids, or None."""
    if out is None:
        return None
    if (not isinstance(out, np.ndarray) or out.dtype != np.float64 or out.shape != tuple(shape)
            or not out.flags.c_contiguous or not out.flags.writeable):
        raise InvalidInputError(
            f"out must be a writable C-contiguous float64 array of shape {tuple(shape)}, got "
            f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}"
        )
    return out.reshape(grid_shape)


def range_softmax(scores: Tensor, lengths=None, starts=None) -> Tensor:
    """Tape op of :func:`range_softmax_forward` over ``[..., T, T]`` score grids."""
    grid_scores, lengths, starts = _grid_layout(scores.value, lengths, starts)
    probabilities = _softmax_grids(grid_scores, lengths, starts)

    def backward(grad):
        dscores = _softmax_grids_backward(probabilities, grad, lengths, starts)
        scores.accumulate(dscores.reshape(scores.shape))

    return record(probabilities.reshape(scores.shape), (scores,), backward)


def _grid_layout(grids, lengths, starts, name: str = "scores"):
    """``grids`` (named ``name``) as [grids, T, T] with its layout checked and flattened alike."""
    array = _grids(name, grids)
    if array.ndim < 2 or array.shape[-1] != array.shape[-2] or array.shape[-1] == 0:
        raise InvalidInputError(f"{name} must be square grids [..., T, T] with T > 0, got shape {array.shape}")
    queries = array.shape[-1]
    grids = array.size // (queries * queries)
    lengths = _flatten_leading("lengths", lengths, array.shape[:-2], (grids,))
    starts = _flatten_leading("starts", starts, array.shape[:-1], (grids, queries))
    lengths, starts = causal_layout(grids, queries, lengths, starts)
    return array.reshape(grids, queries, queries), lengths, starts


def _flatten_leading(name: str, values, shape, flat_shape):
    """Reshape ``values`` of ``shape`` to ``flat_shape``; any other shape is left for the check."""
    if values is None:
        return None
    values = regular_array(name, values)
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
