"""Example sources: where a batch reads its examples' tokens from, by occurrence ordinal.

Three kinds of source follow :class:`ExampleSource`: a list of ``SequenceExample``
objects (:class:`ExampleList`, here), a columnar ``ExampleTable`` (in
:mod:`seqpack.data`), and the joined pieces of a stream (in :mod:`seqpack.packing`).
Batches fill their cells from ``gather`` and name examples in errors with
``example_id``; the memory budget reads ``copies_tokens`` and ``held_bytes_per_example``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from .._arguments import INT32_MAX
from ..data.binding import BatchBinding, Partition, check_expectations, check_owner
from ..data.examples import SequenceExample, check_stored
from ..data.supervision import gathered
from ..data.table import ExampleTable
from ..data.windows import refuse_long
from ..errors import InvalidInputError


class ExampleSource(Protocol):
    """Examples by ordinal: ``first_ordinal`` up to ``first_ordinal + len(source)``.

    ``gather(ordinals)`` returns int32 ``tokens``, their ``supervised`` (a bool array
    aligned with them, or None when every target is supervised) and int64
    ``begins``/``ends`` such that example ``ordinals[i]``'s source tokens (its inputs
    plus its last target) are ``tokens[begins[i]:ends[i]]``. ``copies_tokens`` says whether ``gather`` copies
    them into a fresh array (a list of objects must) or hands over an array it already
    holds (a table does); ``held_bytes_per_example`` is what the source costs per
    example beyond the packer's own arrays. Both feed the memory budget.
    """

    first_ordinal: int
    copies_tokens: bool
    held_bytes_per_example: int

    def __len__(self) -> int: ...

    def example(self, ordinal: int) -> SequenceExample: ...

    def example_id(self, ordinal: int) -> str: ...

    def gather(self, ordinals: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]: ...


class ExampleList:
    """``SequenceExample`` objects as an :class:`ExampleSource`."""

    __slots__ = ("_examples", "first_ordinal")

    copies_tokens = True
    #: Each example's length and tuple slot.
    held_bytes_per_example = 16

    def __init__(self, examples: Sequence[SequenceExample], first_ordinal: int = 0):
        self._examples = tuple(examples)
        self.first_ordinal = first_ordinal

    def __len__(self) -> int:
        return len(self._examples)

    def example(self, ordinal: int) -> SequenceExample:
        return self._examples[ordinal - self.first_ordinal]

    def example_id(self, ordinal: int) -> str:
        return self._examples[ordinal - self.first_ordinal].id

    def gather(self, ordinals: np.ndarray):
        """Flat int32 source tokens of ``ordinals``' examples and their supervision, with
        their int64 begins and ends."""
        base = self.first_ordinal
        examples = [self._examples[i - base] for i in ordinals.tolist()]
        selected = [example.source_tokens for example in examples]
        sizes = [len(tokens) for tokens in selected]
        ends = np.cumsum(sizes, dtype=np.int64)
        begins = np.concatenate(([0], ends[:-1])).astype(np.int64) if selected else ends.copy()
        tokens = np.concatenate(selected).astype(np.int32, copy=False) if selected else np.empty(0, np.int32)
        return tokens, gathered([example.source_supervised for example in examples], sizes), begins, ends


def check_examples(examples: Sequence[SequenceExample], partition: Partition, binding: BatchBinding,
                   first_index: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Validate a list of examples against the partition and binding; return their prediction
    lengths and supervised target counts (int64). Errors name an example by ``first_index`` plus its place in the list (a stream's
    count so far)."""
    check_expectations(partition, binding)
    if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence):
        raise InvalidInputError("examples must be a list or tuple of SequenceExample, or an ExampleTable")
    if len(examples) == 0:
        raise InvalidInputError("a batch needs at least one example")
    for index, example in enumerate(examples, start=first_index):
        if not isinstance(example, SequenceExample):
            raise InvalidInputError(
                f"example {index} is a {type(example).__name__}, not a SequenceExample"
            )
        check_stored(example, index)
        check_owner(f"example {example.id!r} (index {index})", example.binding, example.partition,
                    binding, partition)
    lengths = np.fromiter((len(example) for example in examples), dtype=np.int64, count=len(examples))
    if all(example.supervised is None for example in examples):
        return lengths, lengths
    counts = np.fromiter((example.target_count for example in examples), dtype=np.int64, count=len(examples))
    return lengths, counts


def source_of(examples, partition: Partition, binding: BatchBinding,
              first_index: int = 0) -> tuple[ExampleSource, np.ndarray, np.ndarray]:
    """The :class:`ExampleSource` of a list of examples or a table, checked against the
    expected partition and binding (errors count examples from ``first_index``), with its
    examples' prediction lengths and supervised target counts (int64; the same array
    when every target is supervised)."""
    if isinstance(examples, ExampleTable):
        check_expectations(partition, binding)
        check_owner("the example table", examples.binding, examples.partition, binding, partition)
        if len(examples) == 0:
            raise InvalidInputError("a batch needs at least one example")
        return examples, examples.lengths, examples.target_counts
    lengths, counts = check_examples(examples, partition, binding, first_index)
    return ExampleList(examples), lengths, counts


def check_example_count(count: int) -> None:
    """Segments are int32 example ordinals: at most 2**31 examples."""
    if count > INT32_MAX + 1:
        raise InvalidInputError(
            f"{count} examples exceed the int32 segment namespace of {INT32_MAX + 1}"
        )


def reject_longer(source: ExampleSource, lengths: np.ndarray, limit: int, limit_name: str) -> None:
    """Raise CapacityError naming the first example with more than ``limit`` predictions."""

    def example(index: int) -> str:
        ordinal = source.first_ordinal + index
        return f"example {source.example_id(ordinal)!r} (index {ordinal})"

    refuse_long(lengths, limit, example, limit_name=limit_name)


def pair_name(source: ExampleSource) -> Callable[[int], str]:
    """How errors name preference pair ``p`` of ``source`` (its examples ``2p`` and ``2p + 1``
    counted from the source's first, whose ordinal is even): by its global number, its
    examples' IDs and their ordinals."""

    def name(p: int) -> str:
        chosen = source.first_ordinal + 2 * p
        return (f"pair {chosen // 2} (examples {source.example_id(chosen)!r} and "
                f"{source.example_id(chosen + 1)!r}, indices {chosen} and {chosen + 1})")

    return name
