"""Supervision: which targets count in the loss (the chapter's third field, "target supervised").

A supervision array is a bool array aligned with a token array: ``supervised[j]``
says whether token ``j``, as a target, counts in the loss. A source range's first
token is never one of its targets, so its value is never read. ``None`` means every
target is supervised (no array is stored, and every count equals the prediction count).

TRL's records say it with per-token columns (:func:`trl_supervised`, one rule for the
corpus encoder and the Trainer collator alike): masks of 0 and 1 and ``labels`` that are
the token or :data:`IGNORE_INDEX`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..errors import InvalidInputError

#: The label of a token that is no supervised target: PyTorch's ``cross_entropy``
#: ``ignore_index`` and the -100 of transformers' and TRL's labels.
IGNORE_INDEX = -100

#: The ``labels`` entry of a token whose record has no labels, in a column that other
#: records of the chunk fill (JSON lines): that record is supervised by its masks.
NO_LABEL = -101


def as_supervision(values, length: int, name: str) -> np.ndarray | None:
    """``values`` as a read-only bool copy of ``length`` entries (None stays None).

    A bool array, or integers that are all 0 or 1 (TRL's masks); anything else, or
    another length, is an :class:`InvalidInputError` naming ``name``.
    """
    if values is None:
        return None
    try:
        array = np.asarray(values)
    except (ValueError, TypeError) as error:
        raise InvalidInputError(f"{name} is not a regular array: {error}") from None
    if array.ndim != 1 or array.shape[0] != length:
        raise InvalidInputError(f"{name} must be a 1-D array of {length} entries (one per token), "
                                f"got shape {array.shape}")
    if array.dtype != np.bool_:
        if array.size and array.dtype.kind not in "iu":
            raise InvalidInputError(f"{name} must be bool (or integers 0 and 1), got dtype {array.dtype}")
        outside = np.flatnonzero((array != 0) & (array != 1))
        if outside.size:
            raise InvalidInputError(f"{name}[{int(outside[0])}] is {array[outside[0]]}; supervision is 0 or 1")
    result = np.array(array, dtype=np.bool_, order="C", copy=True)
    result.flags.writeable = False
    return result


def target_counts(supervised: np.ndarray | None, begins: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Supervised targets of each source range ``[begins[i], ends[i])`` (int64, read-only):
    its tokens after the first that are supervised (all of them when ``supervised`` is None)."""
    if supervised is None:
        counts = np.maximum(ends - begins - 1, 0)
    else:
        counts = range_target_counts(flips_of(supervised), begins, ends)
    counts.flags.writeable = False
    return counts


def trl_supervised(tokens: np.ndarray, columns: Mapping[str, np.ndarray], *,
                   completion_only_loss: bool) -> tuple[np.ndarray, tuple[str, ...]]:
    """TRL's rule for pre-tokenized records: token ``j`` of ``tokens``, as a target, is
    supervised when its ``labels`` entry is not :data:`IGNORE_INDEX`, for a record with
    labels (TRL uses them as they are, and no mask); for one without (no ``labels``
    column, or :data:`NO_LABEL` there), when every applied mask column is 1 there:
    ``completion_mask`` under ``completion_only_loss``, ``assistant_masks`` always.
    ``columns`` are aligned with ``tokens`` and obey the rule (:func:`trl_fault` finds what
    does not); a record without a mask holds 1s there: no effect.

    Returns the bool array and the names of the columns applied, sorted.
    """
    labels = columns.get("labels")
    unlabelled = None if labels is None else labels == NO_LABEL
    supervised = np.ones(tokens.shape[0], dtype=np.bool_)
    applied = []
    if unlabelled is None or unlabelled.any():
        for name in sorted(set(columns) - {"labels"}):
            if name == "completion_mask" and not completion_only_loss:
                continue
            supervised &= columns[name] == 1
            applied.append(name)
    if labels is not None:
        supervised = np.where(unlabelled, supervised, labels != IGNORE_INDEX)
        applied = sorted({*applied, "labels"})
    return supervised, tuple(applied)


def trl_fault(tokens: np.ndarray, offsets: np.ndarray, columns: Mapping[str, np.ndarray]) -> tuple[str, int] | None:
    """The first entry of ``columns`` that breaks TRL's rule, as ``(column name, flat
    index)``, or None: a mask value other than 0 and 1 (every column but ``labels``, applied
    or not), or a label that is neither :data:`IGNORE_INDEX` nor its token (packing keeps
    no other label) nor :data:`NO_LABEL`. ``offsets`` (int64, rising from 0) bound the documents of ``tokens``: a
    document's first token is no target, so its label is never read. Columns are checked
    in sorted order of their names."""
    for name in sorted(columns):
        column = columns[name]
        if name == "labels":
            wrong = np.flatnonzero((column != IGNORE_INDEX) & (column != NO_LABEL) & (column != tokens))
            wrong = wrong[~np.isin(wrong, offsets)]  # (an index equal to an offset starts a document)
        else:
            wrong = np.flatnonzero((column != 0) & (column != 1))
        if wrong.size:
            return name, int(wrong[0])
    return None


def first_reserved_label(labels: np.ndarray, offsets: np.ndarray) -> int | None:
    """The first flat index of a user's ``labels`` that holds :data:`NO_LABEL` where it is
    read (past each document's first token, as :func:`trl_fault` reads labels), or None.
    A reader marks with it the records that have no labels, so a user's own would turn a
    label that TRL's loss refuses into a supervised target: every entry of user labels
    checks it before :func:`trl_fault`."""
    wrong = np.flatnonzero(labels == NO_LABEL)
    wrong = wrong[~np.isin(wrong, offsets)]
    return int(wrong[0]) if wrong.size else None


def gathered(parts: list[np.ndarray | None], lengths: list[int]) -> np.ndarray | None:
    """The supervision of token arrays joined end to end: None when every part is None,
    else one bool array (a None part is all True)."""
    if all(part is None for part in parts):
        return None
    return np.concatenate([np.ones(n, np.bool_) if part is None else part for part, n in zip(parts, lengths)])


# Supervision stored as flips: the sorted positions ``j`` of a token sequence where a token's
# supervision differs from the one before it (the one before the first counts as supervised).
# Supervision that changes rarely (a prompt, then its completion) costs a few integers per
# example, and none at all when every target is supervised.

def flips_of(supervised: np.ndarray, start: int = 0, after: bool = True) -> np.ndarray:
    """The flips (int64) of ``supervised``, a bool array whose first token sits at ``start``
    and follows a token whose supervision is ``after``."""
    before = np.empty(supervised.shape[0], dtype=np.bool_)
    before[:1] = after
    before[1:] = supervised[:-1]
    return np.flatnonzero(supervised != before).astype(np.int64) + start


def state_at(flips: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The supervision of the tokens at ``positions``: an even number of flips at or before one
    means supervised."""
    return (np.searchsorted(flips, positions, side="right") & 1) == 0


def supervision_of(flips: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The supervision of tokens ``[start, stop)`` as a bool array."""
    first, last = np.searchsorted(flips, [start, stop])
    toggles = np.zeros(stop - start, dtype=np.uint8)  # (a byte per token: only the parity counts)
    toggles[flips[first:last] - start] = 1
    if stop > start:
        toggles[0] ^= int(first) & 1
    return np.bitwise_xor.accumulate(toggles, out=toggles) == 0


def unsupervised_before(flips: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """How many tokens before each of ``positions`` are unsupervised (int64)."""
    runs = np.zeros(flips.shape[0] // 2 + 1, dtype=np.int64)  # whole unsupervised runs so far
    np.cumsum(flips[1::2] - flips[0:2 * (flips.shape[0] // 2):2], out=runs[1:])
    count = np.searchsorted(flips, positions, side="left")  # flips before each position
    if not flips.shape[0]:
        return np.zeros_like(count)
    open_run = np.where(count & 1, positions - flips[np.maximum(count - 1, 0)], 0)
    return runs[count >> 1] + open_run


def range_target_counts(flips: np.ndarray, begins: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Supervised targets of each source range ``[begins[i], ends[i])``: its tokens after the
    first (an empty range has none)."""
    counts = (ends - begins - 1) - (unsupervised_before(flips, ends) - unsupervised_before(flips, begins + 1))
    return np.maximum(counts, 0)


def placed_flips(flips: np.ndarray, begins: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The flips of the ranges ``[begins[i], ends[i])`` of a flipped sequence written back to
    back in the given order, each range's first token (never a target) taking the state of
    the token before it, so that it adds no flip of its own."""
    sizes = ends - begins
    out = np.zeros(sizes.shape[0], dtype=np.int64)  # where each range starts in the output
    np.cumsum(sizes[:-1], out=out[1:])
    before = np.ones(sizes.shape[0], dtype=np.bool_)
    before[1:] = state_at(flips, ends[:-1] - 1)
    leading = out[state_at(flips, begins + 1) != before] + 1
    low = np.searchsorted(flips, begins + 1, side="right")
    high = np.searchsorted(flips, ends, side="left")
    counts = high - low
    starts = np.zeros(counts.shape[0], dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    index = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts - low, counts)
    inner = flips[index] + np.repeat(out - begins, counts)
    return np.sort(np.concatenate([leading, inner]))
