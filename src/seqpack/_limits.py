"""Argument checks, integer limits and thread counts shared by every layer.

Sizes and limits are normalized to Python ``int`` where they enter the library (a
config's constructor, a public function's arguments), so every later check and byte
count is exact arithmetic: a numpy ``int32`` capacity never overflows a product.

Threads: every threaded entry point takes ``threads=`` (None: :func:`default_threads`,
the least of the cores this process may use, its container's CPU quota and the OpenMP
runtime's limit; one in a forked or ``multiprocessing`` child). Results never depend
on the thread count.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import os
import sys
from pathlib import Path

import numpy as np

from . import _openmp
from .errors import BatchIndexError, InvalidInputError

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


def permitted_edges(lengths: np.ndarray) -> int:
    """The sum of ``n * (n + 1) // 2`` over ``lengths`` (integers in ``[0, 2**31)``, as a
    row's capacity bounds them), exact: the edges causal segments of those lengths
    permit. Each term is split at bit 32 and at most 2**31 terms are summed at once, so
    no uint64 sum can wrap (an int64 sum of 2**20 segments of 2**22 would)."""
    n = np.asarray(lengths, dtype=np.int64).ravel()
    if n.size and not 0 <= int(n.min()) <= int(n.max()) <= INT32_MAX:
        raise InvalidInputError(f"segment lengths must lie in [0, {INT32_MAX}]")
    total = 0
    for first in range(0, n.size, 1 << 31):
        part = n[first:first + (1 << 31)].astype(np.uint64)
        terms = part * (part + np.uint64(1)) // np.uint64(2)  # < 2**61
        total += int((terms >> np.uint64(32)).sum(dtype=np.uint64)) << 32
        total += int((terms & np.uint64(0xFFFFFFFF)).sum(dtype=np.uint64))
    return total


def batch_number(number: object, count: int, owner: str) -> int:
    """``number`` as a Python int in ``[0, count)``, else :class:`BatchIndexError` naming
    ``owner``'s batches (a bool or a float is no batch number)."""
    if not is_int(number) or not 0 <= number < count:
        why = " (a bool is not a batch number)" if isinstance(number, (bool, np.bool_)) else ""
        raise BatchIndexError(f"batch {number!r} is outside {owner}'s batches [0, {count}){why}")
    return operator.index(number)


def batch_index(index: object, count: int, owner: str) -> int:
    """A sequence's index: as :func:`batch_number`, a negative one counting from the end."""
    if is_int(index) and -count <= index < 0:
        return operator.index(index) + count
    return batch_number(index, count, owner)


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


def integer_array(name: str, values, dtype=np.int64, ndim: int | None = None) -> np.ndarray:
    """``values`` as a C-contiguous array of integer ``dtype`` (no copy when it already is).

    Any integer dtype is accepted; a value outside ``dtype``'s range is an error that
    names it, never a silent wraparound (a uint64 above 2**63 - 1 stays what it is).
    """
    try:
        array = np.asarray(values)
    except (ValueError, TypeError) as error:  # ragged nesting, values numpy cannot hold
        raise InvalidInputError(f"{name} is not a regular array: {error}") from None
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
                except np.exceptions.TooHardError:
                    overlapping = True
                if overlapping:
                    raise InvalidInputError(
                        f"{name} overlaps {other_name} in memory: an output buffer must not alias "
                        f"an input or another output"
                    )


def available_cores() -> int:
    """Cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity masks
        return os.cpu_count() or 1


def _quota_cpus(quota: str, period: str) -> int | None:
    """CPUs a CFS quota allows, rounded up (None for no quota)."""
    if quota.strip() in ("max", "-1"):
        return None
    return max(1, -(-int(quota) // int(period)))


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int | None:
    """CPUs this process's container may use by its cgroup CPU quota, or None without one.

    cgroup v2 (``cpu.max``: ``"quota period"`` or ``"max period"``) and v1
    (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``); the tightest quota on the process's
    cgroup and its ancestors counts.
    """
    try:
        lines = Path(membership).read_text().splitlines()
    except OSError:
        lines = []
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            candidates.append((Path(root), path, "v2"))
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                candidates.append((Path(root) / mount, path, "v1"))
    candidates.append((Path(root), "/", "v2"))
    limits = []
    for base, path, version in candidates:
        directory = base / path.lstrip("/")
        while True:
            try:
                if version == "v2":
                    limit = _quota_cpus(*(directory / "cpu.max").read_text().split()[:2])
                else:
                    limit = _quota_cpus((directory / "cpu.cfs_quota_us").read_text(),
                                        (directory / "cpu.cfs_period_us").read_text())
                if limit is not None:
                    limits.append(limit)
            except (OSError, ValueError, TypeError, ZeroDivisionError):
                pass
            if directory == base or directory.parent == directory:
                break
            directory = directory.parent
    return min(limits) if limits else None


_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.cache
def _container_cpus() -> int | None:
    return cgroup_cpu_limit()


def in_child_process() -> bool:
    """Whether this process was forked, or started by ``multiprocessing`` (any start method)."""
    if _forked:
        return True
    multiprocessing = sys.modules.get("multiprocessing")
    return multiprocessing is not None and multiprocessing.parent_process() is not None


def default_threads() -> int:
    """Threads a kernel uses when given ``threads=None``.

    The least of the cores this process may run on, its container's CPU quota, and the
    OpenMP runtime's limit (``OMP_NUM_THREADS``, or ``threadpoolctl.threadpool_limits``);
    one in a forked process or one started by ``multiprocessing`` (data-loader workers,
    pools: each would otherwise take every core, and a forked GNU OpenMP child would hang).
    """
    if in_child_process():
        return 1
    limits = [available_cores(), _openmp.max_threads()]
    quota = _container_cpus()
    if quota is not None:
        limits.append(quota)
    return max(1, min(limits))


#: The most threads a caller may ask for: far above any CPU in use, far below the thousands
#: of threads at which the OpenMP runtime fails to start a team and ends the process.
MAX_THREADS = 1024


def check_threads(threads) -> int | None:
    """``None``, or ``threads`` as a Python int in ``[1, MAX_THREADS]``."""
    return check_optional_int("threads", threads, 1, MAX_THREADS)


def kernel_threads(requested: int | None = None) -> int:
    """Threads for a kernel: ``requested`` (checked) or the default; 1 in a forked child,
    whatever was asked (GNU OpenMP cannot start parallel regions there)."""
    requested = check_threads(requested)
    if _forked:
        return 1
    return default_threads() if requested is None else requested
