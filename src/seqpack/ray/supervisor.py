"""The command line's Ray engine, run as a supervised child process.

``seqpack pack --engine ray`` does not run Ray in its own process (unless that process
has imported Ray already: then it runs there, on that Ray). It starts the same
command again as a child (marked by ``SEQPACK_RAY_DRIVER`` in its environment), in a
session of its own, and waits for it. A Ray driver that a signal reaches at the wrong
moment can leave a state that lies: Ray installs handlers of its own during ``ray.init``
(one exits with the signal's number), its C++ core aborts when a task is completed
under it, and the processes of a local cluster outlive a driver that stops abruptly.
The supervisor, which never imports Ray, turns every such moment into one outcome:

- SIGINT and SIGTERM reach only the supervisor (the child is in its own session, so a
  terminal's Ctrl-C does not reach it). The supervisor kills the child and every process
  below it with SIGKILL, so nothing prints and nothing writes after the signal.
- On Linux the supervisor is a child subreaper, so Ray's processes whose parents died
  are still its descendants, found and killed too; elsewhere the child's process group
  is killed. The child dies with the supervisor (``PR_SET_PDEATHSIG``) where it can.
- Then what the child left beside the output is removed
  (:func:`seqpack.io.publish.remove_leftovers`: its writer is gone), a replaced dataset
  put back where the publish had not committed, and the command exits 130 or 143 with
  one line. If the child had already committed the new dataset (its manifest is in
  place), the command says so and exits 0, as every ``pack`` does: the dataset is the
  new one.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..io import publish

#: Set in the child's environment: run the engine here, do not supervise again.
DRIVER_VARIABLE = "SEQPACK_RAY_DRIVER"
#: The supervisor's process ID, in the child's environment.
PARENT_VARIABLE = "SEQPACK_RAY_SUPERVISOR"
#: ``prctl`` options (Linux).
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def supervised() -> bool:
    """Whether this process runs the engine itself: it is the supervised child, or Ray is
    already imported here (a program calling :func:`seqpack.cli.main` with Ray of its own,
    whose cluster it uses as it is)."""
    return os.environ.get(DRIVER_VARIABLE) == "1" or "ray" in sys.modules


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_supervisor() -> None:
    """In the supervised child: be killed when the supervisor dies (Linux), and stop now
    if it is already gone (adopted by another process)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.environ.get(PARENT_VARIABLE) != str(os.getppid()):
        raise SystemExit(1)


def _children() -> dict[int, list[int]]:
    """Every process's children, from ``/proc`` (empty where there is none)."""
    tree: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return tree
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(root: int, tree: dict[int, list[int]] | None = None) -> list[int]:
    """The processes below ``root`` (children, theirs, and so on), in ``tree`` (default:
    read from ``/proc`` now)."""
    tree, found, todo = _children() if tree is None else tree, [], [root]
    while todo:
        for child in tree.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants(spared: frozenset[int] = frozenset(), rounds: int = 20) -> None:
    """SIGKILL every process below this one but the ``spared`` children and what runs below
    them (the caller's own, when a program calls the command line), and reap what it killed,
    until none is left (a process may start another while the first round kills), at most
    ``rounds`` rounds. Only the killed processes are reaped: the caller's children keep
    their exit statuses."""
    for _ in range(rounds):
        tree = _children()
        kept = set(spared) | {pid for child in spared for pid in descendants(child, tree)}
        below = [pid for pid in descendants(os.getpid(), tree) if pid not in kept]
        if not below:
            return
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in below:   # a killed child of ours is reaped here; others by their parents
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.02)


def run_supervised(argv: list[str], out: Path) -> int:
    """Run ``seqpack argv`` (a pack with ``--engine ray``) as a supervised child writing
    ``out``; return its exit status. SIGINT and SIGTERM (raised here as their exceptions)
    kill the child's whole tree and clear up what it left beside ``out`` before they go
    on (the command line then tells whether ``out`` had been published)."""
    spared = frozenset(_children().get(os.getpid(), ()))   # the caller's own children, if any
    subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
    environment = {**os.environ, DRIVER_VARIABLE: "1", PARENT_VARIABLE: str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-m", "seqpack", *argv], env=environment, start_new_session=True)
    try:
        status = child.wait()
        with publish.signals_deferred():
            kill_descendants(spared)  # what a finished child left running (Ray's agents, idle workers)
    except BaseException:
        with publish.signals_deferred():  # a second signal waits for the clean-up
            _stop(child, spared)
            publish.remove_leftovers(out.parent)
        raise
    finally:
        if subreaper:
            _prctl(PR_SET_CHILD_SUBREAPER, 0)
    if status < 0:
        print(f"seqpack: error: the Ray driver process was killed by signal {-status}", file=sys.stderr)
        publish.remove_leftovers(out.parent)
        return 1
    return status


def _stop(child: subprocess.Popen, spared: frozenset[int]) -> None:
    """SIGKILL the child, its process group and everything below this process but the
    ``spared`` children's trees; reap them."""
    for kill in (lambda: os.killpg(child.pid, signal.SIGKILL), child.kill):
        try:
            kill()
        except OSError:
            pass
    child.wait()
    kill_descendants(spared)
