"""Argument checks, integer limits and thread counts shared by every layer.

Sizes and limits are normalized to Python ``int`` where they enter the library (a
config's constructor, a public function's arguments), so every later check and byte
count is exact arithmetic: a numpy ``int32`` capacity never overflows a product.

Threads: kernels use every core this process may run on unless told otherwise; in a
process forked from one whose OpenMP threads have started, every kernel runs
single-threaded (GNU OpenMP's child would wait for threads that fork did not copy),
so data-loader workers and multiprocessing pools keep working. Results never depend
on the thread count.
"""

from __future__ import annotations

import operator
import os

import numpy as np

from .errors import InvalidInputError

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def is_int(value: object) -> bool:
    """True for Python and numpy integers, False for bool and everything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as a Python int in ``[minimum, maximum]``, else :class:`InvalidInputError`."""
    if not is_int(value):
        raise InvalidInputError(f"{name} must be an int, got {type(value).__name__}")
    value = operator.index(value)
    if value < minimum:
        raise InvalidInputError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidInputError(f"{name} is {value}; the maximum is {maximum}")
    return value


def check_optional_int(name: str, value: object, minimum: int = 1, maximum: int | None = None) -> int | None:
    """``None``, or ``value`` checked as by :func:`check_int`."""
    return None if value is None else check_int(name, value, minimum, maximum)


def available_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity masks
        return os.cpu_count() or 1


_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def kernel_threads(requested: int | None = None) -> int:
    """Threads for a kernel: ``requested`` (all cores when None), or 1 in a forked child."""
    if _forked:
        return 1
    return available_cores() if requested is None else requested
