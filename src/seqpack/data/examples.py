"""Sequence examples: one shifted input/target pair formed inside a selected source range.

An example never reaches outside its range: an interior range adds no BOS or EOS,
and the last input predicts the range's last token, never a neighbour's.
"""

from __future__ import annotations

from typing import Union

import numpy as np

from .._read_only import ReadOnlyArrays
from .binding import BatchBinding, Partition
from .documents import BatchDocument
from .supervision import as_supervision
from ..errors import InvalidInputError, SeqpackError

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
    a document, a step-1 range of at least two of its tokens and a supervision array
    over the document, if any (``from_range`` also validated the document under the
    binding and that a target is supervised)."""
    document, selected = example.document, example.source_range
    if not isinstance(document, BatchDocument) or not isinstance(example.binding, BatchBinding):
        raise InvalidInputError(f"example {example.id!r} (index {index}) holds no BatchDocument and BatchBinding: "
                                "build it with SequenceExample.from_range or from_document")
    if not (isinstance(selected, range) and selected.step == 1 and 0 <= selected.start
            and selected.stop <= len(document) and len(selected) >= 2):
        raise InvalidInputError(f"example {example.id!r} (index {index}): source range {selected!r} is not a step-1 "
                                f"range of at least 2 tokens inside its document of {len(document)} tokens")
    mask = example.supervised
    if mask is not None and not (isinstance(mask, np.ndarray) and mask.dtype == np.bool_
                                 and mask.shape == (len(document),)):
        raise InvalidInputError(f"example {example.id!r} (index {index}): supervised is not a bool array over "
                                f"its document's {len(document)} tokens: build it with from_range")
    tokens, vocabulary = example.source_tokens, example.binding.vocabulary_size
    outside = (tokens < 0) | (tokens >= vocabulary)  # (PAD_CELL is no token)
    if outside.any():
        at = int(np.argmax(outside))
        raise InvalidInputError(f"example {example.id!r} (index {index}): token {int(tokens[at])} at position "
                                f"{selected.start + at} of its document lies outside the vocabulary [0, {vocabulary}): "
                                f"build it with from_range, which validates the document")


class SequenceExample(ReadOnlyArrays):
    """One example: the shifted pair of a document's selected source range.

    ``inputs`` are the range's tokens but the last, ``targets`` the range's tokens
    but the first (both int32, read-only views of the document); ``len(example)``
    is the number of predictions. The example keeps its id, document, partition
    (the document's), range, binding and ``supervised``: None (every target counts
    in the loss) or a read-only bool array over the document's tokens.
    """

    __slots__ = ("id", "document", "source_range", "binding", "supervised")

    def __init__(self, id: str, document: BatchDocument, source_range: range, binding: BatchBinding,
                 supervised: np.ndarray | None = None):
        # Use from_document / from_range: they validate. This only stores.
        self.id = id
        self.document = document
        self.source_range = source_range
        self.binding = binding
        self.supervised = supervised

    @classmethod
    def from_document(cls, id: str, document: BatchDocument, binding: BatchBinding, *,
                      supervised=None) -> "SequenceExample":
        """The whole framed document as one example (its EOS is a real target)."""
        if not isinstance(document, BatchDocument):
            raise InvalidInputError(f"example {id!r}: expected a BatchDocument, got {type(document).__name__}")
        return cls.from_range(id, document, range(0, len(document)), binding, supervised=supervised)

    @classmethod
    def from_range(
        cls, id: str, document: BatchDocument, source_range: SourceRange, binding: BatchBinding, *,
        supervised=None, as_given: bool = False,
    ) -> "SequenceExample":
        """An example from ``document.token_ids[source_range]``.

        The whole document is validated under ``binding`` (framing, control IDs,
        vocabulary, decode limits; with ``as_given``, a fine-tuning record as its
        tokenizer made it: vocabulary and limits only) and must have content; the range must be a
        step-1 range (or ``(start, stop)``) inside it with at least two tokens.
        ``supervised`` (None: all) is a bool array over the document's tokens:
        ``supervised[j]`` says whether token ``j``, as a target, counts in the loss
        (the range's first token is no target). At least one of the example's
        targets must be supervised.
        """
        if not isinstance(id, str) or not id:
            raise InvalidInputError("example ID must be a non-empty string")
        if not isinstance(document, BatchDocument):
            raise InvalidInputError(f"example {id!r}: expected a BatchDocument, got {type(document).__name__}")
        if not isinstance(binding, BatchBinding):
            raise InvalidInputError(f"example {id!r}: expected a BatchBinding, got {type(binding).__name__}")
        try:
            content = binding.validate_document(document.token_ids, as_given=as_given)
        except SeqpackError as error:
            raise error.within(f"example {id!r}") from None
        if content == 0:
            raise InvalidInputError(
                f"example {id!r}: document {document.source_id!r} has empty content and supplies no example"
            )
        selected = _as_source_range(source_range, len(document))
        if len(selected) < 2:
            raise InvalidInputError(
                f"example {id!r}: source range [{selected.start}, {selected.stop}) has "
                f"{len(selected)} tokens; a prediction needs at least 2"
            )
        supervised = as_supervision(supervised, len(document), f"example {id!r}: supervised")
        if supervised is not None and not supervised[selected.start + 1 : selected.stop].any():
            raise InvalidInputError(f"example {id!r}: none of its {len(selected) - 1} targets is supervised")
        return cls(id, document, selected, binding, supervised)

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

    @property
    def source_supervised(self) -> np.ndarray | None:
        """The supervision of the selected range's tokens (None: every target supervised)."""
        if self.supervised is None:
            return None
        return self.supervised[self.source_range.start : self.source_range.stop]

    @property
    def loss_mask(self) -> np.ndarray:
        """Whether each target counts in the loss (bool, one per prediction)."""
        if self.supervised is None:
            return np.ones(len(self), dtype=np.bool_)
        return self.supervised[self.source_range.start + 1 : self.source_range.stop]

    @property
    def target_count(self) -> int:
        """Supervised targets: the example's share of a loss denominator."""
        return len(self) if self.supervised is None else int(np.count_nonzero(self.loss_mask))

    def __len__(self) -> int:
        return len(self.source_range) - 1

    def __repr__(self) -> str:
        r = self.source_range
        return (
            f"SequenceExample({self.id!r}, document={self.document.source_id!r}, "
            f"range=[{r.start}, {r.stop}), predictions={len(self)})"
        )
