"""Reading one chunk ahead on a helper thread, so that reads that release the GIL
overlap the caller's work: order, chunks and errors are unchanged, and closing stops
the helper only after any read in progress.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from .base import DocumentChunk


class Exclusive:
    """``chunks`` shared by two threads: ``next`` and ``close`` never overlap (a close waits
    for a read in progress), and once closed it is exhausted."""

    def __init__(self, chunks: Iterator):
        self._chunks, self._lock, self._closed = chunks, threading.Lock(), False

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            if self._closed:
                raise StopIteration
            return next(self._chunks)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()


def read_ahead(chunks: Iterator[DocumentChunk], enabled: bool = True) -> Iterator[DocumentChunk]:
    """The chunks of ``chunks``; when ``enabled``, each next one is read on a helper thread
    while the caller works on the one it has (reading that releases the GIL, such as
    Parquet decoding or file reads, then overlaps tokenizing and validation). Order,
    chunks and errors are unchanged; at most one chunk is read ahead. Closing this
    generator stops the helper and closes ``chunks``, after any read in progress: a
    signal's exception (Ctrl-C, SIGTERM) can strike while the helper thread starts, where
    the pool no longer knows the thread, which may then be inside ``chunks``.
    """
    chunks = Exclusive(chunks)
    try:
        if not enabled:
            yield from chunks
            return
        end = object()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="seqpack-read-ahead") as pool:
            pending = pool.submit(next, chunks, end)
            while (chunk := pending.result()) is not end:
                pending = pool.submit(next, chunks, end)
                yield chunk
    finally:
        chunks.close()

