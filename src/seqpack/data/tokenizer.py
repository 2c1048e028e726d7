"""The byte tokenizer, its identity and the document rules.

A document is framed ``[BOS, content..., EOS]`` (``[content..., EOS]`` under a
tokenizer without BOS), or taken as given: a fine-tuning record exactly as its
tokenizer or chat template made it, any IDs of the vocabulary. Content tokens are byte tokens
(byte ``b`` has ID ``b + 2``) or byte-pair merge tokens (IDs from 258 up, one per
merge, in rank order); BOS and EOS never appear inside the content. Decoding is
bounded: a document over the token or byte limit is an error, never truncated.
Every check is vectorized; errors name the offending position and ID.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from .._arguments import INT64_MAX, check_int, is_int, regular_array
from .._read_only import ReadOnlyArrays, freeze
from ..errors import DecodeLimitError, InvalidInputError, TokenizerError

BOS_ID = 0
EOS_ID = 1
BYTE_OFFSET = 2
BASE_VOCABULARY_SIZE = BYTE_OFFSET + 256
MAX_VOCABULARY_SIZE = 2**31  # token IDs are int32
# Encoding maps each content token to the code point ``id - BYTE_OFFSET``.
MAX_MERGES = 0x110000 - 256
#: The most bytes every merge's piece may hold together (each piece is stored whole).
MAX_PIECE_BYTES = 1 << 28

_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


def canonical_json(payload: object) -> bytes:
    """The canonical JSON bytes that seqpack digests: sorted keys, no whitespace, UTF-8."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_hex(payload: object) -> str:
    """Lowercase hex SHA-256 of ``canonical_json(payload)``."""
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def check_digest(name: str, digest: object) -> str:
    """Return ``digest`` if it is a 64-character lowercase hex SHA-256, else raise."""
    if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
        raise InvalidInputError(f"{name} must be 64 lowercase hex characters, got {digest!r}")
    return digest


@dataclass(frozen=True)
class DecodeLimits:
    """Upper bounds for one document: ``max_tokens`` counts the framed sequence
    (BOS and EOS included), ``max_bytes`` the decoded content bytes."""

    max_tokens: int
    max_bytes: int

    def __post_init__(self):
        # The validation kernels count in int64.
        object.__setattr__(self, "max_tokens", check_int("max_tokens", self.max_tokens, maximum=INT64_MAX))
        object.__setattr__(self, "max_bytes", check_int("max_bytes", self.max_bytes, maximum=INT64_MAX))


@dataclass(frozen=True)
class TokenizerIdentity:
    """What a binding records about a tokenizer: vocabulary size, control IDs and
    the SHA-256 digest of its canonical payload.

    BOS and EOS may share an ID (GPT-2 style ``<|endoftext|>``): framing still
    works because the first and last positions are checked by place and no
    control ID may appear between them. ``bos_id`` is None for a tokenizer that has
    no BOS (Qwen and GPT-2 files add none): its framed documents are ``[content..., EOS]``.
    """

    vocabulary_size: int
    bos_id: int | None
    eos_id: int
    digest: str

    def __post_init__(self):
        size = check_int("vocabulary_size", self.vocabulary_size, 1, MAX_VOCABULARY_SIZE)
        object.__setattr__(self, "vocabulary_size", size)
        for name in ("bos_id", "eos_id"):
            value = getattr(self, name)
            if name == "bos_id" and value is None:
                continue
            if not is_int(value):
                raise InvalidInputError(f"{name} must be an int, got {type(value).__name__}")
            if not 0 <= value < size:
                raise InvalidInputError(
                    f"{name} {value} is outside the vocabulary [0, {size})"
                )
            object.__setattr__(self, name, int(value))
        check_digest("tokenizer digest", self.digest)

    @classmethod
    def external(
        cls, vocabulary_size: int, bos_id: int | None, eos_id: int, digest: str
    ) -> TokenizerIdentity:
        """Identify a tokenizer seqpack cannot decode (GPT-2 BPE, SentencePiece...).

        ``digest`` is the caller's SHA-256 of that tokenizer's canonical payload
        (for example its vocabulary and merges files). seqpack checks framing,
        control IDs and the ID range of documents bound to it, never their text.
        """
        return cls(vocabulary_size, bos_id, eos_id, digest)


def _as_token_array(token_ids: object) -> np.ndarray:
    """A 1-D integer view of ``token_ids`` (any integer dtype, or a list)."""
    ids = regular_array("token IDs", token_ids)
    if ids.ndim != 1:
        raise InvalidInputError(f"token IDs must be 1-D, got shape {ids.shape}")
    if ids.size == 0:
        return ids.astype(np.int32)
    if ids.dtype.kind not in "iu":
        raise InvalidInputError(f"token IDs must be integers, got dtype {ids.dtype}")
    return ids


def check_framed_document(
    token_ids: object, identity: TokenizerIdentity, max_tokens: int, *, as_given: bool = False
) -> np.ndarray:
    """Check framing, control IDs, ID range and the token limit; return the IDs.

    The first failing position (in index order) is reported: an out-of-vocabulary
    or negative ID, a missing BOS at 0, a missing EOS at the end, or BOS/EOS inside
    the content. The token limit is checked first, before any per-token work. A
    document taken ``as_given`` needs only IDs in the vocabulary and two tokens (a target).
    """
    ids = _as_token_array(token_ids)
    count = ids.shape[0]
    if count > max_tokens:
        raise DecodeLimitError(
            f"document has {count} tokens; the limit is {max_tokens} "
            f"(first token over it at position {max_tokens})",
            max_tokens,
        )
    bos, eos, size = identity.bos_id, identity.eos_id, identity.vocabulary_size
    outside = (ids < 0) | (ids >= size)
    if as_given:
        if count < 2:
            raise TokenizerError(f"a document of {count} token{'s' if count != 1 else ''} has no target", None)
        bad = outside
    else:
        if count == 0:
            raise TokenizerError("an empty token sequence is not a framed document", None)
        bad = outside | (ids == bos) | (ids == eos)
        if bos is not None:
            bad[0] = outside[0] or ids[0] != bos
        bad[-1] = outside[-1] or ids[-1] != eos or (count == 1 and bos is not None)
    if bad.any():
        position = int(np.argmax(bad))
        raise TokenizerError(_frame_error(ids, position, identity, bool(outside[position])), position)
    return ids


def _frame_error(ids: np.ndarray, position: int, identity: TokenizerIdentity, outside: bool) -> str:
    """What breaks the frame at ``position``, the first bad position of ``ids``."""
    token, count, bos, eos = int(ids[position]), ids.shape[0], identity.bos_id, identity.eos_id
    if outside:
        kind = "negative" if token < 0 else "out of vocabulary"
        return f"token {token} at position {position} is {kind} (vocabulary size {identity.vocabulary_size})"
    if position == 0 and bos is not None and token != bos:
        return f"document must start with BOS {bos}; position 0 holds {token}"
    if count == 1:
        return f"document [{token}] has no EOS: a framed document needs at least BOS and EOS (position 0)"
    if position == count - 1:
        return f"document must end with EOS {eos}; position {position} holds {token}"
    name = "BOS" if token == bos else "EOS"
    return f"control token {token} ({name}) at position {position} is inside the content"


@functools.cache
def _fixture_merges() -> tuple[tuple[int, int], ...]:
    text = importlib.resources.files("seqpack.fixtures").joinpath("byte_merges.json").read_text(
        encoding="utf-8"
    )
    entries = json.loads(text)["merges"]
    merges = tuple((entry["left"], entry["right"]) for entry in entries)
    tokenizer = ByteTokenizer(merges)
    for rank, entry in enumerate(entries):
        expected = entry["text"].encode()
        if tokenizer.token_bytes(BASE_VOCABULARY_SIZE + rank) != expected:
            raise InvalidInputError(
                f"fixture merge {rank} spells "
                f"{tokenizer.token_bytes(BASE_VOCABULARY_SIZE + rank)!r}, not {expected!r}"
            )
    return merges


def _merge_error(rank: int, merge: object, seen: set[tuple[int, int]]) -> str | None:
    """Why ``merge`` cannot be merge ``rank`` after the pairs ``seen`` (None: it can)."""
    if rank >= MAX_MERGES:
        return f"at most {MAX_MERGES} merges are supported"
    try:
        left, right = merge
    except (TypeError, ValueError):
        return f"merge {rank} must be a pair of IDs, got {merge!r}"
    for value in (left, right):
        if not is_int(value):
            return f"merge {rank} holds a non-int ID {value!r}"
        if not BYTE_OFFSET <= value < BASE_VOCABULARY_SIZE + rank:
            return (f"merge {rank} uses ID {value}; it must be a content ID in "
                    f"[{BYTE_OFFSET}, {BASE_VOCABULARY_SIZE + rank})")
    if (int(left), int(right)) in seen:
        return f"merge {rank} repeats the pair {(int(left), int(right))}"
    return None


class ByteTokenizer(ReadOnlyArrays):
    """Byte-level tokenizer with optional byte-pair merges.

    BOS = 0, EOS = 1, byte ``b`` -> ``b + 2``; merge of rank ``k`` (a pair of
    existing content IDs) gets ID ``258 + k``. Encoding applies merges by rank, the
    lowest first, each as a non-overlapping left-to-right pass; that equals standard
    BPE because a merge can only use tokens created before it. Decoding accepts any
    content IDs, merged or not.
    """

    __slots__ = ("_merges", "_piece_bytes", "_piece_start", "_piece_length", "_identity")

    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, merges: Iterable[tuple[int, int]] = ()):
        if isinstance(merges, (str, bytes)) or not isinstance(merges, Iterable):
            raise InvalidInputError(f"merges must be an iterable of (left, right) ID pairs, not "
                                    f"{type(merges).__name__}")
        checked: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        for rank, merge in enumerate(merges):
            merge = tuple(merge) if isinstance(merge, Iterator) else merge  # unpacked twice below
            problem = _merge_error(rank, merge, seen)
            if problem:
                raise InvalidInputError(problem)
            left, right = merge
            checked.append((int(left), int(right)))
            seen.add(checked[-1])
        self._merges = tuple(checked)
        lengths, total = [0, 0] + [1] * 256, 256  # each piece's bytes, counted before any is built
        for rank, (left, right) in enumerate(self._merges):
            lengths.append(lengths[left] + lengths[right])
            total += lengths[-1]
            if total > MAX_PIECE_BYTES:  # (stopped here: the lengths of doubling pieces grow as 2**merges)
                raise InvalidInputError(f"the merges' pieces hold more than {MAX_PIECE_BYTES} bytes in all from "
                                        f"merge {rank} on; at most {MAX_PIECE_BYTES} are supported (a merge of "
                                        f"pieces that double each other grows as 2**merges)")
        pieces = [b"", b""] + [bytes([b]) for b in range(256)]
        for left, right in self._merges:
            pieces.append(pieces[left] + pieces[right])
        self._piece_length = np.array([len(p) for p in pieces], dtype=np.intp)
        self._piece_start = np.concatenate(([0], np.cumsum(self._piece_length)[:-1]))
        self._piece_bytes = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        freeze((self._piece_length, self._piece_start))   # the tokenizer never changes
        payload = {
            "kind": "seqpack-byte-bpe",
            "bos_id": BOS_ID,
            "eos_id": EOS_ID,
            "byte_offset": BYTE_OFFSET,
            "merges": [list(m) for m in self._merges],
        }
        self._identity = TokenizerIdentity(
            BASE_VOCABULARY_SIZE + len(self._merges), BOS_ID, EOS_ID, sha256_hex(payload)
        )

    @classmethod
    def fixture(cls) -> ByteTokenizer:
        """The 266-entry fixture vocabulary: 258 base entries and the 8 merges in
        ``fixtures/byte_merges.json``."""
        return cls(_fixture_merges())

    @property
    def merges(self) -> tuple[tuple[int, int], ...]:
        """The merge pairs in rank order; merge ``k`` has ID ``258 + k``."""
        return self._merges

    @property
    def vocabulary_size(self) -> int:
        return self._identity.vocabulary_size

    @property
    def identity(self) -> TokenizerIdentity:
        """Vocabulary size, control IDs and the digest of the canonical payload."""
        return self._identity

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ByteTokenizer):
            return NotImplemented
        return self._merges == other._merges

    def __hash__(self) -> int:
        return hash(self._merges)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocabulary_size={self.vocabulary_size}, merges={len(self._merges)})"

    @property
    def piece_lengths(self) -> np.ndarray:
        """Decoded bytes of every ID (controls decode to nothing), a read-only int64 array."""
        lengths = self._piece_length.astype(np.int64)
        lengths.flags.writeable = False
        return lengths

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a content token stands for (empty for BOS and EOS)."""
        if not is_int(token_id):
            raise TokenizerError(f"a token ID must be an int, not {type(token_id).__name__}")
        token_id = int(token_id)
        if not 0 <= token_id < self.vocabulary_size:
            raise TokenizerError(
                f"token {token_id} is outside the vocabulary [0, {self.vocabulary_size})"
            )
        start = self._piece_start[token_id]
        return self._piece_bytes[start : start + self._piece_length[token_id]].tobytes()

    def encode_document(self, text: str | bytes) -> np.ndarray:
        """``[BOS, content..., EOS]`` as int32; ``str`` is encoded as UTF-8 first."""
        if isinstance(text, str):
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise TokenizerError(
                    f"text holds {text[error.start]!r} (a lone surrogate) at character {error.start}: "
                    f"it has no UTF-8 encoding", error.start,
                ) from None
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise InvalidInputError(f"encode_document takes str or bytes, got {type(text).__name__}")
        # Code point = token ID - BYTE_OFFSET, so each merge is one str.replace pass.
        content = data.decode("latin-1")
        for rank, (left, right) in enumerate(self._merges):
            content = content.replace(
                chr(left - BYTE_OFFSET) + chr(right - BYTE_OFFSET), chr(256 + rank)
            )
        codes = np.frombuffer(content.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        ids = np.empty(codes.shape[0] + 2, dtype=np.int32)
        ids[0] = BOS_ID
        ids[1:-1] = codes + BYTE_OFFSET
        ids[-1] = EOS_ID
        return ids

    def _checked_content(
        self, token_ids: object, limits: DecodeLimits, as_given: bool = False
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Content IDs, their byte lengths and the byte total of a checked document
        (of a document taken as given, every ID is content: controls decode to nothing)."""
        if not isinstance(limits, DecodeLimits):
            raise InvalidInputError(f"limits must be a DecodeLimits, not {type(limits).__name__}")
        ids = check_framed_document(token_ids, self._identity, limits.max_tokens, as_given=as_given)
        first = 0 if as_given else 1
        content = ids[first:ids.shape[0] - first].astype(np.intp)
        lengths = self._piece_length[content]
        total = int(lengths.sum())
        if total > limits.max_bytes:
            ends = np.cumsum(lengths)
            position = int(np.searchsorted(ends, limits.max_bytes, side="right")) + first
            raise DecodeLimitError(
                f"document decodes to {total} bytes; the limit is {limits.max_bytes} "
                f"(exceeded by token {int(ids[position])} at position {position})",
                position,
            )
        return content, lengths, total

    def check_document(self, token_ids: object, limits: DecodeLimits, *, as_given: bool = False) -> int:
        """Check a framed document (or one taken ``as_given``) under ``limits`` without
        building its bytes; return its decoded content byte count."""
        return self._checked_content(token_ids, limits, as_given)[2]

    def decode_document_bounded(self, token_ids: object, limits: DecodeLimits) -> bytes:
        """The content bytes of a framed document (BOS and EOS removed).

        Raises :class:`TokenizerError` for a broken frame, a control ID inside the
        content or an ID outside the vocabulary, and :class:`DecodeLimitError` when
        the document has more than ``limits.max_tokens`` tokens or its content more
        than ``limits.max_bytes`` bytes; both name the position. The limits are
        checked before any byte is materialized.
        """
        content, lengths, total = self._checked_content(token_ids, limits)
        # Output byte j of a piece comes from piece byte (piece start - output start) + j.
        shift = self._piece_start[content] - (np.cumsum(lengths) - lengths)
        source = np.repeat(shift, lengths) + np.arange(total)
        return self._piece_bytes[source].tobytes()
