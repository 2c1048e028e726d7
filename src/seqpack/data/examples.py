"""Sequence examples: one shifted input/target pair formed inside a selected source range.

An example never reaches outside its range: an interior range adds no BOS or EOS,
and the last input predicts the range's last token, never a neighbour's.
"""

from __future__ import annotations

from typing import Union

import numpy as np

from .binding import BatchBinding, Partition
from .documents import BatchDocument
from ..errors import InvalidInputError

SourceRange = Union[range, "tuple[int, int]"]


def _as_source_range(source_range, document_length: int) -> range:
    """Return ``source_range`` as a step-1 ``range`` inside ``[0, document_length]``."""
    if isinstance(source_range, range):
        if source_range.step != 1:
            raise InvalidInputError(f"source range {source_range} must have step 1")
        start, stop = source_range.start, source_range.stop
    elif isinstance(source_range, tuple) and len(source_range) == 2:
        start, stop = source_range
    else:
        raise InvalidInputError(
            f"source range must be a range or a (start, stop) pair, not {source_range!r}"
        )
    if not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in (start, stop)):
        raise InvalidInputError(f"source range bounds must be integers, not {start!r}, {stop!r}")
    start, stop = int(start), int(stop)
    if start < 0 or stop < 0:
        raise InvalidInputError(f"source range [{start}, {stop}) has a negative bound")
    if start > stop or stop > document_length:
        raise InvalidInputError(
            f"source range [{start}, {stop}) must lie inside its document of "
            f"{document_length} tokens"
        )
    return range(start, stop)


def check_stored(example: "SequenceExample", index: int) -> None:
    """What the constructor (which only stores) leaves unchecked and a layout relies on:
    a document and a step-1 range of at least two of its tokens (``from_range`` also
    validated the document under the binding)."""
    document, selected = example.document, example.source_range
    if not isinstance(document, BatchDocument) or not isinstance(example.binding, BatchBinding):
        raise InvalidInputError(f"example {example.id!r} (index {index}) holds no BatchDocument and BatchBinding: "
                                "build it with SequenceExample.from_range or from_document")
    if not (isinstance(selected, range) and selected.step == 1 and 0 <= selected.start
            and selected.stop <= len(document) and len(selected) >= 2):
        raise InvalidInputError(f"example {example.id!r} (index {index}): source range {selected!r} is not a step-1 "
                                f"range of at least 2 tokens inside its document of {len(document)} tokens")


class SequenceExample:
    """One example: the shifted pair of a document's selected source range.

    ``inputs`` are the range's tokens but the last, ``targets`` the range's tokens
    but the first (both int32, read-only views of the document); ``len(example)``
    is the number of predictions. The example keeps its id, document, partition
    (the document's), range and binding.
    """

    __slots__ = ("id", "document", "source_range", "binding")

    def __init__(self, id: str, document: BatchDocument, source_range: range, binding: BatchBinding):
        # Use from_document / from_range: they validate. This only stores.
        self.id = id
        self.document = document
        self.source_range = source_range
        self.binding = binding

    @classmethod
    def from_document(cls, id: str, document: BatchDocument, binding: BatchBinding) -> "SequenceExample":
        """The whole framed document as one example (its EOS is a real target)."""
        if not isinstance(document, BatchDocument):
            raise InvalidInputError(f"example {id!r}: expected a BatchDocument, got {type(document).__name__}")
        return cls.from_range(id, document, range(0, len(document)), binding)

    @classmethod
    def from_range(
        cls, id: str, document: BatchDocument, source_range: SourceRange, binding: BatchBinding
    ) -> "SequenceExample":
        """An example from ``document.token_ids[source_range]``.

        The whole document is validated under ``binding`` (framing, control IDs,
        vocabulary, decode limits) and must have content; the range must be a
        step-1 range (or ``(start, stop)``) inside it with at least two tokens.
        """
        if not isinstance(id, str) or not id:
            raise InvalidInputError("example ID must be a non-empty string")
        if not isinstance(document, BatchDocument):
            raise InvalidInputError(f"example {id!r}: expected a BatchDocument, got {type(document).__name__}")
        if not isinstance(binding, BatchBinding):
            raise InvalidInputError(f"example {id!r}: expected a BatchBinding, got {type(binding).__name__}")
        if binding.validate_document(document.token_ids) == 0:
            raise InvalidInputError(
                f"example {id!r}: document {document.source_id!r} has empty content and supplies no example"
            )
        selected = _as_source_range(source_range, len(document))
        if len(selected) < 2:
            raise InvalidInputError(
                f"example {id!r}: source range [{selected.start}, {selected.stop}) has "
                f"{len(selected)} tokens; a prediction needs at least 2"
            )
        return cls(id, document, selected, binding)

    @property
    def partition(self) -> Partition:
        return self.document.partition

    @property
    def source_tokens(self) -> np.ndarray:
        """The selected range's tokens (int32, read-only view)."""
        return self.document.token_ids[self.source_range.start : self.source_range.stop]

    @property
    def inputs(self) -> np.ndarray:
        return self.document.token_ids[self.source_range.start : self.source_range.stop - 1]

    @property
    def targets(self) -> np.ndarray:
        return self.document.token_ids[self.source_range.start + 1 : self.source_range.stop]

    def __len__(self) -> int:
        return len(self.source_range) - 1

    def __repr__(self) -> str:
        r = self.source_range
        return (
            f"SequenceExample({self.id!r}, document={self.document.source_id!r}, "
            f"range=[{r.start}, {r.stop}), predictions={len(self)})"
        )
