"""The spec chapters' fixture documents, and the batches the chapters build from them.

ch04 right-pads ``short`` and ``long``; ch05 packs A, B and C next-fit at
capacity 6. The documents are supplied ID arrays in the 266-entry fixture
vocabulary (BOS 0, EOS 1, ``a`` = 99).
"""

from __future__ import annotations

from ..data.binding import BatchBinding, Partition
from ..data.documents import BatchDocument
from ..data.examples import SequenceExample
from ..errors import InvalidInputError
from ..packing.config import PackConfig, PadConfig
from ..packing.packed import PackedBatch
from ..packing.padding import PaddedBatch, pad
from ..packing.planning import pack

KINDS = ("padded", "packed")
PACKED_CAPACITY = 6

DOCUMENTS = {
    "padded": {"short": [0, 99, 1], "long": [0, 100, 101, 102, 1]},
    "packed": {"A": [0, 99, 100, 1], "B": [0, 101, 1], "C": [0, 102, 103, 104, 1]},
}
#: Our data for ch05's second density example: prediction lengths 4, 4, 2, 2 at capacity 12.
DENSITY_DOCUMENTS = {"P": [0, 99, 100, 101, 1], "Q": [0, 102, 103, 104, 1], "R": [0, 105, 1], "S": [0, 106, 1]}


def examples_of(documents: dict, binding: BatchBinding) -> list[SequenceExample]:
    """One full-document example per ``name: token_ids`` entry, named after it."""
    return [
        SequenceExample.from_document(name, BatchDocument(name, tokens), binding)
        for name, tokens in documents.items()
    ]


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise InvalidInputError(f"trace kind must be one of {KINDS}, not {kind!r}")


def chapter_examples(kind: str, binding: BatchBinding) -> list[SequenceExample]:
    """The chapter's examples, one per document, in supplied order."""
    _check_kind(kind)
    return examples_of(DOCUMENTS[kind], binding)


def padded_batch(examples, binding: BatchBinding) -> PaddedBatch:
    """All ``examples`` right-padded into one batch."""
    (batch,) = pad(examples, PadConfig(rows_per_batch=len(examples)), partition=Partition.TRAIN, binding=binding)
    return batch


def packed_batch(examples, binding: BatchBinding, capacity: int) -> PackedBatch:
    """All ``examples`` packed next-fit at ``capacity`` into one batch."""
    config = PackConfig(capacity, rows_per_batch=len(examples), max_memory_bytes=1 << 20)
    (batch,) = pack(examples, config, partition=Partition.TRAIN, binding=binding)
    return batch


def chapter_batch(kind: str, binding: BatchBinding):
    """The chapter's batch: ch04 padded, ch05 packed at capacity 6."""
    examples = chapter_examples(kind, binding)
    return padded_batch(examples, binding) if kind == "padded" else packed_batch(examples, binding, PACKED_CAPACITY)
