"""Packing a corpus in shards: one part per shard, the same bytes whoever packs it.

:func:`plan_shards` splits the readers' inputs into at most ``count`` contiguous shards
of about equal input bytes, in input order: whole files (a directory's files one by
one), Parquet files by row groups, and JSONL files of at least a shard's bytes by line
ranges cut near the shard boundaries. :func:`pack_shard` packs one shard on its own into
one part (placement policies apply within a shard, never across shards).
:func:`pack_sharded` runs the shards, one after another here or through a runner (as
``seqpack.ray`` does on a cluster), and publishes the dataset only once every part is
complete, the manifest last (see :mod:`seqpack.io.format`). A part depends only on its
shard and the settings, so the dataset's bytes do not depend on which process packed
which shard, on the number of workers or on the order in which they finished.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._arguments import check_int, is_int
from ..data.binding import BatchBinding, Partition
from ..errors import InvalidInputError, SeqpackError
from ..packing.config import PackConfig
from . import format as fmt
from .chunk_encoder import ChunkEncoder, SupervisionOptions
from .progress import Progress
from .readers import (
    ArrowBatches,
    DocumentChunk,
    Input,
    JsonLines,
    Reader,
    SavedDataset,
    TextFiles,
    import_pyarrow,
    record_chunks,
    record_columns,
)
from .templates import TemplateLimits
from .writer import (STAGED_TOKENS, Stage, check_arguments, check_readers, describe_binding, manifest_of,
                     no_content, output_path, stage_documents, supervise_part, write_part)

#: What the manifest says about placement in a sharded dataset.
PLACEMENT_SCOPE = "each shard (part) is placed on its own; rows and batches never span shards"
#: Input bytes per shard when no shard count is given.
SHARD_BYTES = 64 << 20


class RowGroups:
    """Row groups ``groups`` of one Parquet file, read like :class:`ArrowBatches` reads
    the whole file; rows count from the file's first row (``first_row`` is the first
    row of ``groups[0]``)."""

    def __init__(self, path: str, groups: range, first_row: int, *, text_field=None, ids_field=None):
        self.groups, self.first_row = groups, first_row
        self.text_field, self.ids_field = text_field, ids_field
        self.inputs = [Input(str(path), "parquet", "row")]

    def chunks(self, first_input: int) -> Iterator[DocumentChunk]:
        pa = import_pyarrow()
        where = self.inputs[0]
        try:
            handle = pa.parquet.ParquetFile(where.name, memory_map=True)
        except (pa.ArrowInvalid, OSError) as error:
            raise InvalidInputError(f"{where.name}: cannot read as parquet: {error}") from None
        fields = record_columns(handle.schema_arrow, self.text_field, self.ids_field, where.name)
        batches = handle.iter_batches(batch_size=ArrowBatches.BATCH_ROWS, row_groups=list(self.groups),
                                      columns=list(fields.read))
        yield from record_chunks(batches, fields, first_input, self.first_row, where)


@dataclass(frozen=True)
class Unit:
    """The smallest piece of input a shard holds: a reader of one input (or of a piece
    of it, or of several consecutive inputs), the global index of its first input, and
    its size in input bytes. It is itself a reader whose input indices are global."""

    reader: Reader
    first_input: int
    weight: int

    @property
    def inputs(self) -> list[Input]:
        return self.reader.inputs

    def chunks(self, first_input: int):
        """The reader's chunks, numbered from this unit's global first input (whatever
        ``first_input`` a caller counted)."""
        return self.reader.chunks(self.first_input)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: consecutive units, packed into part ``index``."""

    index: int
    count: int
    units: tuple[Unit, ...]

    @property
    def label(self) -> str:
        first, last = self.units[0].inputs[0].name, self.units[-1].inputs[-1].name
        names = first if first == last else f"{first} ... {last}"
        return f"shard {self.index} of {self.count} ({names})"


def _file_bytes(inputs: list[Input]) -> int:
    return sum(os.path.getsize(item.name) for item in inputs if os.path.isfile(item.name))


def units_of(reader: Reader, first_input: int) -> list[Unit]:
    """A reader's units: one per text file, one per Parquet row group, else the reader whole."""
    if isinstance(reader, TextFiles):
        return [Unit(TextFiles([path]), first_input + i, path.stat().st_size) for i, path in enumerate(reader.paths)]
    if isinstance(reader, ArrowBatches) and reader.inputs[0].kind == "parquet":
        pa = import_pyarrow()
        name = reader.inputs[0].name
        try:
            metadata = pa.parquet.ParquetFile(name, memory_map=True).metadata
        except (pa.ArrowInvalid, OSError) as error:
            raise InvalidInputError(f"{name}: cannot read as parquet: {error}") from None
        units, row = [], 0
        for group in range(metadata.num_row_groups):
            info = metadata.row_group(group)
            groups = RowGroups(name, range(group, group + 1), row, text_field=reader.text_field,
                               ids_field=reader.ids_field)
            units.append(Unit(groups, first_input, info.total_byte_size))
            row += info.num_rows
        if units:
            return units
    if isinstance(reader, SavedDataset):  # a directory: its data files' bytes
        return [Unit(reader, first_input, sum(path.stat().st_size for path in reader.files))]
    weight = _file_bytes(reader.inputs) or int(getattr(getattr(reader, "source", None), "nbytes", 0) or 0)
    return [Unit(reader, first_input, weight)]


def _exact_dtype(total: int, count: int):
    """int64 when products of byte offsets (up to twice ``total``) and shard numbers (up to
    ``count``) fit in it, else Python ints (object arrays): never a silent wraparound."""
    return np.int64 if 2 * total * count < 2 ** 63 else object


def _split_large_jsonl(units: list[Unit], count: int, total: int) -> list[Unit]:
    """``units`` with every whole JSONL file of at least a shard's bytes (``total / count``)
    cut into line ranges at the shard boundaries inside it (``k * total / count``, rounded
    up, moved on to the next line start), so that those shards split the file."""
    result, begin = [], 0
    for unit in units:
        weight = max(unit.weight, 1)
        reader = unit.reader
        if isinstance(reader, JsonLines) and reader.start == 0 and reader.stop is None and weight * count >= total:
            shard = np.arange(begin * count // total + 1, (begin + weight) * count // total + 1,
                              dtype=_exact_dtype(total, count))
            cuts = -(-shard * total // count) - begin
            cuts = cuts[(cuts > 0) & (cuts < weight)].tolist()
        else:
            cuts = []
        if cuts:
            result.extend(Unit(piece, unit.first_input, piece.stop - piece.start) for piece in reader.split(cuts))
        else:
            result.append(unit)
        begin += weight
    return result


def plan_shards(readers: list[Reader], count: int | None) -> tuple[list[Input], list[Shard]]:
    """``(inputs, shards)``: every input in order, and at most ``count`` shards (by
    default one per ``SHARD_BYTES`` of input) of consecutive units of about equal bytes
    (a unit goes to the shard its middle byte falls in; empty shards are dropped). A JSONL
    file of at least a shard's bytes is first cut into line ranges at the shard boundaries. The
    plan depends only on the inputs and ``count``, never on the machines that pack it."""
    count = None if count is None else check_int("shards", count)
    inputs = [item for reader in readers for item in reader.inputs]
    units, first = [], 0
    for reader in readers:
        units.extend(units_of(reader, first))
        first += len(reader.inputs)
    if not units:
        raise no_content()
    total = sum(max(unit.weight, 1) for unit in units)
    if count is None:
        count = max(1, -(-total // SHARD_BYTES))
    count = min(count, total)  # more shards than input bytes plan alike: every unit (line) alone
    units = _split_large_jsonl(units, count, total)
    weights = np.array([max(unit.weight, 1) for unit in units], dtype=_exact_dtype(total, count))
    ends = np.cumsum(weights)
    middles = 2 * (ends - weights) + weights  # twice each unit's middle byte
    owners = np.minimum(middles * count // (2 * int(ends[-1])), count - 1)
    groups = np.split(np.arange(len(units)), np.flatnonzero(np.diff(owners)) + 1)
    shards = [Shard(index, len(groups), tuple(units[i] for i in group)) for index, group in enumerate(groups)]
    return inputs, shards


@dataclass(frozen=True)
class ShardJob:
    """What every shard is packed with (sent once to every worker)."""

    binding: BatchBinding
    tokenizer: object
    inputs: list[Input]
    config: PackConfig
    policy: str
    long: str
    framed: bool
    threads: int | None
    supervision: SupervisionOptions = SupervisionOptions()


def pack_shard(job: ShardJob, shard: Shard, staging: Path) -> tuple[dict, int]:
    """Pack ``shard`` into ``staging/part-NNNNN``; return its part record and input bytes.

    The part is written under a fresh hidden name and renamed into place last, replacing
    whatever an earlier attempt at the same shard (a killed worker) may have left; the
    record depends only on the shard and the job. A shard of nothing but empty documents
    has no part: its record's ``name`` is None. An error names the shard.
    """
    name = fmt.part_name(shard.index)
    attempt = Path(staging) / f".{name}.attempt-{uuid.uuid4().hex[:12]}"
    attempt.mkdir()
    quiet = Progress(enabled=False)
    try:
        encoder = ChunkEncoder(job.binding, job.tokenizer, job.inputs, framed=job.framed, threads=job.threads,
                               supervision=job.supervision)
        stage = Stage(attempt / STAGED_TOKENS, fmt.token_dtype(job.binding.vocabulary_size))
        try:
            staged = stage_documents(list(shard.units), encoder, stage, capacity=job.config.capacity, long=job.long,
                                     progress=quiet, require_content=False)
            if not staged.lengths.size:  # only empty documents: no part, their count kept
                return {"name": None, "documents": 0, "tokens": 0,
                        "skipped_empty_documents": staged.skipped_empty}, staged.input_bytes
            record = write_part(attempt / name, staged, job.config, job.policy, job.long, quiet)
        finally:
            stage.discard()
        final = Path(staging) / name
        shutil.rmtree(final, ignore_errors=True)
        os.rename(attempt / name, final)
    except SeqpackError as error:
        error.args = (f"{shard.label}: {error.args[0] if error.args else error}",) + error.args[1:]
        raise
    finally:
        shutil.rmtree(attempt, ignore_errors=True)
    record["name"] = name
    return record, staged.input_bytes


#: ``run(job, shards, staging)`` packs every shard and yields ``(shard index, (record,
#: input bytes))`` as each finishes, in any order; on an error it stops every shard
#: still running before raising.
Runner = Callable[[ShardJob, list[Shard], Path], Iterator[tuple[int, tuple[dict, int]]]]


def run_serially(job: ShardJob, shards: list[Shard], staging: Path) -> Iterator[tuple[int, tuple[dict, int]]]:
    """The shards one after another in this process."""
    for shard in shards:
        yield shard.index, pack_shard(job, shard, staging)


class ShardProgress(Progress):
    """A bar over shards on the driver, with the tokens packed so far and their rate."""

    def __init__(self, shards: int, enabled: bool = True):
        super().__init__(enabled)
        self.phase("packing shards", shards, " shards")

    def shard_done(self, record: dict, input_bytes: int) -> None:
        self.documents += record["documents"]
        self.tokens += record["tokens"]
        self.bytes += input_bytes
        if self._bar is not None:
            seconds = max(time.perf_counter() - self._start, 1e-9)
            self._bar.set_postfix_str(f"{self.tokens:,} tokens, {self.tokens / seconds / 1e6:.2f} M tokens/s",
                                      refresh=False)
        self.advance(1)


def pack_sharded(readers: list[Reader], out, *, binding: BatchBinding, tokenizer, config: PackConfig,
                 shards: int | None, policy: str = "next-fit", partition: Partition = Partition.TRAIN,
                 long: str = "error", framed: bool = False, force: bool = False, progress: bool = False,
                 threads: int | None = None, run: Runner | None = None, completion_only_loss: bool = True,
                 chat_template: str | None = None, assistant_only_loss: bool = False,
                 template_limits: TemplateLimits = TemplateLimits()) -> dict:
    """Pack ``readers`` at ``out`` as one dataset of one part per shard; return its manifest.

    The arguments are :func:`~seqpack.io.pack_corpus`'s, plus ``shards`` (at most that
    many, or ``None`` for one per ``SHARD_BYTES``; see :func:`plan_shards`) and ``run``
    (default :func:`run_serially`); ``progress`` draws a bar over shards and tokens. Example ordinals, documents, rows and batches
    are global in shard order, then input order. Every runner gives the same bytes.
    When some shard's inputs carry supervision, every part gets a supervision file
    (those without, an empty one) and the dataset is format version 2.
    """
    out = output_path(out)
    check_arguments(binding, tokenizer, config, policy, partition, long)
    readers = check_readers(readers)
    inputs, planned = plan_shards(readers, shards)
    options = SupervisionOptions(completion_only_loss, chat_template, assistant_only_loss, template_limits)
    job = ShardJob(binding, tokenizer, inputs, config, policy, long, framed, threads, options)
    records: list = [None] * len(planned)
    input_bytes = 0
    with fmt.staging_directory(out, force, inputs) as staging:
        bar = ShardProgress(len(planned), enabled=progress)
        finished = (run or run_serially)(job, planned, staging)
        try:
            for index, (record, nbytes) in finished:
                known = is_int(index) and 0 <= index < len(planned)
                if not known or records[index] is not None:  # counted twice, the manifest's counts would be wrong
                    raise SeqpackError(f"the runner reported shard {index!r} of {len(planned)} "
                                       + ("twice" if known else "(no such shard)"))
                records[index] = record
                input_bytes += nbytes
                bar.shard_done(record, nbytes)
        finally:
            finished.close()  # a runner stops its running shards before the staging directory goes
            bar.close()
        unfinished = [shard.label for shard, record in zip(planned, records) if record is None]
        if unfinished:
            raise SeqpackError(f"the runner never reported {unfinished[0]}"
                               + (f" (and {len(unfinished) - 1} more shards)" if len(unfinished) > 1 else ""))
        parts = [record for record in records if record["name"] is not None]
        if not parts:
            raise no_content()
        # Shards of nothing but empty documents have no part; their count goes to the first part.
        parts[0]["skipped_empty_documents"] += sum(r["skipped_empty_documents"] for r in records if r["name"] is None)
        if any("supervision" in record for record in parts):
            for record in parts:
                if "supervision" not in record:
                    supervise_part(staging / record["name"], record)
        names = {record["name"] for record in parts}
        for entry in staging.iterdir():  # what killed attempts left
            if entry.name not in names:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        manifest = manifest_of(
            parts, binding=describe_binding(binding, tokenizer), partition=partition, config=config, policy=policy,
            dtype=fmt.token_dtype(binding.vocabulary_size), long=long,
            inputs=[{"name": item.name, "kind": item.kind, "unit": item.unit} for item in inputs],
            extra={"input_bytes": input_bytes, "shards": {"count": len(planned), "placement": PLACEMENT_SCOPE}},
            options=options,
        )
        fmt.publish(staging, out, manifest, force)
    return manifest
