"""Streaming next-fit: batches packed as examples (or preference pairs) arrive, equal to
packing the whole input."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Union

import numpy as np

from .._arguments import check_bool
from ..data.binding import BatchBinding, Partition, check_expectations
from ..data.examples import SequenceExample
from ..data.supervision import gathered
from ..data.table import ExampleTable
from ..errors import InvalidInputError
from ..layout.sources import ExampleList, check_example_count, pair_name, reject_longer, source_of
from . import _placement, budget
from .config import PackConfig
from .packed import PackedBatch, packed_batch
from .placement import checked_pair_lengths, pair_members
from .planning import check_batch_cells, check_config


class StreamSource:
    """Several sources whose ordinal ranges follow each other, seen as one :class:`ExampleSource`."""

    copies_tokens = True  # joining the parts may copy every token
    held_bytes_per_example = ExampleList.held_bytes_per_example

    def __init__(self, sources):
        self._sources = sources
        self._firsts = np.array([source.first_ordinal for source in sources], dtype=np.int64)
        self.first_ordinal = sources[0].first_ordinal

    def __len__(self) -> int:
        return sum(len(source) for source in self._sources)

    def _source_of(self, ordinal: int):
        return self._sources[int(np.searchsorted(self._firsts, ordinal, side="right")) - 1]

    def example(self, ordinal: int) -> SequenceExample:
        return self._source_of(ordinal).example(ordinal)

    def example_id(self, ordinal: int) -> str:
        return self._source_of(ordinal).example_id(ordinal)

    def gather(self, ordinals: np.ndarray):
        """Each source's part, with token arrays (and their supervision) joined once,
        when the sources differ."""
        which = np.searchsorted(self._firsts, ordinals, side="right") - 1
        parts = [self._sources[i].gather(ordinals[which == i]) for i in np.unique(which).tolist()]
        if all(tokens is parts[0][0] for tokens, _, _, _ in parts):
            return parts[0][0], parts[0][1], np.concatenate([p[2] for p in parts]), np.concatenate([p[3] for p in parts])
        sizes = [len(tokens) for tokens, _, _, _ in parts]
        shift = np.cumsum([0] + sizes[:-1])
        return (
            np.concatenate([tokens for tokens, _, _, _ in parts]),
            gathered([supervised for _, supervised, _, _ in parts], sizes),
            np.concatenate([b + k for (_, _, b, _), k in zip(parts, shift)]),
            np.concatenate([e + k for (_, _, _, e), k in zip(parts, shift)]),
        )


def stream(
    examples: Iterable[Union[SequenceExample, ExampleTable]], config: PackConfig, *,
    partition: Partition, binding: BatchBinding, pairs: bool = False,
) -> Iterator[PackedBatch]:
    """Next-fit over a stream of ``SequenceExample`` objects and/or ``ExampleTable`` chunks.

    Yields each batch once no later example can join it, so memory is bounded by one
    batch plus the open row; ordinals count across the whole stream and empty chunks
    are skipped. The batches equal ``seqpack.pack`` on the concatenated input. The
    arguments are checked when ``stream`` is called; each example when it arrives;
    each batch's bytes (fields, records, gathering) against ``max_memory_bytes``
    before it is built.

    With ``pairs=True`` the stream's examples ``2p`` and ``2p + 1`` are preference pair
    ``p``'s chosen and rejected sequences, wherever the items divide them (a chunk may
    end between them), and next-fit places whole pairs as ``seqpack.pack(...,
    pairs=True)`` does. A stream that ends after a chosen sequence is an
    ``InvalidInputError`` naming the unfinished pair, raised in place of the last batch.
    """
    config = check_config(config)
    check_expectations(partition, binding)
    pairs = check_bool("pairs", pairs)
    try:
        items = iter(examples)
    except TypeError:
        raise InvalidInputError(f"examples must be iterable, not {type(examples).__name__}") from None
    pieces = _arrivals(items, config.capacity, partition, binding)
    return _packed_stream(_whole_pairs(pieces) if pairs else pieces, config, partition, binding, pairs)


def _arrivals(items, capacity: int, partition, binding):
    """Each non-empty item as a checked source, numbered from the stream's count so far
    (``first_ordinal``), with its examples' lengths."""
    ordinal = 0
    for item in items:
        if isinstance(item, ExampleTable):
            if len(item) == 0:
                continue
            source, lengths, _ = source_of(item.chunk(0, len(item)), partition, binding)
        else:
            source, lengths, _ = source_of([item], partition, binding, first_index=ordinal)
        source.first_ordinal = ordinal
        check_example_count(ordinal + len(lengths))
        reject_longer(source, lengths, capacity, "capacity")
        ordinal += len(lengths)
        yield source, lengths


def _whole_pairs(arrivals):
    """The arrivals as pieces of whole preference pairs: a chosen sequence that ends an
    arrival waits for its rejected, and the two come as one piece of their own."""
    waiting = None  # (source, ordinal, length) of a chosen sequence whose rejected has not arrived
    for source, lengths in arrivals:
        first = 0
        if waiting is not None:
            chosen_source, chosen, length = waiting
            both = ExampleList([chosen_source.example(chosen), source.example(source.first_ordinal)], chosen)
            yield both, np.array([length, lengths[0]], dtype=np.int64)
            first, waiting = 1, None
        end = len(lengths) - (len(lengths) - first) % 2
        if end < len(lengths):
            waiting = (source, source.first_ordinal + end, int(lengths[end]))
        if first == 0 and end == len(lengths):
            yield source, lengths
        elif first < end:  # only a table holds more than one example
            part = source.chunk(first, end)
            part.first_ordinal = source.first_ordinal + first
            yield part, lengths[first:end]
    if waiting is not None:
        source, chosen, _ = waiting
        raise InvalidInputError(
            f"the stream ended after example {source.example_id(chosen)!r} (index {chosen}), the chosen sequence "
            f"of pair {chosen // 2}: its rejected sequence (index {chosen + 1}) never came"
        )


def _packed_stream(pieces, config: PackConfig, partition, binding, pairs: bool) -> Iterator[PackedBatch]:
    capacity, per_batch = config.capacity, config.rows_per_batch
    pending = []  # (source, ordinals, global rows, starts, lengths) of the current batch
    number, open_row, used = 0, -1, -1

    def flush(last_row: int) -> PackedBatch:
        if len(pending) == 1:  # the batch lies inside one piece: no joining
            source, ordinals, rows, starts, lengths = pending[0]
        else:
            sources = list({id(p[0]): p[0] for p in pending}.values())
            source = sources[0] if len(sources) == 1 else StreamSource(sources)
            ordinals, rows, starts, lengths = (np.concatenate([p[k] for p in pending]) for k in range(1, 5))
        batch_rows = last_row + 1 - number * per_batch
        check_batch_cells(batch_rows, config)
        tokens = int(lengths.sum()) + len(lengths)
        required = (budget.batch_bytes(batch_rows, len(lengths), capacity)
                    + budget.gather_bytes(source.copies_tokens, tokens, len(lengths)))
        budget.require(required, config.max_memory_bytes, f"batch {number}")
        return packed_batch(partition, binding, source, ordinals, rows - number * per_batch, starts, lengths,
                            (batch_rows, capacity), pairs=pairs)

    for source, lengths in pieces:
        # Next-fit places the piece's items (its pairs, or its examples) after the open row's used cells.
        items = checked_pair_lengths(lengths, capacity, pair_name(source)) if pairs else lengths
        rows = np.empty(len(items), dtype=np.int64)
        starts = np.empty(len(items), dtype=np.int64)
        _, used = _placement.next_fit(items, capacity, rows, starts, used)
        if pairs:
            rows, starts = pair_members(lengths, rows, starts)
        rows += max(open_row, 0)  # the kernel numbers the open row (or the first new one) 0
        ordinals = np.arange(source.first_ordinal, source.first_ordinal + len(lengths), dtype=np.int64)
        # Batches that this piece completes: every batch before the one holding its last row.
        # Rows never decrease, so each batch's examples are one slice of the piece.
        batches = rows // per_batch
        cuts = np.searchsorted(batches, np.arange(number, int(batches[-1]) + 2)).tolist()
        for finished, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]), start=number):
            pending.append((source, ordinals[a:b], rows[a:b], starts[a:b], lengths[a:b]))
            if finished < int(batches[-1]):
                yield flush((finished + 1) * per_batch - 1)
                pending, number = [], finished + 1
        open_row = int(rows[-1])
    if pending:
        yield flush(open_row)
