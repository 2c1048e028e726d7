"""Writing a packed dataset crash-safely: hashed, durable writes, and the publish transaction.

A part's files are written once, front to back, through :class:`HashingFile` (or
:func:`write_array`), which keeps each one's SHA-256 and size for the manifest and
flushes and fsyncs it on close; the manifest through :func:`write_json`, fsynced too.
:func:`file_sha256` hashes a file already on disk. The files' layout and the manifest's seal are :mod:`seqpack.io.format`'s.

A writer takes :func:`pending_dataset`, a hidden temporary sibling directory of its
output (the output checked first by :func:`check_output`: it must not destroy or read
itself), and writes everything into it; :func:`publish` renames the directory into place
and ``manifest.json`` in last, atomically, from a temporary name of this writer's own. A
directory without ``manifest.json`` is incomplete and is refused by ``open_dataset`` and
``verify``. The rename of the manifest is the commit point: a failure before it puts the
old dataset back, and a signal (Ctrl-C, SIGTERM) after it no longer fails the publish.

Every temporary name carries its writer's host and process ID
(``.NAME.seqpack-partial-HOST-PID-ID``, ID twelve hex digits, and ``seqpack-old`` for a replaced
dataset on its way out), so a later pack into the same directory removes what a killed
writer left (:func:`remove_leftovers`) and never what a running one is writing.
Writers into one directory take turns at the renames (an exclusive ``flock`` on the
parent directory), so concurrent ``--force`` packs publish one after another.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .._arguments import check_bool
from ..errors import InvalidInputError
from .format import FORMAT_VERSION, MANIFEST, is_packed_dataset, part_files, part_name, seal

#: Writes at least this large are hashed on a second thread while they are written, and
#: start writing back to the disk (on a third) while the caller prepares the next one.
PARALLEL_HASH_BYTES = 1 << 20
#: ``os.fdatasync`` where the platform has it.
DATA_SYNC = getattr(os, "fdatasync", os.fsync)


class HashingFile:
    """A file written once, front to back, whose SHA-256 and size are kept as it grows;
    ``close()`` flushes and fsyncs it and returns its manifest record.

    Large writes are hashed on a helper thread during the write (both release the GIL);
    ``write`` returns only when both are done, so the caller may reuse its buffer. After a
    large write, a second helper syncs what is written so far while the caller prepares
    the next write (one sync in flight), so the disk works while the caller does and the
    final fsync has little left to do. A failed sync raises from the next ``write`` or
    from ``close``.
    """

    def __init__(self, path: Path):
        self.path = path
        self._handle = open(path, "wb")
        self._digest = hashlib.sha256()
        self._helpers = None     # (hasher, syncer) once a large write comes
        self._syncing = None     # the sync in flight
        self.size = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        if view.nbytes >= PARALLEL_HASH_BYTES:
            if self._helpers is None:
                self._helpers = (ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1))
            hasher, syncer = self._helpers
            hashing = hasher.submit(self._digest.update, view)
            try:
                self._handle.write(view)
            finally:
                hashing.result()
            self._wait_for_sync()
            self._handle.flush()
            self._syncing = syncer.submit(DATA_SYNC, self._handle.fileno())
        else:
            self._handle.write(view)
            self._digest.update(view)
        self.size += view.nbytes

    def _wait_for_sync(self) -> None:
        syncing, self._syncing = self._syncing, None
        if syncing is not None:
            syncing.result()

    def close(self) -> dict:
        self._wait_for_sync()
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self.abandon()
        return {"bytes": self.size, "sha256": self._digest.hexdigest()}

    def abandon(self) -> None:
        """Close without syncing (the partial file is removed with its directory); a sync
        in flight is waited for, its outcome ignored."""
        if self._helpers is not None:
            for helper in self._helpers:
                helper.shutdown()
        self._syncing = None
        self._handle.close()


def write_array(path: Path, array: np.ndarray) -> dict:
    """Save ``array`` as ``.npy`` (fsynced); return its manifest record."""
    target = HashingFile(path)
    try:
        np.lib.format.write_array(target, np.ascontiguousarray(array), allow_pickle=False)
    except BaseException:
        target.abandon()
        raise
    return target.close()


def write_json(path: Path, manifest: dict) -> None:
    """``manifest`` as JSON at ``path``, flushed and fsynced; a failure removes the file."""
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(manifest, handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (new names, renames) durable."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open directories
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def file_sha256(path) -> str:
    """Lowercase hex SHA-256 of a file's bytes, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


#: A temporary sibling's name: its dataset's name, its kind, its writer's host and PID.
LEFTOVER = re.compile(r"^\.(?P<out>.+)\.seqpack-(?P<kind>partial|old)-(?P<host>[A-Za-z0-9._]+)-(?P<pid>\d+)-[0-9a-f]{12}$")
#: A manifest on its way in (inside the dataset's directory).
MANIFEST_TEMPORARY = re.compile(r"^\." + re.escape(MANIFEST) + r"\.[A-Za-z0-9._]+-\d+-[0-9a-f]{12}\.partial$")


def this_host() -> str:
    """This machine's name as temporary names carry it (letters, digits and dots, at most 32)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:32] or "host"


def _writer_tag() -> str:
    return f"{this_host()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def temporary_sibling(out: Path, kind: str) -> Path:
    """A fresh hidden sibling of ``out`` of ``kind`` (``partial`` or ``old``), named for this writer."""
    return out.parent / f".{out.name}.seqpack-{kind}-{_writer_tag()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def _renames_locked(parent: Path):
    """Hold an exclusive ``flock`` on ``parent`` (the directory itself, so no lock file is
    left): seqpack's writers into one directory take turns at their renames."""
    descriptor = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def remove_leftovers(parent: Path) -> list[str]:
    """Clear up the temporary siblings in ``parent`` that seqpack writers on this host left
    when they were killed (their process is gone); return their names. A replaced
    dataset on its way out is put back where the new one never committed (its name holds
    no complete dataset: nothing, or an incomplete one, which goes); everything else a
    dead writer left is removed. A writer still running, or one on another host (a
    shared file system), is left alone."""
    removed, host = [], this_host()
    with contextlib.suppress(OSError), _renames_locked(parent):
        for entry in sorted(parent.iterdir()):
            _remove_leftover(parent, entry, host, removed)
    return removed


def left_by_a_dead_writer(entry: Path, host: str):
    """The :data:`LEFTOVER` match of ``entry`` if a seqpack writer on ``host`` left it and is
    no longer running, else None (a link is never a leftover)."""
    match = LEFTOVER.match(entry.name)
    if match is None or match["host"] != host or _alive(int(match["pid"])) or entry.is_symlink():
        return None
    return match


def _remove_leftover(parent: Path, entry: Path, host: str, removed: list) -> None:
    """Clear up ``entry`` (see :func:`remove_leftovers`) if a dead writer on ``host`` left it."""
    match = left_by_a_dead_writer(entry, host)
    if match is None:
        return
    target = parent / match["out"]
    with contextlib.suppress(OSError):
        if match["kind"] == "old" and not is_packed_dataset(target):
            if target.is_dir() and not target.is_symlink() and _stranger(target) is None:
                shutil.rmtree(target)  # the dead writer's incomplete new dataset
            if not (target.exists() or target.is_symlink()):
                os.rename(entry, target)
                removed.append(entry.name)
            return
        shutil.rmtree(entry)
        removed.append(entry.name)


def is_part_name(name) -> bool:
    """Whether ``name`` names a part directory (``part-00000``, ...)."""
    return (isinstance(name, str) and name.startswith("part-") and len(name) >= len(part_name(0))
            and name[5:].isascii() and name[5:].isdigit())


def _stranger(directory: Path) -> str | None:
    """The first entry of ``directory`` that no packed dataset holds, or None: a dataset
    holds only its seqpack ``manifest.json`` (or none yet, or one on its way in) and part
    directories (``part-NNNNN``) holding only part files."""
    for entry in sorted(directory.iterdir()):
        if entry.name == MANIFEST:
            if not is_packed_dataset(directory):
                return f"{MANIFEST}, which is not a seqpack manifest"
        elif MANIFEST_TEMPORARY.match(entry.name) and entry.is_file() and not entry.is_symlink():
            continue  # a writer's manifest on its way in
        elif not is_part_name(entry.name) or entry.is_symlink() or not entry.is_dir():
            return repr(entry.name)
        else:
            inside = sorted(child.name for child in entry.iterdir()
                            if child.name not in part_files(FORMAT_VERSION))
            if inside:
                return repr(f"{entry.name}/{inside[0]}")
    return None


def _input_twice(item, first) -> InvalidInputError:
    """The error for ``item`` naming the file ``first`` named already, each said as given
    or as found inside its directory."""
    if item.within and item.within == first.within:
        return InvalidInputError(f"the directory {item.within} is an input twice (its file {item.name} among "
                                 f"others): give each directory once")
    name = f"{item.name} (inside {item.within})" if item.within else item.name
    also = f"inside {first.within}" if first.within else f"as {first.name}"
    return InvalidInputError(f"{name} is an input twice (also {also}): give each file once")


def _file_identity(path: Path):
    """``(device, inode)`` of the file at ``path``, which names it through hard links too;
    ``path`` itself where there is no such file (a Megatron prefix names two)."""
    try:
        status = os.stat(path)
    except OSError:
        return path
    return status.st_dev, status.st_ino


def check_output(out: Path, force: bool, inputs=()) -> None:
    """Refuse an output that would destroy or read itself.

    An existing ``out`` is refused unless ``force``, and even then unless it is a packed
    dataset (a directory holding only ``manifest.json`` and part directories, complete or
    not) or an empty directory: ``--force`` never deletes anything else. Its parent must
    exist, inside no packed dataset. ``inputs`` (:class:`~seqpack.io.readers.Input` records)
    must name each file once (through hard and symbolic links too) and none inside ``out``,
    and ``out`` must not lie inside (or be) a directory an input was found in.
    """
    force = check_bool("force", force)  # a truthy "no" must not replace a dataset
    if out.name in ("", ".", ".."):
        raise InvalidInputError(
            f"the output {str(out)!r} ends in '.' or '..': name the dataset's own directory (such as "
            f"../{out.resolve().name or 'packed'}), which is written beside it and then renamed into place"
        )
    if out.exists() or out.is_symlink():
        if not force:
            raise InvalidInputError(f"{out} already exists (--force replaces it)")
        if out.is_symlink() or not out.is_dir():
            raise InvalidInputError(f"{out} is not a directory; --force replaces only a packed dataset")
        stranger = _stranger(out)
        if stranger is not None:
            raise InvalidInputError(
                f"{out} is not a packed dataset (it holds {stranger}); --force replaces only a packed "
                f"dataset: choose another --out"
            )
    if not out.parent.is_dir():
        problem = "is not a directory" if out.parent.exists() else "does not exist"
        raise InvalidInputError(f"{out.parent} {problem} (the parent of {out})")
    check_outside_datasets(out, "the output")
    target = out.resolve()
    seen = {}
    for item in inputs:
        if item.kind == "table":       # an in-memory table, not a file
            continue
        path = Path(item.name).resolve()
        key = _file_identity(path)
        if key in seen:
            raise _input_twice(item, seen[key])
        seen[key] = item
        if path == target or target in path.parents:
            raise InvalidInputError(f"input {item.name} lies inside the output {out}: packing would replace it")
    for directory in dict.fromkeys(item.within for item in inputs if item.within):
        found = Path(directory).resolve()
        if target == found or found in target.parents:
            raise InvalidInputError(f"the output {out} lies inside the input directory {directory}: write it "
                                    f"outside the inputs")


def check_outside_datasets(out: Path, what: str) -> None:
    """Refuse an output ``out`` inside a packed dataset (an ancestor holding a seqpack
    manifest, the part directories included): a dataset holds only its manifest and
    parts, so ``verify`` would then fail on it."""
    for directory in out.resolve().parents:
        if is_packed_dataset(directory):
            raise InvalidInputError(f"{what} {out} is inside the packed dataset {directory}, which holds only its "
                                    f"manifest and parts: write it elsewhere")


def check_replaceable_file(out: Path, what: str) -> None:
    """Refuse an existing ``out`` that a file written beside it and renamed into place must
    not replace: a symbolic link, a FIFO, a device or a socket (``/dev/stdout`` would become
    a regular file, and nothing would reach the terminal)."""
    if out.is_symlink() or (out.exists() and not out.is_file() and not out.is_dir()):
        kind = "a symbolic link" if out.is_symlink() else "not a regular file"
        raise InvalidInputError(f"{what} {out} is {kind}; seqpack writes a new file or replaces a regular one "
                                f"whole: name a file")


def check_name_length(out: Path) -> None:
    """Refuse an output whose temporary siblings' names would be too long for the file system."""
    longest = len(os.fsencode(temporary_sibling(out, "partial").name))
    try:
        limit = os.pathconf(out.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if longest > limit:
        suffix = longest - len(os.fsencode(out.name))
        raise InvalidInputError(
            f"the output's name is {len(os.fsencode(out.name))} bytes; it is written first under a hidden sibling "
            f"name {suffix} bytes longer ('.NAME.seqpack-partial-HOST-PID-ID'), and this file system allows "
            f"{limit}: give --out a name of at most {limit - suffix} bytes")


@contextlib.contextmanager
def pending_dataset(out: Path, force: bool, inputs=()):
    """A hidden temporary sibling of ``out`` to write into; removed on any failure.

    What killed writers left beside ``out`` is cleared up first (:func:`remove_leftovers`:
    a dataset that a killed ``--force`` had moved aside comes back), then ``out``, ``force``
    and ``inputs`` are checked (:func:`check_output`). The
    caller finishes with :func:`publish`, which renames it into place.
    """
    remove_leftovers(out.parent)  # first: a dataset a killed --force left hidden comes back before out is checked
    check_output(out, force, inputs)
    check_name_length(out)
    staging = temporary_sibling(out, "partial")
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextlib.contextmanager
def signals_deferred():
    """Within the block, SIGINT and SIGTERM are recorded (in the list it yields) instead of
    handled; outside the main thread, where no handler runs, nothing changes."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    kept = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    for number in kept:
        signal.signal(number, lambda received, frame: caught.append(received))
    try:
        yield caught
    finally:
        for number, handler in kept.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def publish(staging: Path, out: Path, manifest: dict, force: bool) -> None:
    """Rename ``staging`` to ``out`` (replacing an old ``out`` only when ``force``), then
    rename ``manifest.json`` in last, atomically. Until that final rename ``out`` has no
    manifest and is refused as incomplete, and any failure on the way (a full disk,
    Ctrl-C) puts everything back: the new files at ``staging`` (which the caller removes)
    and the old ``out`` where it was. The final rename commits: from it on, SIGINT and
    SIGTERM are deferred until the old dataset is removed, and one that arrives stops the
    removal (the next pack beside ``out`` finishes it) without failing the publish; it is
    raised again once the dataset is published (its handler then runs, as for a signal
    that comes just after). The renames hold the parent directory's lock, so concurrent
    writers publish in turn."""
    temporary = staging / f".{MANIFEST}.{_writer_tag()}.partial"
    write_json(temporary, seal(manifest))
    fsync_directory(staging)
    old, committed, caught = None, False, []
    with _renames_locked(out.parent):
        try:
            if out.exists() or out.is_symlink():
                check_output(out, force)   # whatever appeared there since the start is checked again
                old = temporary_sibling(out, "old")
                os.rename(out, old)
            os.rename(staging, out)
            fsync_directory(out.parent)
            with signals_deferred() as caught:
                os.rename(out / temporary.name, out / MANIFEST)
                committed = True
                fsync_directory(out)
                if old is not None:
                    _remove_unless(old, caught)
        except BaseException:
            if not committed:
                _put_back(staging, out, old)
                raise
            # (else the dataset is published; only a removal of the old one failed)
    for number in caught[:1]:   # the signal the commit deferred, now that nothing is left to undo
        signal.raise_signal(number)


def _remove_unless(directory: Path, caught: list) -> None:
    """Remove ``directory`` entry by entry, stopping when ``caught`` fills (a signal came)."""
    for entry in sorted(directory.iterdir()):
        if caught:
            return
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    if not caught:
        shutil.rmtree(directory, ignore_errors=True)


def _put_back(staging: Path, out: Path, old: Path | None) -> None:
    """Undo a :func:`publish` stopped at any step before its commit (judged by what is on disk)."""
    with contextlib.suppress(OSError):
        if not staging.exists() and (out.exists() or out.is_symlink()) and (old is None or old.exists()):
            os.rename(out, staging)       # the new files, moved back for the caller to remove
        if old is not None and old.exists() and not (out.exists() or out.is_symlink()):
            os.rename(old, out)
