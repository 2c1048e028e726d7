"""Audit of shard planning, the sharded driver, the Ray entry point, ``stats`` figures and
``show`` rendering: each test here failed (a silent wrong answer or a non-seqpack error)
before its fix."""

import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import seqpack as sp
from seqpack import io
from seqpack.errors import InvalidInputError, SeqpackError
from seqpack.io.render import batch_svg, batch_text
from seqpack.io.shards import pack_sharded, plan_shards, run_serially
from seqpack.io.stats import dataset_stats, stats_svg

from helpers import write_jsonl

TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="corpus")
CONFIG = sp.PackConfig(32, 3)


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(1)
    directory = tmp_path / "in"
    directory.mkdir()
    return [write_jsonl(directory / f"p{i}.jsonl", ["a" * int(n) for n in rng.integers(1, 40, 30)])
            for i in range(3)]


def sharded(paths, out, run=None):
    return pack_sharded([io.JsonLines(p) for p in paths], out, binding=BINDING, tokenizer=TOKENIZER, config=CONFIG,
                        shards=3, long="cut", run=run)


def plan(readers, count):
    return [[(unit.first_input, getattr(unit.reader, "start", None)) for unit in shard.units]
            for shard in plan_shards(readers, count)[1]]


def test_a_shard_count_past_int64_products_plans_exactly(tmp_path):
    """Text files of 1 and 3 bytes: with more shards than bytes each file is a shard of its
    own. The int64 product of a middle byte and 2**62 wrapped around and merged them."""
    for name, text in (("a.txt", "x"), ("b.txt", "yyy")):
        (tmp_path / name).write_text(text)
    readers = [io.TextFiles([tmp_path / "a.txt"]), io.TextFiles([tmp_path / "b.txt"])]
    expected = [[(0, None)], [(1, None)]]
    assert plan(readers, 4) == expected
    for count in (2 ** 62, 10 ** 19, 2 ** 200):
        assert plan(readers, count) == expected


def test_a_huge_shard_count_splits_a_jsonl_file_like_one_shard_per_byte(tmp_path):
    """More shards than bytes plan as one shard per byte (every line alone), instead of
    a MemoryError or a wrapped int64."""
    path = write_jsonl(tmp_path / "big.jsonl", ["x" * 50] * 40)
    total = path.stat().st_size
    expected = plan([io.JsonLines(path)], total)
    assert len(expected) == 40
    for count in (total + 1, 2 ** 40, 2 ** 62, 10 ** 30):
        assert plan([io.JsonLines(path)], count) == expected


def test_a_runner_reporting_a_shard_twice_or_never_is_an_error(corpus, tmp_path):
    """A duplicated task's record was counted twice (the manifest's input_bytes doubled);
    a missing one crashed with a TypeError. Nothing is published either way."""
    expected = sharded(corpus, tmp_path / "serial")

    def twice(job, shards, staging):
        for index, result in run_serially(job, shards, staging):
            yield index, result
            yield index, result

    def never(job, shards, staging):
        for index, result in run_serially(job, shards, staging):
            if index != 1:
                yield index, result

    def stranger(job, shards, staging):
        yield from run_serially(job, shards, staging)
        yield -1, (None, 0)

    for name, run, message in (("twice", twice, r"reported shard 0 of 3 twice"),
                               ("never", never, r"never reported shard 1 of 3 \("),
                               ("stranger", stranger, r"reported shard -1 of 3 \(no such shard\)")):
        with pytest.raises(SeqpackError, match=message):
            sharded(corpus, tmp_path / name, run=run)
        assert not (tmp_path / name).exists()
    assert sharded(corpus, tmp_path / "again")["input_bytes"] == expected["input_bytes"] == \
        sum(p.stat().st_size for p in corpus)


def test_ray_pack_corpus_refuses_one_path_given_as_a_string(tmp_path):
    """A string was iterated character by character: '/data' read the root directory '/'."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    from seqpack.ray import pack_corpus

    (tmp_path / "a.txt").write_text("some text")
    for inputs in (str(tmp_path), tmp_path):
        with pytest.raises(InvalidInputError, match="inputs must be a list of readers or paths"):
            pack_corpus(inputs, tmp_path / "out", config=CONFIG)
    assert not (tmp_path / "out").exists()


def closed_port() -> int:
    """A loopback port that nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


FAILS_FAST = """
import sys, time
import ray
import seqpack as sp
from seqpack.errors import InvalidInputError
from seqpack.ray import pack_corpus

path, out, address = sys.argv[1:]
started = time.monotonic()
try:
    pack_corpus([path], out, config=sp.PackConfig(32, 3), address=address)
except InvalidInputError as error:
    print(f"{time.monotonic() - started:.1f}|{ray.is_initialized()}|{error}")
"""


def test_ray_pack_corpus_fails_fast_on_an_unreachable_address(tmp_path):
    """``ray.init`` retried a closed port for about ten minutes, then logged only Ray's
    "Failed to get cluster ID from GCS server: TimedOut". Each call runs in a fresh
    process, where no Ray is initialized yet (one already running would be used whatever
    the address)."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    path = write_jsonl(tmp_path / "a.jsonl", ["some text"])
    port = closed_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        run = subprocess.run([sys.executable, "-c", FAILS_FAST, str(path), str(tmp_path / "out"), address],
                             capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 0, run.stderr
        seconds, initialized, message = run.stdout.strip().split("|", 2)
        assert re.match(rf"^cannot reach a Ray cluster at {re.escape(address)}: ", message), message
        assert float(seconds) < 10 and initialized == "False" and not (tmp_path / "out").exists()


def test_only_an_explicit_host_and_port_is_probed(monkeypatch):
    """A silent address names the wait; "auto", None and addresses without a port are Ray's."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    from seqpack.ray import pipeline

    calls = []

    def silent(target, timeout):
        calls.append((target, timeout))
        raise TimeoutError("timed out")

    monkeypatch.setattr(pipeline.socket, "create_connection", silent)
    for address in (None, "auto", "local", "head-node", "anyscale://cluster"):
        pipeline.check_reachable(address)
    assert calls == []
    for address, target in (("10.0.0.7:6379", ("10.0.0.7", 6379)), ("ray://head:10001", ("head", 10001)),
                            ("[::1]:6379", ("::1", 6379))):
        with pytest.raises(InvalidInputError, match=rf"^cannot reach a Ray cluster at {re.escape(address)}: "
                                                    r"no answer within 5 s$"):
            pipeline.check_reachable(address)
        assert calls.pop() == (target, pipeline.CONNECT_TIMEOUT)


class LoopbackServer:
    """A one-connection TCP server on a loopback port that ``reply(connection)`` answers."""

    def __init__(self, reply):
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, args=(reply,), daemon=True)
        self.thread.start()

    def _serve(self, reply):
        connection, _ = self.listener.accept()
        with connection:
            reply(connection)

    def close(self):
        """Once the connection is served (the kernel accepts a client before ``accept``
        returns, so the probe may finish first), stop listening."""
        self.thread.join(10)
        self.listener.close()


def http1(connection):
    connection.recv(1024)
    connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


def banner(connection):
    connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    connection.recv(1024)


def silent(connection):
    time.sleep(2)


def hang_up(connection):
    """Reads the whole greeting (unread bytes would make the close a reset), then closes."""
    from seqpack.ray.pipeline import HTTP2_GREETING

    received = b""
    while len(received) < len(HTTP2_GREETING):
        received += connection.recv(1024)


@pytest.mark.parametrize("reply, message", [
    (http1, r"is not a Ray cluster's address: an HTTP/1 server answers there \(the Ray dashboard does, on port 8265 "
            r"by default; a cluster's address is its GCS port, 6379 by default, or ray://host:10001 for Ray Client\)$"),
    (banner, r"is not a Ray cluster's address: the server answered b'SSH-2.0-O'$"),
    (hang_up, r"is not a Ray cluster's address: the server closed the connection without a word$"),
    (silent, r"^cannot reach a Ray cluster at ray://127\.0\.0\.1:\d+: no answer within 0\.5 s$"),
])
def test_an_address_where_something_else_listens_is_refused_in_seconds(monkeypatch, reply, message):
    """``ray.init`` hung inside Ray on such an address; the probe names what answered."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    from seqpack.ray import pipeline

    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    server = LoopbackServer(reply)
    try:
        started = time.monotonic()
        with pytest.raises(InvalidInputError, match=message):
            pipeline.check_reachable(f"ray://{server.address}", timeout=0.5)
        assert time.monotonic() - started < 1.5
    finally:
        server.close()


def test_with_tls_only_the_connection_is_checked(monkeypatch):
    """A TLS cluster would not answer a plain-text greeting; with RAY_USE_TLS set the probe sends none."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    from seqpack.ray import pipeline

    received = []
    server = LoopbackServer(lambda connection: received.append(connection.recv(1024)))
    monkeypatch.setenv("RAY_USE_TLS", "1")
    try:
        pipeline.check_reachable(server.address, timeout=0.5)
    finally:
        server.close()
    assert received == [b""]


def test_stats_figure_bins_label_exactly_what_they_count(corpus, tmp_path):
    """Every bar's label ``[lo, hi)`` (``[lo, hi]`` for the last) holds exactly its count of
    the values computed from the dataset's files. The last bin, which holds full rows and
    examples of the capacity, was labelled half-open, and its edges were rounded
    (``[0.969, 1)`` for ``[0.96875, 1]``)."""
    manifest = sharded(corpus, tmp_path / "out")
    lengths, fill = [], []
    for part in manifest["parts"]:
        occurrences = np.load(tmp_path / "out" / part["name"] / "occurrences.npy")
        examples = np.load(tmp_path / "out" / part["name"] / "examples.npy")
        predictions = examples[occurrences[:, 0], 2] - examples[occurrences[:, 0], 1] - 1
        lengths += predictions.tolist()
        fill += np.bincount(occurrences[:, 1], weights=predictions).tolist()
    capacity = CONFIG.capacity
    fill = np.array(fill) / capacity
    assert (fill == 1).any() and (np.array(lengths) == capacity).any()
    stats = dataset_stats(sp.open_dataset(tmp_path / "out"))
    assert stats["report"]["rows"] == len(fill) and stats["counts"]["examples"] == len(lengths)
    svg = stats_svg(stats)
    titles = re.findall(r"<title>\[([^,]+), ([^\]\)]+)([\]\)]): (\d+)</title>", svg)
    assert len(titles) == 64
    for values, bins in ((np.array(lengths), titles[:32]), (fill, titles[32:])):
        for number, (low, high, close, count) in enumerate(bins):
            low, high = float(low), float(high)
            assert close == ("]" if number == 31 else ")")
            inside = (values >= low) & ((values <= high) if close == "]" else (values < high))
            assert inside.sum() == int(count), (low, high, close, count)


def test_show_refuses_rows_and_columns_it_would_draw_wrongly(corpus, tmp_path):
    """A stepped column range drew the matrix of other columns under its labels; a bool
    row, a float row or no rows at all were drawn, crashed or gave an empty figure."""
    sharded(corpus, tmp_path / "out")
    batch = sp.open_dataset(tmp_path / "out").batch(0)
    for draw in (batch_text, batch_svg):
        with pytest.raises(InvalidInputError, match="columns must be a range of consecutive columns"):
            draw(batch, columns=range(0, 10, 2))
        with pytest.raises(InvalidInputError, match="columns must be a range of consecutive columns"):
            draw(batch, columns=range(5, -1, -1))
        with pytest.raises(InvalidInputError, match="columns must be a range of consecutive columns"):
            draw(batch, columns=[0, 1])
        for row in (True, 0.5):
            with pytest.raises(InvalidInputError, match="a row must be an int"):
                draw(batch, rows=[row])
        with pytest.raises(InvalidInputError, match="rows is empty"):
            draw(batch, rows=[])
    svg = batch_svg(batch, rows=[np.int64(1)], columns=range(3, 9))
    assert svg.count('class="cell"') == 6
    assert re.findall(r'class="cell" data-row="(\d+)" data-column="(\d+)"', svg) == [("1", str(c)) for c in range(3, 9)]
