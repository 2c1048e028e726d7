"""seqpack.ray on a local 2-CPU cluster: the same bytes as the serial sharded path for any
shard count, a killed worker retried without changing a byte, a bad line failing the run
with its shard, file and line and leaving nothing complete-looking."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the Ray engine needs the ray extra: pip install 'seqpack[ray]'")

import seqpack as sp  # noqa: E402
from seqpack import io  # noqa: E402
from seqpack.cli import main  # noqa: E402
from seqpack.errors import InvalidInputError  # noqa: E402
from seqpack.io import format as fmt  # noqa: E402
from seqpack.io import publish  # noqa: E402
from seqpack.io.job import PackJob, run_job  # noqa: E402
from seqpack.ray import pack_corpus, pipeline  # noqa: E402
from seqpack.ray.pipeline import RayRunner  # noqa: E402

pytestmark = pytest.mark.slow

TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="corpus")
CONFIG = sp.PackConfig(128, 4)
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def cluster():
    os.environ["RAY_DISABLE_USAGE_STATS"] = "1"
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # SlowJsonLines, on the workers
    yield
    ray.shutdown()


def write_corpus(directory, files, per_file=200, seed=0):
    """JSONL files of lognormal-length texts (some longer than a row of 128)."""
    rng = np.random.default_rng(seed)
    directory.mkdir()
    paths = []
    for number in range(files):
        sizes = np.clip(rng.lognormal(np.log(60), 1.0, per_file).astype(int), 1, 600)
        lines = [json.dumps({"text": "".join(map(chr, rng.integers(97, 123, size=n)))}) + "\n" for n in sizes]
        paths.append(directory / f"part{number}.jsonl")
        paths[-1].write_text("".join(lines), encoding="utf-8")
    return paths


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("ray") / "in", files=8)


def serial(readers, out, shards):
    return io.pack_corpus(readers, out, binding=BINDING, tokenizer=TOKENIZER, config=CONFIG, shards=shards,
                          policy="best-fit-decreasing", long="cut")


def on_ray(readers, out, shards):
    return pack_corpus(readers, out, tokenizer=TOKENIZER, config=CONFIG, shards=shards, policy="best-fit-decreasing",
                       long="cut")


def assert_same_bytes(expected, actual):
    expected_names = sorted(str(p.relative_to(expected)) for p in expected.rglob("*"))
    assert expected_names == sorted(str(p.relative_to(actual)) for p in actual.rglob("*"))
    for name in expected_names:
        if (expected / name).is_file():
            assert (expected / name).read_bytes() == (actual / name).read_bytes(), name


@pytest.fixture(scope="module")
def one_file(corpus):
    """The first four corpus files as one JSONL file, which shards split into line ranges."""
    path = corpus[0].parent.parent / "one.jsonl"
    path.write_bytes(b"".join(p.read_bytes() for p in corpus[:4]))
    return path


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_ray_output_equals_the_serial_output(cluster, corpus, one_file, tmp_path, shards):
    for name, paths in (("files", corpus), ("one", [one_file])):
        reference = serial([io.JsonLines(p) for p in paths], tmp_path / f"{name}-serial", shards)
        manifest = on_ray([io.JsonLines(p) for p in paths], tmp_path / f"{name}-ray", shards)
        assert manifest == reference and len(manifest["parts"]) == shards
        assert [part["files"] for part in manifest["parts"]] == [part["files"] for part in reference["parts"]]
        assert_same_bytes(tmp_path / f"{name}-serial", tmp_path / f"{name}-ray")
        assert io.verify_dataset(tmp_path / f"{name}-ray")["parts"] == shards
    dataset = io.open_dataset(tmp_path / "one-ray")
    assert dataset.example_id(dataset.occurrence_count - 1).startswith(f"{one_file}:800")  # global line numbers


class SlowJsonLines(io.JsonLines):
    """A JSONL reader that records its worker's pid in ``marks`` and then waits, so that
    the test can kill the worker while the shard is being packed."""

    def __init__(self, path, marks, delay):
        super().__init__(path)
        self.marks, self.delay = marks, delay

    def chunks(self, first_input):
        (self.marks / f"{os.path.basename(self.path)}.{os.getpid()}").touch()
        time.sleep(self.delay)
        yield from super().chunks(first_input)


def test_a_killed_worker_is_retried_and_the_dataset_is_identical(cluster, corpus, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    reference = serial([io.JsonLines(p) for p in corpus[:3]], tmp_path / "serial", 2)
    slow_last = [io.JsonLines(corpus[0]), io.JsonLines(corpus[1]), SlowJsonLines(corpus[2], marks, 2.0)]
    outcome = {}

    def run():
        try:
            outcome["manifest"] = on_ray(slow_last, tmp_path / "ray", 2)  # files under a shard's bytes: not cut
        except Exception as error:  # reported by the assertions below
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 60
    while not any(marks.glob("part2.jsonl.*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = int(next(marks.glob("part2.jsonl.*")).suffix[1:])
    assert victim != os.getpid()
    os.kill(victim, signal.SIGKILL)
    killed_mid_run = thread.is_alive()
    thread.join(120)
    assert killed_mid_run and not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    attempts = sorted(int(mark.suffix[1:]) for mark in marks.glob("part2.jsonl.*"))
    assert len(attempts) == 2 and victim in attempts  # the shard ran again, in another worker
    assert outcome["manifest"] == reference
    assert_same_bytes(tmp_path / "serial", tmp_path / "ray")


def test_the_bytes_do_not_depend_on_finish_order_or_worker_count(cluster, corpus, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    reference = serial([io.JsonLines(p) for p in corpus], tmp_path / "serial", 4)
    # Shard 0 waits, so it finishes last; then tasks of 2 CPUs each, and one task at a time.
    late = [SlowJsonLines(corpus[0], marks, 1.5), *map(io.JsonLines, corpus[1:])]
    assert on_ray(late, tmp_path / "late", 4) == reference
    one_worker = pack_corpus([io.JsonLines(p) for p in corpus], tmp_path / "one", tokenizer=TOKENIZER, config=CONFIG,
                             shards=4, policy="best-fit-decreasing", long="cut", threads=2)
    assert one_worker == reference
    assert pack_corpus([io.JsonLines(p) for p in corpus], tmp_path / "w1", tokenizer=TOKENIZER, config=CONFIG,
                       shards=4, policy="best-fit-decreasing", long="cut", workers=1) == reference
    assert_same_bytes(tmp_path / "serial", tmp_path / "late")
    assert_same_bytes(tmp_path / "serial", tmp_path / "one")


class ThreadsJsonLines(io.JsonLines):
    """A JSONL reader that records, in ``marks``, its worker's pid and the tokenizer pool
    size its process started with."""

    def __init__(self, path, marks):
        super().__init__(path)
        self.marks = marks

    def chunks(self, first_input):
        (self.marks / f"{os.path.basename(self.path)}.{os.getpid()}.{os.environ.get('RAYON_NUM_THREADS')}").touch()
        yield from super().chunks(first_input)


def test_each_task_runs_in_a_worker_started_with_its_thread_count(cluster, corpus, tmp_path):
    """The tokenizers pool is sized once per process: a worker that ran 1-thread tasks is
    not reused for 2-thread tasks (and the other way round)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    for threads in (1, 2, 1):
        for old in marks.iterdir():
            old.unlink()
        pack_corpus([ThreadsJsonLines(p, marks) for p in corpus[:4]], tmp_path / f"out{threads}", tokenizer=TOKENIZER,
                    config=CONFIG, shards=4, long="cut", threads=threads, force=True)
        seen = sorted(mark.name.rsplit(".", 2) for mark in marks.iterdir())
        assert {name for name, _, _ in seen} == {p.name for p in corpus[:4]}, seen
        assert {size for _, _, size in seen} == {str(threads)}, seen
        for pid in {pid for _, pid, _ in seen}:
            with open(f"/proc/{pid}/environ", "rb") as handle:  # what the process started with
                assert f"RAYON_NUM_THREADS={threads}".encode() in handle.read().split(b"\0"), (pid, threads)


def test_a_bad_line_fails_the_run_naming_shard_file_and_line(cluster, tmp_path):
    paths = write_corpus(tmp_path / "in", files=6, per_file=50, seed=1)
    lines = paths[3].read_text().splitlines(keepends=True)
    lines[11] = '{"text": 12}\n'
    paths[3].write_text("".join(lines))
    with pytest.raises(InvalidInputError, match=r"^shard 1 of 3 \(.*part2.jsonl \.\.\. .*part3.jsonl\): "
                                                r".*part3.jsonl:12: field 'text' is not a string$"):
        on_ray([io.JsonLines(p) for p in paths], tmp_path / "out", 3)
    assert sorted(os.listdir(tmp_path)) == ["in"]  # no output, no hidden partial sibling
    one = tmp_path / "in" / "one.jsonl"  # the same line in the second line range of one file
    one.write_bytes(b"".join(p.read_bytes() for p in paths))
    with pytest.raises(InvalidInputError, match=r"^shard 1 of 2 \(.*one.jsonl\): .*one.jsonl:162: field 'text' is not "
                                                r"a string$"):
        on_ray([io.JsonLines(one)], tmp_path / "out", 2)
    assert sorted(os.listdir(tmp_path)) == ["in"]


def test_the_command_line_engine_ray_equals_serial_shards(cluster, corpus, tmp_path, capsys, monkeypatch):
    common = ["pack", *map(str, corpus[:4]), "--capacity", "128", "--cut-long", "--shards", "3", "--quiet", "--json"]
    assert main([*common, "--out", str(tmp_path / "serial")]) == 0
    serial_manifest = json.loads(capsys.readouterr().out)
    assert main([*common, "--out", str(tmp_path / "ray"), "--engine", "ray"]) == 0
    assert json.loads(capsys.readouterr().out) == serial_manifest
    assert_same_bytes(tmp_path / "serial", tmp_path / "ray")
    runners = []

    class RecordingRunner(RayRunner):
        def __init__(self, ray_module, **options):
            runners.append(options)
            super().__init__(ray_module, **options)

    monkeypatch.setattr(pipeline, "RayRunner", RecordingRunner)
    assert main([*common, "--out", str(tmp_path / "one"), "--engine", "ray", "--workers", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == serial_manifest
    assert runners == [{"cpus_per_task": 1, "max_retries": 3, "workers": 1, "shutdown": False}]  # its cluster
    assert_same_bytes(tmp_path / "serial", tmp_path / "one")
    assert json.loads((tmp_path / "ray" / fmt.MANIFEST).read_text())["shards"]["count"] == 3


def test_the_readme_example_runs(cluster, tmp_path, monkeypatch):
    block = re.search(r"```python ray\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL).group(1)
    (tmp_path / "corpus").mkdir()
    for number in range(3):
        (tmp_path / "corpus" / f"{number}.txt").write_text(f"document {number} " * (500 * number + 10))
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(block, str(README), "exec"), namespace)
    manifest, dataset = namespace["manifest"], namespace["dataset"]
    assert len(manifest["parts"]) == 3 and len(dataset) == manifest["counts"]["batches"] == 3
    assert dataset.example_id(0) == "corpus/0.txt"


def test_a_running_clusters_address_passes_the_probe(cluster):
    """The probe's gRPC greeting gets this cluster's GCS to answer with its SETTINGS frame."""
    address = ray.get_runtime_context().gcs_address
    pipeline.check_reachable(address)
    pipeline.check_reachable(address, timeout=1.0)


class FailingJsonLines(io.JsonLines):
    """A JSONL reader that raises its ``error`` when the task reads it: its file vanished
    (an OSError), or it broke (any other error)."""

    error: BaseException

    def chunks(self, first_input):
        raise self.error
        yield


def failing(path, error) -> FailingJsonLines:
    reader = FailingJsonLines(path)
    reader.error = error
    return reader


def test_a_task_failure_is_one_line_or_the_error_itself(cluster, corpus, tmp_path):
    """An error that is not seqpack's came back as Ray's remote traceback, in colour, as
    the 'one-line' message; an OSError now comes back as itself, naming its file."""
    vanished = FileNotFoundError(2, "No such file or directory", str(corpus[1]))
    with pytest.raises(FileNotFoundError) as caught:
        on_ray([io.JsonLines(corpus[0]), failing(corpus[1], vanished)], tmp_path / "out", 2)
    assert caught.value.filename == str(corpus[1]) and caught.value.errno == 2
    with pytest.raises(sp.SeqpackError) as caught:
        on_ray([io.JsonLines(corpus[0]), failing(corpus[1], RuntimeError("broken reader"))],
               tmp_path / "out", 2)
    message = str(caught.value)
    assert re.fullmatch(r"shard \d of 2 \(.*part1.jsonl\): the Ray task failed: RuntimeError: broken reader", message)
    assert sorted(os.listdir(tmp_path)) == []


class LongJsonLines(io.JsonLines):
    """A JSONL reader that yields its file's chunks 600 times, 0.05 s apart: a shard
    that runs for more than 30 s unless it is stopped."""

    def chunks(self, first_input):
        for _ in range(600):
            time.sleep(0.05)
            yield from super().chunks(first_input)


def test_a_failed_shard_stops_the_running_ones_without_ray_cancel(cluster, corpus, tmp_path, monkeypatch):
    """The driver cancelled the running tasks with ray.cancel(force=True); when a task's
    reply was in flight, Ray's core failed a check ('Tried to complete task that was not
    pending') and ended the whole process (this suite, in CI). The tasks now stop at the
    driver's stop file, and the driver waits for them."""
    cancels = []
    monkeypatch.setattr(ray, "cancel", lambda *args, **kwargs: cancels.append(args))
    began = time.monotonic()
    with pytest.raises(sp.SeqpackError, match="the Ray task failed: RuntimeError: broken reader"):
        on_ray([LongJsonLines(corpus[0]), failing(corpus[1], RuntimeError("broken reader"))], tmp_path / "out", 2)
    assert time.monotonic() - began < 20 and cancels == [] and os.listdir(tmp_path) == []


def test_a_task_stops_at_its_next_chunk_once_the_stop_file_exists(tmp_path, monkeypatch):
    """In the worker: a task started after the stop reads nothing; a running one stops at
    its next chunk (a read-ahead thread may have taken one more) and leaves nothing but
    the stop file."""
    lines = "".join(json.dumps({"text": f"line {n}"}) + "\n" for n in range(25_000))  # seven chunks of 4096 lines
    (tmp_path / "in.jsonl").write_text(lines, encoding="utf-8")
    staging = tmp_path / "staging"
    staging.mkdir()
    stop_file = staging / pipeline.STOP_FILE
    yielded = []

    class StoppedAtItsSecondChunk(io.JsonLines):  # on its first reading only
        def chunks(self, first_input):
            for number, chunk in enumerate(super().chunks(first_input)):
                if len(yielded) == 1:
                    stop_file.touch()
                yielded.append(number)
                yield chunk

    reader = StoppedAtItsSecondChunk(tmp_path / "in.jsonl")
    job = PackJob.of([reader], tmp_path / "out", binding=BINDING, tokenizer=TOKENIZER, config=CONFIG, long="cut")
    _, (shard,) = io.shards.plan_shards([reader], 1)
    monkeypatch.chdir(tmp_path)
    assert pipeline.pack_shard_task(job.for_workers(), shard, str(staging), str(tmp_path)) == (None, None)
    assert yielded[:2] == [0, 1] and len(yielded) <= 3 and os.listdir(staging) == [pipeline.STOP_FILE]
    read = len(yielded)
    assert pipeline.pack_shard_task(job.for_workers(), shard, str(staging), str(tmp_path)) == (None, None)
    assert len(yielded) == read
    stop_file.unlink()  # without it, the same task packs its part
    result, failure = pipeline.pack_shard_task(job.for_workers(), shard, str(staging), str(tmp_path))
    assert failure is None and result[0]["documents"] == 25_000 and yielded[read:] == list(range(7))


def test_more_threads_than_a_node_has_is_an_error_not_a_wait(cluster, corpus, tmp_path):
    """threads=4 on a cluster of 2-CPU nodes waited for ever for a node Ray could not find."""
    began = time.monotonic()
    with pytest.raises(InvalidInputError, match=r"threads=3 CPUs, but the largest node of the Ray cluster has 2"):
        pack_corpus(corpus[:1], tmp_path / "out", config=CONFIG, threads=3, long="cut")
    with pytest.raises(InvalidInputError, match="threads is 1025; the maximum is 1024"):
        pack_corpus(corpus[:1], tmp_path / "out", config=CONFIG, threads=1025, long="cut")
    assert time.monotonic() - began < 30 and not (tmp_path / "out").exists()


def test_an_address_cannot_choose_a_cluster_once_ray_is_initialized(cluster, corpus, tmp_path):
    """address= was ignored when this process had already initialized Ray."""
    with pytest.raises(InvalidInputError, match="Ray is already initialized in this process"):
        pack_corpus(corpus[:1], tmp_path / "out", config=CONFIG, address="127.0.0.1:1", long="cut")


def test_the_output_is_checked_before_a_cluster_starts(corpus, tmp_path, monkeypatch):
    """A missing parent directory was found after Ray had started (12 to 26 s)."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def no_start(*args):
        raise AssertionError("a cluster was started before the output was checked")

    monkeypatch.setattr(pipeline, "_join_or_start", no_start)
    with pytest.raises(InvalidInputError, match="nowhere"):
        pack_corpus(corpus[:1], tmp_path / "nowhere" / "x", config=CONFIG, long="cut")
    with pytest.raises(InvalidInputError, match="out must be a path"):
        pack_corpus(corpus[:1], 5, config=CONFIG, long="cut")
    # Review: Ray's OverflowError for max_retries past int32, and an AttributeError for an int address.
    for options, message in (({"max_retries": 2**31}, "max_retries is 2147483648; the maximum is 2147483647"),
                             ({"address": 6379}, "address must be a str such as 'auto' or 'host:6379', not int")):
        with pytest.raises(InvalidInputError, match=message):
            pack_corpus(corpus[:1], tmp_path / "out", config=CONFIG, long="cut", **options)


class FakeRay:
    """What ``_join_or_start`` calls: ``init``, here replacing the SIGTERM handler as Ray's does."""

    def __init__(self, error=None):
        self.error, self.calls = error, []

    def init(self, **options):
        self.calls.append(options)
        signal.signal(signal.SIGTERM, lambda *args: sys.exit(15))
        if self.error is not None:
            raise self.error


def test_joining_names_a_malformed_or_silent_address_and_keeps_the_signal_handlers(monkeypatch):
    """A malformed address was a traceback; RAY_ADDRESS was joined without the probe; and
    Ray's SIGTERM handler replaced the command line's (exit 15 and a native stack dump)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for address, error in (("localhost", ValueError("Invalid address format: localhost")),
                           ("http://127.0.0.1:8265", ValueError("Invalid Ray address"))):
        with pytest.raises(InvalidInputError, match=rf"cannot join the Ray cluster at {re.escape(address)}: Invalid"):
            pipeline._join_or_start(FakeRay(error), address)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    fake = FakeRay()
    with pytest.raises(InvalidInputError, match=r"cannot reach a Ray cluster at 127.0.0.1:1 \(from RAY_ADDRESS\)"):
        pipeline._join_or_start(fake, None)
    assert fake.calls == []
    monkeypatch.delenv("RAY_ADDRESS")

    def ours(*args):
        pass

    previous = signal.signal(signal.SIGTERM, ours)
    try:
        fake = FakeRay()
        with pipeline._signal_handlers_kept():
            pipeline._join_or_start(fake, None)
        assert fake.calls == [{"address": None, "logging_level": logging.WARNING, "include_dashboard": False}]
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_raised_inside_rays_wait_arrives_as_itself():
    """SIGTERM's exception raised inside Ray's signal check came out as a SystemError
    traceback instead of the command line's 'seqpack: terminated' (exit 143)."""
    from seqpack.cli import Terminated

    for signalled in (Terminated(), KeyboardInterrupt()):
        with pytest.raises(type(signalled)):
            with pipeline._signals_raised():
                raise SystemError("returned a result with an exception set") from signalled
    with pytest.raises(SystemError):  # any other SystemError stays one
        with pipeline._signals_raised():
            raise SystemError("other") from ValueError("a cause")


class InProcessRay:
    """Enough of Ray's API for ``RayRunner``: each task runs when it is submitted, in this
    process; ``shutdown`` raises ``interrupt`` (a Ctrl-C while Ray stops) and records the call."""

    exceptions = ray.exceptions

    def __init__(self, interrupt=None):
        self.interrupt, self.calls = interrupt, []

    def remote(self, function):
        fake = self

        class Task:
            def options(self, **options):
                return self

            def remote(self, *args):
                fake.calls.append("task")
                reference = type("Reference", (), {})()  # hashed by identity, like Ray's
                reference.value = function(*args)
                return reference

        return Task()

    def put(self, value):
        return value

    def wait(self, refs, num_returns):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        return ref.value

    def shutdown(self):
        self.calls.append("shutdown")
        if self.interrupt is not None:
            raise self.interrupt


def test_a_signal_while_the_tasks_stop_arrives_as_itself(corpus, tmp_path):
    """The wait for the stopped tasks was not inside the signal check's unwrapping: a
    SIGTERM there came out as Ray's SystemError."""
    from seqpack.cli import Terminated

    class SignalledWhileDraining(InProcessRay):
        def get(self, ref):
            if ref is not self.first:
                raise SystemError("returned a result with an exception set") from Terminated()
            return super().get(ref)

        def wait(self, refs, num_returns):
            self.first = refs[0]
            return super().wait(refs, num_returns)

    readers = [failing(corpus[0], FileNotFoundError(2, "gone", str(corpus[0]))), io.JsonLines(corpus[1])]
    job = PackJob.of(readers, tmp_path / "out", binding=BINDING, tokenizer=TOKENIZER, config=CONFIG, shards=2,
                     long="cut")
    with pytest.raises(Terminated):
        run_job(job, RayRunner(SignalledWhileDraining(), cpus_per_task=1, max_retries=0))
    assert os.listdir(tmp_path) == []


def test_ray_is_shut_down_before_the_dataset_is_published(corpus, tmp_path):
    """A Ctrl-C during ray.shutdown (a second or more), which ran after the dataset was
    published, made the command exit 130 with a complete dataset left behind; the runner
    now shuts Ray down once the last shard is in, so the Ctrl-C leaves nothing."""
    readers = [io.JsonLines(p) for p in corpus[:3]]
    fake = InProcessRay(interrupt=KeyboardInterrupt())
    job = PackJob.of(readers, tmp_path / "out", binding=BINDING, tokenizer=TOKENIZER, config=CONFIG, shards=3,
                     long="cut")
    with pytest.raises(KeyboardInterrupt):
        run_job(job, RayRunner(fake, cpus_per_task=1, max_retries=0, shutdown=True))
    assert fake.calls == ["task"] * 3 + ["shutdown"]
    assert os.listdir(tmp_path) == []  # no output, no hidden partial sibling
    fake = InProcessRay()
    manifest = run_job(job, RayRunner(fake, cpus_per_task=1, max_retries=0, shutdown=True))
    assert fake.calls == ["task"] * 3 + ["shutdown"] and len(manifest["parts"]) == 3
    assert io.open_dataset(tmp_path / "out").report().valid_targets == manifest["report"]["valid_targets"]


# --- signals at every moment of a command-line Ray run: the old dataset kept, no process left

def _marked_processes(mark: str) -> list[int]:
    """Processes whose environment holds ``SEQPACK_TEST_RUN=mark`` (a run's own, Ray's included)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    if f"SEQPACK_TEST_RUN={mark}".encode() in handle.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def _staging(parent: Path):
    hidden = [p for p in parent.iterdir() if ".seqpack-partial-" in p.name]
    return hidden[0] if hidden else None


#: When each moment has come, judged from what is on disk and in the process table:
#: inside ray.init (Ray's GCS runs, no temporary directory yet), while the shards run
#: (a temporary directory, no part in it), while the parts are gathered (one or two of
#: three), and during the shutdown before the publish (all three, no manifest yet).
MOMENTS = {
    "ray.init": lambda parent, mark: _staging(parent) is None and any(
        b"gcs_server" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _marked_processes(mark)
        if Path(f"/proc/{pid}/cmdline").exists()),
    "shards running": lambda parent, mark: (s := _staging(parent)) is not None and not list(s.glob("part-*")),
    "gathering": lambda parent, mark: (s := _staging(parent)) is not None and 1 <= len(list(s.glob("part-*"))) < 3,
    "shutdown": lambda parent, mark: (s := _staging(parent)) is not None and len(list(s.glob("part-*"))) == 3,
}


@pytest.fixture(scope="module")
def signal_corpus(tmp_path_factory):
    """Three JSONL files of about 0.5, 2 and 4 MB: with one worker the shards run one
    after another, so each moment lasts long enough to be caught."""
    directory = tmp_path_factory.mktemp("signals")
    rng = np.random.default_rng(7)
    paths = []
    for number, lines in enumerate((3_000, 12_000, 24_000)):
        sizes = rng.integers(20, 300, size=lines)
        text = "".join(json.dumps({"text": "".join(map(chr, rng.integers(97, 123, size=n)))}) + "\n" for n in sizes)
        paths.append(directory / f"{number}.jsonl")
        paths[-1].write_text(text, encoding="utf-8")
    return paths


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("moment", sorted(MOMENTS))
def test_a_signal_at_any_moment_of_a_ray_run_leaves_the_old_dataset_and_no_process(signal_corpus, tmp_path,
                                                                                    moment, number):
    """At 7.5 s a SIGTERM gave exit 1, Ray's C++ check failure, a 32 MB partial directory
    and Ray processes alive for a minute; inside ray.init, exit 15 and no message."""
    out = tmp_path / "out"
    assert main(["pack", str(signal_corpus[0]), "--out", str(out), "--capacity", "512", "--quiet"]) == 0
    before = (out / fmt.MANIFEST).read_text()
    mark = f"{moment}-{number}-{os.getpid()}".replace(" ", "_").replace(".", "_")
    environment = {**os.environ, "SEQPACK_TEST_RUN": mark, "RAY_DISABLE_USAGE_STATS": "1"}
    environment.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "seqpack", "pack", *map(str, signal_corpus), "--out", str(out), "--force",
               "--engine", "ray", "--shards", "3", "--workers", "1", "--capacity", "512", "--quiet"]
    run = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not MOMENTS[moment](tmp_path, mark):
        assert run.poll() is None, f"the run ended before {moment}: {run.stderr.read()}"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    run.send_signal(number)
    _, stderr = run.communicate(timeout=120)
    expected = {signal.SIGTERM: (143, "seqpack: terminated"), signal.SIGINT: (130, "seqpack: interrupted")}[number]
    assert (run.returncode, stderr.strip()) == expected, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing partial, no old copy
    assert (out / fmt.MANIFEST).read_text() == before
    io.verify_dataset(out)
    for _ in range(50):  # every process of the run's own cluster gone within 5 s
        alive = _marked_processes(mark)
        if not alive:
            break
        time.sleep(0.1)
    assert alive == [], [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in alive]


def test_a_later_pack_removes_what_a_killed_ray_run_left(signal_corpus, tmp_path):
    """A killed run's leftovers (its writer gone) go at the next pack beside them; a live
    writer's stay."""
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    host = publish.this_host()
    partial = tmp_path / f".out.seqpack-partial-{host}-{pid}-0123456789ab"
    (partial / "part-00000").mkdir(parents=True)
    live = tmp_path / f".other.seqpack-partial-{host}-{os.getpid()}-0123456789ab"
    live.mkdir()
    assert main(["pack", str(signal_corpus[0]), "--out", str(out), "--capacity", "512", "--quiet"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "out"]


def test_a_quiet_ray_run_prints_nothing_and_leaves_no_process(signal_corpus, tmp_path):
    """--quiet still printed Ray's authentication_token_setup.py warning."""
    mark = f"quiet-{os.getpid()}"
    environment = {**os.environ, "SEQPACK_TEST_RUN": mark, "RAY_DISABLE_USAGE_STATS": "1"}
    environment.pop("RAY_ADDRESS", None)
    result = subprocess.run([sys.executable, "-m", "seqpack", "pack", str(signal_corpus[0]), "--out",
                             str(tmp_path / "out"), "--engine", "ray", "--capacity", "512", "--quiet"],
                            env=environment, capture_output=True, text=True, timeout=300)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert _marked_processes(mark) == []


def test_a_program_calling_the_command_line_keeps_its_own_children(signal_corpus, tmp_path):
    """The supervisor SIGKILLed every child of a program calling main(["pack", ..., "--engine", "ray"]) and
    reaped their exit statuses (review): only the driver's processes are the supervisor's to kill."""
    program = f"""
import os, subprocess, sys, time
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
time.sleep(0.5)
from seqpack.cli import main
assert "ray" not in sys.modules   # else the pack runs here, unsupervised
status = main(["pack", {str(signal_corpus[0])!r}, "--out", {str(tmp_path / "out")!r}, "--engine", "ray",
               "--address", "127.0.0.1:9", "--quiet"])
alive = sleeper.poll() is None
sleeper.kill()
print(status, alive, failing.wait())
"""
    environment = {**os.environ, "RAY_DISABLE_USAGE_STATS": "1"}
    environment.pop("RAY_ADDRESS", None)
    result = subprocess.run([sys.executable, "-c", program], env=environment, capture_output=True, text=True,
                            timeout=300)
    assert result.stdout.split() == ["1", "True", "3"], result.stderr
    assert "cannot reach a Ray cluster at 127.0.0.1:9" in result.stderr


def test_supervision_on_ray_is_byte_identical_to_serial_shards(cluster, tmp_path):
    # Pre-tokenized records with TRL's completion_mask, prompts long enough that some --cut-long
    # windows hold no supervised target: Ray leaves out the windows the serial path leaves out.
    rng = np.random.default_rng(35)
    (tmp_path / "in").mkdir()
    paths = []
    for number in range(3):
        lines = []
        for _ in range(120):
            prompt, completion = int(rng.integers(1, 300)), int(rng.integers(1, 80))
            ids = rng.integers(2, 258, prompt + completion).tolist()
            lines.append(json.dumps({"input_ids": ids, "completion_mask": [0] * prompt + [1] * completion}) + "\n")
        paths.append(tmp_path / "in" / f"sft{number}.jsonl")
        paths[-1].write_text("".join(lines), encoding="utf-8")
    readers = lambda: [io.JsonLines(p, ids_field="input_ids") for p in paths]  # noqa: E731
    reference = serial(readers(), tmp_path / "serial", 3)
    manifest = on_ray(readers(), tmp_path / "ray", 3)
    assert manifest == reference and manifest["format_version"] == 2
    assert manifest["supervision"]["applied"] == ["completion_mask"]
    assert manifest["counts"]["skipped_unsupervised_windows"] > 0
    assert_same_bytes(tmp_path / "serial", tmp_path / "ray")
    io.verify_dataset(tmp_path / "ray")
    dataset = io.open_dataset(tmp_path / "ray")
    assert sum(batch.target_count for batch in dataset) == manifest["counts"]["supervised_targets"]


def test_preference_pairs_on_ray_are_byte_identical_to_serial_shards(cluster, tmp_path):
    # One JSONL file that the shards cut into line ranges, and two more: every pair stays whole in its record's part.
    rng = np.random.default_rng(36)
    (tmp_path / "in").mkdir()
    paths = []
    for number, count in enumerate((240, 60, 60)):
        lines = [json.dumps({key: rng.integers(2, 258, int(rng.integers(1, 30))).tolist()
                             for key in ("prompt_ids", "chosen_ids", "rejected_ids")}) + "\n" for _ in range(count)]
        paths.append(tmp_path / "in" / f"dpo{number}.jsonl")
        paths[-1].write_text("".join(lines), encoding="utf-8")
    reference = serial([io.JsonLines(p) for p in paths], tmp_path / "serial", 4)
    manifest = on_ray([io.JsonLines(p) for p in paths], tmp_path / "ray", 4)
    assert manifest == reference and manifest["format_version"] == 3 and len(manifest["parts"]) == 4
    assert manifest["counts"]["pairs"] == 360 and manifest["supervision"]["applied"] == ["preference IDs"]
    assert_same_bytes(tmp_path / "serial", tmp_path / "ray")
    assert io.verify_dataset(tmp_path / "ray")["pairs"] == 360
