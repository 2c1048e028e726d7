"""Right-padding, the other policy: one example per row, consecutive examples per batch.

Batch ``k`` holds examples ``[k * rows_per_batch, (k + 1) * rows_per_batch)`` in
supplied order, one per row from column 0, and is as wide as its longest example;
the last batch keeps its actual row count (no all-padding rows are added). Every
limit is checked for every batch before any batch is built. Preference pairs
(``pairs=True``: examples ``2p`` and ``2p + 1``) take two consecutive rows of one
batch, which an even ``rows_per_batch`` guarantees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import numpy as np

from .._arguments import check_bool
from ..data.binding import BatchBinding, Partition
from ..data.examples import SequenceExample
from ..data.table import ExampleTable
from ..errors import CapacityError, InvalidInputError
from ..layout.batch import BatchLayout
from ..layout.fields import Placements
from ..layout.sources import check_example_count, reject_longer, source_of
from . import budget
from .config import PadConfig
from .epoch import Epoch
from .placement import check_pair_count


class PaddedBatch(BatchLayout):
    """A right-padded batch (the chapter's ``VariableBatch``): one example per row.

    Row ``r`` holds its example from column 0; every valid cell's segment is the
    example's ordinal in the padded input. With ``pairs`` a pair's chosen and rejected
    sequences take consecutive rows.
    """


class PaddedEpoch(Epoch):
    """The padded batches of one ``seqpack.pad`` call, in supplied order (a list)."""


def pad(
    examples: Union[Sequence[SequenceExample], ExampleTable], config: PadConfig = PadConfig(), *,
    partition: Partition, binding: BatchBinding, pairs: bool = False,
) -> PaddedEpoch:
    """Right-pad ``examples`` into batches of ``config.rows_per_batch`` consecutive examples.

    ``examples`` is a list of ``SequenceExample`` or an ``ExampleTable``, all made
    under ``binding`` for ``partition`` (checked). ``pairs=True`` reads them as
    preference pairs (``2p`` chosen, ``2p + 1`` rejected), which needs an even example
    count and an even ``rows_per_batch`` (``InvalidInputError`` otherwise). Errors, all
    raised before any batch is built: an example over ``max_width`` or a batch over
    ``max_cells`` (``CapacityError``, naming it); the epoch's bytes over
    ``max_memory_bytes`` (``MemoryBudgetError``).
    """
    if not isinstance(config, PadConfig):
        raise InvalidInputError(f"config must be a PadConfig, not {type(config).__name__}")
    if check_bool("pairs", pairs) and config.rows_per_batch % 2:
        raise InvalidInputError(
            f"rows_per_batch {config.rows_per_batch} is odd: padding gives each sequence its own row, so a "
            "batch would split a preference pair; use an even rows_per_batch with pairs=True"
        )
    source, lengths, _ = source_of(examples, partition, binding)
    count = lengths.shape[0]
    check_example_count(count)
    if pairs:
        check_pair_count(count)
    if config.max_width is not None:
        reject_longer(source, lengths, config.max_width, "max_width")
    firsts = np.arange(0, count, config.rows_per_batch, dtype=np.int64)
    rows = np.diff(np.append(firsts, count))
    widths = np.maximum.reduceat(lengths, firsts)
    cells = rows * widths
    if config.max_cells is not None and cells.max() > config.max_cells:
        number = int(np.argmax(cells > config.max_cells))
        first, end = int(firsts[number]), int(firsts[number] + rows[number])
        raise CapacityError(
            f"batch {number} (examples {first}..{end - 1}) has {rows[number]} rows x {widths[number]} "
            f"columns = {cells[number]} cells; max_cells is {config.max_cells}",
            cells=int(cells[number]),
            maximum=config.max_cells,
        )
    tokens = np.add.reduceat(lengths, firsts) + rows
    largest_gather = int(budget.gather_bytes(source.copies_tokens, tokens, rows).max())
    required = (sum(budget.batch_bytes(r, r, w) for r, w in zip(rows.tolist(), widths.tolist()))
                + count * source.held_bytes_per_example + largest_gather + budget.PAD_FIXED_BYTES)
    budget.require(required, config.max_memory_bytes, "the padded epoch")
    batches = [
        _padded_batch(partition, binding, source, lengths, first, first + batch_rows, width, pairs)
        for first, batch_rows, width in zip(firsts.tolist(), rows.tolist(), widths.tolist())
    ]
    return PaddedEpoch(batches, required, pairs)


def _padded_batch(partition, binding, source, lengths, first: int, end: int, width: int,
                  pairs: bool) -> PaddedBatch:
    rows = end - first
    ordinals = np.arange(first, end, dtype=np.int64) + source.first_ordinal
    placements = Placements(ordinals, np.arange(rows, dtype=np.int64), np.zeros(rows, np.int64),
                            lengths[first:end], ordinals.astype(np.int32))
    return PaddedBatch.filled(partition, binding, source, placements, (rows, width), pairs=pairs)
