"""One part of a packed dataset on disk: its files checked against the manifest's record,
memory-mapped while in use (at most ``MAPPED_PARTS`` parts over every open dataset, least
recently used unmapped first), and the index arrays its batches need, derived once and
checked so that a damaged file can never make a fill write out of bounds, serve the wrong
batch or split a preference pair.
"""

from __future__ import annotations

import mmap
import os
import threading
import tokenize
import weakref
from collections import OrderedDict
from functools import cached_property
from pathlib import Path

import numpy as np

from ..data.supervision import range_target_counts, supervision_of
from ..data.windows import document_examples
from ..errors import InvalidInputError
from ..layout.counts import permitted_edges
from ..packing.config import PackConfig
from . import format as fmt


MAPPED_PARTS = 64
_mapped: OrderedDict[int, weakref.ref] = OrderedDict()   # id(part) -> part, least recent first
#: Held while a part maps its files or another's are dropped to stay under MAPPED_PARTS:
#: threads reading one dataset would otherwise drop the maps a part was returning.
_mapping = threading.Lock()


def _after_fork_in_child() -> None:
    global _mapping
    _mapping = threading.Lock()  # a thread of the parent may have held it: the child's is free


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one file from another at the same path: device, inode, size and mtime."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def _npy_header(path: Path) -> tuple[tuple, bool, np.dtype, int]:
    """The shape, Fortran order, dtype and data offset of the ``.npy`` file at ``path``."""
    try:
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) \
                else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(handle)
            return shape, fortran, dtype, handle.tell()
    except (ValueError, OSError, SyntaxError, tokenize.TokenError) as error:  # (a header numpy cannot parse)
        raise InvalidInputError(f"{path}: not a readable .npy file: {error}") from None


class Part:
    """One part's files, memory-mapped while in use (at most ``MAPPED_PARTS`` parts at a
    time), with the index arrays its batches need."""

    def __init__(self, directory: Path, record: dict, config: PackConfig, dtype: np.dtype, long: str,
                 version: int = 1):
        self.directory = directory
        self.supervised = version >= fmt.SUPERVISED_VERSION
        self.paired = version >= fmt.PAIRED_VERSION
        self.name = record["name"]
        self.first_example = int(record["first_example"])
        self.first_document = int(record["first_document"])
        self.first_row = int(record["first_row"])
        self.first_batch = int(record["first_batch"])
        self.example_count = int(record["examples"])
        self.row_count = int(record["rows"])
        self.batch_count = int(record["batches"])
        self.pair_count = int(record["pairs"]) if self.paired else 0
        self._sizes = {name: record["files"][name]["bytes"] for name in fmt.part_files(version)}
        self._identities = {}  # each file's (device, inode, size, mtime) as opened: a re-map checks it
        for name, expected in self._sizes.items():
            path = directory / name
            if not path.is_file():
                raise InvalidInputError(f"{path}: missing")
            status = path.stat()
            if status.st_size != expected:
                raise InvalidInputError(f"{path}: {status.st_size} bytes; the manifest records {expected}")
            self._identities[name] = _identity(status)
        # A file only a later version writes is left from a dataset whose version was lowered.
        for since, name in fmt.VERSION_FILES.items():
            if since > version and (directory / name).exists():
                raise InvalidInputError(f"{directory / name}: a part of a version-{version} dataset holds no "
                                        f"{name}; only version {since} and later write one")
        self._dtype, self._document_count = dtype, int(record["documents"])
        if self._sizes["tokens.bin"] % dtype.itemsize:
            raise InvalidInputError(f"{directory / 'tokens.bin'}: {self._sizes['tokens.bin']} bytes, not a whole "
                                    f"number of {dtype.itemsize}-byte tokens")
        self._maps, self._views = None, {}  # the arrays over the files, and their maps by file name
        self._check_row_and_batch_counts(config)
        self._derive_index(config.rows_per_batch)
        self._check_placements(config)
        self._check_pairs(record)
        self._check_supervision()
        self._check_examples(config, long, record)
        self._check_counts(record, config)

    def _mapped(self) -> tuple:
        """``(tokens, occurrences, examples, documents, flips, pairs)``, mapped now unless
        they are, each file checked to still have its recorded size (reading a mapped file
        that shrank would kill the process with SIGBUS)."""
        key = id(self)
        with _mapping:
            if self._maps is None:
                self._views = {}
                tokens = self._map("tokens.bin", self._dtype, (self._sizes["tokens.bin"] // self._dtype.itemsize,))
                self._maps = (tokens, self._table("occurrences.npy", self.example_count),
                              self._table("examples.npy", self.example_count),
                              self._table("documents.npy", self._document_count),
                              self._flips() if self.supervised else None,
                              self._table(fmt.PAIRS_FILE, self.pair_count, 2) if self.paired else None)
                _mapped[key] = weakref.ref(self, lambda _, key=key: _mapped.pop(key, None))
                while len(_mapped) > MAPPED_PARTS:
                    _, oldest = _mapped.popitem(last=False)
                    part = oldest()
                    if part is not None:
                        part._maps, part._views = None, {}
            else:
                _mapped.move_to_end(key)
            maps, views = self._maps, self._views   # (another thread may drop them once released)
        for name, view in views.items():
            if view.size() != self._sizes[name]:  # the mapped file's size now (an fstat)
                raise InvalidInputError(f"{self.directory / name}: {view.size()} bytes; the manifest records "
                                        f"{self._sizes[name]} (the file changed while the dataset was open)")
        return maps

    def _map(self, name: str, dtype: np.dtype, shape: tuple, offset: int = 0) -> np.ndarray:
        """A read-only array over ``name`` from ``offset``; its map is kept for the size check."""
        if not np.prod(shape, dtype=np.int64):
            return np.zeros(shape, dtype)
        try:
            handle = open(self.directory / name, "rb")
        except OSError as error:  # removed since the dataset was opened (a pack --force replacing it), say
            raise InvalidInputError(f"{self.directory / name}: cannot read: {error.strerror or error} (open the "
                                    f"dataset again if it was replaced)") from None
        with handle:
            if _identity(os.fstat(handle.fileno())) != self._identities[name]:
                # (unmapped to stay under MAPPED_PARTS, mapped again: the same sizes would not
                # show a dataset replaced in between, whose tokens the old index would misread)
                raise InvalidInputError(f"{self.directory / name}: the file was replaced or rewritten since the "
                                        f"dataset was opened: open it again")
            view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._views[name] = view
        return np.frombuffer(view, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)

    # The part's files, mapped on use (see seqpack.io.format for what each holds).
    tokens = property(lambda self: self._mapped()[0], doc="tokens.bin: the placed examples' tokens")
    occurrences = property(lambda self: self._mapped()[1], doc="occurrences.npy: (ordinal, row, column) each")
    examples = property(lambda self: self._mapped()[2], doc="examples.npy: (document, start, stop) each")
    documents = property(lambda self: self._mapped()[3], doc="documents.npy: (input, place, tokens) each")
    flips = property(lambda self: self._mapped()[4], doc="supervision.npy: the flips (int64), or None")
    pair_map = property(lambda self: self._mapped()[5], doc="pairs.npy: (chosen, rejected) each, or None")

    def _flips(self) -> np.ndarray:
        """``supervision.npy``'s flips as int64 (a copy: small, and read on every batch)."""
        path = self.directory / fmt.SUPERVISION_FILE
        shape, fortran, dtype, offset = _npy_header(path)
        if dtype not in (np.dtype("<u4"), np.dtype("<i8")) or len(shape) != 1 or fortran:
            raise InvalidInputError(f"{path}: holds {dtype} {shape}; expected a 1-D uint32 or int64 array of flips")
        if offset + shape[0] * dtype.itemsize != self._sizes[fmt.SUPERVISION_FILE]:
            raise InvalidInputError(f"{path}: {self._sizes[fmt.SUPERVISION_FILE]} bytes, not the {shape[0]} "
                                    f"flips its header declares")
        return self._map(fmt.SUPERVISION_FILE, dtype, shape, offset).astype(np.int64)

    def _table(self, name: str, rows: int, columns: int = 3) -> np.ndarray:
        """The int64 ``[rows, columns]`` table in the ``.npy`` file ``name``, mapped."""
        path = self.directory / name
        shape, fortran, dtype, offset = _npy_header(path)
        if dtype != np.int64 or shape != (rows, columns) or fortran:
            raise InvalidInputError(f"{path}: holds {dtype} {shape}{' (Fortran order)' if fortran else ''}; "
                                    f"expected int64 ({rows}, {columns})")
        if offset + rows * columns * dtype.itemsize != self._sizes[name]:
            raise InvalidInputError(f"{path}: {self._sizes[name]} bytes, not the {rows} rows its header declares")
        return self._map(name, dtype, shape, offset)

    def _derive_index(self, rows_per_batch: int) -> None:
        """The index arrays the batches read, each in placement order: every placement's
        example (``ordinals``), ``rows``, ``starts``, ``lengths`` (its predictions) and
        ``targets`` (its supervised predictions: all of them without supervision), where
        each placed example's tokens begin in ``tokens.bin`` (``token_offsets``, one more
        for the end) and each batch's first placement (``bounds``, one more for the end).

        Nothing is checked here and nothing fails on a damaged file: the ``_check_*``
        methods called after it refuse one, reading these arrays."""
        ordinals, rows, starts = (np.ascontiguousarray(self.occurrences[:, k]) for k in range(3))
        # An ordinal out of range is refused by _check_placements; clipped, it reads no row outside the table.
        spans = self.examples[np.clip(ordinals, 0, max(self.example_count - 1, 0))]
        sizes = spans[:, 2] - spans[:, 1]
        offsets = np.zeros(self.example_count + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        self.ordinals, self.rows, self.starts = ordinals, rows, starts
        self.lengths = sizes - 1
        self.token_offsets = offsets
        self.bounds = np.append(np.searchsorted(rows, np.arange(self.batch_count, dtype=np.int64) * rows_per_batch),
                                self.example_count)
        self.targets = range_target_counts(self.flips, offsets[:-1], offsets[1:]) if self.supervised else self.lengths

    def _check_row_and_batch_counts(self, config: PackConfig) -> None:
        """Rows and batches the index is sized by: at most one row per example, and the
        batches the rows make (checked before the index allocates one entry per batch)."""
        where = f"{self.directory.parent / fmt.MANIFEST}: part {self.name} records"
        if not 0 <= self.row_count <= self.example_count:
            raise InvalidInputError(f"{where} {self.row_count} rows of its {self.example_count} examples; a row "
                                    f"holds at least one")
        batches = -(-self.row_count // config.rows_per_batch)
        if self.batch_count != batches:
            raise InvalidInputError(f"{where} batches {self.batch_count}; its {self.row_count} rows make {batches}")

    def _check_placements(self, config: PackConfig) -> None:
        """What the fill kernel trusts: every example placed once, rows 0, 1... each used
        and in order, every placement inside its row, each row's examples tiling its
        prefix, and the token file holding every example."""
        ordinals, rows, starts, offsets = self.ordinals, self.rows, self.starts, self.token_offsets
        sizes = self.lengths + 1  # each placed example's source tokens
        where = f"{self.directory / 'occurrences.npy'}"
        if self.example_count and (ordinals.min() < 0 or ordinals.max() >= self.example_count):
            raise InvalidInputError(f"{where}: an example ordinal lies outside [0, {self.example_count})")
        if np.any(np.bincount(ordinals, minlength=self.example_count) != 1):
            raise InvalidInputError(f"{where}: the placements do not name every example exactly once")
        steps = np.diff(rows)
        if not self.example_count or rows[0] != 0 or rows[-1] != self.row_count - 1 \
                or np.any((steps < 0) | (steps > 1)):
            raise InvalidInputError(f"{where}: the placements do not fill rows 0 to {self.row_count - 1} in order")
        if np.any(sizes < 2) or np.any(starts < 0) or np.any(starts + sizes - 1 > config.capacity):
            bad = int(np.flatnonzero((sizes < 2) | (starts < 0) | (starts + sizes - 1 > config.capacity))[0])
            raise InvalidInputError(f"{where}: placement {bad} does not lie inside a row of {config.capacity} columns")
        # Each row's examples tile its prefix, in column order (a gap or an overlap fills a wrong batch).
        follows = np.zeros(self.example_count, dtype=np.int64)
        follows[1:] = starts[:-1] + sizes[:-1] - 1
        expected = np.where(np.append(True, steps != 0), 0, follows)
        if not np.array_equal(starts, expected):
            bad = int(np.flatnonzero(starts != expected)[0])
            raise InvalidInputError(f"{where}: placement {bad} leaves a gap or overlaps in row {int(rows[bad])}")
        if offsets[-1] != self.tokens.shape[0]:
            raise InvalidInputError(
                f"{self.directory / 'tokens.bin'}: {self.tokens.shape[0]} tokens; the examples need {offsets[-1]}"
            )

    def _check_pairs(self, record: dict) -> None:
        """What a preference objective trusts of a part of pairs: its examples are its
        pairs' (two each), ``pairs.npy`` names pair ``p`` as examples ``2p`` (chosen) and
        ``2p + 1`` (rejected), so every example is in exactly one pair, and each pair's
        rejected is placed right after its chosen, in the same row."""
        if not self.paired:
            return
        if 2 * self.pair_count != self.example_count:
            raise InvalidInputError(f"{self.directory.parent / fmt.MANIFEST}: part {self.name} records "
                                    f"{record['pairs']!r} pairs of its {self.example_count} examples; a pair is two")
        pairs = self.pair_map
        expected = np.arange(self.example_count, dtype=np.int64).reshape(-1, 2)
        wrong = np.flatnonzero(np.any(pairs != expected, axis=1))
        if wrong.size:
            index = int(wrong[0])
            raise InvalidInputError(f"{self.directory / fmt.PAIRS_FILE}: pair {index} is examples "
                                    f"{int(pairs[index, 0])} and {int(pairs[index, 1])}, not {2 * index} (chosen) "
                                    f"and {2 * index + 1} (rejected)")
        chosen, rejected = self.placement_of[0::2], self.placement_of[1::2]
        apart = np.flatnonzero((rejected != chosen + 1) | (self.rows[chosen] != self.rows[rejected]))
        if apart.size:
            index = int(apart[0])
            at = int(chosen[index]), int(rejected[index])
            raise InvalidInputError(
                f"{self.directory / 'occurrences.npy'}: pair {index} (examples {2 * index} and {2 * index + 1}) "
                f"is not side by side in one row, chosen first: placements {at[0]} and {at[1]}, in rows "
                f"{int(self.rows[at[0]])} and {int(self.rows[at[1]])}")

    def _check_supervision(self) -> None:
        """What the fill and the loss trust of ``supervision.npy``: flips that rise inside the
        token file, none on an example's first token (the canonical form the writer makes),
        and a supervised target in every example."""
        if not self.supervised:
            return
        flips, where = self.flips, self.directory / fmt.SUPERVISION_FILE
        if flips.size and (flips[0] < 0 or flips[-1] >= self.tokens.shape[0] or np.any(np.diff(flips) <= 0)):
            raise InvalidInputError(f"{where}: the flips do not rise inside the {self.tokens.shape[0]} tokens")
        firsts = self.token_offsets[:-1]
        on_first = np.flatnonzero(np.isin(flips, firsts))
        if on_first.size:
            raise InvalidInputError(f"{where}: flip {int(on_first[0])} falls on an example's first token, "
                                    f"which is no target")
        none = np.flatnonzero(self.targets == 0)
        if none.size:
            raise InvalidInputError(f"{where}: placement {int(none[0])} has no supervised target")

    def _check_examples(self, config: PackConfig, long: str, record: dict) -> None:
        """The examples are the documents' ranges the pack makes (what ``example`` and
        ``example_id`` rely on to rebuild and name a document), but for the windows left
        out for having no supervised target, which the manifest counts."""
        try:
            documents, ranges = document_examples(np.ascontiguousarray(self.documents[:, 2]), config.capacity, long)
        except InvalidInputError as error:  # (lengths no pack writes: a damaged file)
            raise InvalidInputError(f"{self.directory / 'documents.npy'}: {error}") from None
        where = f"{self.directory / 'examples.npy'}: the examples are not the documents' ranges for capacity " \
                f"{config.capacity}"
        if self.supervised:
            skipped = record["skipped_unsupervised_windows"]
            found = np.column_stack([documents, ranges])
            expected = found.shape[0] - self.example_count
            if expected != skipped:
                raise InvalidInputError(f"{where} ({expected} windows missing; the manifest records {skipped!r} "
                                        f"left out)")
            if skipped:  # the windows the examples name (by their first token's place), in order
                sizes = np.ascontiguousarray(self.documents[:, 2])
                starts = np.concatenate(([0], np.cumsum(sizes)))
                named = np.clip(self.examples[:, 0], 0, sizes.shape[0] - 1)
                at = np.searchsorted(starts[documents] + ranges[:, 0], starts[named] + self.examples[:, 1])
                at = np.minimum(at, found.shape[0] - 1)
                if np.any(np.diff(at) <= 0):
                    raise InvalidInputError(f"{where} (a window appears twice)")
                documents, ranges = documents[at], ranges[at]
        if not (np.array_equal(documents, self.examples[:, 0]) and np.array_equal(ranges, self.examples[:, 1:])):
            raise InvalidInputError(where)

    def _check_counts(self, record: dict, config: PackConfig) -> None:
        """The part's recorded counts are the ones its files give (no token is read)."""
        lengths = self.lengths
        derived = {"tokens": self.tokens.shape[0], "document_tokens": int(self.documents[:, 2].sum()),
                   "batches": -(-self.row_count // config.rows_per_batch), "valid_targets": int(lengths.sum()),
                   "permitted_edges": permitted_edges(lengths)}
        if self.supervised:
            derived["supervised_targets"] = int(self.targets.sum())
        for key, value in derived.items():
            if record[key] != value:
                raise InvalidInputError(f"{self.directory.parent / fmt.MANIFEST}: part {self.name} records {key} "
                                        f"{record[key]!r}; its files hold {value}")

    @cached_property
    def placement_of(self) -> np.ndarray:
        """The placement index of every part-local example ordinal."""
        inverse = np.empty(self.example_count, dtype=np.int64)
        inverse[self.ordinals] = np.arange(self.example_count, dtype=np.int64)
        return inverse

    def source_tokens(self, local: int) -> np.ndarray:
        """Example ``local``'s source tokens (int32)."""
        at = int(self.placement_of[local])
        return np.asarray(self.tokens[self.token_offsets[at]: self.token_offsets[at + 1]], dtype=np.int32)

    def source_supervision(self, local: int) -> np.ndarray:
        """Example ``local``'s supervision (bool, aligned with its source tokens)."""
        at = int(self.placement_of[local])
        return supervision_of(self.flips, int(self.token_offsets[at]), int(self.token_offsets[at + 1]))
