"""Checking a packed dataset on disk: every checksum, count, placement rule and batch invariant.

``verify_dataset`` refuses a directory without a manifest (an incomplete pack) or one
whose manifest differs from its seal (an edited field, named) or has none though its format
version is always sealed (only version 1 may have none), recomputes the SHA-256 of every
file the manifest lists, finds any file or directory it
does not list, then checks the part files
against each other and the manifest: examples are exactly the documents' whole ranges
(or their windows, for a pack that cut long documents), the placement is exactly what
the recorded policy gives for those lengths (for preference pairs, what it gives placing
each pair as one item) and tiles each row's prefix, tokens are in
the vocabulary with BOS and EOS exactly where the documents' frames put them (a dataset
whose supervision records documents taken as given, TRL's as its tokenizer made them,
has no frames to check), no
document is longer than the binding's ``max_tokens`` (``long_documents`` is checked on
open: examples must be the documents whole, or their windows for ``cut``), and every
count matches: each part's against its files, the firsts and totals against the parts
(checked on open), the report against the one the parts give, the shard count against
the parts; the supervision's flips rise, none falls on an example's first token, every
example has a supervised target and the supervised counts are the files'; the pair map
of a dataset of preference pairs has one row per pair and names pair ``p`` as examples
``2p`` (chosen) and ``2p + 1`` (rejected), so every example is in exactly one pair, each
pair lies side by side in one row (so in one batch), and the pair counts are the files'
(checked on open). Finally every batch is built and ``verify()``-ed (its ``loss_mask``
against the flips, its pairs whole). The first failure raises
:class:`~seqpack.errors.VerificationError` naming the file and the field.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .._arguments import check_bool
from ..errors import InvalidInputError, VerificationError
from ..packing.placement import place
from . import format as fmt
from .dataset import PackedDataset, malformed
from .part import Part
from .progress import Progress
from .readers import input_path

HASH_BLOCK = 8 << 20


def check_no_strangers(path: Path, manifest: dict) -> None:
    """The directory holds exactly what the manifest lists: ``manifest.json`` and its
    parts, each part exactly its files (a stranger there is no part of the dataset, and
    ``--force`` would refuse to replace the directory)."""
    try:
        parts = {part["name"]: set(part["files"]) for part in manifest["parts"]}
    except (KeyError, TypeError, AttributeError) as error:
        raise VerificationError(str(malformed(path, error))) from None
    for entry in sorted(path.iterdir()):
        if entry.name != fmt.MANIFEST and entry.name not in parts:
            raise VerificationError(f"{entry}: not listed in the manifest (a dataset holds only its manifest and parts)")
        _check_own(entry)
        if entry.name in parts and entry.is_dir():
            for inner in sorted(entry.iterdir()):
                if inner.name not in parts[entry.name]:
                    raise VerificationError(f"{inner}: not listed in the manifest (a part holds only its files)")
                _check_own(inner)


def _check_own(entry: Path) -> None:
    """A dataset's manifest, parts and files are its own: no symbolic link."""
    if entry.is_symlink():
        raise VerificationError(f"{entry}: a symbolic link; a dataset's manifest, parts and files are its own")


def check_checksums(path: Path, manifest: dict, progress: Progress) -> int:
    """Recompute every listed file's SHA-256 (and size); return the bytes read."""
    try:
        listed = [(path / part["name"] / name, record) for part in manifest["parts"]
                  for name, record in part["files"].items()]
        for part in manifest["parts"]:
            files = set(fmt.part_files(manifest["format_version"]))
            missing, extra = files - set(part["files"]), set(part["files"]) - files
            if missing:
                raise VerificationError(f"{path / fmt.MANIFEST}: part {part['name']} lists no {sorted(missing)[0]}")
            if extra:
                raise VerificationError(f"{path / fmt.MANIFEST}: part {part['name']} lists {sorted(extra)[0]!r}, "
                                        f"which no part holds")
        expected = [(file, int(record["bytes"]), str(record["sha256"])) for file, record in listed]
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise VerificationError(str(malformed(path, error))) from None
    total = sum(size for _, size, _ in expected)
    progress.phase("checksums", total, "B")
    for file, size, sha256 in expected:
        if not file.is_file():
            raise VerificationError(f"{file}: missing")
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            while block := handle.read(HASH_BLOCK):
                digest.update(block)
                progress.advance(len(block))
        found = file.stat().st_size
        if found != size or digest.hexdigest() != sha256:
            raise VerificationError(
                f"{file}: SHA-256 {digest.hexdigest()[:16]}... ({found} bytes) differs from the manifest's "
                f"{sha256[:16]}... ({size} bytes)"
            )
    return total


def _fail(file: Path, message: str):
    raise VerificationError(message).within(file, path=file)


def check_part(dataset: PackedDataset, part: Part) -> None:
    """The placement and token rules of one part. Opening it checked its counts, that the
    examples are the documents' ranges and that the placements tile each row once each."""
    capacity, policy = dataset.config.capacity, dataset.policy
    occurrences = part.directory / "occurrences.npy"
    sizes = np.ascontiguousarray(part.documents[:, 2])
    # Limits: no document is longer (framed) than the binding's decode limit allows.
    max_tokens = dataset.binding.limits.max_tokens
    if sizes.size and int(sizes.max()) > max_tokens:
        _fail(part.directory / "documents.npy", f"document {int(np.argmax(sizes))} has {int(sizes.max())} tokens; "
                                                f"the manifest's binding.limits.max_tokens is {max_tokens}")
    # Placement: what the recorded policy gives, in row-then-column order.
    lengths = part.examples[:, 2] - part.examples[:, 1] - 1
    placement = place(lengths, capacity, policy, pairs=dataset.pairs)
    if placement.row_count != part.row_count or not (
            np.array_equal(placement.rows[part.ordinals], part.rows)
            and np.array_equal(placement.starts[part.ordinals], part.starts)):
        _fail(occurrences, f"the placement differs from {policy} on these examples")
    # Tokens: in the vocabulary, BOS and EOS exactly where the frames put them (documents
    # taken as given, fine-tuning records as their tokenizer made them, have no frame).
    tokens = part.tokens
    binding = dataset.binding
    framed = not dataset.as_given
    spans = part.examples[part.ordinals]
    starts_document = np.flatnonzero(spans[:, 1] == 0) if binding.bos_id is not None else np.zeros(0, np.int64)
    ends_document = np.flatnonzero(spans[:, 2] == sizes[spans[:, 0]])
    frame = np.unique(np.concatenate([part.token_offsets[starts_document], part.token_offsets[ends_document + 1] - 1]))
    controls = []
    for first in range(0, tokens.shape[0], HASH_BLOCK):
        block = np.asarray(tokens[first: first + HASH_BLOCK]).astype(np.int64)
        if block.size and (block.min() < 0 or block.max() >= binding.vocabulary_size):
            _fail(part.directory / "tokens.bin", f"a token lies outside the vocabulary [0, {binding.vocabulary_size})")
        if framed:
            # (kernel_bos is -1 without a BOS: no token in the vocabulary equals it)
            controls.append(first + np.flatnonzero((block == binding.eos_id) | (block == binding.kernel_bos)))
    found = np.concatenate(controls) if controls else np.zeros(0, np.int64)
    if framed and not np.array_equal(found, frame):
        _fail(part.directory / "tokens.bin", "BOS or EOS tokens are not exactly at the documents' frames")
    bos_at = part.token_offsets[starts_document]
    if framed and bos_at.size and np.any(np.asarray(tokens[bos_at]) != binding.bos_id):
        _fail(part.directory / "tokens.bin", "a document does not start with BOS")
    # Windows of one document share one token (the last input of one is the first of the next).
    if part.example_count > 1:
        # (A window left out for having no supervised target breaks the chain: no pair there.)
        same = np.flatnonzero((part.examples[1:, 0] == part.examples[:-1, 0])
                              & (part.examples[1:, 1] == part.examples[:-1, 2] - 1))
        if same.size:
            at = part.placement_of
            last = np.asarray(tokens[part.token_offsets[at[same] + 1] - 1])
            first = np.asarray(tokens[part.token_offsets[at[same + 1]]])
            if not np.array_equal(last, first):
                _fail(part.directory / "tokens.bin", "consecutive windows of a document do not share their token")


def check_report(dataset: PackedDataset) -> None:
    """The manifest's report is the one the parts give; its shard count is the parts'."""
    manifest, where = dataset.manifest, dataset.path / fmt.MANIFEST
    recorded = manifest.get("report")
    if not isinstance(recorded, dict):
        _fail(where, "no 'report' object")
    for key, value in dataset.report().as_dict().items():
        if recorded.get(key) != value:
            _fail(where, f"report records {key} {recorded.get(key)!r}; the parts give {value!r}")
    shards = manifest.get("shards", {"count": len(dataset.parts)})
    count = shards.get("count") if isinstance(shards, dict) else shards
    # A shard of nothing but empty documents has no part, so there may be fewer parts.
    if isinstance(count, bool) or not isinstance(count, int) or count < len(dataset.parts):
        _fail(where, f"shards records count {count!r}; the dataset's part count is {len(dataset.parts)}")


def check_tokenizer(dataset: PackedDataset, file) -> None:
    """``file`` is the tokenizers JSON file the dataset was packed with: its identity
    (content digest, vocabulary size, BOS and EOS) is the one the manifest records."""
    from .tokenizer_file import TokenizerFile

    recorded = dataset.manifest["binding"]["tokenizer"]
    if recorded.get("kind") == "byte":
        raise VerificationError(f"{file}: {dataset.path} was packed with the byte tokenizer, not a tokenizers file")
    try:
        found = TokenizerFile(file, bos=recorded["bos_id"], eos=recorded["eos_id"]).identity
    except InvalidInputError as error:
        if error.kind == "missing-extra":
            raise
        # (the reason without the file's name, which leads this message)
        refusal = VerificationError(f"not the tokenizer {dataset.path} was packed with ({error.message})")
        raise refusal.within(file, path=file) from None
    expected = dataset.binding.tokenizer_identity
    if found != expected:
        raise VerificationError(
            f"{file}: not the tokenizer {dataset.path} was packed with (SHA-256 {found.digest[:16]}..., "
            f"{found.vocabulary_size} IDs; the manifest records {recorded.get('file', 'a file')!r} with "
            f"{expected.digest[:16]}..., {expected.vocabulary_size} IDs)")


def verify_dataset(path, *, tokenizer=None, progress: Progress | None = None, batches: bool = True) -> dict:
    """Check everything about the dataset at ``path``; return what was checked. With
    ``tokenizer`` (a tokenizers JSON file), also check that it is the one the dataset was
    packed with.

    Raises :class:`~seqpack.errors.VerificationError` naming the first failing file, or
    ``InvalidInputError`` for a missing or unreadable manifest, arguments of the wrong
    type, and a dataset replaced (a pack with ``--force``) while it was being read.
    """
    path = input_path(path)
    tokenizer = None if tokenizer is None else input_path(tokenizer, "tokenizer")
    batches = check_bool("batches", batches)
    if progress is not None and not isinstance(progress, Progress):
        raise InvalidInputError(f"progress must be a seqpack.io Progress or None, not {type(progress).__name__}")
    progress = progress or Progress(enabled=False)
    stamp = fmt.manifest_stamp(path)
    try:
        checked = _verify(path, tokenizer, progress, batches)
    except (VerificationError, InvalidInputError):
        _check_not_replaced(path, stamp)
        raise
    _check_not_replaced(path, stamp)
    return checked


def _check_not_replaced(path: Path, stamp) -> None:
    """Refuse a verify that read two datasets: a pack --force replaced ``path`` meanwhile, so
    a file that differs from the manifest read first says nothing of either."""
    if stamp is not None and fmt.manifest_stamp(path) != stamp:
        raise InvalidInputError(f"{path}: the dataset was replaced while it was being verified (a pack with "
                                f"--force into it?): verify it again")


def _verify(path: Path, tokenizer, progress: Progress, batches: bool) -> dict:
    """:func:`verify_dataset` on checked arguments."""
    manifest = fmt.read_manifest(path, VerificationError)
    try:
        checked_bytes = check_checksums(path, manifest, progress)
        try:
            dataset = PackedDataset(path)
        except InvalidInputError as error:  # a file the manifest does not describe
            raise VerificationError(str(error)) from None
        check_no_strangers(path, manifest)
        if tokenizer is not None:
            check_tokenizer(dataset, tokenizer)
        for part in dataset.parts:
            check_part(dataset, part)
        check_report(dataset)
        if batches:
            progress.phase("batches", dataset.batch_count, " batches")
            for number, batch in enumerate(dataset.batches(reuse_buffers=True)):
                try:
                    batch.verify()
                except VerificationError as error:
                    raise error.within(f"batch {number}").within(path, path=path) from None
                progress.advance(1)
    finally:
        progress.close()
    return {"path": str(path), "sealed": fmt.SEAL in manifest,
            "tokenizer": None if tokenizer is None else str(tokenizer), "files": sum(len(p["files"]) for p in manifest["parts"]), "bytes": checked_bytes,
            "parts": len(manifest["parts"]), "examples": dataset.occurrence_count,
            "pairs": dataset.pair_count if dataset.pairs else None, "batches": dataset.batch_count,
            "batches_verified": dataset.batch_count if batches else 0}
