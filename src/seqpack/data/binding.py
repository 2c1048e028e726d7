"""Partitions, split receipts and the batch binding that examples and batches share.

A :class:`BatchBinding` names the tokenizer (by identity), the data split (by the
digest of a split receipt, or of a name) and the decode limits under which documents
are accepted. Two bindings are equal exactly when those three values are equal. A
receipt digest identifies caller-accepted split evidence; it does not approve it.
"""

from __future__ import annotations

import enum
import functools
import importlib.resources
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Union

import numpy as np

from ..errors import BindingError, InvalidInputError
from .tokenizer import (
    ByteTokenizer,
    DecodeLimits,
    TokenizerIdentity,
    check_digest,
    check_framed_document,
    sha256_hex,
)

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


class Partition(enum.Enum):
    """The data split a document, example or batch belongs to."""

    TRAIN = "train"
    VALIDATION = "validation"
    TEST = "test"


class SplitReceipt:
    """Caller-accepted evidence of which document IDs went to which partition.

    The payload is a JSON object with a ``partitions`` object mapping each of
    ``train``, ``validation`` and ``test`` to a list of distinct, non-empty document
    IDs; no ID may sit in two partitions. Other keys are kept as evidence. ``digest``
    is the SHA-256 of the canonical JSON of the whole payload.
    """

    __slots__ = ("_payload", "_partitions", "_owner", "_digest")

    def __init__(self, payload: Mapping):
        if not isinstance(payload, Mapping) or not isinstance(payload.get("partitions"), Mapping):
            raise InvalidInputError("a split receipt needs a 'partitions' object")
        listed = payload["partitions"]
        names = {p.value for p in Partition}
        if set(listed) != names:
            raise InvalidInputError(
                f"split receipt partitions must be exactly {sorted(names)}, got {sorted(map(repr, listed))} "
                f"(keys are the partitions' names as strings)"
            )
        owner: dict[str, Partition] = {}
        partitions: dict[Partition, tuple[str, ...]] = {}
        for partition in Partition:
            ids = listed[partition.value]
            if not isinstance(ids, list):
                raise InvalidInputError(f"split receipt partition {partition.value!r} must be a list")
            for doc_id in ids:
                if not isinstance(doc_id, str) or not doc_id:
                    raise InvalidInputError(
                        f"split receipt partition {partition.value!r} holds a bad ID {doc_id!r}"
                    )
                if doc_id in owner:
                    raise InvalidInputError(
                        f"document {doc_id!r} is in both {owner[doc_id].value!r} and "
                        f"{partition.value!r}"
                    )
                owner[doc_id] = partition
            partitions[partition] = tuple(ids)
        try:
            self._payload = json.loads(json.dumps(payload, allow_nan=False))
            self._digest = sha256_hex(self._payload)
        except (TypeError, ValueError, RecursionError) as error:   # UnicodeEncodeError: a lone surrogate
            raise InvalidInputError(f"a split receipt must be plain JSON data: {error}") from None
        if self._payload != payload:   # JSON made its keys strings (merging 1 and "1") or its tuples lists
            raise InvalidInputError("a split receipt must be plain JSON data: its objects' keys must be strings "
                                    "and its arrays lists (JSON would change them)")
        self._partitions = MappingProxyType(partitions)
        self._owner = MappingProxyType(owner)

    def __reduce__(self):
        return SplitReceipt, (self._payload,)

    @classmethod
    def load(cls, source: str | os.PathLike | Traversable) -> SplitReceipt:
        """Read a receipt from a JSON file path or an ``importlib.resources`` traversable."""
        path = Path(source) if isinstance(source, (str, os.PathLike)) else source
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise InvalidInputError(f"split receipt {source} is not valid JSON: {error}") from error
        except UnicodeDecodeError as error:
            raise InvalidInputError(f"split receipt {source} is not UTF-8: {error}") from None
        except OSError as error:
            raise InvalidInputError(f"split receipt {source}: cannot read: {error.strerror or error}") from None
        try:
            return cls(payload)
        except InvalidInputError as error:
            raise error.within(f"split receipt {source}", path=str(source)) from None

    @classmethod
    def fixture(cls) -> SplitReceipt:
        """The receipt in ``fixtures/split_receipt.json`` for the chapter-4 documents."""
        return _fixture_receipt()

    @property
    def digest(self) -> str:
        return self._digest

    @property
    def partitions(self) -> Mapping[Partition, tuple[str, ...]]:
        """Document IDs per partition, in the receipt's order."""
        return self._partitions

    def partition_of(self, document_id: str) -> Partition:
        """The partition the receipt assigns ``document_id`` to."""
        try:
            return self._owner[document_id]
        except KeyError:
            raise InvalidInputError(f"document {document_id!r} is not in the split receipt") from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SplitReceipt):
            return NotImplemented
        return self._digest == other._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __repr__(self) -> str:
        counts = ", ".join(f"{p.value}={len(ids)}" for p, ids in self._partitions.items())
        return f"SplitReceipt({counts}, digest={self._digest[:12]}...)"


@functools.cache
def _fixture_receipt() -> SplitReceipt:
    return SplitReceipt.load(
        importlib.resources.files("seqpack.fixtures").joinpath("split_receipt.json")
    )


#: Limits a binding gets unless told otherwise: 1,000,000 tokens and 8,000,000 bytes a document.
DEFAULT_LIMITS = DecodeLimits(max_tokens=1_000_000, max_bytes=8_000_000)

Split = Union[SplitReceipt, str, "os.PathLike[str]"]


def split_digest(split: Split) -> str:
    """The split-receipt digest a binding records for ``split``.

    ``split`` is a :class:`SplitReceipt`, a path (``pathlib.Path`` or another
    ``os.PathLike``) to a receipt's JSON file, or a ``str`` naming the split (for
    example ``"wikitext-2024-06"``), whose digest is that of the payload
    ``{"split_name": name}``. A plain string is always a name, never a path.
    """
    if isinstance(split, SplitReceipt):
        return split.digest
    if isinstance(split, os.PathLike):
        return SplitReceipt.load(split).digest
    if isinstance(split, str) and split:
        if any(0xD800 <= ord(c) <= 0xDFFF for c in split):  # (an undecodable command-line byte)
            raise InvalidInputError(f"the split name {split!r} holds a byte that is not UTF-8")
        return sha256_hex({"split_name": split})
    raise InvalidInputError(
        f"split must be a SplitReceipt, a path to a receipt file or a non-empty name, not {split!r}"
    )


@dataclass(frozen=True)
class BatchBinding:
    """Tokenizer identity, split-receipt digest and decode limits; equal by value.

    Every document, example, table and batch is made under one binding, and a batch
    refuses examples made under another: text tokenized by a different tokenizer, or
    split into train/validation/test differently, never mixes in silently. Make one
    with :meth:`for_tokenizer`.

    ``tokenizer`` (not compared) is the :class:`ByteTokenizer` whose identity this
    is, when seqpack can decode the text. A binding made from a bare
    :class:`TokenizerIdentity` has none: documents are checked for framing, control
    IDs, ID range and ``limits.max_tokens``, but ``limits.max_bytes`` cannot apply
    since seqpack never sees the text.
    """

    tokenizer_identity: TokenizerIdentity
    split_receipt_digest: str
    limits: DecodeLimits
    tokenizer: ByteTokenizer | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.tokenizer_identity, TokenizerIdentity):
            raise InvalidInputError("tokenizer_identity must be a TokenizerIdentity")
        check_digest("split_receipt_digest", self.split_receipt_digest)
        if not isinstance(self.limits, DecodeLimits):
            raise InvalidInputError("limits must be DecodeLimits")
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, ByteTokenizer):
                raise InvalidInputError("tokenizer must be a ByteTokenizer or None")
            if self.tokenizer.identity != self.tokenizer_identity:
                raise BindingError("the tokenizer's identity differs from tokenizer_identity")

    @classmethod
    def for_tokenizer(
        cls, tokenizer: ByteTokenizer | TokenizerIdentity, *, split: Split,
        limits: DecodeLimits = DEFAULT_LIMITS,
    ) -> BatchBinding:
        """Bind ``tokenizer`` to ``split`` (see :func:`split_digest`) under ``limits``.

        ``tokenizer`` is a :class:`ByteTokenizer` (both limits apply), or the
        :class:`TokenizerIdentity` of a tokenizer seqpack does not decode (GPT-2 BPE,
        SentencePiece...; only ``limits.max_tokens`` applies).
        """
        if isinstance(tokenizer, ByteTokenizer):
            return cls(tokenizer.identity, split_digest(split), limits, tokenizer)
        if isinstance(tokenizer, TokenizerIdentity):
            return cls(tokenizer, split_digest(split), limits)
        raise InvalidInputError(
            f"tokenizer must be a ByteTokenizer or a TokenizerIdentity, not {type(tokenizer).__name__}"
        )

    @classmethod
    def fixture(cls) -> BatchBinding:
        """The chapters' binding: the fixture tokenizer, the fixture split receipt and
        the default limits."""
        return cls.for_tokenizer(ByteTokenizer.fixture(), split=SplitReceipt.fixture())

    @property
    def vocabulary_size(self) -> int:
        return self.tokenizer_identity.vocabulary_size

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer_identity.bos_id

    @property
    def kernel_bos(self) -> int:
        """BOS as the validation kernel takes it: -1 for a tokenizer without BOS."""
        return -1 if self.tokenizer_identity.bos_id is None else self.tokenizer_identity.bos_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer_identity.eos_id

    def validate_document(self, token_ids: np.ndarray, *, as_given: bool = False) -> int:
        """Check a framed document under this binding (or one taken ``as_given``: any
        IDs of the vocabulary, at least two); return its content token count.

        With a tokenizer, the rules of ``decode_document_bounded`` apply (byte limit
        included, computed without building the bytes); without one, framing,
        control IDs, ID range and the token limit. Zero content is not an error here.
        """
        if self.tokenizer is not None:
            self.tokenizer.check_document(token_ids, self.limits, as_given=as_given)
        else:
            check_framed_document(token_ids, self.tokenizer_identity, self.limits.max_tokens, as_given=as_given)
        if as_given:
            return len(token_ids)
        return len(token_ids) - 1 - (self.tokenizer_identity.bos_id is not None)

    def decode_document(self, token_ids: object) -> bytes:
        """The document's content bytes under this binding's limits."""
        if self.tokenizer is None:
            raise BindingError("a binding without a ByteTokenizer cannot decode text")
        return self.tokenizer.decode_document_bounded(token_ids, self.limits)


def check_partition(partition: Partition) -> None:
    """``partition`` must be a :class:`Partition`; a partition's name given as a string is
    refused with the member to pass instead."""
    if isinstance(partition, Partition):
        return
    hint = ""
    if isinstance(partition, str) and partition.lower() in {member.value for member in Partition}:
        hint = f": pass seqpack.Partition.{Partition(partition.lower()).name}"
    raise InvalidInputError(f"partition must be a Partition, not {partition!r}{hint}")


def check_expectations(partition: Partition, binding: BatchBinding) -> None:
    """The partition and binding a batch or table is made for must be of the right types."""
    check_partition(partition)
    if not isinstance(binding, BatchBinding):
        raise InvalidInputError(f"binding must be a BatchBinding, not {type(binding).__name__}")


def check_owner(what: str, owner_binding, owner_partition, binding: BatchBinding, partition: Partition) -> None:
    """``what`` (an example or a table) must share the expected binding (by value) and partition."""
    if owner_binding is not binding and owner_binding != binding:
        raise BindingError(f"{what} was built under a different binding")
    if owner_partition is not partition:
        raise BindingError(
            f"{what} belongs to partition {owner_partition.value!r}, not {partition.value!r}"
        )
