"""The packed dataset on disk: its files and its sealed manifest, and reading the manifest.

A dataset is a directory holding ``manifest.json`` and one or more *parts*, each a
subdirectory (``part-00000``...) packed on its own:

``tokens.bin``
    The source tokens of every placed example (its inputs plus its last target),
    back to back in placement order (batch, row, column): little-endian uint16 when
    the vocabulary has at most 65,536 IDs, else int32. A batch's tokens are one
    contiguous run, so loading a batch reads sequentially under every policy.
``occurrences.npy``
    int64 ``[examples, 3]``: the part-local example ordinal, the part-local row and the
    start column of each placement, in the same order (rows non-decreasing; each row's
    examples tile its first columns).
``examples.npy``
    int64 ``[examples, 3]`` by example ordinal: its part-local document and its source
    range ``[start, stop)`` in that document.
``documents.npy``
    int64 ``[documents, 3]``: the input (an index into the manifest's ``inputs``), the
    place in it (line, row or sequence) and the framed token count of each document.
``supervision.npy`` (format versions 2 and 3)
    Which targets count in the loss, as *flips*: the sorted positions in ``tokens.bin``
    whose supervision differs from the token before (the one before the first counts
    as supervised); uint32 when the part holds fewer than 2**32 tokens, else int64. An
    example's first token is no target and takes the state before it, so a flip never
    falls on one: a prompt and its completion cost two integers, a fully supervised
    example none.

``pairs.npy`` (format version 3 only)
    int64 ``[pairs, 2]``: each preference pair's chosen and rejected example ordinals,
    part-local like ``occurrences.npy``'s. Pair ``p`` is always examples ``2p`` (chosen)
    and ``2p + 1`` (rejected), placed side by side in one row, chosen first, so a
    batch's occurrences come as (chosen, rejected) of each of its pairs in turn.

A dataset is written in version 2 when its inputs carry supervision (prompt-completion
records, conversations, or mask columns): its manifest then records under
``supervision`` what was applied, and its counts and parts ``supervised_targets`` and
``skipped_unsupervised_windows`` (``--cut-long`` windows with no supervised target,
left out). A dataset of preference pairs (DPO records: every input of the pack holds
them) is written in version 3: everything version 2 writes, plus each part's
``pairs.npy`` and the pair count (``pairs``) in the counts, the report and each part's record.
Any other dataset is written in version 1, byte for byte as before; all three open.
A manifest holds nothing only a later version writes (:data:`VERSION_FIELDS`) and its
parts no file only a later version writes (:data:`VERSION_FILES`), so a version lowered
by hand is refused where a trace is left.

``manifest.json`` records the format version, the binding (tokenizer identity, split
digest, limits), partition, config, policy, token dtype, inputs, counts, the
efficiency report, and per part its first global example, document, row and batch, its
counts and every file's byte size and SHA-256. A part's example ``i`` has the global
ordinal ``first_example + i`` (its segment in every batch). Batches never span parts.

The manifest is sealed (:func:`seal`): its ``seal`` holds the SHA-256 of its canonical
JSON and a digest of each field down to three levels of keys (``binding.limits.max_tokens``,
``inputs[0].name``, ``parts[0].files.tokens.bin``), so an edited field is an error naming it wherever the manifest is
read. Only a version-1 manifest may have none (one written before seals existed), and it
still opens; every seqpack that writes version 2 or 3 seals it, so such a manifest without a
seal had it removed and is refused. :func:`read_manifest` reads a complete dataset's
manifest, its format and seal checked.

Writing a dataset crash-safely (hashed, durable writes, the hidden directory it is
written into, the publish transaction and the temporary names a killed writer leaves)
is :mod:`seqpack.io.publish`'s.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..errors import InvalidInputError

FORMAT = "seqpack-packed-dataset"
#: The version written for a dataset with supervision, and for one of preference pairs (the
#: latest); one with neither is written as version 1.
SUPERVISED_VERSION = 2
PAIRED_VERSION = 3
FORMAT_VERSION = PAIRED_VERSION
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
SEAL = "seal"
#: How many levels of keys the seal names: ``binding.limits.max_tokens`` is three.
SEAL_DEPTH = 3
#: The format versions written before seals existed: only their manifests may have no seal.
UNSEALED_VERSIONS = (1,)
PART_FILES = ("tokens.bin", "occurrences.npy", "examples.npy", "documents.npy")
SUPERVISION_FILE = "supervision.npy"
PAIRS_FILE = "pairs.npy"
#: The part file each later version adds (a part of that version or later holds it).
VERSION_FILES = {SUPERVISED_VERSION: SUPERVISION_FILE, PAIRED_VERSION: PAIRS_FILE}
#: The counts a version-2 dataset adds (totals of the parts', like ``COUNTS``).
SUPERVISION_COUNTS = ("supervised_targets", "skipped_unsupervised_windows")
#: The counts a version-3 dataset adds.
PAIR_COUNTS = ("pairs",)
#: The counts each later version adds.
VERSION_COUNTS = {SUPERVISED_VERSION: SUPERVISION_COUNTS, PAIRED_VERSION: PAIR_COUNTS}
#: What only version 2 writes in the manifest (by keys) and whether it always does: a
#: version-1 manifest holds none of it, a version-2 one every field marked True (the report
#: has ``supervised_targets`` only when some target is unsupervised).
SUPERVISION_FIELDS = {("supervision",): True, **{("counts", key): True for key in SUPERVISION_COUNTS},
                      ("report", "supervised_targets"): False}
#: The same in each part's record.
PART_SUPERVISION_FIELDS = {("files", SUPERVISION_FILE): True, **{(key,): True for key in SUPERVISION_COUNTS}}
#: What only version 3 writes, in the manifest and in each part's record.
PAIR_FIELDS = {**{("counts", key): True for key in PAIR_COUNTS}, ("report", "pairs"): True}
PART_PAIR_FIELDS = {("files", PAIRS_FILE): True, **{(key,): True for key in PAIR_COUNTS}}
#: Each later version's fields: ``(in the manifest, in each part's record)``. A manifest of an
#: earlier version holds none of them; one of that version or later every field marked True.
VERSION_FIELDS = {SUPERVISED_VERSION: (SUPERVISION_FIELDS, PART_SUPERVISION_FIELDS),
                  PAIRED_VERSION: (PAIR_FIELDS, PART_PAIR_FIELDS)}
#: The manifest's totals, each the sum of the parts' counts of that name.
COUNTS = ("documents", "examples", "tokens", "document_tokens", "rows", "batches", "valid_targets",
          "permitted_edges", "skipped_empty_documents")
#: Each part's ``first_*`` field and the count it is the running sum of.
FIRSTS = {"first_example": "examples", "first_document": "documents", "first_row": "rows", "first_batch": "batches"}
#: Vocabularies up to this size store uint16 tokens.
UINT16_VOCABULARY = 1 << 16


def part_files(version: int) -> tuple[str, ...]:
    """The files a part of a dataset of format ``version`` holds."""
    return (*PART_FILES, *(name for since, name in VERSION_FILES.items() if since <= version))


def counts_of(version: int) -> tuple[str, ...]:
    """The manifest's totals in format ``version``."""
    return (*COUNTS, *(key for since, keys in VERSION_COUNTS.items() if since <= version for key in keys))


def version_of(supervised: bool, paired: bool) -> int:
    """The format version a dataset is written in: 3 for preference pairs (which always
    carry supervision), 2 for other supervision, else 1."""
    return PAIRED_VERSION if paired else SUPERVISED_VERSION if supervised else 1


def flips_dtype(tokens: int) -> np.dtype:
    """``supervision.npy``'s dtype for a part of ``tokens`` tokens."""
    return np.dtype("<u4") if tokens < 1 << 32 else np.dtype("<i8")


def token_dtype(vocabulary_size: int) -> np.dtype:
    """uint16 when every ID fits, else int32 (little-endian either way)."""
    return np.dtype("<u2") if vocabulary_size <= UINT16_VOCABULARY else np.dtype("<i4")


def part_name(index: int) -> str:
    return f"part-{index:05d}"


def _is_manifest(value) -> bool:
    return isinstance(value, dict) and value.get("format") == FORMAT


def manifest_stamp(directory: Path):
    """What identifies ``directory``'s manifest file now (inode, modification time and
    size), or None when it has none: a publish since changes it."""
    try:
        status = (Path(directory) / MANIFEST).stat()
    except OSError:
        return None
    return status.st_ino, status.st_mtime_ns, status.st_size


def is_packed_dataset(directory: Path) -> bool:
    """Whether ``directory`` holds a seqpack ``manifest.json`` (one whose ``format`` says
    so, of any format version)."""
    try:
        return _is_manifest(json.loads((directory / MANIFEST).read_text(encoding="utf-8")))
    except (OSError, ValueError, RecursionError):  # no such file, not UTF-8, not JSON, nested too deep
        return False


def _digest(value) -> str:
    """SHA-256 of ``value``'s canonical JSON (sorted keys, no spaces)."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _field_digests(value, prefix: str = "", depth: int = SEAL_DEPTH) -> dict[str, str]:
    """A digest of each field of ``value`` down to ``depth`` levels of keys (a list index is
    no level: ``parts[0].files.tokens.bin`` is three), keyed by its path."""
    if isinstance(value, dict):
        fields = ((f"{prefix}.{key}" if prefix else str(key), inner) for key, inner in value.items())
    elif isinstance(value, list) and prefix:
        fields = ((f"{prefix}[{index}]", inner) for index, inner in enumerate(value))
    else:
        return {}
    below = depth if isinstance(value, list) else depth - 1
    digests = {}
    for path, inner in fields:
        digests[path] = _digest(inner)[:16]
        if below > 0:
            digests.update(_field_digests(inner, path, below))
    return digests


def seal(manifest: dict) -> dict:
    """``manifest`` with its seal: the whole content's SHA-256 and each field's digest."""
    content = {key: value for key, value in manifest.items() if key != SEAL}
    return {**content, SEAL: {"sha256": _digest(content), "fields": _field_digests(content)}}


def check_seal(path: Path, manifest: dict, failure=InvalidInputError) -> bool:
    """Whether ``manifest`` (read from ``path``, its version checked) is sealed; raise
    ``failure`` naming the fields that differ from their seal (the deepest sealed ones), a
    broken seal, or a missing one where the version is always sealed."""
    if SEAL not in manifest:
        version = manifest.get("format_version")
        if version not in UNSEALED_VERSIONS:
            raise failure(f"{path}: no seal, but a version-{version} manifest is always sealed by the seqpack that "
                          f"writes it, so its seal was removed")
        return False
    recorded, content = manifest[SEAL], {key: value for key, value in manifest.items() if key != SEAL}
    if not (isinstance(recorded, dict) and isinstance(recorded.get("fields"), dict)
            and isinstance(recorded.get("sha256"), str)):
        raise failure(f"{path}: its seal is not a seqpack seal (the manifest was edited)")
    if _digest(content) == recorded["sha256"]:
        return True
    found, sealed = _field_digests(content), recorded["fields"]
    differ = {key: "added" if key not in sealed else "removed" if key not in found else "edited"
              for key in sorted(found.keys() | sealed.keys()) if found.get(key) != sealed.get(key)}

    def ancestors(key):
        return [key[:at] for at, char in enumerate(key) if char in ".[" and key[:at] in differ]

    above = {ancestor for key in differ for ancestor in ancestors(key)}
    # An added or removed field is named, not its contents; an edited one at its deepest.
    deepest = [key for key, how in differ.items() if key not in above or how != "edited"]
    deepest = [key for key in deepest if not any(differ[a] != "edited" for a in ancestors(key))]
    named = ", ".join(f"{key} ({differ[key]})" for key in deepest[:4]) or "the seal itself"
    more = f" and {len(deepest) - 4} more" if len(deepest) > 4 else ""
    raise failure(f"{path}: the manifest differs from its seal at {named}{more}: it no longer describes the "
                  "dataset that was written")


def read_manifest(directory, failure=InvalidInputError) -> dict:
    """The manifest of a complete dataset, its format and seal checked; errors (``failure``
    for a broken seal) name the directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InvalidInputError(f"{directory}: {'not a' if directory.exists() else 'no such'} directory")
    path = directory / MANIFEST
    if not path.is_file():
        raise InvalidInputError(f"{path}: missing, so {directory} is not a complete packed dataset")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:  # removed since (a pack --force replacing the dataset), or unreadable
        raise InvalidInputError(f"{path}: cannot read: {error.strerror or error}") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise InvalidInputError(f"{path}: not valid JSON: {error}") from None
    except RecursionError:
        raise InvalidInputError(f"{path}: not a seqpack packed-dataset manifest: its JSON is nested too deep "
                                "to read") from None
    if not _is_manifest(manifest):
        raise InvalidInputError(f"{path}: not a seqpack packed-dataset manifest")
    version = manifest.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise InvalidInputError(
            f"{path}: format version {version!r}; this seqpack reads "
            f"{', '.join(map(str, READABLE_VERSIONS[:-1]))} and {READABLE_VERSIONS[-1]}"
        )
    check_seal(path, manifest, failure)
    return manifest
