"""Progress bars on stderr for long corpus work (tqdm, from the ``corpus`` extra).

A bar is shown only when asked for and stderr is a terminal; without tqdm the work
runs silently. Reading shows documents with tokens and bytes per second; later
phases (placing, writing, checking) show their own units. Byte rates are decimal
(1 MB = 10**6 bytes), as tqdm labels them.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """Counters of one command, drawn as tqdm bars when ``enabled`` (and stderr is a tty)."""

    def __init__(self, enabled: bool = True):
        self._tqdm = None
        if enabled and sys.stderr is not None and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            self._tqdm = tqdm
        self._bar = None
        self._start = time.perf_counter()
        self.documents = self.tokens = self.bytes = 0

    def reading(self, documents: int, tokens: int, nbytes: int) -> None:
        """Count documents read and tokenized, with their tokens and input bytes."""
        self.documents += documents
        self.tokens += tokens
        self.bytes += nbytes
        if self._tqdm is None:
            return
        if self._bar is None:
            self._bar = self._tqdm(desc="reading", unit=" docs", file=sys.stderr, dynamic_ncols=True)
        seconds = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(f"{self.tokens / seconds / 1e6:.2f} M tokens/s, "
                                  f"{self.bytes / seconds / 1e6:.1f} MB/s", refresh=False)
        self._bar.update(documents)

    def phase(self, name: str, total: int | None, unit: str) -> None:
        """Start a new bar for ``name`` (closing the previous one)."""
        self.close()
        if self._tqdm is not None:
            self._bar = self._tqdm(desc=name, total=total, unit=unit, unit_scale=unit == "B", file=sys.stderr,
                                   dynamic_ncols=True)

    def advance(self, amount: int) -> None:
        if self._bar is not None:
            self._bar.update(amount)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

