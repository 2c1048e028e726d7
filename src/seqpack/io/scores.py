"""Per-example scores of a packed dataset as a Parquet file, written crash-safely.

:func:`scores_table` turns an evaluation (per-example ordinals, IDs, supervised target
counts and NLL sums: what ``seqpack.hf.evaluate`` returns) into one row per example, named
by where it came from; :func:`write_scores` writes it. The file is written into a hidden
temporary sibling of its output (``.NAME.seqpack-partial-HOST-PID-ID``, the names
:mod:`seqpack.io.publish` gives), flushed and fsynced, and renamed into place last: an
interrupted or failed run leaves no output and no sibling (a killed one leaves the
sibling, which the next write beside it removes), and ``--force`` replaces an old file
in one atomic rename. pyarrow (the ``corpus`` extra) is imported only here.

The columns (:data:`COLUMNS`): ``example`` (the global example ordinal), ``input`` (the
input's name as the manifest records it), ``line`` (the document's place in that input
as its reader counts it: 1-based line of JSONL, 0-based row of Parquet/Arrow, 0-based
sequence of Megatron, 1 for a text file, which is one document), ``example_id`` (with
``[start:stop]`` for a window of a longer document),
``targets`` (supervised targets), ``nll_sum`` (sum of -log p over them, nats),
``nll_mean`` (``nll_sum / targets``) and ``perplexity`` (``exp(nll_mean)``).
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import numpy as np

from ..errors import InvalidInputError
from .publish import (check_name_length, check_outside_datasets, check_replaceable_file, fsync_directory,
                      left_by_a_dead_writer, signals_deferred, temporary_sibling, this_host)
from .readers import missing_extra

#: The file's columns and their Arrow types, in order.
COLUMNS = (("example", "int64"), ("input", "string"), ("line", "int64"), ("example_id", "string"),
           ("targets", "int64"), ("nll_sum", "float64"), ("nll_mean", "float64"), ("perplexity", "float64"))
#: The schema metadata key under which the run's summary is kept (JSON).
METADATA_KEY = b"seqpack.scores"


def import_parquet():
    """``pyarrow`` and ``pyarrow.parquet`` (the ``corpus`` extra), or an error naming the extra."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise missing_extra("writing scores as Parquet", "corpus") from None
    return pyarrow, pyarrow.parquet


def check_scores_output(out: Path, force: bool) -> None:
    """Refuse an output that cannot be written or must not be replaced: an existing ``out``
    without ``force``, a directory or a file that is not Parquet even with it (``force``
    replaces only a scores file, never a model's ``config.json`` or weights), a
    missing parent, and a file inside a packed dataset, the one scored or another (which
    holds only its manifest and parts, so ``verify`` would fail on it)."""
    if out.name in ("", ".", ".."):
        raise InvalidInputError(f"the output {str(out)!r} ends in '.' or '..': name the scores file")
    check_outside_datasets(out, "--out")
    check_replaceable_file(out, "--out")
    if out.exists():
        if not force:
            raise InvalidInputError(f"{out} already exists (--force replaces it)")
        if out.is_dir():
            raise InvalidInputError(f"{out} is a directory; --force replaces only a file")
        if not _is_parquet(out):
            raise InvalidInputError(f"{out} is not a Parquet file; --force replaces only a scores file (this one "
                                    f"may be a model's config or weights, or another tool's data): name another")
    if not out.parent.is_dir():
        problem = "is not a directory" if out.parent.exists() else "does not exist"
        raise InvalidInputError(f"{out.parent} {problem} (the parent of {out})")
    check_name_length(out)


def example_sources(dataset, ordinals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(input, place)`` of each example ``ordinals`` names (int64 each): the index into the
    dataset's ``inputs`` of the input its document came from, and the document's place there
    (``documents.npy`` of the example's part, through its ``examples.npy``)."""
    ordinals = np.asarray(ordinals, dtype=np.int64)
    if ordinals.size and (ordinals.min() < 0 or ordinals.max() >= dataset.occurrence_count):
        raise InvalidInputError(f"an example ordinal lies outside the dataset's examples "
                                f"[0, {dataset.occurrence_count})")
    firsts = np.array([part.first_example for part in dataset.parts], dtype=np.int64)
    owners = np.searchsorted(firsts, ordinals, side="right") - 1     # each example's part
    sources = np.empty((ordinals.size, 2), dtype=np.int64)            # [examples, (input, place)]
    for index in np.unique(owners):
        part, chosen = dataset.parts[index], owners == index
        documents = part.examples[ordinals[chosen] - part.first_example, 0]
        sources[chosen] = part.documents[documents, :2]
    return sources[:, 0], sources[:, 1]


def scores_table(dataset, evaluation, metadata: dict | None = None):
    """The Arrow table of :data:`COLUMNS`, one row per example of ``evaluation`` (an
    ``Evaluation``: ordinals ascending, its arrays of one length), with ``metadata``
    (JSON-serializable) under :data:`METADATA_KEY`."""
    pyarrow, _ = import_parquet()
    ordinals = np.asarray(evaluation.ordinals, dtype=np.int64)
    targets = np.asarray(evaluation.targets, dtype=np.int64)
    sums = np.asarray(evaluation.nll_sums, dtype=np.float64)
    inputs, places = example_sources(dataset, ordinals)
    names = pyarrow.array([item.name for item in dataset.inputs], type=pyarrow.string())
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # no stored example lacks a target
        means = sums / targets
        perplexities = np.exp(means)
    columns = {"example": ordinals, "input": names.take(pyarrow.array(inputs)), "line": places,
               "example_id": pyarrow.array(evaluation.example_ids, type=pyarrow.string()), "targets": targets,
               "nll_sum": sums, "nll_mean": means, "perplexity": perplexities}
    schema = pyarrow.schema([(name, getattr(pyarrow, kind)()) for name, kind in COLUMNS],
                            metadata={METADATA_KEY: json.dumps(json_ready(metadata or {}), sort_keys=True,
                                                                allow_nan=False).encode()})
    return pyarrow.Table.from_pydict(columns, schema=schema)


def json_ready(record: dict) -> dict:
    """``record`` with each infinite or NaN float as None (JSON's null): JSON holds neither."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()}


def remove_dead_partials(out: Path) -> list[str]:
    """Remove the temporary siblings of ``out`` that killed writers on this host left (their
    process is gone); return their names. A running writer's, and one from another host,
    stay."""
    removed, host = [], this_host()
    try:
        entries = sorted(out.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = left_by_a_dead_writer(entry, host)
        if match is None or match["out"] != out.name or match["kind"] != "partial" or not entry.is_file():
            continue
        try:
            entry.unlink()
        except OSError:
            continue
        removed.append(entry.name)
    return removed


def _is_parquet(path: Path) -> bool:
    """Whether the file at ``path`` begins with Parquet's magic bytes (unreadable: no)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"PAR1"
    except OSError:
        return False


def _publish_new(temporary: Path, out: Path) -> None:
    """Rename ``temporary`` to ``out`` only if no ``out`` exists, atomically: a hard link
    fails on an existing name, so of two writers at once one is refused (a check and then
    a rename would let both succeed, the second replacing the first). A file system
    without hard links falls back to the check just made."""
    try:
        os.link(temporary, out)
    except FileExistsError:
        raise InvalidInputError(f"{out} already exists (--force replaces it)") from None
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV,
                               errno.EMLINK):
            raise
        os.replace(temporary, out)
        return
    temporary.unlink()


def write_scores(table, out: Path, *, force: bool) -> bool:
    """Write ``table`` as Parquet at ``out``: into a temporary sibling, fsynced, then renamed
    into place (``out`` checked again first) and the directory fsynced. Any failure or
    signal before the rename removes the sibling and leaves ``out`` as it was. SIGINT and
    SIGTERM are deferred across the rename; returns whether one came then (the file is
    complete all the same)."""
    _, parquet = import_parquet()
    check_scores_output(out, force)
    remove_dead_partials(out)
    temporary = temporary_sibling(out, "partial")
    try:
        with open(temporary, "xb") as handle:
            parquet.write_table(table, handle)
            handle.flush()
            os.fsync(handle.fileno())
        check_scores_output(out, force)   # whatever appeared at ``out`` since the start
        with signals_deferred() as caught:
            if force:
                os.replace(temporary, out)
            else:
                _publish_new(temporary, out)
            fsync_directory(out.parent)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return bool(caught)
