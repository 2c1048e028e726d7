"""Overlapped corpus I/O: reading a chunk ahead and syncing behind the writer change no
byte of the output, keep every error, and stop their helper threads."""

import hashlib
import json
import threading

import numpy as np
import pytest

import seqpack as sp
from seqpack import io
from seqpack.io import publish
from seqpack.io.readers import read_ahead

TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="tests")


def helper_threads(prefix="seqpack-read-ahead"):
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


class Chunks:
    """An iterator of numbers that records who reads it and whether it was closed, and
    fails at ``fail_at`` when given."""

    def __init__(self, count, fail_at=None):
        self.count, self.fail_at, self.next_value, self.closed = count, fail_at, 0, False
        self.readers = set()

    def __iter__(self):
        return self

    def __next__(self):
        self.readers.add(threading.current_thread().name)
        if self.next_value == self.fail_at:
            raise sp.InvalidInputError(f"input row {self.fail_at}: the document is null")
        if self.next_value == self.count:
            raise StopIteration
        self.next_value += 1
        return self.next_value - 1

    def close(self):
        self.closed = True


@pytest.mark.parametrize("enabled", [True, False])
def test_read_ahead_keeps_order_reads_on_a_helper_and_closes(enabled):
    chunks = Chunks(50)
    assert list(read_ahead(chunks, enabled)) == list(range(50))
    assert chunks.closed
    on_helper = any(name.startswith("seqpack-read-ahead") for name in chunks.readers)
    assert on_helper == enabled
    assert not helper_threads()


def test_read_ahead_reads_at_most_one_chunk_ahead():
    chunks = Chunks(50)
    ahead = read_ahead(chunks)
    assert next(ahead) == 0
    assert next(ahead) == 1
    ahead.close()
    assert chunks.next_value == 3  # the two taken and the one read ahead
    assert chunks.closed and not helper_threads()


def test_read_ahead_raises_the_readers_error_at_its_place():
    chunks = Chunks(50, fail_at=7)
    taken = []
    with pytest.raises(sp.InvalidInputError, match="input row 7: the document is null"):
        for value in read_ahead(chunks):
            taken.append(value)
    assert taken == list(range(7))
    assert chunks.closed and not helper_threads()


def test_a_consumer_that_stops_early_closes_the_reader():
    chunks = Chunks(50)
    with pytest.raises(RuntimeError, match="consumer failed"):
        for value in read_ahead(chunks):
            if value == 3:
                raise RuntimeError("consumer failed")
    # The generator is closed when the failing frame lets go of it.
    assert chunks.closed and not helper_threads()


def test_closing_while_another_thread_reads_waits_for_the_read():
    """CI sent SIGTERM while read_ahead started its helper thread: the pool lost track of
    the thread, which was still inside the reader when read_ahead closed it, and
    'ValueError: generator already executing' replaced the signal's exception (a
    traceback and exit 1 instead of 'terminated' and 143). Closing now waits for the read
    in progress; the reader is exhausted afterwards."""
    from seqpack.io.readers import Exclusive

    entered, release, order = threading.Event(), threading.Event(), []

    def slow():
        entered.set()
        release.wait(10)
        order.append("read")
        try:
            yield 1
        finally:
            order.append("closed")

    exclusive = Exclusive(slow())
    reader = threading.Thread(target=lambda: order.append(next(exclusive)))
    reader.start()
    assert entered.wait(10)
    closer = threading.Thread(target=exclusive.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and order == []  # the close waits for the read in progress
    release.set()
    reader.join(10)
    closer.join(10)
    assert sorted(order, key=str) == [1, "closed", "read"] and order.index("read") < order.index("closed")
    with pytest.raises(StopIteration):
        next(exclusive)


def test_sync_behind_writes_the_same_bytes_and_digest(tmp_path):
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in (3 << 20, 100, 2 << 20, publish.PARALLEL_HASH_BYTES, 7)]
    target = publish.HashingFile(tmp_path / "file.bin")
    for block in blocks:
        target.write(block)
    record = target.close()
    expected = b"".join(block.tobytes() for block in blocks)
    assert (tmp_path / "file.bin").read_bytes() == expected
    assert record == {"bytes": len(expected), "sha256": hashlib.sha256(expected).hexdigest()}


def test_a_failed_sync_behind_raises_from_the_next_write_or_close(tmp_path, monkeypatch):
    def failing_sync(descriptor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(publish, "DATA_SYNC", failing_sync)
    block = np.zeros(publish.PARALLEL_HASH_BYTES, dtype=np.uint8)
    target = publish.HashingFile(tmp_path / "next-write.bin")
    target.write(block)  # starts the sync that fails
    with pytest.raises(OSError, match="No space left"):
        target.write(block)
    target.abandon()  # nothing in flight is left running, nothing raised

    target = publish.HashingFile(tmp_path / "close.bin")
    target.write(block)
    with pytest.raises(OSError, match="No space left"):
        target.close()
    target.abandon()

    target = publish.HashingFile(tmp_path / "abandon.bin")
    target.write(block)
    target.abandon()  # a failed sync of an abandoned file is ignored


@pytest.mark.parametrize("fmt_name", ["jsonl", "parquet"])
def test_one_thread_and_two_write_the_same_dataset(tmp_path, monkeypatch, fmt_name):
    # Small chunks, so that reading ahead happens many times.
    monkeypatch.setattr(io.readers.jsonl, "CHUNK_DOCUMENTS", 97)
    monkeypatch.setattr(io.ArrowBatches, "BATCH_ROWS", 97)
    rng = np.random.default_rng(3)
    sizes = np.clip(rng.lognormal(np.log(40), 1.0, 3000).astype(int), 1, 120)
    if fmt_name == "jsonl":
        source = tmp_path / "docs.jsonl"
        source.write_text("".join(json.dumps({"text": "x" * int(n)}) + "\n" for n in sizes))
        make = lambda: io.JsonLines(source)  # noqa: E731
    else:
        pa = pytest.importorskip("pyarrow", reason="Parquet input needs the corpus extra (pyarrow)")
        import pyarrow.parquet as pq

        ids = [rng.integers(2, 258, size=int(n)).tolist() for n in sizes]
        source = tmp_path / "docs.parquet"
        pq.write_table(pa.table({"input_ids": ids}), source, row_group_size=500)
        make = lambda: io.ArrowBatches(source, ids_field="input_ids")  # noqa: E731
    assert len(list(make().chunks(0))) > 20
    manifests = []
    for threads in (1, 2):
        out = tmp_path / f"packed-{threads}"
        io.pack_corpus([make()], out, binding=BINDING, tokenizer=TOKENIZER, config=sp.PackConfig(128, 4),
                       policy="best-fit-decreasing", threads=threads)
        manifest = json.loads((out / "manifest.json").read_text())
        manifests.append([part["files"] for part in manifest["parts"]])
        io.verify_dataset(out)
    assert manifests[0] == manifests[1]
    assert not helper_threads()
