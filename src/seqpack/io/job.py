"""One way to pack a corpus: a job described once, run by one driver.

:class:`PackJob` is everything a pack needs, validated once where it is built
(:meth:`PackJob.of`). :func:`run_job` is the driver: it plans the shards
(:func:`~seqpack.io.shards.plan_shards`), has a :class:`Runner` pack each into a part
of the dataset's temporary directory, collects the parts' records in shard order and
publishes the dataset, the manifest last (:mod:`seqpack.io.publish`). Runners decide
only where shards run: :class:`SerialRunner` here, one after another; ``seqpack.ray``
as Ray tasks. A part depends only on its shard and the job, so every runner writes the
same bytes.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from .._arguments import check_bool, check_choice, check_optional_int, is_int
from .._threads import check_threads
from ..data.binding import BatchBinding, Partition, check_partition
from ..data.table import LONG_DOCUMENTS
from ..data.tokenizer import ByteTokenizer
from ..errors import InvalidInputError, SeqpackError
from ..packing.config import PackConfig
from ..packing.placement import check_policy
from . import format as fmt
from . import publish
from .chunk_encoder import SupervisionOptions
from .progress import Progress
from .readers import Input, reader_for
from .shards import PLACEMENT_SCOPE, Shard, ShardProgress, pack_shard, plan_shards
from .templates import TemplateLimits
from .tokenizer_file import TokenizerFile
from .writer import describe_binding, manifest_of, mixed_kinds, no_content, supervise_part

#: What :func:`pack_corpus` refuses, each an InvalidInputError naming the path, and the
#: line or row. Its docstring and ``seqpack pack --help`` show this table.
REFUSED_INPUTS = (
    "a file given twice, or a directory and a file inside it",
    "a lone Megatron .idx or .bin, or a broken document index",
    "a dangling link, a pipe, a directory link cycle, or a directory reached twice through links",
    "a compressed file (gzip, bzip2, xz, zstd or zip, known by its first bytes whatever its name)",
    "inside a text directory, a Parquet, Arrow, Feather or Megatron file or a .jsonl/.ndjson file "
    "(give it as an input of its own)",
    "a packed dataset given as an input (inside a directory it is skipped and reported)",
    "a JSONL line that is not an object, or a field that is not a string (a list of IDs with --ids-field)",
    "a record of another kind than its input's first",
    "preference records ('chosen' and 'rejected') beside other records (a dataset holds pairs only, or none)",
    "a preference pair longer than a row, chosen and rejected together, even with long='cut' (a pair is never cut)",
    "a control token inside a plain text",
    "an ID outside the vocabulary",
    "a document longer than a row without long='cut' (--cut-long)",
    "a flag no input uses (--glob without a directory, --text-field or --ids-field without JSONL, Parquet or "
    "Arrow, --framed without token IDs), and --text-field with --ids-field",
    "an out inside an input directory, or an input inside out",
    "a document none of whose targets is supervised",
    "a label that is neither -100 nor its token, a mask value other than 0 and 1",
    "prompt-completion records or conversations without a tokenizers file",
    "conversations without a chat template",
    "a record the template fails on, or whose rendering passes template_limits",
    "assistant_only_loss without a chat template, or with one that has no {% generation %} block",
    "a conversation with no assistant token under it",
)


@dataclass(frozen=True)
class PackJob:
    """A pack, validated: what :func:`run_job` and every runner's workers read.

    Build it with :meth:`of`, which takes :func:`pack_corpus`'s arguments. ``readers``
    hold the inputs (a worker does not need them: its shard carries its own units);
    ``inputs`` are their :class:`~seqpack.io.readers.Input` records, in order.
    """

    readers: tuple
    inputs: tuple[Input, ...]
    out: Path
    tokenizer: object
    binding: BatchBinding
    config: PackConfig
    policy: str
    partition: Partition
    long: str
    framed: bool
    supervision: SupervisionOptions
    shards: int | None
    threads: int | None
    progress: bool
    force: bool

    @classmethod
    def of(cls, inputs, out, *, tokenizer=None, binding: BatchBinding | None = None, config: PackConfig,
           policy: str = "next-fit", partition: Partition = Partition.TRAIN, long: str = "error",
           framed: bool = False, completion_only_loss: bool = True, chat_template: str | None = None,
           assistant_only_loss: bool = False, template_limits: TemplateLimits = TemplateLimits(),
           shards: int | None = None, threads: int | None = None, progress: bool = False,
           force: bool = False) -> PackJob:
        """The job of :func:`pack_corpus`'s arguments, each checked here and only here
        (the output too: an existing ``out`` without ``force``, or one inside an input,
        is refused before anything is read)."""
        if not isinstance(out, (str, os.PathLike)):
            raise InvalidInputError(f"out must be a path (str or os.PathLike), not {type(out).__name__}")
        out = Path(out)
        readers = _readers_of(inputs)
        if binding is not None and not isinstance(binding, BatchBinding):
            raise InvalidInputError(f"binding must be a BatchBinding, not {type(binding).__name__}")
        if tokenizer is None:
            tokenizer = ByteTokenizer() if binding is None else binding.tokenizer
        if not isinstance(tokenizer, (ByteTokenizer, TokenizerFile)):
            raise InvalidInputError(f"tokenizer must be a seqpack.ByteTokenizer or a seqpack.io.TokenizerFile, "
                                    f"not {type(tokenizer).__name__}")
        if binding is None:  # a ByteTokenizer's binding holds the tokenizer itself, another's its identity
            binding = BatchBinding.for_tokenizer(
                tokenizer if isinstance(tokenizer, ByteTokenizer) else tokenizer.identity, split="corpus")
        if tokenizer is not binding.tokenizer and tokenizer.identity != binding.tokenizer_identity:
            raise InvalidInputError("the tokenizer's identity differs from the binding's")
        if isinstance(tokenizer, ByteTokenizer) and binding.tokenizer is None:
            # a binding of the byte tokenizer's bare identity: its byte limit applies as the dataset's will
            binding = dataclasses.replace(binding, tokenizer=tokenizer)
        if not isinstance(config, PackConfig):
            raise InvalidInputError(f"config must be a PackConfig, not {type(config).__name__}")
        check_policy(policy, config.capacity)
        check_partition(partition)
        check_choice("long", long, LONG_DOCUMENTS)
        supervision = SupervisionOptions(completion_only_loss, chat_template, assistant_only_loss, template_limits)
        listed = tuple(item for reader in readers for item in reader.inputs)
        force = check_bool("force", force)
        publish.remove_leftovers(out.parent)  # (a dataset a killed --force left hidden comes back first)
        publish.check_output(out, force, listed)
        return cls(readers, listed, out, tokenizer, binding, config, policy, partition, long,
                   check_bool("framed", framed), supervision, check_optional_int("shards", shards),
                   check_threads(threads), check_bool("progress", progress), force)

    def for_workers(self) -> PackJob:
        """This job without its readers: what every worker is sent once."""
        return dataclasses.replace(self, readers=())


def _readers_of(inputs) -> tuple:
    """``inputs`` (readers, or paths read by :func:`~seqpack.io.reader_for`) as readers;
    one reader or path alone is an error, not a list of its characters."""
    if isinstance(inputs, (str, bytes, os.PathLike)) or hasattr(inputs, "chunks"):
        raise InvalidInputError(f"inputs must be a list of readers or paths, not one {type(inputs).__name__}: "
                                f"give [{inputs!r}]")
    try:
        inputs = list(inputs)
    except TypeError:
        raise InvalidInputError(f"inputs must be a list of readers or paths, not {type(inputs).__name__}") from None
    readers = []
    for index, item in enumerate(inputs):
        if isinstance(item, (str, os.PathLike)):
            item = reader_for(item)
        elif not (callable(getattr(item, "chunks", None)) and isinstance(getattr(item, "inputs", None), list)):
            raise InvalidInputError(
                f"inputs[{index}] is a {type(item).__name__}, not a path or a reader (TextFiles, JsonLines, "
                f"ArrowBatches, Megatron, or seqpack.io.reader_for(path))")
        readers.append(item)
    return tuple(readers)


class Runner(Protocol):
    """Where a job's shards run. Calling it packs every shard (with
    :func:`~seqpack.io.shards.pack_shard`) and yields ``(shard index, (record, input
    bytes))`` as each finishes, in any order; on an error, or when the caller closes the
    iterator, it stops every shard still running before it returns.

    ``default_shards`` is the shard count of a job that names none (None: one per
    :data:`~seqpack.io.shards.SHARD_BYTES` of input); ``in_process`` says whether the
    shards run in this process, where one shard may draw its own reading and writing bar."""

    default_shards: int | None
    in_process: bool

    def __call__(self, job: PackJob, shards: list[Shard], staging: Path,
                 progress: Progress) -> Iterator[tuple[int, tuple[dict, int]]]: ...


class SerialRunner:
    """The shards one after another in this process; a job that names no shard count is
    one shard, one part."""

    default_shards = 1
    in_process = True

    def __call__(self, job, shards, staging, progress):
        for shard in shards:
            yield shard.index, pack_shard(job, shard, staging, progress)


def run_job(job: PackJob, run: Runner | None = None) -> dict:
    """Pack ``job`` with ``run`` (default :class:`SerialRunner`) and publish the dataset;
    return its manifest, sealed, as ``manifest.json`` holds it.

    Example ordinals, documents, rows and batches are global in shard order, then input
    order. When some shard's inputs carry supervision, every part gets a supervision
    file (those without, an empty one) and the dataset is format version 2; a dataset of
    preference pairs (every part's, or an error naming the first document of the other
    kind) is version 3.
    """
    run = run or SerialRunner()
    _, planned = plan_shards(list(job.readers), job.shards if job.shards is not None else run.default_shards)
    detailed = job.progress and run.in_process and len(planned) == 1
    records: list = [None] * len(planned)
    input_bytes = 0
    with publish.pending_dataset(job.out, job.force, job.inputs) as staging:
        bar = ShardProgress(len(planned), enabled=job.progress and not detailed)
        finished = run(job, planned, staging, Progress(enabled=detailed))
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
        check_one_kind(job, parts, staging)
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
            parts, binding=describe_binding(job.binding, job.tokenizer), partition=job.partition, config=job.config,
            policy=job.policy, dtype=fmt.token_dtype(job.binding.vocabulary_size), long=job.long,
            inputs=[{"name": item.name, "kind": item.kind, "unit": item.unit} for item in job.inputs],
            extra={"input_bytes": input_bytes, "shards": {"count": len(planned), "placement": PLACEMENT_SCOPE}},
            options=job.supervision,
        )
        publish.publish(staging, job.out, manifest, job.force)
    return fmt.seal(manifest)  # what manifest.json holds


def check_one_kind(job: PackJob, parts: list[dict], staging: Path) -> None:
    """Every part holds preference pairs, or none does: else the error names the first
    document of the first part of the other kind than the first part's (as
    :func:`~seqpack.io.writer.encode_documents` does within one shard)."""
    kinds = ["pairs" in record for record in parts]
    if all(kinds) or not any(kinds):
        return

    def first_document(record: dict) -> tuple[Input, int]:
        index, location = np.load(staging / record["name"] / "documents.npy", mmap_mode="r")[0, :2]
        return job.inputs[int(index)], int(location)

    first, at = first_document(parts[0])
    other, location = first_document(parts[kinds.index(not kinds[0])])
    error = InvalidInputError(mixed_kinds(not kinds[0], first.where(at)))
    raise error.within(other.where(location), path=other.name, line=location if other.unit is not None else None)


def pack_corpus(inputs, out, **options) -> dict:
    """Pack every document of ``inputs`` into a packed dataset at ``out``; return its manifest.

    ``inputs`` are readers (:mod:`seqpack.io.readers`) or paths (read by
    :func:`~seqpack.io.reader_for`). ``tokenizer`` is a :class:`~seqpack.ByteTokenizer`
    (default: the binding's, else a new one) or a :class:`~seqpack.io.TokenizerFile`;
    ``binding`` defaults to the tokenizer's with the split name ``"corpus"``.

    Records that carry supervision are encoded as TRL 1.16's ``SFTTrainer`` encodes them
    and packed with it (a dataset of format version 2): prompt-completion records
    (supervising the completion only unless ``completion_only_loss=False``; a record
    whose prompt encoding is no prefix of the joint one is counted in the manifest),
    conversations rendered with ``chat_template`` (the Jinja text; ``assistant_only_loss``
    supervises its ``{% generation %}`` spans only; each record's rendering is bounded by
    ``template_limits``), and token IDs beside ``completion_mask``, ``assistant_masks`` or
    ``labels`` columns. These documents are taken as TRL gives them (no BOS or EOS added).

    Preference records (TRL's DPO formats: ``chosen`` and ``rejected``, with or without a
    ``prompt``, or their ``*_ids``) are packed as pairs into a dataset of format version 3:
    each pair's chosen and rejected sequences (examples ``2p`` and ``2p + 1``) side by side
    in one row.

    ``long="error"`` (default) refuses a document longer than ``config.capacity``
    predictions naming its file and line; ``long="cut"`` cuts it into overlapping
    windows (never a preference pair: one longer than a row is refused either way).
    ``framed`` takes pre-tokenized documents as already ``[BOS, ..., EOS]``. ``shards``
    splits the inputs into at most that many shards of about equal bytes, each placed on
    its own into one part (default: one; see :func:`~seqpack.io.shards.plan_shards`), and
    never splits a record. ``threads`` runs the tokenizer and kernels on that many threads
    (default: every core this process may use). ``progress`` draws a bar. An existing
    ``out`` is refused unless ``force``. The config's limits on a batch hold as in
    :func:`seqpack.plan`, before a part is written: over ``max_cells``, a ``CapacityError``;
    a batch whose reading would exceed ``max_memory_bytes``, a ``MemoryBudgetError``.
    The dataset appears at ``out`` only once complete
    (see :mod:`seqpack.io.publish`). :func:`seqpack.ray.pack_corpus` takes the same
    arguments and writes the same bytes.

    Refused inputs (each an InvalidInputError naming the path, and the line or row):
    {refused}.
    """
    return run_job(PackJob.of(inputs, out, **options))


pack_corpus.__doc__ = pack_corpus.__doc__.replace("{refused}", "; ".join(REFUSED_INPUTS))
pack_corpus.__signature__ = inspect.signature(PackJob.of).replace(return_annotation=dict)
