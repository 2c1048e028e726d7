"""Thread counts: how many threads a kernel runs on.

Every threaded entry point takes ``threads=`` (None: :func:`default_threads`, the least
of the cores this process may use, its container's CPU quota and the OpenMP runtime's
limit; one in a forked or ``multiprocessing`` child). Results never depend on the
thread count.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from . import _openmp
from ._arguments import check_optional_int

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
    OpenMP runtime's limit (``OMP_NUM_THREADS`` or ``threadpoolctl.threadpool_limits``,
    capped by ``OMP_THREAD_LIMIT``);
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
