"""The files a directory stands for: regular files, sorted, hidden names skipped,
filtered by a name pattern, linked directories followed. A link cycle, a directory
reached twice, or a matching name that is not a regular file is an error; packed
datasets inside are set aside, never read.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import InvalidInputError
from ..format import is_packed_dataset
from .base import cannot_read, link_loop


def _identity(path) -> tuple[int, int]:
    """``(device, inode)`` of a directory or file, links followed."""
    status = os.stat(path)
    return status.st_dev, status.st_ino


def _walk_error(error: OSError):
    """A directory that cannot be listed is an error, not skipped."""
    raise cannot_read(error.filename, error)


def _files_under(path: Path, pattern: str | None) -> tuple[list[Path], list[Path]]:
    """``(files, datasets)``: the regular files under a directory, sorted, hidden names
    skipped, matching ``pattern``, and the packed datasets left out of them (subdirectories
    :func:`~seqpack.io.format.is_packed_dataset` recognizes). Linked directories are
    followed; a link to a directory's own ancestor (a cycle), a directory reached a second
    time through links (its files would be inputs twice), a file reached a second time
    (through a symbolic or hard link), or a matching name that is not a regular file (a
    dangling link, a link that loops, a pipe), is an error."""
    found, datasets = [], []
    top = os.fspath(path)
    ancestors = {top: {_identity(top): top}}  # each directory to visit: the directories above it and itself
    reached = {_identity(top): top}  # every directory met so far
    met = {}  # every file found so far, by identity
    for root, dirs, files in os.walk(top, onerror=_walk_error, followlinks=True):
        above = ancestors.pop(root)
        visible = sorted(d for d in dirs if not d.startswith("."))
        packed = [d for d in visible if is_packed_dataset(Path(root, d))]
        datasets.extend(Path(root, d) for d in packed)
        dirs[:] = [d for d in visible if d not in packed]
        for name in dirs:
            directory = os.path.join(root, name)
            key = _identity(directory)
            if key in above:
                raise InvalidInputError(f"{directory}: a directory link cycle (it leads back to {above[key]})")
            if key in reached:  # found now, not after walking every path to it (2**depth of them)
                raise InvalidInputError(f"{directory}: the directory {reached[key]} again, through a link: its "
                                        f"files would be inputs twice")
            reached[key] = directory
            ancestors[directory] = {**above, key: directory}
        for name in sorted(files):
            if name.startswith(".") or (pattern and not Path(name).match(pattern)):
                continue
            candidate = Path(root) / name
            if not candidate.is_file():
                what = link_loop(candidate) or "not a regular file (a dangling link, a pipe or a device)"
                raise InvalidInputError(f"{candidate}: {what}; remove it or leave it out with --glob")
            key = _identity(candidate)
            if key in met:
                raise InvalidInputError(f"{candidate}: the file {met[key]} again, through a link: it would be an "
                                        f"input twice; remove one or leave it out with --glob")
            met[key] = candidate
            found.append(candidate)
    return found, datasets

