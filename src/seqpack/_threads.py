"""How many threads the kernels may use.

By default, every core this process may run on. A process forked from one whose
OpenMP threads have started cannot run a parallel region (GNU OpenMP's child
waits for threads that fork did not copy), so in a forked child every kernel runs
single-threaded: data-loader workers and multiprocessing pools keep working.
Results never depend on the thread count.
"""

from __future__ import annotations

import os


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
