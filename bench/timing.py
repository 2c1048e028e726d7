"""Wall-clock timing shared by the benchmark scripts (medians; machines are noisy)."""

from __future__ import annotations

import statistics
import time


def timings(call, repeat: int) -> list[float]:
    """Seconds of ``repeat`` calls of ``call``."""
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def median_seconds(call, repeat: int) -> float:
    return statistics.median(timings(call, repeat))
