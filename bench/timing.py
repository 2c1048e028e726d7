"""Wall-clock timing shared by the benchmark scripts (medians; machines are noisy)."""

from __future__ import annotations

import argparse
import statistics
import time


def positive(text: str) -> int:
    """An ``argparse`` type: a positive integer (a count or a size), else a usage error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_size(text: str) -> float:
    """An ``argparse`` type: a positive, finite number (a size), else a usage error."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def arguments(description: str, repeats: int, *counts: tuple[str, int, str]) -> argparse.ArgumentParser:
    """A benchmark's parser: each ``(flag, default, help)`` of ``counts`` (positive integers), then
    ``--repeats`` (rounds, each running every method once), ``--threads`` (torch threads, 2)
    and ``--json``."""
    parser = argparse.ArgumentParser(description=description)
    for flag, default, what in counts:
        parser.add_argument(flag, type=positive, default=default, help=f"{what} (default {default})")
    parser.add_argument("--repeats", type=positive, default=repeats,
                        help=f"rounds, each running every method once (default {repeats})")
    parser.add_argument("--threads", type=positive, default=2, help="torch threads (default 2)")
    parser.add_argument("--json", action="store_true", help="print machine-readable records")
    return parser


def timings(call, repeat: int) -> list[float]:
    """Seconds of ``repeat`` calls of ``call``, after one untimed call (imports, caches,
    first touches of memory)."""
    call()
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return seconds


def check_agreement(differences: dict[str, float], tolerance: float, what: str) -> None:
    """Refuse to time methods that compute different things: each of ``differences`` (a
    method's largest relative difference from the reference method, or NaN) must be at most
    ``tolerance``, else ``SystemExit`` names the method, its difference and ``what`` differed."""
    for name, difference in differences.items():
        if not difference <= tolerance:  # NaN included
            raise SystemExit(f"{name}: {what} differ from the reference by {difference:.1e} (relative), more "
                             f"than {tolerance:.0e}; the methods do not compute the same thing, so no timing is reported")


def median_seconds(call, repeat: int) -> float:
    return statistics.median(timings(call, repeat))


def conditions() -> str:
    """One line naming the CPU, its vector flags, the default thread count and the load.

    Printed at the head of every benchmark: figures from different CPUs or a busy
    machine are not comparable.
    """
    import os

    from seqpack._threads import default_threads
    from seqpack.bench.measure import cpu_description

    load = " ".join(f"{value:.2f}" for value in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    return f"CPU: {cpu_description()}; threads {default_threads()}; load average {load}"
