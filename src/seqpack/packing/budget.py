"""The memory budget: every byte padding and packing hold, counted before anything large exists.

A config's ``max_memory_bytes`` is checked against these requirements before the
arrays they describe are allocated; everything is exact Python-int arithmetic.

=====================================  ===========================================  =================
what is held                           bytes                                        counted in
=====================================  ===========================================  =================
each cell of a batch's fields          19: four int32 fields, three bool flags      ``batch_bytes``
each row of a batch                    8: its valid length (int64)                  ``batch_bytes``
each occurrence of a batch             36: one ``OCCURRENCE_DTYPE`` record          ``batch_bytes``
each batch                             3 KiB: the object, its dict, nine headers    ``batch_bytes``
a batch read from disk                 4 per token, supervised 2 more and 8 per     ``stored_batch_bytes``
                                       flip; 56 per occurrence (bounds, placements)
gathering a batch's tokens, per        list of examples: 292 plus 6 per token       ``gather_bytes``
occurrence (plus 64 per gather)        (copied, with its supervision); table: 44
a plan, per example                    1 (a scan) + the source's own (list 16,      ``plan_bytes``
                                       table 0) + 24 for decreasing policies
                                       (visiting order, sorted rows and starts)
a plan, per batch / fixed              128 (first row, bounds, list slot) / 8 KiB   ``plan_bytes``
placement, per example                 16 (rows, starts); decreasing policies add   ``placement_bytes``
                                       32, the sort's workspace and the policy's
                                       search structure (see ``placement_bytes``)
placement of pairs, per pair           8 (the pair's cells) + the larger of placing     ``placement_bytes``
                                       the pairs and 48 (their rows and starts, then
                                       their two examples')
an eager epoch, per occurrence         44 temporaries + 36 record                   ``epoch_bytes``
an eager epoch, per batch              3 KiB + 8 (the view and its list slot)       ``epoch_bytes``
a padded epoch, fixed                  8 KiB (the epoch, its lists, temporaries)    ``PAD_FIXED_BYTES``
=====================================  ===========================================  =================

The object allowances were measured with tracemalloc and rounded up, so the budget
stays an upper bound of what is really held.
"""

from __future__ import annotations

import numpy as np

from .._arguments import INT64_MAX, check_bool
from ..errors import InvalidInputError, MemoryBudgetError
from ..layout.fields import CELL_FIELDS, FLAG_FIELDS, OCCURRENCE_DTYPE
from .placement import (
    any_fit_row_bound,
    check_policy,
    checked_capacity,
    checked_lengths,
    checked_pair_lengths,
    counting_sort_fits,
    power_of_two_at_least,
)

#: Bytes per stored cell (the int32 fields and the bool flags) and per row (valid length).
CELL_BYTES = 4 * len(CELL_FIELDS) + len(FLAG_FIELDS)
ROW_BYTES = 8
RECORD_BYTES = OCCURRENCE_DTYPE.itemsize
BATCH_OBJECT_BYTES = 3 * 1024
PLAN_BYTES_PER_BATCH = 128
PLAN_FIXED_BYTES = 8 * 1024
PAD_FIXED_BYTES = 8 * 1024
PLAN_SCAN_BYTES_PER_EXAMPLE = 1
DECREASING_BYTES_PER_EXAMPLE = 24
REORDER_BYTES_PER_EXAMPLE = 32  # the placed rows and starts, the sort keys and scratch
REORDER_FIXED_BYTES = 8 << 16  # its digit counts
# Gathering: bounds (begins, ends), their int64 copies and the fill's record copies per
# occurrence; a list source also holds one token view (256) and copies every token: int32,
# and its supervision joined (bool) from parts that may be all-True temporaries (bool).
GATHER_BYTES_PER_OCCURRENCE = 8 + 16 + 20
COPY_BYTES_PER_OCCURRENCE = 16 + 20 + 256
COPY_BYTES_PER_TOKEN = 4 + 1 + 1
GATHER_FIXED_BYTES = 64
# An eager epoch's temporaries per occurrence: ordinals and input-order indices (int64),
# segments (int32), batch-local rows, lengths and a fill run's row shift (int64).
EPOCH_BYTES_PER_OCCURRENCE = 8 + 8 + 4 + 8 + 8 + 8
# A batch read from disk, per occurrence: ordinals, begins and ends (int64), the placements'
# rows and int32 segments, and the fill's record copies; per supervised token: the bool
# supervision and the parity byte it is rebuilt from; per flip in its range, an int64.
STORED_BYTES_PER_OCCURRENCE = 8 + 16 + 8 + 4 + 20
STORED_SUPERVISION_BYTES_PER_TOKEN = 2
#: Gathering temporaries an eager epoch allows one fill run (unless one batch needs more).
FILL_BLOCK_BYTES = 64 * 2**20


def require(required: int, maximum: int, what: str = "packing") -> None:
    """Raise :class:`MemoryBudgetError` when ``required`` bytes exceed ``maximum``."""
    if required > maximum:
        raise MemoryBudgetError(
            f"{what} needs {required} bytes; max_memory_bytes is {maximum}",
            required=required,
            maximum=maximum,
        )


def field_bytes(rows: int, width: int) -> int:
    """Bytes of the field arrays of ``rows`` rows of ``width`` cells.

    Raises ``InvalidInputError`` when the arrays could not be indexed with int64.
    """
    if rows * width > INT64_MAX // CELL_BYTES:
        raise InvalidInputError(f"a batch of {rows} rows x {width} columns cannot be indexed")
    return rows * (width * CELL_BYTES + ROW_BYTES)


def batch_bytes(rows: int, occurrences: int, width: int) -> int:
    """Bytes one built batch holds: field arrays, occurrence records, objects."""
    return field_bytes(rows, width) + occurrences * RECORD_BYTES + BATCH_OBJECT_BYTES


def stored_batch_bytes(rows: int, occurrences: int, tokens: int, width: int, flips: int | None = None) -> int:
    """Bytes one batch read from a packed dataset holds: the built batch, its source
    tokens as int32, its occurrences' ordinals, bounds and placements, and, with
    supervision (``flips``: at most how many supervision flips its tokens hold), its
    tokens' supervision with what it is rebuilt from."""
    supervision = 0 if flips is None else STORED_SUPERVISION_BYTES_PER_TOKEN * tokens + 8 * flips
    return batch_bytes(rows, occurrences, width) + 4 * tokens + STORED_BYTES_PER_OCCURRENCE * occurrences + supervision


def gather_bytes(copies_tokens: bool, tokens, occurrences):
    """Temporaries of gathering ``occurrences`` examples holding ``tokens`` source tokens.

    Works elementwise on int64 arrays (one entry per batch) as on ints.
    """
    if copies_tokens:
        return COPY_BYTES_PER_TOKEN * tokens + COPY_BYTES_PER_OCCURRENCE * occurrences + GATHER_FIXED_BYTES
    return GATHER_BYTES_PER_OCCURRENCE * occurrences + GATHER_FIXED_BYTES


def placement_bytes(lengths, capacity: int, policy: str = "next-fit", *, pairs: bool = False) -> int:
    """The most bytes ``seqpack.place`` holds at once for these arguments (an upper bound).

    Not counted: the int64 copy made of lengths given in another dtype or layout.
    Next-fit holds its two int64 outputs; the decreasing policies add the visiting order,
    the sorted lengths, outputs in visiting order, the sort's workspace and the policy's
    search structure (sized by the any-fit row bound). ``pairs`` as for ``place``.
    """
    capacity = checked_capacity(capacity)
    check_policy(policy, capacity)
    lengths = checked_lengths(lengths, capacity)
    if check_bool("pairs", pairs):
        return paired_placement_bytes(checked_pair_lengths(lengths, capacity), capacity, policy)
    return checked_placement_bytes(lengths, capacity, policy)


def checked_placement_bytes(lengths: np.ndarray, capacity: int, policy: str) -> int:
    """:func:`placement_bytes` of arguments already checked."""
    count = lengths.shape[0]
    required = 16 * count
    if policy == "next-fit":
        return required
    # Counting sort counters, or the radix sort's keys and scratch and its 2**16 counters.
    sort = 8 * (capacity + 1) if counting_sort_fits(count, capacity) else 16 * count + (8 << 16)
    required += 32 * count + sort
    max_rows = any_fit_row_bound(lengths, capacity)
    if policy == "first-fit-decreasing":
        return required + 16 * power_of_two_at_least(max_rows)
    return required + 8 * capacity + 2 * power_of_two_at_least(capacity + 1) + 24 * max_rows


def paired_placement_bytes(pair_lengths: np.ndarray, capacity: int, policy: str) -> int:
    """:func:`placement_bytes` of preference pairs of ``pair_lengths`` cells (checked): the
    pairs' lengths, held while the pairs are placed and then while their rows and starts
    become their examples' (twice as many)."""
    count = pair_lengths.shape[0]
    members = 48 * count  # the pairs' rows and starts, and their examples'
    return 8 * count + max(checked_placement_bytes(pair_lengths, capacity, policy), members)


def plan_bytes(lengths: np.ndarray, capacity: int, policy: str, held_bytes_per_example: int,
               pair_lengths: np.ndarray | None = None) -> int:
    """Bytes of a plan before its batches are counted: lengths, scans, placement, order.
    ``pair_lengths`` (checked) are given when the examples are placed as preference pairs."""
    count = lengths.shape[0]
    per_example = held_bytes_per_example + PLAN_SCAN_BYTES_PER_EXAMPLE
    placing = (checked_placement_bytes(lengths, capacity, policy) if pair_lengths is None
               else paired_placement_bytes(pair_lengths, capacity, policy))
    if policy != "next-fit":
        per_example += DECREASING_BYTES_PER_EXAMPLE
        # The placed rows are then reordered by stable_order, once the placement's temporaries are gone.
        placing = max(placing, REORDER_BYTES_PER_EXAMPLE * count + REORDER_FIXED_BYTES)
    return count * per_example + placing + PLAN_FIXED_BYTES


def epoch_bytes(plan: int, occurrences: int, rows: int, batches: int, largest_batch_rows: int,
                fill_gather: int, capacity: int) -> int:
    """Bytes an eager epoch holds at its peak, as an exact integer (past 2**63 too).

    The plan, the epoch's fields and records, its per-occurrence temporaries, every
    batch's view object and list slot, and the largest fill run's gathering. Raises
    ``InvalidInputError`` when even one batch's arrays could not be indexed.
    """
    field_bytes(largest_batch_rows, capacity)
    return (plan + rows * (capacity * CELL_BYTES + ROW_BYTES)
            + occurrences * (RECORD_BYTES + EPOCH_BYTES_PER_OCCURRENCE)
            + batches * (BATCH_OBJECT_BYTES + 8) + fill_gather)
