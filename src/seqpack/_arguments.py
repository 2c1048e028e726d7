"""Argument checks and integer limits shared by every layer.

Sizes and limits are normalized to Python ``int`` where they enter the library (a
config's constructor, a public function's arguments), so every later check and byte
count is exact arithmetic: a numpy ``int32`` capacity never overflows a product.
"""

from __future__ import annotations

import math
import numbers
import operator

import numpy as np

from .errors import BatchIndexError, InvalidInputError

#: What np.shares_memory raises when deciding would take too long (``numpy.exceptions``,
#: where it lives, is numpy 1.25 and later; numpy 1.24 has it at the top level).
_TOO_HARD = getattr(np, "exceptions", np).TooHardError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
#: The memory budget of a config or call that names none: 8 GiB.
DEFAULT_MEMORY_BYTES = 8 * 2**30


def is_int(value: object) -> bool:
    """True for Python and numpy integers, False for bool and everything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def shown(value: object) -> str:
    """``value`` for an error message: its repr, but an int too long for Python to print
    (past 4300 digits ``str`` raises a ValueError) named by its size."""
    if is_int(value) and abs(int(value)).bit_length() > 10_000:
        return f"{'a negative' if value < 0 else 'an'} int of {abs(int(value)).bit_length()} bits"
    return repr(value)


def check_int(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as a Python int in ``[minimum, maximum]``, else :class:`InvalidInputError`."""
    if not is_int(value):
        raise InvalidInputError(f"{name} must be an int, got {type(value).__name__}")
    value = operator.index(value)
    if value < minimum:
        raise InvalidInputError(f"{name} must be at least {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise InvalidInputError(f"{name} is {shown(value)}; the maximum is {maximum}")
    return value


def batch_number(number: object, count: int, owner: str) -> int:
    """``number`` as a Python int in ``[0, count)``, else :class:`BatchIndexError` naming
    ``owner``'s batches (a bool or a float is no batch number)."""
    if not is_int(number):
        raise BatchIndexError(f"batch {number!r} is a {type(number).__name__}, not an int: {owner}'s batches "
                              f"are numbered [0, {count})")
    if not 0 <= number < count:
        raise BatchIndexError(f"batch {shown(number)} is outside {owner}'s batches [0, {count})")
    return operator.index(number)


def batch_index(index: object, count: int, owner: str) -> int:
    """A sequence's index: as :func:`batch_number`, a negative one counting from the end."""
    if is_int(index) and -count <= index < 0:
        return operator.index(index) + count
    return batch_number(index, count, owner)


def batch_range(index: slice, count: int, owner: str) -> range:
    """The batch numbers slice ``index`` selects of ``count``; a zero step or bounds that are
    no integers are a :class:`BatchIndexError` naming ``owner``'s batches."""
    try:
        return range(*index.indices(count))
    except (TypeError, ValueError) as error:
        raise BatchIndexError(f"slice {index!r} of {owner}'s batches [0, {count}): {error}") from None


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of the strings ``choices``, else :class:`InvalidInputError`
    (an array is no choice: ``in`` would compare it element by element)."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidInputError(f"{name} must be one of {choices}, not {shown(value)}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` as a Python bool (a bool or numpy bool only), else :class:`InvalidInputError`."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidInputError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_scale(name: str, value: object) -> float | None:
    """An attention score scale as a Python float (None stays None: ``1/sqrt(head_dim)``):
    a finite real number, not a bool."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidInputError(f"{name} must be a real number or None, got {type(value).__name__}")
    try:
        scale = float(value)
    except OverflowError:  # an integer past the float range
        raise InvalidInputError(f"{name} must be finite ({name} is too large for a float)") from None
    if not math.isfinite(scale):
        raise InvalidInputError(f"{name} must be finite, got {scale}")
    return scale


def check_optional_int(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> int | None:
    """``None``, or ``value`` checked as by :func:`check_int`."""
    return None if value is None else check_int(name, value, minimum, maximum)


def regular_array(name: str, values) -> np.ndarray:
    """``np.asarray(values)``; ragged nesting, values numpy cannot hold and torch tensors it
    cannot view (one that requires grad, say) are an error naming ``name``."""
    try:
        return np.asarray(values)
    except (ValueError, TypeError) as error:
        raise InvalidInputError(f"{name} is not a regular array: {error}") from None
    except RuntimeError as error:  # torch: a tensor that requires grad, or has its negative bit set
        raise InvalidInputError(f"{name} must be a numpy array (seqpack.torch takes torch tensors): "
                                f"{str(error).splitlines()[0]}") from None


def integer_array(name: str, values, dtype=np.int64, ndim: int | None = None) -> np.ndarray:
    """``values`` as a C-contiguous array of integer ``dtype`` (no copy when it already is).

    Any integer dtype is accepted; a value outside ``dtype``'s range is an error that
    names it, never a silent wraparound (a uint64 above 2**63 - 1 stays what it is).
    """
    array = regular_array(name, values)
    if ndim is not None and array.ndim != ndim:
        raise InvalidInputError(f"{name} must be {ndim}-dimensional, got shape {array.shape}")
    if array.size == 0:
        return np.empty(array.shape, dtype=dtype)
    if array.dtype.kind not in "iu":
        raise InvalidInputError(f"{name} must hold integers, got dtype {array.dtype}")
    if not np.can_cast(array.dtype, dtype):
        info = np.iinfo(dtype)
        low, high = int(array.min()), int(array.max())
        if low < info.min or high > info.max:
            value = low if low < info.min else high
            raise InvalidInputError(
                f"{name} holds {value}, outside the {np.dtype(dtype).name} range [{info.min}, {info.max}]"
            )
    return np.ascontiguousarray(array, dtype=dtype)


def query_starts(name: str, starts: np.ndarray, lengths: np.ndarray, dtype) -> np.ndarray:
    """Integer ``starts`` ``[rows, T]`` as :func:`integer_array` gives them, read where the
    query is active (its column below its row's entry of ``lengths``, integers): an inactive
    query's start is never used, so one outside ``dtype``'s range there is read as 0."""
    if starts.dtype.kind in "iu" and not np.can_cast(starts.dtype, dtype) and starts.size:
        starts = np.where(np.arange(starts.shape[1]) < lengths[:, None], starts, 0)
    return integer_array(name, starts, dtype)


def _memory_of(value) -> np.ndarray | None:
    """``value``'s own memory as an array (an ndarray, a CPU torch tensor, a memoryview or
    another buffer), or None when it has none a kernel could write into."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor, without importing torch
        try:
            return value.detach().numpy()
        except (TypeError, RuntimeError):  # not on the CPU, or a dtype numpy lacks
            return None
    if isinstance(value, memoryview) or hasattr(value, "__array_interface__"):
        return np.asarray(value)
    return None


def check_disjoint(outputs: dict, inputs: dict) -> None:
    """Every output buffer must share no memory with any input or any other output.

    Inputs count by their own memory (see ``_memory_of``: torch tensors and memoryviews
    too, not only ndarrays). ``np.shares_memory`` decides wherever ``np.may_share_memory``
    is true; a case too hard to decide counts as overlapping.
    """
    named_outputs = [(name, array) for name, array in outputs.items() if isinstance(array, np.ndarray)]
    others = [(name, memory) for name, memory in ((n, _memory_of(a)) for n, a in inputs.items())
              if memory is not None]
    for index, (name, output) in enumerate(named_outputs):
        for other_name, other in others + named_outputs[index + 1:]:
            if np.may_share_memory(output, other):
                try:
                    overlapping = np.shares_memory(output, other)
                except _TOO_HARD:
                    overlapping = True
                if overlapping:
                    raise InvalidInputError(
                        f"{name} overlaps {other_name} in memory: an output buffer must not alias "
                        f"an input or another output"
                    )
