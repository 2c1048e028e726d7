"""Packing a corpus on a Ray cluster: one Ray task per shard, one part per task.

The driver (:func:`seqpack.io.job.run_job`) plans the shards; :class:`RayRunner` puts
the job in the object store once and submits one task per shard; each task reads, tokenizes,
places and writes its part into the dataset's temporary directory (which every node
must see: a shared file system) and returns only the part's small record. The driver
collects the records as tasks finish, drawing a bar over shards and tokens, and writes
the manifest only after every part is complete.
A task whose worker dies is retried by Ray (``max_retries``) and rewrites its part from
the start; a task that fails on its input fails the run with the shard, file and line
named, after the other tasks have stopped and the temporary directory is removed.
The driver stops them with a file, not ``ray.cancel``: it creates ``STOP_FILE`` in the
temporary directory, each running task sees it at its next chunk read or block written and
returns, and the driver waits for every one. (In Ray 2.60 a cancel that meets a task's
reply in flight fails a check in Ray's C++ core, which ends the driver's process: a
failed shard could kill the program that asked for the pack.)
Every task unpickles the settings, tokenizer included; the copies of a
:class:`~seqpack.io.TokenizerFile` in one worker share one ``tokenizers.Tokenizer``, so
a worker builds it once, not once per shard (which cost about 1.5x the CPU time).

Tasks rather than Ray Data: a shard's work is one indivisible step (placement needs all
of a shard's lengths before anything is written) whose output is a directory on disk,
not rows to stream onward, and the driver needs exactly one result per shard, in shard
order, to number the parts. Ray Data's streaming blocks would add a repartition and a
custom datasink to recover what one task per shard gives directly.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import signal
import socket
import threading
from contextlib import contextmanager, suppress
from pathlib import Path

from .._arguments import INT32_MAX, check_int
from ..errors import InvalidInputError, SeqpackError
from ..io.job import PackJob, run_job
from ..io.progress import Progress
from ..io.readers import missing_extra
from ..io.shards import pack_shard

#: Times Ray reruns a shard whose worker process died.
MAX_RETRIES = 3

#: Seconds to wait for a TCP connection to an explicit cluster address.
CONNECT_TIMEOUT = 5.0

#: Created in the temporary directory when a run ends early: each running task stops.
STOP_FILE = ".stop"


def import_ray():
    """Ray (the ``ray`` extra), or an error naming the extra."""
    try:
        import ray
    except ImportError:
        raise missing_extra("the Ray engine", "ray") from None
    return ray


#: What a gRPC client sends first: the HTTP/2 connection preface and an empty SETTINGS frame.
HTTP2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def check_reachable(address: str | None, timeout: float = CONNECT_TIMEOUT, source: str = "") -> None:
    """Raise :class:`InvalidInputError` unless ``address`` (``host:port`` or
    ``ray://host:port``) answers as a Ray cluster's gRPC server does within ``timeout``
    seconds: a TCP connection opens, and the server's first HTTP/2 frame is SETTINGS (with
    ``RAY_USE_TLS`` set, only the connection is checked). ``ray.init`` retries an
    unreachable address, or one where something else listens (the dashboard's port, for
    one), for minutes without a word; this fails in seconds instead. Other addresses
    (``None``, ``"auto"``, other schemes, no port) are left to Ray. ``source`` follows the
    address in errors (" (from RAY_ADDRESS)")."""
    if address is None:
        return
    target = address[len("ray://"):] if address.startswith("ray://") else address
    host, colon, port = target.rpartition(":")
    if not colon or "://" in target or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as connection:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return
            answer = _first_frame(connection)
    except OSError as error:
        reason = f"no answer within {timeout:g} s" if isinstance(error, TimeoutError) else error.strerror or str(error)
        raise InvalidInputError(f"cannot reach a Ray cluster at {address}{source}: {reason}") from None
    if len(answer) == 9 and answer[3] == 4 and answer[5:9] == bytes(4):
        return
    if answer.startswith(b"HTTP/"):
        what = ("an HTTP/1 server answers there (the Ray dashboard does, on port 8265 by default; a cluster's "
                "address is its GCS port, 6379 by default, or ray://host:10001 for Ray Client)")
    elif not answer:
        what = "the server closed the connection without a word"
    else:
        what = f"the server answered {answer[:9]!r}"
    raise InvalidInputError(f"{address}{source} is not a Ray cluster's address: {what}")


def _first_frame(connection: socket.socket) -> bytes:
    """The first 9 bytes (an HTTP/2 frame header) a server sends after the gRPC greeting,
    fewer if it closes the connection first."""
    connection.sendall(HTTP2_GREETING)
    answer = b""
    while len(answer) < 9:
        chunk = connection.recv(9 - len(answer))
        if not chunk:
            break
        answer += chunk
    return answer


class _Stopped(Exception):
    """The driver asked the task to stop (``STOP_FILE`` exists)."""


class _StopWatch(Progress):
    """No bars: raises ``_Stopped`` at the next chunk read or block written once the
    driver's ``STOP_FILE`` exists (a stat per chunk of up to 8 MiB)."""

    def __init__(self, stop_file: Path):
        super().__init__(enabled=False)
        self.stop_file = stop_file

    def reading(self, documents: int, tokens: int, nbytes: int) -> None:
        if self.stop_file.exists():
            raise _Stopped
        super().reading(documents, tokens, nbytes)

    def advance(self, amount: int) -> None:
        if self.stop_file.exists():
            raise _Stopped
        super().advance(amount)


def pack_shard_task(job: PackJob, shard, staging: str, directory: str):
    """A Ray task: pack one shard, in the driver's working ``directory`` (so that relative
    paths name the same files, and the manifest and errors name them as the user did).
    Returns ``(result, None)``, or ``(None, failure)`` for a seqpack error (its class,
    message and attributes: not every error class pickles) or an OSError or MemoryError
    (the error itself: a file that vanished or could not be read is named as the serial
    engine names it), or ``(None, None)`` once the driver has asked the run to stop
    (``STOP_FILE``): then the task leaves nothing in ``staging``."""
    stop_file = Path(staging) / STOP_FILE
    if stop_file.exists():
        return None, None
    os.chdir(directory)
    try:
        return pack_shard(job, shard, Path(staging), _StopWatch(stop_file)), None
    except _Stopped:
        return None, None
    except SeqpackError as error:
        return None, (type(error), str(error), vars(error))
    except (OSError, MemoryError) as error:
        return None, error


def _raise_failure(failure) -> None:
    if isinstance(failure, BaseException):
        raise failure
    kind, message, attributes = failure
    error = kind.__new__(kind)
    error.args = (message,)
    error.__dict__.update(attributes)
    raise error


def _task_failure(error) -> str:
    """One line for a failed Ray task: the exception it raised (not Ray's remote traceback,
    in colour), or the first line of Ray's own error (a worker that died)."""
    cause = getattr(error, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(error)
    lines = re.sub(r"\x1b\[[0-9;]*m", "", text).strip().splitlines()
    return lines[0] if lines else type(error).__name__


@contextmanager
def _signals_raised():
    """Raise a signal handler's exception (SIGTERM's, not an ``Exception``) as itself:
    raised inside Ray's own signal check, it arrives wrapped in a SystemError."""
    try:
        yield
    except SystemError as error:
        cause = error.__cause__
        if isinstance(cause, BaseException) and not isinstance(cause, Exception):
            raise cause from None
        raise


class RayRunner:
    """A :class:`~seqpack.io.job.Runner` that packs each shard as a Ray task taking
    ``cpus_per_task`` CPUs, at most ``workers`` at once (default: as many as the
    cluster's CPUs take), each rerun up to ``max_retries`` times if its worker dies; a
    job that names no shard count has one shard per 64 MiB of input. With ``shutdown``,
    it shuts Ray down once every shard is in, before the dataset is published, so that a
    Ctrl-C during the shutdown (a second or more) never leaves a complete dataset behind
    a failed command.

    The tokenizers library sizes its thread pool once per process, from
    ``RAYON_NUM_THREADS``; the tasks' runtime environment sets it, so Ray runs them in
    worker processes started with that many threads and never reuses a worker whose
    pool has another size."""

    default_shards = None
    in_process = False

    def __init__(self, ray, *, cpus_per_task: int, max_retries: int, workers: int | None = None,
                 shutdown: bool = False):
        threads = str(cpus_per_task)
        self.ray, self.workers, self.shutdown = ray, workers, shutdown
        self.remote = ray.remote(pack_shard_task).options(
            num_cpus=cpus_per_task, max_retries=max_retries,
            runtime_env={"env_vars": {"RAYON_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}},
        )

    def __call__(self, job, shards, staging, progress):
        ray, workers = self.ray, self.workers
        settings = ray.put(job.for_workers())
        waiting = list(reversed(shards))
        pending = {}
        try:
            while waiting or pending:
                while waiting and (workers is None or len(pending) < workers):
                    shard = waiting.pop()
                    pending[self.remote.remote(settings, shard, str(staging), os.getcwd())] = shard
                with _signals_raised():
                    done, _ = ray.wait(list(pending), num_returns=1)
                shard = pending.pop(done[0])
                try:
                    result, failure = ray.get(done[0])
                except ray.exceptions.RayError as error:
                    raise SeqpackError(f"{shard.label}: the Ray task failed: {_task_failure(error)}") from None
                if failure is not None:
                    _raise_failure(failure)
                yield shard.index, result
            if self.shutdown:
                with _signal_handlers_kept():
                    ray.shutdown()
        finally:
            if pending:  # nothing may still write into the directory the driver removes
                with suppress(OSError):  # unwritable: the tasks run to their end instead
                    (Path(staging) / STOP_FILE).touch()
                with _signals_raised():   # (the wait lasts until each task's next chunk)
                    for ref in pending:
                        try:
                            ray.get(ref)
                        except ray.exceptions.RayError:
                            pass


def pack_corpus(inputs, out, *, address: str | None = None, workers: int | None = None,
                max_retries: int = MAX_RETRIES, **options) -> dict:
    """Pack ``inputs`` at ``out`` on a Ray cluster, one task per shard; return the manifest.

    ``options`` are :func:`seqpack.io.pack_corpus`'s arguments, with the same names,
    meanings and defaults, and the dataset's bytes equal its bytes with the same
    ``shards``, whatever the number of workers or the order in which they finish. Here a
    job that names no ``shards`` has one per 64 MiB of input, and each task takes
    ``threads`` CPUs (default 1), which must fit the cluster's largest node. ``address``,
    ``workers`` and ``max_retries`` are :func:`run_on_ray`'s.
    """
    return run_on_ray(PackJob.of(inputs, out, **options), address=address, workers=workers,
                      max_retries=max_retries)


def run_on_ray(job: PackJob, *, address: str | None = None, workers: int | None = None,
               max_retries: int = MAX_RETRIES) -> dict:
    """Run ``job`` (a :class:`~seqpack.io.PackJob`) on a Ray cluster with a
    :class:`RayRunner`; return the manifest.

    ``address`` is the cluster to join (``"auto"``, ``"host:6379"``, or Ray Client's
    ``"ray://host:10001"``, which needs ``pip install "ray[client]"``; a
    ``host:port`` that does not answer as a Ray cluster within :data:`CONNECT_TIMEOUT`
    seconds is an error); without one, the cluster in ``RAY_ADDRESS`` (probed the same
    way) or, without that, a local cluster started here and shut down at the end. A Ray
    already initialized in this process is used as it is (then ``address`` is an
    error). At most ``workers`` tasks run at once (default: as many as the cluster's CPUs
    take); a task whose worker dies is rerun up to ``max_retries`` times. The job's
    output was checked when it was built, before any cluster starts.
    """
    max_retries = check_int("max_retries", max_retries, minimum=0, maximum=INT32_MAX)  # (Ray's own bound)
    workers = None if workers is None else check_int("workers", workers)
    if address is not None and not isinstance(address, str):
        raise InvalidInputError(f"address must be a str such as 'auto' or 'host:6379', not {type(address).__name__}")
    cpus = job.threads or 1
    ray = import_ray()
    started = not ray.is_initialized()
    if not started and address is not None:
        raise InvalidInputError(f"Ray is already initialized in this process, so address {address!r} cannot choose "
                                f"the cluster: leave address out, or call ray.shutdown() first")
    try:
        with _signal_handlers_kept():
            if started:
                _join_or_start(ray, address, quiet=not job.progress)
        _check_cpus(ray, cpus)
        return run_job(job, RayRunner(ray, cpus_per_task=cpus, max_retries=max_retries, workers=workers,
                                      shutdown=started))
    finally:
        if started:
            with _signal_handlers_kept():
                ray.shutdown()


def _signature_of_pack_corpus() -> inspect.Signature:
    """:func:`seqpack.io.pack_corpus`'s parameters, then the Ray runner's own."""
    shared = list(inspect.signature(PackJob.of).parameters.values())
    own = [parameter for name, parameter in inspect.signature(pack_corpus).parameters.items()
           if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    return inspect.Signature(shared + own, return_annotation=dict)


pack_corpus.__signature__ = _signature_of_pack_corpus()


def _join_or_start(ray, address: str | None, quiet: bool = False) -> None:
    """``ray.init``: join ``address`` (or ``RAY_ADDRESS``, as Ray would), probed first, or
    start a local cluster; a malformed address is an error naming it. ``quiet`` keeps
    Ray's warnings (its token authentication notice, for one) off stderr."""
    joined = address if address is not None else os.environ.get("RAY_ADDRESS") or None
    source = "" if address is not None else " (from RAY_ADDRESS)"
    check_reachable(joined, source=source)
    options = {"include_dashboard": False} if joined is None else {}
    try:
        ray.init(address=address, logging_level=logging.ERROR if quiet else logging.WARNING, **options)
    except (ConnectionError, ValueError) as error:
        raise InvalidInputError(f"cannot join the Ray cluster at {joined}{source}: {error}") from None


@contextmanager
def _signal_handlers_kept():
    """Keep this process's SIGTERM and SIGINT handlers across ``ray.init`` and
    ``ray.shutdown`` (Ray installs its own, which exit with the signal's number and stay
    after the cluster stops), so a signal still cleans up as the caller arranged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for number, handler in kept.items():
            if handler is not None:
                signal.signal(number, handler)


def _check_cpus(ray, threads: int) -> None:
    """A task of ``threads`` CPUs must fit a node: Ray would wait for one for ever. (A
    cluster whose nodes have no CPUs yet is left alone: an autoscaler may add them.)"""
    largest = max((node.get("Resources", {}).get("CPU", 0) for node in ray.nodes() if node.get("Alive")), default=0)
    if 0 < largest < threads:
        raise InvalidInputError(f"each task takes threads={threads} CPUs, but the largest node of the Ray cluster "
                                f"has {largest:g}: give at most that many threads")
