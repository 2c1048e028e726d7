"""Cutting documents: overlapping ranges that fit a row, and fixed causal windows.

:func:`window_ranges` cuts long documents into overlapping source ranges that each
fit a row, so packing never truncates; :func:`document_examples` applies it, or not, to
a corpus's documents, and :func:`refuse_long` names the first that does not fit when
they are not cut. The rest is the
older complete-window policy, kept for contrast with variable-length examples:

A window of context length ``L`` starting at ``s`` pairs inputs ``tokens[s:s+L]``
with targets ``tokens[s+1:s+L+1]``. Only complete windows exist: starts are
``0, stride, 2*stride, ...`` while ``s + L + 1 <= len(tokens)``, so a document
shorter than ``L + 1`` tokens supplies none. Windows never cross documents.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .._arguments import INT32_MAX, check_int, integer_array
from .._read_only import ReadOnlyArrays
from ..errors import CapacityError, InvalidInputError
from .binding import Partition, check_partition
from .documents import BatchDocument, as_int32_tokens


def refuse_long(predictions: np.ndarray, limit: int, name: Callable[[int], str], *, limit_name: str = "capacity",
                hint: str = "") -> None:
    """Raise a :class:`~seqpack.errors.CapacityError` for the first item of
    ``predictions`` (each item's prediction count) with more than ``limit``:
    ``"{name(index)} has {count} predictions; {limit_name} is {limit}{hint}"``."""
    if predictions.size and predictions.max() > limit:
        index = int(np.argmax(predictions > limit))
        count = int(predictions[index])
        raise CapacityError(f"{name(index)} has {count} predictions; {limit_name} is {limit}{hint}",
                            cells=count, maximum=limit)


def window_ranges(lengths, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut documents into overlapping ranges of at most ``capacity`` predictions each.

    ``lengths[d]`` is document ``d``'s token count. Returns ``(documents, ranges)``
    (int64 ``[n]`` and ``[n, 2]``), ready for ``ExampleTable.from_arrays(...,
    ranges=ranges, documents=documents)``: document ``d`` of ``n`` tokens supplies the
    ranges ``[s, min(s + capacity + 1, n))`` for ``s = 0, capacity, 2 * capacity, ...``
    while ``s + 1 < n``. Consecutive ranges share one token (the last input of one is
    the first of the next), so every prediction of the document appears exactly once,
    no range adds BOS or EOS, and nothing is truncated.
    """
    capacity = check_int("capacity", capacity, maximum=INT32_MAX)
    lengths = integer_array("lengths", lengths, np.int64, 1)
    if lengths.size and lengths.min() < 0:
        raise InvalidInputError(f"lengths must not be negative, got {int(lengths.min())}")
    pieces = np.maximum(0, -(-(lengths - 1) // capacity))  # ceil((n - 1) / capacity) predictions blocks
    total = int(pieces.sum(dtype=object)) if pieces.size else 0
    if total > INT32_MAX + 1:
        raise InvalidInputError(
            f"cutting these documents at capacity {capacity} gives {total} ranges; a table holds at most "
            f"{INT32_MAX + 1} examples"
        )
    documents = np.repeat(np.arange(len(lengths), dtype=np.int64), pieces)
    first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
    starts = (np.arange(len(documents), dtype=np.int64) - first_piece) * capacity
    stops = np.minimum(starts + capacity + 1, lengths[documents])
    return documents, np.stack([starts, stops], axis=1)


def document_examples(lengths: np.ndarray, capacity: int, long: str) -> tuple[np.ndarray, np.ndarray]:
    """``(documents, ranges)`` of documents of ``lengths`` tokens: each whole, or under
    ``long="cut"`` cut by :func:`window_ranges`. The writer and the dataset on disk derive
    a corpus's examples with this one rule."""
    if long == "cut":
        return window_ranges(lengths, capacity)
    ranges = np.stack([np.zeros_like(lengths), lengths], axis=1)
    return np.arange(lengths.shape[0], dtype=np.int64), ranges


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class CausalWindow(ReadOnlyArrays):
    """One shifted pair: ``targets[t]`` is the token after ``inputs[t]`` (int32)."""

    inputs: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return self.targets.shape[0]


@dataclass(frozen=True)
class CausalWindowConfig:
    """Complete windows of ``context_length`` predictions, ``stride`` tokens apart."""

    context_length: int
    stride: int

    def __post_init__(self):
        # (bounded so that window arithmetic stays in int64 for numpy)
        object.__setattr__(self, "context_length", check_int("context_length", self.context_length,
                                                             maximum=INT32_MAX))
        object.__setattr__(self, "stride", check_int("stride", self.stride, maximum=INT32_MAX))

    def window_count(self, token_count: int) -> int:
        """How many complete windows a sequence of ``token_count`` tokens supplies
        (an int, numpy's included, at least 0)."""
        spare = check_int("token_count", token_count, minimum=0) - self.context_length - 1
        return spare // self.stride + 1 if spare >= 0 else 0

    def window_starts(self, token_count: int) -> np.ndarray:
        """The start index of every complete window, in order."""
        return np.arange(self.window_count(token_count), dtype=np.intp) * self.stride

    def windows(self, tokens: object) -> Iterator[CausalWindow]:
        """Yield every complete shifted window of ``tokens`` (read-only int32 copies)."""
        tokens = as_int32_tokens(tokens, "window tokens")
        length = self.context_length
        for start in self.window_starts(tokens.shape[0]):
            yield CausalWindow(tokens[start : start + length], tokens[start + 1 : start + length + 1])


class BatchOrder(enum.Enum):
    """Window order within an epoch: as supplied, or a seeded permutation."""

    SEQUENTIAL = "sequential"
    SHUFFLED = "shuffled"


@dataclass(frozen=True)
class MiniBatchConfig:
    """``batch_size`` windows per batch, in ``order``; ``seed`` drives the shuffle."""

    batch_size: int
    order: BatchOrder = BatchOrder.SEQUENTIAL
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "batch_size", check_int("batch_size", self.batch_size))
        if not isinstance(self.order, BatchOrder):
            raise InvalidInputError(f"order must be a BatchOrder, got {self.order!r}")
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0))


@dataclass(frozen=True, eq=False)
class MiniBatch(ReadOnlyArrays):
    """Windows stacked as int32 ``inputs``/``targets`` of shape ``[n, context_length]``.

    ``document_indices[i]`` (into the documents given to the epoch) and ``starts[i]``
    locate window ``i`` in its source document.
    """

    inputs: np.ndarray  # [n, context_length]
    targets: np.ndarray  # [n, context_length]
    document_indices: np.ndarray  # [n]
    starts: np.ndarray  # [n]

    @property
    def token_count(self) -> int:
        """The number of next-token targets in this batch."""
        return self.targets.size

    def __len__(self) -> int:
        return self.targets.shape[0]


@dataclass(frozen=True, eq=False)
class MiniBatchEpoch:
    """Every complete window of one partition's documents, cut into mini-batches.

    The final batch keeps its smaller size. An epoch whose documents supply no
    complete window has no batches.
    """

    partition: Partition
    window_config: CausalWindowConfig
    minibatch_config: MiniBatchConfig
    batches: tuple[MiniBatch, ...]

    @classmethod
    def build(
        cls,
        partition: Partition,
        documents: Sequence[BatchDocument],
        window_config: CausalWindowConfig,
        minibatch_config: MiniBatchConfig,
    ) -> MiniBatchEpoch:
        """Windows of ``partition``'s documents, in document then start order
        (sequential) or permuted by ``numpy.random.default_rng(seed)`` (shuffled)."""
        check_partition(partition)
        for name, value, kind in (("window_config", window_config, CausalWindowConfig),
                                  ("minibatch_config", minibatch_config, MiniBatchConfig)):
            if not isinstance(value, kind):
                raise InvalidInputError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
        documents = list(documents)  # (a generator is read once)
        for index, document in enumerate(documents):
            if not isinstance(document, BatchDocument):
                raise InvalidInputError(
                    f"documents[{index}] must be a BatchDocument, got {type(document).__name__}"
                )
        chosen = [i for i, d in enumerate(documents) if d.partition is partition]
        lengths = np.array([len(documents[i]) for i in chosen], dtype=np.intp)
        counts = (lengths - window_config.context_length - 1) // window_config.stride + 1
        counts = np.maximum(counts, 0)
        total = int(counts.sum())
        flat = np.concatenate(
            [documents[i].token_ids for i in chosen] or [np.empty(0, np.int32)]
        )
        # Window k of document j starts at offset[j] + k * stride in the flat array.
        offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.intp)
        first_window = np.cumsum(counts) - counts
        document_of = np.repeat(np.arange(len(chosen), dtype=np.intp), counts)
        starts = (np.arange(total, dtype=np.intp) - first_window[document_of]) * window_config.stride
        if minibatch_config.order is BatchOrder.SHUFFLED:
            order = np.random.default_rng(minibatch_config.seed).permutation(total)
            document_of, starts = document_of[order], starts[order]
        gather = (offsets[document_of] + starts)[:, None] + np.arange(window_config.context_length)
        inputs = flat[gather]  # [windows, context_length]
        targets = flat[gather + 1]  # [windows, context_length]
        sources = np.array(chosen, dtype=np.intp)[document_of]
        size = minibatch_config.batch_size
        batches = tuple(
            MiniBatch(
                _read_only(inputs[i : i + size].copy()),
                _read_only(targets[i : i + size].copy()),
                _read_only(sources[i : i + size].copy()),
                _read_only(starts[i : i + size].copy()),
            )
            for i in range(0, total, size)
        )
        return cls(partition, window_config, minibatch_config, batches)

    @property
    def token_count(self) -> int:
        """Total next-token targets over all batches."""
        return sum(batch.token_count for batch in self.batches)

    @property
    def window_count(self) -> int:
        return sum(len(batch) for batch in self.batches)
