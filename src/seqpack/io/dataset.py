"""A packed dataset opened from disk: lazy batches with the interface of a packing plan.

``open_dataset(DIR)`` memory-maps the parts it reads (at most ``seqpack.io.part.MAPPED_PARTS`` at once)
and builds nothing up front beyond
O(examples) index arrays; ``batch(i)`` reads batch ``i``'s tokens (one contiguous run of
``tokens.bin``) and fills its fields with the same kernel as ``seqpack.pack``, so the
batches equal those of ``seqpack.pack`` on the same examples under the same policy. The
object follows :class:`~seqpack.packing.PackedBatches` (what ``seqpack.plan`` returns follows it too), so
anything that consumes a plan (a trainer loop, ``seqpack.torch.IterableBatchDataset``)
takes a dataset on disk unchanged. Opening checks, without reading tokens, that every
file has the size and shape the manifest records, that the placements tile each row
and place every example once, that the examples are the documents' ranges (less the
windows left out for want of a supervised target), that the format version agrees with
the manifest and the parts (a manifest holds nothing only a later version writes and
everything its own always writes), that the supervision of a version-2 or 3
dataset is canonical and gives every example a supervised target, that the pair map of
a version-3 dataset names pair ``p`` as examples ``2p`` and ``2p + 1`` placed side by side
in one row, and that the manifest's counts agree with the files and each other (each
part's firsts are the running sums of the parts before it), so a damaged file can never
make the fill write out of bounds or serve the wrong batch (or a pair in two); filling a
batch refuses a token outside the vocabulary. ``seqpack.io.verify_dataset`` checks the rest.

A dataset of preference pairs (``pairs`` True) numbers its examples so that pair ``p`` is
global examples ``2p`` (chosen) and ``2p + 1`` (rejected) in every part, and each batch's
occurrences come pair by pair, chosen then rejected: what a preference objective reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import json
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import numpy as np

from .._arguments import batch_number, check_bool
from .._threads import check_threads
from ..data.binding import BatchBinding, Partition
from ..data.documents import BatchDocument
from ..data.examples import SequenceExample
from ..data.supervision import supervision_of
from ..data.table import LONG_DOCUMENTS
from ..data.tokenizer import ByteTokenizer, DecodeLimits, TokenizerIdentity
from ..errors import InvalidInputError
from ..layout.fields import FieldArrays, Placements
from ..packing import budget
from ..packing.config import PackConfig
from ..packing.packed import PackedBatch
from ..packing.placement import check_policy
from ..packing.planning import batch_at
from ..packing.report import EfficiencyReport
from . import format as fmt
from . import publish
from .part import Part
from .readers import Input, input_path


#: How an input locates a document in it (see :class:`~seqpack.io.readers.Input`).
UNITS = ("line", "row", "sequence", None)


def malformed(path: Path, error: Exception) -> InvalidInputError:
    """The one-line error for a manifest missing a key or holding a bad value."""
    what = f"no {error.args[0]!r} key" if isinstance(error, KeyError) else str(error)
    return InvalidInputError(f"{path / fmt.MANIFEST}: malformed manifest ({what})")


def _holds(record, keys: tuple) -> bool:
    """Whether ``record[keys[0]][keys[1]]...`` exists."""
    for key in keys:
        if not isinstance(record, dict) or key not in record:
            return False
        record = record[key]
    return True


def input_of(index: int, item: dict) -> Input:
    """The manifest's ``inputs[index]``, its fields checked."""
    name, kind, unit = item["name"], item["kind"], item["unit"]
    if not (isinstance(name, str) and name and isinstance(kind, str) and kind and unit in UNITS):
        raise InvalidInputError(f"inputs[{index}] needs a name, a kind and a unit in {UNITS}")
    return Input(name, kind, unit)


def binding_of(described: dict) -> tuple[BatchBinding, ByteTokenizer | None]:
    """Rebuild the binding a manifest records (the byte tokenizer too, when it was one)."""
    tokenizer = described["tokenizer"]
    limits = DecodeLimits(**described["limits"])
    identity = TokenizerIdentity(tokenizer["vocabulary_size"], tokenizer["bos_id"], tokenizer["eos_id"],
                                 tokenizer["digest"])
    byte_tokenizer = None
    if tokenizer.get("kind") == "byte":
        byte_tokenizer = ByteTokenizer([tuple(m) for m in tokenizer["merges"]])
        if byte_tokenizer.identity != identity:
            raise InvalidInputError("the manifest's byte tokenizer does not match its recorded identity")
    return BatchBinding(identity, described["split_receipt_digest"], limits, byte_tokenizer), byte_tokenizer


#: Parts whose files stay memory-mapped at once, over every open dataset: each map holds
#: a file descriptor (four per part), so a dataset of thousands of parts maps the parts
#: it reads, least recently used unmapped first, within the usual limit of 1024.
class _BatchSource:
    """The examples of one loaded batch, as an ``ExampleSource`` over its own int32 tokens;
    ordinals are the dataset's global ones (names and whole examples come from it)."""

    copies_tokens = False
    held_bytes_per_example = 0
    first_ordinal = 0

    def __init__(self, dataset: "PackedDataset", tokens, supervised, ordinals, begins, ends):
        self._dataset = dataset
        self._tokens, self._supervised = tokens, supervised
        self._ordinals, self._begins, self._ends = ordinals, begins, ends

    def __len__(self) -> int:
        return self._dataset.occurrence_count

    def example(self, ordinal: int) -> SequenceExample:
        return self._dataset.example(ordinal)

    def example_id(self, ordinal: int) -> str:
        return self._dataset.example_id(ordinal)

    @cached_property
    def _sorter(self) -> np.ndarray:
        return np.argsort(self._ordinals, kind="stable")

    def gather(self, ordinals: np.ndarray):
        if ordinals is self._ordinals:  # the fill asks for the batch's own placement order
            return self._tokens, self._supervised, self._begins, self._ends
        known = self._ordinals[self._sorter]
        at = np.minimum(np.searchsorted(known, ordinals), known.shape[0] - 1)
        if not np.array_equal(known[at], ordinals):
            raise InvalidInputError("an occurrence names an example outside this batch")
        index = self._sorter[at]
        return self._tokens, self._supervised, self._begins[index], self._ends[index]


#: Times :class:`PackedDataset` tries to open a dataset that is being replaced meanwhile.
OPEN_ATTEMPTS = 5


class PackedDataset:
    """A packed dataset on disk, its batches built on demand; follows :class:`~seqpack.packing.PackedBatches`.

    Batches are numbered globally across parts (a part's batches follow the previous
    part's); ordinals and segments are global example ordinals. ``threads`` fills a batch
    of at least ``PARALLEL_CELLS`` cells, as a plan's batches fill. The object pickles as its
    path, so data-loader workers reopen the memory maps instead of copying them.
    """

    def __init__(self, path, *, threads: int | None = None):
        self.path = input_path(path)
        self.threads = check_threads(threads)
        # The manifest and the part files it lists must be one dataset's: a pack --force
        # that publishes between reading the one and opening the others would mix two (the
        # old manifest over the new tokens). The manifest's stamp before and after tells;
        # a replaced dataset is opened again.
        for _ in range(OPEN_ATTEMPTS):
            stamp = fmt.manifest_stamp(self.path)
            try:
                self._open()
            except InvalidInputError:
                if stamp is None or fmt.manifest_stamp(self.path) == stamp:
                    raise   # what is on disk, not a replacement in progress
                continue
            if fmt.manifest_stamp(self.path) == stamp:
                return
        raise InvalidInputError(f"{self.path}: the dataset was replaced while it was being opened, "
                                f"{OPEN_ATTEMPTS} times (packs with --force into it?): open it again")

    def _open(self) -> None:
        """Read the manifest and open the parts it lists, every file checked against it."""
        manifest = fmt.read_manifest(self.path)
        self.manifest = manifest
        #: The manifest's digest: a pickled dataset reopens only the dataset it was.
        self.manifest_sha256 = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
        try:
            self.binding, self.tokenizer = binding_of(manifest["binding"])
            self.partition = Partition(manifest["partition"])
            config = PackConfig(**manifest["config"])
            # The manifest records a derived max_cells as its value: derived again, so that a
            # dataclasses.replace copy (more rows, a wider capacity) derives its own.
            full = config.max_cells == config.rows_per_batch * config.capacity
            self.config = dataclasses.replace(config, max_cells=None) if full else config
            self.policy = manifest["policy"]
            check_policy(self.policy, self.config.capacity)
            self.long = manifest["long_documents"]
            if self.long not in LONG_DOCUMENTS:
                raise InvalidInputError(f"long_documents {self.long!r} is not one of {LONG_DOCUMENTS}")
            self.token_dtype = np.dtype(manifest["token_dtype"])
            if self.token_dtype != fmt.token_dtype(self.binding.vocabulary_size):
                raise InvalidInputError(f"token_dtype {manifest['token_dtype']!r} is not the one a vocabulary of "
                                        f"{self.binding.vocabulary_size} is stored in")
            self.inputs = [input_of(i, item) for i, item in enumerate(manifest["inputs"])]
            records = list(manifest["parts"])
        except (KeyError, TypeError, ValueError) as error:  # InvalidInputError from the checks too
            raise malformed(self.path, error) from None
        try:
            self.version = manifest["format_version"]
            self._check_version(manifest, records)
            #: What the pack applied (``supervision`` of the manifest), or None for version 1.
            self.supervision = manifest.get("supervision")
            if not isinstance(self.supervision, dict | None):
                raise TypeError(f"supervision is a {type(self.supervision).__name__}, not an object")
            #: Whether documents are taken as given (fine-tuning records as TRL has them), not framed.
            self.as_given = bool((self.supervision or {}).get("as_given_documents"))
            #: Whether the examples are preference pairs (format version 3): see :meth:`pair_map`.
            self.pairs = self.version >= fmt.PAIRED_VERSION
            self.parts = [Part(directory, record, self.config, self.token_dtype, self.long, self.version)
                          for directory, record in zip(self._part_directories(records), records)]
        except InvalidInputError:  # a file that disagrees with the manifest, named
            raise
        except (KeyError, TypeError, ValueError) as error:
            raise malformed(self.path, error) from None
        if not self.parts:
            raise InvalidInputError(f"{self.path / fmt.MANIFEST}: lists no part")
        try:
            self._check_counts(records, manifest["counts"])
        except (KeyError, TypeError) as error:
            raise malformed(self.path, error) from None
        self._first_batches = np.array([part.first_batch for part in self.parts], dtype=np.int64)
        self._first_examples = np.array([part.first_example for part in self.parts], dtype=np.int64)
        self.batch_count = sum(part.batch_count for part in self.parts)
        self.row_count = sum(part.row_count for part in self.parts)
        self.occurrence_count = sum(part.example_count for part in self.parts)
        self.document_count = sum(part.documents.shape[0] for part in self.parts)
        self.pair_count = sum(part.pair_count for part in self.parts)
        per_batch = self.config.rows_per_batch
        self.largest_batch_rows = min(per_batch, max(part.row_count for part in self.parts))
        cells = self.largest_batch_rows * self.config.capacity
        if cells > self.config.max_cells:   # (no pack writes one: the config was changed)
            raise InvalidInputError(f"{self.path / fmt.MANIFEST}: a batch of {self.largest_batch_rows} rows x "
                                    f"{self.config.capacity} columns has {cells} cells; its config's max_cells is "
                                    f"{self.config.max_cells}")
        largest = max(int(np.diff(part.bounds).max()) for part in self.parts)
        tokens = max(int(np.diff(part.token_offsets[part.bounds]).max()) for part in self.parts)
        # Per example: ordinals, rows, starts, lengths, token offsets and targets (int64); a pair's placement.
        index_bytes = sum(8 * ((6 + self.pairs) * part.example_count + part.batch_count) for part in self.parts)
        index_bytes += sum(8 * (part.example_count + part.flips.shape[0]) for part in self.parts if part.supervised)
        flips = None
        if any(part.supervised for part in self.parts):  # the most flips one batch's tokens hold
            flips = max(int(np.diff(np.searchsorted(part.flips, part.token_offsets[part.bounds])).max())
                        for part in self.parts if part.supervised)
        #: Bytes one built batch holds, with its int32 tokens: what ``max_memory_bytes`` caps.
        self.batch_peak = budget.stored_batch_bytes(self.largest_batch_rows, largest, tokens, self.config.capacity,
                                                    flips)
        #: Bytes held: the index arrays (memory-mapped from the files) and one built batch.
        self.memory_peak = index_bytes + self.batch_peak

    def _part_directories(self, records: list) -> list[Path]:
        """Each part record's directory: a ``part-NNNNN`` directory of this dataset, named
        once (a name leading elsewhere, or a part listed twice, would let a dataset hold
        what it does not)."""
        directories, seen = [], set()
        for record in records:
            name = record["name"]
            if not publish.is_part_name(name):
                raise ValueError(f"part name {name!r} is not part-NNNNN")
            if name in seen:
                raise ValueError(f"part {name!r} is listed twice")
            seen.add(name)
            directory = self.path / name
            if directory.is_symlink():
                raise InvalidInputError(f"{directory}: a symbolic link; a dataset's parts are its own directories")
            directories.append(directory)
        return directories

    def _check_version(self, manifest: dict, records: list) -> None:
        """The manifest holds what its format version writes: nothing a later version adds
        (read as version 1, a version-2 dataset would supervise every target; read as
        version 2, a version-3 one would lose its pairs), and everything its own version
        and the earlier ones always write."""
        for since, (fields, part_fields) in fmt.VERSION_FIELDS.items():
            found = [(".".join(keys), always, _holds(manifest, keys)) for keys, always in fields.items()]
            found += [(f"parts[{index}].{'.'.join(keys)}", always, _holds(record, keys))
                      for index, record in enumerate(records) for keys, always in part_fields.items()]
            if self.version < since:
                wrong = [name for name, _, held in found if held]
                problem = f"holds {{}}, which only version {since} and later write"
            else:
                wrong = [name for name, always, held in found if always and not held]
                problem = f"lacks {{}}, which version {since} and later always write"
            if wrong:
                more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
                raise InvalidInputError(f"{self.path / fmt.MANIFEST}: format version {self.version}, but the "
                                        f"manifest {problem.format(wrong[0] + more)}")

    def _check_counts(self, records: list, counts: dict) -> None:
        """Each part's firsts are the running sums of the parts before it, every total is
        the parts' sum, and every document names one of the inputs."""
        where = self.path / fmt.MANIFEST
        running = dict.fromkeys(fmt.FIRSTS, 0)
        for record in records:
            for first, count in fmt.FIRSTS.items():
                if record[first] != running[first]:
                    raise InvalidInputError(f"{where}: part {record['name']} records {first} {record[first]!r}; "
                                            f"the parts before it hold {running[first]} {count}")
                running[first] += record[count]
        for key in fmt.counts_of(self.version):
            total = sum(record[key] for record in records)
            if counts[key] != total:
                raise InvalidInputError(f"{where}: counts records {key} {counts[key]!r}; the parts hold {total}")
        for part in self.parts:
            sources = part.documents[:, 0]
            if sources.size and (sources.min() < 0 or sources.max() >= len(self.inputs)):
                raise InvalidInputError(f"{part.directory / 'documents.npy'}: a document names an input outside "
                                        f"the manifest's {len(self.inputs)} inputs")

    def __getstate__(self) -> dict:
        # absolute: a process that unpickles it (a spawned loader worker) may have another directory
        return {"path": os.path.abspath(self.path), "threads": self.threads, "manifest_sha256": self.manifest_sha256}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], threads=state["threads"])
        if self.manifest_sha256 != state["manifest_sha256"]:
            raise InvalidInputError(f"{self.path}: the dataset was replaced after it was pickled "
                                    f"(its manifest differs)")

    def __repr__(self) -> str:
        return (f"PackedDataset({str(self.path)!r}, batches={self.batch_count}, examples={self.occurrence_count}, "
                f"policy={self.policy!r}, capacity={self.config.capacity})")

    def __len__(self) -> int:
        return self.batch_count

    def _locate(self, number) -> tuple[Part, int]:
        number = batch_number(number, self.batch_count, "this dataset")
        part = self.parts[int(np.searchsorted(self._first_batches, number, side="right")) - 1]
        return part, int(number) - part.first_batch

    def batch_rows(self, number: int) -> int:
        """Rows of batch ``number``: ``rows_per_batch`` except for a part's smaller final batch."""
        part, local = self._locate(number)
        return min(self.config.rows_per_batch, part.row_count - local * self.config.rows_per_batch)

    def batch(self, number: int) -> PackedBatch:
        """Build batch ``number`` from its tokens on disk (rows local to it, ordinals global).
        A batch over the config's ``max_memory_bytes`` is a ``MemoryBudgetError``, raised
        before anything is allocated (the index is memory-mapped, not counted)."""
        return self._batch(number, None)

    def _require_budget(self) -> None:
        budget.require(self.batch_peak, self.config.max_memory_bytes, f"{self.path}: one batch")

    def _batch(self, number: int, buffers: FieldArrays | None) -> PackedBatch:
        """Batch ``number`` in ``buffers`` (at least the largest batch), or in fresh arrays."""
        self._require_budget()
        part, local = self._locate(number)
        per_batch = self.config.rows_per_batch
        first, end = int(part.bounds[local]), int(part.bounds[local + 1])
        offsets = part.token_offsets[first: end + 1]
        tokens = part.tokens[offsets[0]: offsets[-1]].astype(np.int32)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.binding.vocabulary_size):
            raise InvalidInputError(f"{part.directory / 'tokens.bin'}: batch {number} holds a token outside the "
                                    f"vocabulary [0, {self.binding.vocabulary_size})")
        ordinals = part.ordinals[first:end] + part.first_example
        begins, ends = offsets[:-1] - offsets[0], offsets[1:] - offsets[0]
        supervised = None if part.flips is None else supervision_of(part.flips, int(offsets[0]), int(offsets[-1]))
        source = _BatchSource(self, tokens, supervised, ordinals, begins, ends)
        placements = Placements(ordinals, part.rows[first:end] - local * per_batch, part.starts[first:end],
                                part.lengths[first:end], ordinals.astype(np.int32))
        rows = min(per_batch, part.row_count - local * per_batch)
        return PackedBatch.filled(self.partition, self.binding, source, placements, (rows, self.config.capacity),
                                  buffers, self.pairs, self.threads)

    def __getitem__(self, index):
        return batch_at(self, index, "this dataset")

    def batches(self, reuse_buffers: bool = False) -> Iterator[PackedBatch]:
        """Every batch in order; with ``reuse_buffers=True`` all share one set of field
        arrays, each valid only until the next is requested."""
        reuse = check_bool("reuse_buffers", reuse_buffers)
        self._require_budget()
        buffers = FieldArrays.allocate(self.largest_batch_rows, self.config.capacity) if reuse else None
        for number in range(self.batch_count):
            yield self._batch(number, buffers)

    def __iter__(self) -> Iterator[PackedBatch]:
        return self.batches()

    def batch_targets(self) -> np.ndarray:
        """Supervised targets of every batch (the loss denominators), without building any."""
        return np.concatenate([np.add.reduceat(part.targets, part.bounds[:-1]) if part.batch_count
                               else np.zeros(0, np.int64) for part in self.parts])

    def batch_pairs(self) -> np.ndarray:
        """Preference pairs of every batch (int64, all zero unless ``pairs``), without building any."""
        return np.concatenate([np.diff(part.bounds) // 2 if self.pairs else np.zeros(part.batch_count, np.int64)
                               for part in self.parts])

    def pair_map(self) -> np.ndarray:
        """Every preference pair's chosen and rejected global example ordinals, int64
        ``[pairs, 2]``: pair ``p`` is ``(2p, 2p + 1)`` (see :mod:`seqpack.io.format`). A
        dataset of other examples has no pairs: an error."""
        if not self.pairs:
            raise InvalidInputError(f"{self.path}: a dataset of format version {self.version} holds no preference "
                                    f"pairs (version 3 does)")
        return np.concatenate([part.pair_map + part.first_example for part in self.parts])

    def lengths(self) -> np.ndarray:
        """Every example's predictions, by global ordinal (int64)."""
        result = np.empty(self.occurrence_count, dtype=np.int64)
        for part in self.parts:
            result[part.first_example + part.ordinals] = part.lengths
        return result

    def row_fill(self) -> np.ndarray:
        """Valid cells of every row, in row order (int64)."""
        return np.concatenate([np.bincount(part.rows, weights=part.lengths, minlength=part.row_count)
                               for part in self.parts]).astype(np.int64)

    def report(self) -> EfficiencyReport:
        """Storage and attention efficiency of the packed epoch."""
        lengths = np.concatenate([part.lengths for part in self.parts])
        return EfficiencyReport.of(self.policy, self.config.capacity, self.row_count, lengths, self.batch_targets(),
                                   self.pair_count)

    def _part_of_example(self, ordinal) -> tuple[Part, int]:
        if isinstance(ordinal, bool) or not isinstance(ordinal, (int, np.integer)) \
                or not 0 <= ordinal < self.occurrence_count:
            raise InvalidInputError(f"example {ordinal!r} is outside this dataset's examples [0, {self.occurrence_count})")
        part = self.parts[int(np.searchsorted(self._first_examples, ordinal, side="right")) - 1]
        return part, int(ordinal) - part.first_example

    def example_id(self, ordinal: int) -> str:
        """Where example ``ordinal`` came from: ``file:line``, ``file row 3``... plus
        ``[start:stop]`` when it is a window of its document."""
        part, local = self._part_of_example(ordinal)
        document, start, stop = (int(v) for v in part.examples[local])
        source, location, size = (int(v) for v in part.documents[document])
        name = self.inputs[source].where(location)
        return name if (start, stop) == (0, size) else f"{name}[{start}:{stop}]"

    def example(self, ordinal: int) -> SequenceExample:
        """Example ``ordinal`` over its whole document, rebuilt from the document's examples."""
        part, local = self._part_of_example(ordinal)
        document, start, stop = (int(v) for v in part.examples[local])
        column = np.ascontiguousarray(part.examples[:, 0])
        first, end = np.searchsorted(column, document), np.searchsorted(column, document, side="right")
        windows = part.examples[int(first):int(end)]
        if windows[0, 1] != 0 or windows[-1, 2] != part.documents[document, 2] \
                or np.any(windows[1:, 1] != windows[:-1, 2] - 1):
            raise InvalidInputError(f"example {ordinal} ({self.example_id(ordinal)}): a window of its document "
                                    f"was left out (no supervised target), so the document cannot be rebuilt")
        pieces = [part.source_tokens(i) for i in range(int(first), int(end))]
        # Windows of one document share one token with the next: keep it once.
        tokens = np.concatenate([pieces[0]] + [piece[1:] for piece in pieces[1:]])
        supervised = None
        if part.flips is not None:
            marks = [part.source_supervision(i) for i in range(int(first), int(end))]
            supervised = np.concatenate([marks[0]] + [mark[1:] for mark in marks[1:]])
        doc = BatchDocument(f"document {part.first_document + document}", tokens, self.partition)
        return SequenceExample.from_range(self.example_id(ordinal), doc, (start, stop), self.binding,
                                          supervised=supervised, as_given=self.as_given)


def open_dataset(path, *, threads: int | None = None) -> PackedDataset:
    """Open the packed dataset at ``path`` (written by ``seqpack pack`` or
    :func:`seqpack.io.pack_corpus`): lazy batches with the plan's interface."""
    return PackedDataset(path, threads=threads)
