"""Placement: which row and start column every example gets, from its prediction length alone.

Examples are never split, truncated or dropped; an example longer than the capacity is
an error naming it. ``"next-fit"`` (the default, and the packing chapter's policy) fills
only the current row in input order. ``"first-fit-decreasing"`` and
``"best-fit-decreasing"`` visit examples longest first (equal lengths in input order)
and usually need fewer rows. Whatever the policy, ``rows[i]`` and ``starts[i]`` describe
example ``i`` of the input, rows are numbered in the order they are opened, and an
example occupies columns ``[starts[i], starts[i] + lengths[i])`` of its row.

Preference pairs (``pairs=True``) are examples ``2p`` and ``2p + 1``, pair ``p``'s chosen and
rejected sequences. A pair is placed as one item, its two sequences side by side in one
row (chosen first), so no policy ever puts them in different batches; a pair longer
than the capacity is an error naming it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from .._arguments import INT64_MAX, check_bool, shown
from .._read_only import ReadOnlyArrays
from ..data.windows import refuse_long
from ..errors import InvalidInputError
from . import _placement

POLICIES = ("next-fit", "first-fit-decreasing", "best-fit-decreasing")

# Best-fit-decreasing keeps one bucket per possible remaining room, O(capacity) workspace.
BEST_FIT_MAX_CAPACITY = 2**24


@dataclass(frozen=True)
class Placement(ReadOnlyArrays):
    """Where each example lives: ``rows[i]`` and ``starts[i]`` (read-only int64) for example ``i``."""

    rows: np.ndarray
    starts: np.ndarray
    row_count: int
    policy: str


def place(lengths, capacity: int, policy: str = "next-fit", *, pairs: bool = False) -> Placement:
    """Assign every example a row and a start column under ``policy``.

    ``lengths`` holds each example's prediction count (1-D integers, each in
    ``[1, capacity]``). Next-fit reads examples in input order and opens a new row when
    an example does not fit the current row's remaining cells; an exact fill opens no
    empty row. The decreasing policies sort by length descending (ties keep input
    order); first-fit puts each example in the lowest-numbered row with room, best-fit
    in the row with the least room that still fits (ties to the lowest-numbered row).
    Within a row, examples take increasing start columns in the order they are assigned.

    With ``pairs=True`` the policy places pairs (``lengths[2p] + lengths[2p + 1]`` cells
    each, see the module docstring); ``lengths`` must then have an even count.
    """
    capacity = checked_capacity(capacity)
    check_policy(policy, capacity)
    check_bool("pairs", pairs)
    if not pairs:
        return placed(checked_lengths(lengths, capacity), capacity, policy)
    lengths = checked_lengths(lengths, capacity)
    return placed_pairs(lengths, checked_pair_lengths(lengths, capacity), capacity, policy)


def placed_pairs(lengths: np.ndarray, pair_lengths: np.ndarray, capacity: int, policy: str) -> Placement:
    """:func:`placed` for preference pairs: ``pair_lengths`` (from :func:`checked_pair_lengths`)
    placed by ``policy``, then each pair's chosen at the pair's start and its rejected right after."""
    pair = placed(pair_lengths, capacity, policy)
    rows, starts = pair_members(lengths, pair.rows, pair.starts)
    rows.flags.writeable = False
    starts.flags.writeable = False
    return Placement(rows=rows, starts=starts, row_count=pair.row_count, policy=policy)


def pair_members(lengths: np.ndarray, pair_rows: np.ndarray, pair_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every example's row and start (fresh int64 arrays) from its pair's: example ``2p`` at
    pair ``p``'s start, example ``2p + 1`` right after it (``lengths`` are the examples')."""
    rows = np.empty(2 * pair_rows.shape[0], dtype=np.int64)
    starts = np.empty_like(rows)
    rows[0::2] = rows[1::2] = pair_rows  # not np.repeat, whose broadcast repeat counts cost 8 bytes a pair
    starts[0::2] = pair_starts
    np.add(pair_starts, lengths[0::2], out=starts[1::2])
    return rows, starts


def checked_pair_lengths(lengths: np.ndarray, capacity: int, name=None) -> np.ndarray:
    """Each pair's cells, ``lengths[2p] + lengths[2p + 1]`` (int64), after checking that
    ``lengths`` (checked by :func:`checked_lengths`) holds whole pairs that each fit a row.

    ``name(p)`` names pair ``p`` in the error (default: ``"pair p (examples 2p and 2p + 1)"``).
    """
    check_pair_count(lengths.shape[0])
    # Two lengths of up to 2**63 - 1 add up exactly in uint64; once checked, each sum fits int64.
    pair_lengths = np.add(lengths[0::2], lengths[1::2], dtype=np.uint64, casting="unsafe")
    if name is None:
        def name(p: int) -> str:
            return f"pair {p} (examples {2 * p} and {2 * p + 1})"
    refuse_long(pair_lengths, capacity, name, hint="; a pair's chosen and rejected sequences share one row")
    return pair_lengths.view(np.int64)


def check_pair_count(count: int) -> None:
    """Preference pairs come whole: an odd example count is an error."""
    if count % 2:
        raise InvalidInputError(
            f"{count} examples cannot be preference pairs: pair p is examples 2p and 2p + 1"
        )


def placed(lengths: np.ndarray, capacity: int, policy: str) -> Placement:
    """:func:`place` on arguments already checked: C-contiguous int64 ``lengths`` in
    ``[1, capacity]``, a Python int ``capacity`` and a policy that allows it."""
    count = lengths.shape[0]
    rows = np.empty(count, dtype=np.int64)
    starts = np.empty(count, dtype=np.int64)
    if policy == "next-fit":
        row_count, _ = _placement.next_fit(lengths, capacity, rows, starts)
    else:
        order, visit_lengths = _longest_first(lengths, capacity)
        visit_rows = np.empty(count, dtype=np.int64)
        visit_starts = np.empty(count, dtype=np.int64)
        max_rows = any_fit_row_bound(lengths, capacity)
        if policy == "first-fit-decreasing":
            room_tree = np.empty(2 * power_of_two_at_least(max_rows), dtype=np.int64)
            row_count = _placement.first_fit(visit_lengths, capacity, visit_rows, visit_starts, room_tree)
        else:
            row_count = _placement.best_fit(
                visit_lengths,
                capacity,
                visit_rows,
                visit_starts,
                np.empty(capacity, dtype=np.int64),  # bucket roots, by remaining room
                np.empty(2 * power_of_two_at_least(capacity + 1), dtype=np.uint8),
                np.empty((max_rows, 3), dtype=np.int64),  # leftist heaps: left, right, rank per row
            )
        rows[order] = visit_rows
        starts[order] = visit_starts
    rows.flags.writeable = False
    starts.flags.writeable = False
    return Placement(rows=rows, starts=starts, row_count=int(row_count), policy=policy)


def lower_bound_rows(lengths, capacity: int) -> int:
    """The fewest rows any placement can use: ``ceil(sum(lengths) / capacity)``."""
    capacity = checked_capacity(capacity)
    total = _total(checked_lengths(lengths, capacity), capacity)
    return -(-total // capacity)


def real_target_fraction(lengths, row_count: int, capacity: int) -> float:
    """The share of stored cells that hold real targets: ``sum(lengths) / (row_count * capacity)``."""
    capacity = checked_capacity(capacity)
    total = _total(checked_lengths(lengths, capacity), capacity)
    if isinstance(row_count, (bool, np.bool_)) or not isinstance(row_count, (int, np.integer)):
        raise InvalidInputError(f"row_count must be an integer, got {row_count!r}")
    row_count = int(row_count)
    if row_count < 1 or row_count * capacity < total:
        raise InvalidInputError(
            f"{row_count} rows of capacity {capacity} cannot hold {total} predictions"
        )
    return total / (row_count * capacity)


def check_policy(policy: str, capacity: int) -> None:
    if not isinstance(policy, str) or policy not in POLICIES:
        raise InvalidInputError(f"unknown placement policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy == "best-fit-decreasing" and capacity > BEST_FIT_MAX_CAPACITY:
        raise InvalidInputError(
            f"capacity {capacity} is too large for best-fit-decreasing, "
            f"which keeps one bucket per remaining room; its limit is {BEST_FIT_MAX_CAPACITY}"
        )


def checked_capacity(capacity) -> int:
    if isinstance(capacity, (bool, np.bool_)):
        raise InvalidInputError(f"capacity must be a positive integer, got {capacity!r}")
    try:
        capacity = operator.index(capacity)
    except TypeError:
        raise InvalidInputError(f"capacity must be a positive integer, got {capacity!r}") from None
    if not 1 <= capacity <= INT64_MAX:
        raise InvalidInputError(f"capacity must be in [1, {INT64_MAX}], got {shown(capacity)}")
    return capacity


def checked_lengths(lengths, capacity: int) -> np.ndarray:
    """Coerce to C-contiguous int64 after checking every length is in ``[1, capacity]``."""
    try:
        array = np.asarray(lengths)
    except (ValueError, TypeError) as error:  # ragged nesting, values numpy cannot hold
        raise InvalidInputError(f"lengths is not a regular array: {error}") from None
    if array.ndim != 1:
        raise InvalidInputError(f"lengths must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise InvalidInputError(f"lengths must be integers, got dtype {array.dtype}")
    if array.min() < 1:
        index = int(np.argmax(array < 1))
        raise InvalidInputError(
            f"example {index} has {int(array[index])} predictions; every example needs at least 1"
        )
    refuse_long(array, capacity, lambda index: f"example {index}")
    return np.ascontiguousarray(array, dtype=np.int64)


def _longest_first(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Example indices longest first (equal lengths in input order), and their lengths.

    A counting sort when its ``capacity + 1`` counters cost no more than the examples
    themselves (or 64 Ki), else a radix sort by 16-bit digits (both interruptible).
    """
    count = lengths.shape[0]
    sorted_lengths = np.empty(count, dtype=np.int64)
    if counting_sort_fits(count, capacity):
        order = np.empty(count, dtype=np.int64)
        counts = np.empty(capacity + 1, dtype=np.int64)
        _placement.order_longest_first(lengths, capacity, counts, order, sorted_lengths)
    else:
        order = stable_order(lengths, capacity - 1, flip_from=capacity)
        np.take(lengths, order, out=sorted_lengths)
    return order, sorted_lengths


def stable_order(keys: np.ndarray, largest: int, flip_from: int | None = None) -> np.ndarray:
    """The indices of int64 ``keys`` by sort key, equal keys in index order: numpy's
    stable argsort, as an interruptible radix sort over 16-bit digits.

    The sort key is the key, or ``flip_from - key`` when ``flip_from`` is given (longest
    first without a flipped copy of the keys); every sort key is in ``[0, largest]``.
    """
    count = keys.shape[0]
    order = np.empty(count, dtype=np.int64)
    passes = max(1, -(-int(largest).bit_length() // 16))
    _placement.stable_order(np.ascontiguousarray(keys, dtype=np.int64), -1 if flip_from is None else int(flip_from),
                            passes, np.empty(2**16, dtype=np.int64), np.empty(count, dtype=np.int64), order)
    return order


def counting_sort_fits(count: int, capacity: int) -> bool:
    return capacity <= max(count, 2**16)


def _total(lengths: np.ndarray, capacity: int) -> int:
    """Exact sum of validated lengths, in int64 chunks that cannot overflow."""
    chunk = max(1, INT64_MAX // capacity)
    return sum(int(lengths[i : i + chunk].sum()) for i in range(0, lengths.shape[0], chunk))


def any_fit_row_bound(lengths: np.ndarray, capacity: int) -> int:
    """At most ``ceil(2 * total / capacity)`` rows (and one per example).

    A policy that opens a row only when no open row fits leaves at most one row at most
    half full: every later row's first example did not fit that row's room.
    """
    total = _total(lengths, capacity)
    return min(lengths.shape[0], -(-2 * total // capacity))


def power_of_two_at_least(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()
