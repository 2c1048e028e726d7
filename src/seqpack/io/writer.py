"""One part of a packed dataset: read, tokenize, validate, spool, place and write it; the manifest.

Documents stream through in chunks (one chunk of text at a time, plus O(1) bytes per
document and example); their framed tokens are spooled in memory up to
``SPOOL_MEMORY_BYTES`` and beyond it in a file inside the temporary output directory.
Once every length is known, the examples (whole documents, or with ``long="cut"`` the
overlapping windows of :func:`~seqpack.data.window_ranges`) are placed by the chosen
policy, and the part's ``tokens.bin`` is written in placement order from the spooled
tokens, block by block. A document longer than a row is an error
naming its file and line unless ``long="cut"``; nothing is ever truncated. Preference
records give pairs of documents (chosen, then rejected) that are placed as one item, side
by side in one row: a pair longer than a row is an error naming its record whatever
``long`` says, as no pair is ever cut, and a pack's inputs hold preference records only,
or none. See :mod:`seqpack.io.format` for the files and :mod:`seqpack.io.job` for the driver.
"""

from __future__ import annotations

import hashlib
from contextlib import closing
from dataclasses import dataclass
from importlib.metadata import version as package_version
from pathlib import Path

import numpy as np

from ..data.binding import BatchBinding, Partition
from ..data.supervision import flips_of, placed_flips, range_target_counts
from ..data.tokenizer import ByteTokenizer
from ..data.windows import document_examples, refuse_long
from ..errors import InvalidInputError, SeqpackError
from ..layout.sources import check_example_count
from ..packing import budget
from ..packing.config import PackConfig
from ..packing.gather import gather_ranges
from ..packing.placement import place
from ..packing.planning import check_batch_cells
from ..packing.report import EfficiencyReport, report_counts
from . import format as fmt
from . import publish
from .chunk_encoder import ChunkEncoder, Encoded, SupervisionOptions
from .progress import Progress
from .readers import Reader, read_ahead

#: Tokens gathered per block while writing ``tokens.bin`` in placement order.
WRITE_BLOCK_TOKENS = 1 << 24
#: The spool's file, in the temporary output directory.
SPOOL_FILE = "spooled-tokens.bin"
#: Spooled tokens kept in memory up to this many bytes; beyond it they spill to the file.
SPOOL_MEMORY_BYTES = 1 << 30


class TokenSpool:
    """Framed tokens of the documents read so far, in input order: held in memory until
    they pass ``limit`` bytes, then spilled to ``path`` (in the temporary output directory).
    Their supervision is kept as flips (see :mod:`seqpack.io.format`), in memory."""

    def __init__(self, path: Path, dtype: np.dtype, limit: int = SPOOL_MEMORY_BYTES):
        self.path, self.dtype, self.limit = path, dtype, limit
        self._held: list[np.ndarray] = []
        self._file = None
        self.nbytes = 0
        self._flips: list[np.ndarray] = []
        self._last = True  # the supervision of the last spooled token

    def add(self, tokens: np.ndarray, supervised: np.ndarray | None = None) -> None:
        start = self.nbytes // self.dtype.itemsize
        if supervised is not None and supervised.size:
            self._flips.append(flips_of(supervised, start, self._last))
            self._last = bool(supervised[-1])
        elif supervised is None and tokens.size and not self._last:  # every target supervised again
            self._flips.append(np.array([start], np.int64))
            self._last = True
        tokens = tokens.astype(self.dtype, copy=False)
        self.nbytes += tokens.nbytes
        if self._file is None and self.nbytes <= self.limit:
            self._held.append(tokens)
            return
        if self._file is None:
            self._file = open(self.path, "wb")
            for held in self._held:
                self._file.write(memoryview(held).cast("B"))
            self._held = []
        self._file.write(memoryview(tokens).cast("B"))

    def flips(self) -> np.ndarray:
        """The spooled tokens' flips (int64)."""
        return np.concatenate(self._flips) if self._flips else np.zeros(0, np.int64)

    def pieces(self) -> list[np.ndarray]:
        """The spooled tokens: the chunks held in memory, or one memory map once spilled."""
        if self._file is None:
            return list(self._held)
        self._file.close()
        return [np.memmap(self.path, dtype=self.dtype, mode="r")]

    def discard(self) -> None:
        """Drop the spooled tokens (the spill file too)."""
        self._held = []
        if self._file is not None:
            self._file.close()
            self.path.unlink(missing_ok=True)


@dataclass
class EncodedDocuments:
    """Validated documents: their framed tokens back to back, in ``pieces`` (arrays that
    each hold whole documents), and per document its token count, input and place in it.
    With supervision, ``flips`` describes it, ``supervision`` names its sources, and
    ``mismatched`` counts the prompts that are no prefix of their record (``first_mismatched``
    names the first) and ``as_given`` the documents taken as given (fine-tuning records, not
    framed, which make a dataset of version 2 even with no mask applied: its manifest says
    so); without, ``flips`` is None. ``paired``: documents ``2p`` and ``2p + 1`` are preference
    pair ``p``'s chosen and rejected sequences (which always carry supervision)."""

    pieces: list
    lengths: np.ndarray
    inputs: np.ndarray
    locations: np.ndarray
    skipped_empty: int
    input_bytes: int
    flips: np.ndarray | None = None
    supervision: tuple = ()
    mismatched: int = 0
    first_mismatched: str | None = None
    as_given: int = 0
    paired: bool = False

    @property
    def token_count(self) -> int:
        return int(self.lengths.sum())


def encode_documents(readers: list[Reader], encoder: ChunkEncoder, spool: TokenSpool, *, capacity: int, long: str,
                     progress: Progress) -> EncodedDocuments:
    """Read, tokenize and validate every document into ``spool``.

    With ``long="error"`` a document of more than ``capacity`` predictions is a
    :class:`CapacityError` naming its file and line (or row); under any ``long``, so is a
    preference pair of more than ``capacity`` predictions together. Documents of another
    kind than the first (preference pairs or not) are an error naming the first of them.
    Readers of nothing but empty documents are no error here (they may be one shard of many).
    """
    lengths, inputs, locations = [], [], []
    skipped = input_bytes = mismatched = as_given = 0
    first_input, first_mismatched, supervision = 0, None, set()
    paired, first = None, None  # whether the first chunk's documents are pairs, and where it is
    for reader in readers:
        with closing(read_ahead(reader.chunks(first_input), enabled=encoder.read_ahead)) as chunks:
            for chunk in chunks:
                encoded = encoder.encode(chunk)
                if paired is None:
                    paired, first = encoded.paired, encoder.where(chunk, 0)
                elif encoded.paired != paired:
                    raise encoder.refused(chunk, 0, mixed_kinds(encoded.paired, first))
                document_lengths = np.diff(encoded.offsets)
                if paired:
                    check_pairs(encoder, encoded, document_lengths, capacity)
                elif long == "error":
                    check_lengths(encoder, encoded, document_lengths, capacity)
                spool.add(encoded.tokens, encoded.supervised)
                supervision.update(encoded.supervision)
                if encoded.mismatched is not None and encoded.mismatched.size:
                    mismatched += int(encoded.mismatched.size)
                    if first_mismatched is None:
                        at = int(encoded.mismatched[0])
                        first_mismatched = encoder.inputs[int(encoded.inputs[at])].where(int(encoded.locations[at]))
                lengths.append(document_lengths)
                inputs.append(encoded.inputs)
                locations.append(encoded.locations)
                skipped += encoded.skipped
                as_given += 0 if encoded.as_given is None else int(encoded.as_given.sum())
                input_bytes += chunk.nbytes
                progress.reading(len(document_lengths), int(encoded.tokens.shape[0]), chunk.nbytes)
        first_input += len(reader.inputs)
    join = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
    return EncodedDocuments(spool.pieces(), join(lengths), join(inputs), join(locations), skipped, input_bytes,
                            spool.flips() if supervision or as_given or paired else None, tuple(sorted(supervision)),
                            mismatched, first_mismatched, as_given, bool(paired))


def check_lengths(encoder: ChunkEncoder, encoded: Encoded, document_lengths: np.ndarray, capacity: int) -> None:
    """A :class:`CapacityError` naming the first document of ``encoded`` with more than
    ``capacity`` predictions, with the flag that cuts long documents instead."""
    def document(index: int) -> str:
        return f"{encoder.inputs[int(encoded.inputs[index])].where(int(encoded.locations[index]))}: the document"

    _refuse_located(encoder, encoded, document_lengths - 1, capacity, document, lambda index: index,
                    hint=" (--cut-long cuts long documents into overlapping windows)")


def check_pairs(encoder: ChunkEncoder, encoded: Encoded, document_lengths: np.ndarray, capacity: int) -> None:
    """A :class:`CapacityError` naming the record of the first pair of ``encoded`` (documents
    ``2p`` and ``2p + 1``) with more than ``capacity`` predictions together: a pair's two
    sequences share one row, and no ``long`` setting cuts a pair."""
    chosen, rejected = document_lengths[0::2] - 1, document_lengths[1::2] - 1

    def pair(index: int) -> str:
        where = encoder.inputs[int(encoded.inputs[2 * index])].where(int(encoded.locations[2 * index]))
        return f"{where}: the preference pair (chosen {int(chosen[index])} + rejected {int(rejected[index])})"

    _refuse_located(encoder, encoded, chosen + rejected, capacity, pair, lambda index: 2 * index,
                    hint="; its chosen and rejected sequences share one row, and a pair is never cut (not even "
                         "by --cut-long)")


def _refuse_located(encoder: ChunkEncoder, encoded: Encoded, predictions: np.ndarray, capacity: int, name,
                    document_of, hint: str) -> None:
    """:func:`refuse_long`, its error's ``path`` and ``line`` those of the first document
    (``document_of(index)``) of the item it names."""
    named = []
    try:
        refuse_long(predictions, capacity, lambda index: named.append(index) or name(index), hint=hint)
    except SeqpackError as error:
        first = document_of(named[0])
        encoder.inputs[int(encoded.inputs[first])].located(error, int(encoded.locations[first]))
        raise


def mixed_kinds(paired: bool, first: str) -> str:
    """Why a document of the other kind than the pack's first, at ``first``, is refused:
    a preference record (``paired``) after other records, or the other way round."""
    return (f"{'a' if paired else 'not a'} preference record, but {first} {'is not' if paired else 'is one'}: "
            f"a dataset of preference pairs holds nothing else")


def no_content() -> InvalidInputError:
    """The error of a corpus whose every document is empty."""
    return InvalidInputError("the inputs hold no document with content")


def _check_batches(bounds: np.ndarray, tokens: np.ndarray, row_count: int, config: PackConfig,
                   flips: np.ndarray | None) -> None:
    """The config's limits on one batch, as ``seqpack.plan`` checks them and as reading the
    part will: ``max_cells`` (a ``CapacityError``) and ``max_memory_bytes`` for the largest
    batch read back (a ``MemoryBudgetError``). ``bounds``: each batch's first example in
    placement order; ``tokens``: each example's source tokens, in that order; ``flips``:
    at most how many supervision flips each holds (None: no supervision)."""
    if not bounds.size:
        return
    rows = min(config.rows_per_batch, row_count)
    check_batch_cells(rows, config)
    occurrences = int(np.diff(np.append(bounds, tokens.shape[0])).max())
    largest = int(np.add.reduceat(tokens, bounds).max())
    most_flips = None if flips is None else int(np.add.reduceat(flips, bounds).max())
    budget.require(budget.stored_batch_bytes(rows, occurrences, largest, config.capacity, most_flips),
                   config.max_memory_bytes, "one batch of the packed dataset")


def write_part(directory: Path, encoded: EncodedDocuments, config: PackConfig, policy: str, long: str,
               progress: Progress) -> dict:
    """Place the encoded documents' examples and write one part into ``directory``.

    Preference pairs are placed as pairs (each pair's examples side by side in one row)
    and get the part's ``pairs.npy``. Returns the part's manifest record (counts, report
    figures, files), without the global firsts, which the manifest assigns.
    """
    capacity, per_batch = config.capacity, config.rows_per_batch
    documents, ranges = document_examples(encoded.lengths, capacity, long)
    document_starts = np.zeros(encoded.lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(encoded.lengths, out=document_starts[1:])
    begins = document_starts[documents] + ranges[:, 0]
    ends = document_starts[documents] + ranges[:, 1]
    windows = documents.shape[0]
    targets = None if encoded.flips is None else range_target_counts(encoded.flips, begins, ends)
    if targets is not None and not targets.all():  # a document has a supervised target: only a window may not
        keep = targets > 0
        documents, ranges, begins, ends, targets = documents[keep], ranges[keep], begins[keep], ends[keep], targets[keep]
    check_example_count(documents.shape[0])
    lengths = ranges[:, 1] - ranges[:, 0] - 1
    targets = lengths if targets is None else targets
    placement = place(lengths, capacity, policy, pairs=encoded.paired)
    if policy == "next-fit":  # rows never decrease in input order
        order = None
        rows, starts = placement.rows, placement.starts
    else:
        order = np.argsort(placement.rows * capacity + placement.starts, kind="stable")
        rows, starts = placement.rows[order], placement.starts[order]
    batch_count = -(-placement.row_count // per_batch)
    bounds = np.searchsorted(rows, np.arange(batch_count, dtype=np.int64) * per_batch)
    flips = None  # each example's flips, and one more where its first token may open a run
    if encoded.flips is not None:
        flips = np.searchsorted(encoded.flips, ends) - np.searchsorted(encoded.flips, begins) + 1
    _check_batches(bounds, ends - begins if order is None else (ends - begins)[order], placement.row_count, config,
                   flips=flips if order is None or flips is None else flips[order])
    directory.mkdir()
    files = {"tokens.bin": _write_tokens(directory / "tokens.bin", encoded.pieces, begins, ends, order, progress)}
    ordinals = np.arange(documents.shape[0], dtype=np.int64) if order is None else order
    files["occurrences.npy"] = publish.write_array(directory / "occurrences.npy", np.stack([ordinals, rows, starts], 1))
    files["examples.npy"] = publish.write_array(directory / "examples.npy", np.column_stack([documents, ranges]))
    files["documents.npy"] = publish.write_array(
        directory / "documents.npy", np.stack([encoded.inputs, encoded.locations, encoded.lengths], 1))
    tokens = int((ends - begins).sum())
    if encoded.flips is not None:
        placed = placed_flips(encoded.flips, *((begins, ends) if order is None else (begins[order], ends[order])))
        files[fmt.SUPERVISION_FILE] = publish.write_array(directory / fmt.SUPERVISION_FILE,
                                                      placed.astype(fmt.flips_dtype(tokens)))
    if encoded.paired:  # a pair's documents are its examples: no pair is cut or has a window left out
        files[fmt.PAIRS_FILE] = publish.write_array(directory / fmt.PAIRS_FILE,
                                                    np.arange(documents.shape[0], dtype=np.int64).reshape(-1, 2))
    sorted_targets = targets if order is None else targets[order]
    batch_targets = np.add.reduceat(sorted_targets, bounds)
    pairs = int(documents.shape[0]) // 2 if encoded.paired else 0
    report = EfficiencyReport.of(policy, capacity, placement.row_count, lengths, batch_targets, pairs)
    record = {
        "examples": int(documents.shape[0]), "documents": int(encoded.lengths.shape[0]),
        "tokens": tokens, "document_tokens": encoded.token_count,
        "rows": placement.row_count, "batches": batch_count, "valid_targets": report.valid_targets,
        "permitted_edges": report.permitted_edges, "skipped_empty_documents": encoded.skipped_empty,
        "files": files,
    }
    if encoded.flips is not None:
        record.update(supervised_targets=report.supervised_targets,
                      skipped_unsupervised_windows=windows - int(documents.shape[0]),
                      supervision={"applied": list(encoded.supervision), "mismatched_prompts": encoded.mismatched,
                                   "first_mismatched_prompt": encoded.first_mismatched,
                                   "as_given_documents": encoded.as_given})
    if encoded.paired:
        record["pairs"] = pairs
    return record


def supervise_part(directory: Path, record: dict) -> None:
    """Give a part packed without supervision the (empty) supervision file and counts of
    a version-2 part, as if its inputs had carried masks of all ones."""
    record["files"][fmt.SUPERVISION_FILE] = publish.write_array(directory / fmt.SUPERVISION_FILE,
                                                            np.zeros(0, fmt.flips_dtype(record["tokens"])))
    record.update(supervised_targets=record["valid_targets"], skipped_unsupervised_windows=0,
                  supervision={"applied": [], "mismatched_prompts": 0, "first_mismatched_prompt": None,
                               "as_given_documents": 0})


def _write_tokens(path: Path, pieces: list, begins, ends, order, progress: Progress) -> dict:
    """``tokens.bin``: each example's source tokens in placement order, gathered block by
    block from the spooled pieces (no example spans two pieces)."""
    if order is not None:
        begins, ends = begins[order], ends[order]
    piece_starts = np.cumsum([0] + [piece.shape[0] for piece in pieces])
    sizes = np.cumsum(ends - begins)
    total = int(sizes[-1])
    dtype = pieces[0].dtype
    target = publish.HashingFile(path)
    progress.phase("writing", total * dtype.itemsize, "B")
    try:
        buffer = np.empty(min(total, WRITE_BLOCK_TOKENS), dtype=dtype)
        first, done = 0, 0
        while first < begins.shape[0]:
            # At least one example per block, else as many as fit the buffer.
            end = max(first + 1, int(np.searchsorted(sizes, done + buffer.shape[0], side="right")))
            count = int(sizes[end - 1]) - done
            block = buffer[:count] if count <= buffer.shape[0] else np.empty(count, dtype)
            at = sizes[first:end] - (ends[first:end] - begins[first:end]) - done
            which = np.searchsorted(piece_starts, begins[first:end], side="right") - 1
            by_piece = np.argsort(which, kind="stable")
            cuts = np.searchsorted(which[by_piece], np.arange(len(pieces) + 1))
            for number, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
                if a < b:
                    chosen = by_piece[a:b] + first
                    shift = piece_starts[number]
                    gather_ranges(pieces[number], begins[chosen] - shift, ends[chosen] - shift, dtype, out=block,
                                  at=at[chosen - first])
            target.write(block)
            progress.advance(block.nbytes)
            first, done = end, done + count
    except BaseException:
        target.abandon()
        raise
    return target.close()


def describe_binding(binding: BatchBinding, tokenizer) -> dict:
    """The binding as the manifest records it (enough to rebuild it on load)."""
    if isinstance(tokenizer, ByteTokenizer):  # the binding's, or an equal one
        described = {"kind": "byte", "merges": [list(m) for m in tokenizer.merges]}
    else:
        described = tokenizer.describe()
    identity = binding.tokenizer_identity
    described.update(vocabulary_size=identity.vocabulary_size, bos_id=identity.bos_id, eos_id=identity.eos_id,
                     digest=identity.digest)
    return {"tokenizer": described, "split_receipt_digest": binding.split_receipt_digest,
            "limits": {"max_tokens": binding.limits.max_tokens, "max_bytes": binding.limits.max_bytes}}


def manifest_of(parts: list[dict], *, binding: dict, partition: Partition, config: PackConfig, policy: str,
                dtype: np.dtype, long: str, inputs: list, extra: dict | None = None,
                options: SupervisionOptions = SupervisionOptions()) -> dict:
    """The manifest of ``parts`` (records from :func:`write_part`, in order, each with
    its ``name``): assigns each part its first global example, document, row and batch,
    and sums the counts and the report. Parts of preference pairs (every part, or none)
    make a dataset of format version 3; else parts with supervision (every part, or none:
    see :func:`supervise_part`) one of version 2, recording what was applied under
    ``options``; else it is version 1."""
    supervision = supervision_record([part.pop("supervision", None) for part in parts], options)
    version = fmt.version_of(supervision is not None, any("pairs" in part for part in parts))
    running = dict.fromkeys(fmt.FIRSTS, 0)
    for part in parts:
        for first, count in fmt.FIRSTS.items():
            part[first] = running[first]
            running[first] += part[count]
    counts = {key: sum(part[key] for part in parts) for key in fmt.counts_of(version)}
    report = report_counts(policy, config.capacity, counts["rows"], counts["batches"], counts["valid_targets"],
                           counts.get("supervised_targets", counts["valid_targets"]), counts["permitted_edges"],
                           counts.get("pairs", 0))
    if supervision is not None:
        extra = {**(extra or {}), "supervision": supervision}
    return {
        "format": fmt.FORMAT, "format_version": version, "created_by": f"seqpack {package_version('seqpack')}",
        "binding": binding, "partition": partition.value,
        "config": {"capacity": config.capacity, "rows_per_batch": config.rows_per_batch,
                   "max_cells": config.max_cells, "max_memory_bytes": config.max_memory_bytes},
        "policy": policy, "long_documents": long, "token_dtype": dtype.str,
        "inputs": inputs, "counts": counts, "report": report, "parts": parts, **(extra or {}),
    }


def supervision_record(parts: list[dict | None], options: SupervisionOptions) -> dict | None:
    """What the manifest records of the supervision the parts applied (None: none had
    any). An option none of the applied sources used is recorded as None:
    ``completion_only_loss`` applies to prompt-completion records and ``completion_mask``,
    ``assistant_only_loss`` to rendered records other than preference pairs (supervised on
    their completions whatever it says, as in TRL), the template to every rendered record.
    ``as_given_documents`` counts the documents taken as given (not framed): ``verify``
    checks their IDs only."""
    if all(part is None for part in parts):
        return None
    if any(part is None for part in parts):
        raise AssertionError("some parts have supervision and some not: supervise_part the others")
    applied = sorted({name for part in parts for name in part["applied"]})
    assistant = any(name in ("conversation", "conversational prompt-completion") for name in applied)
    rendered = assistant or "conversational preference" in applied
    completion = any(name in ("prompt-completion", "conversational prompt-completion", "completion_mask")
                     for name in applied)
    template = options.chat_template if rendered else None
    return {
        "applied": applied,
        "completion_only_loss": options.completion_only_loss if completion else None,
        "assistant_only_loss": options.assistant_only_loss if assistant else None,
        "chat_template_sha256": None if template is None else hashlib.sha256(template.encode("utf-8")).hexdigest(),
        "mismatched_prompts": sum(part["mismatched_prompts"] for part in parts),
        "first_mismatched_prompt": next((part["first_mismatched_prompt"] for part in parts
                                         if part["first_mismatched_prompt"] is not None), None),
        "as_given_documents": sum(part["as_given_documents"] for part in parts),
    }
