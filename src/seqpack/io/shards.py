"""Shards of a corpus: plans, and one part packed per shard, the same bytes whoever packs it.

:func:`plan_shards` splits the readers' inputs into at most ``count`` contiguous shards
of about equal input bytes, in input order: whole files (a directory's files one by
one), Parquet files by row groups, and JSONL files of at least a shard's bytes by line
ranges cut near the shard boundaries: every cut falls between records, so no record (nor
the two sequences of a preference pair) is ever split. :func:`pack_shard` packs one shard
on its own into one part (placement policies apply within a shard, never across shards); the driver
(:func:`seqpack.io.job.run_job`) has a runner pack every shard, here or on a cluster,
and publishes the dataset once every part is complete. A part depends only on its
shard and the job, so the dataset's bytes do not depend on which process packed which
shard, on the number of workers or on the order in which they finished.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._arguments import check_int
from ..errors import SeqpackError
from . import format as fmt
from .chunk_encoder import ChunkEncoder
from .progress import Progress
from .readers import (
    ArrowBatches,
    DocumentChunk,
    Input,
    JsonLines,
    Reader,
    SavedDataset,
    TextFiles,
    open_parquet,
    record_chunks,
    record_columns,
)
from .writer import SPOOL_FILE, TokenSpool, encode_documents, no_content, write_part

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
        where = self.inputs[0]
        handle = open_parquet(where.name)
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
        name = reader.inputs[0].name
        metadata = open_parquet(name).metadata
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


def pack_shard(job, shard: Shard, staging: Path, progress: Progress | None = None) -> tuple[dict, int]:
    """Pack ``shard`` of ``job`` (a :class:`~seqpack.io.job.PackJob`) into
    ``staging/part-NNNNN``; return its part record and input bytes. ``progress`` (default:
    none) shows the reading and writing.

    The part is written under a fresh hidden name and renamed into place last, replacing
    whatever an earlier attempt at the same shard (a killed worker) may have left; the
    record depends only on the shard and the job. A shard of nothing but empty documents
    has no part: its record's ``name`` is None. An error names the shard.
    """
    name = fmt.part_name(shard.index)
    attempt = Path(staging) / f".{name}.attempt-{uuid.uuid4().hex[:12]}"
    attempt.mkdir()
    progress = progress or Progress(enabled=False)
    try:
        encoder = ChunkEncoder(job.binding, job.tokenizer, list(job.inputs), framed=job.framed,
                               threads=job.threads, supervision=job.supervision)
        spool = TokenSpool(attempt / SPOOL_FILE, fmt.token_dtype(job.binding.vocabulary_size))
        try:
            documents = encode_documents(list(shard.units), encoder, spool, capacity=job.config.capacity,
                                         long=job.long, progress=progress)
            if not documents.lengths.size:  # only empty documents: no part, their count kept
                return {"name": None, "documents": 0, "tokens": 0,
                        "skipped_empty_documents": documents.skipped_empty}, documents.input_bytes
            record = write_part(attempt / name, documents, job.config, job.policy, job.long, progress)
        finally:
            progress.close()
            spool.discard()
        final = Path(staging) / name
        shutil.rmtree(final, ignore_errors=True)
        os.rename(attempt / name, final)
    except SeqpackError as error:
        if shard.count > 1:
            raise error.within(shard.label)
        raise
    finally:
        shutil.rmtree(attempt, ignore_errors=True)
    record["name"] = name
    return record, documents.input_bytes


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
