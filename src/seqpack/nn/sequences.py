"""Per-occurrence log-probabilities: the loss kernel's values, summed per example instead of per batch.

``sequence_logprobs(logits, batch)`` scores every occurrence of a batch (in the batch's
record order: sorted by row, then start) by ``sum log p(target)`` over its supervised
targets (its ``loss_mask`` cells), the quantity an evaluation or a preference objective
reads per example, and differentiates any weighted sum of those scores. As in the masked
loss, supervised cells are selected first and only their logit rows are read, so excluded
cells (padding, prompts, anything in them, NaN included) never enter the arithmetic and get
exactly zero gradient. Each occurrence's targets are contiguous in row-major cell order, so
one ``offsets`` array groups the per-target values by occurrence; every sum is added in
that order by one sequential kernel, so repeated runs agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .._arguments import regular_array
from .._read_only import ReadOnlyArrays
from ..errors import InvalidInputError, VerificationError
from ..layout.batch import BatchLayout
from . import _loss
from .autograd import Tensor
from .loss import _eligible, _real_logits, check_logits


class _Saved(NamedTuple):
    """What ``gradient`` reads again: the logits as read and the forward's selected rows."""

    logits: np.ndarray  # [cells, V], float32 or float64, a view of (or the copy of) the caller's logits
    shape: tuple[int, ...]  # [rows, T, V]
    rows: np.ndarray  # [N] intp, the flat cell of each supervised target
    targets: np.ndarray  # [N] int32, its gold class
    normalizers: np.ndarray  # [N, 2] float64: each row's maximum and log of its shifted sum


@dataclass(frozen=True, eq=False)
class OccurrenceLogprobs(ReadOnlyArrays):
    """Log-probabilities of a batch's supervised targets, per occurrence (natural log).

    With ``n`` occurrences and ``N`` supervised targets: ``ordinals`` (int64 ``[n]``) and
    ``example_ids`` (``n`` str) name each occurrence's example; ``sums`` (float64 ``[n]``)
    is ``sum log p(target)`` over its supervised targets (minus their NLL; 0.0 for an
    occurrence with none); ``counts`` (int64 ``[n]``) how many there are; ``values``
    (float64 ``[N]``) each target's ``log p``, occurrence ``k``'s being
    ``values[offsets[k]:offsets[k + 1]]`` (``offsets`` int64 ``[n + 1]``), in row-major
    cell order. Every array is read-only.
    """

    ordinals: np.ndarray
    example_ids: tuple[str, ...]
    sums: np.ndarray
    counts: np.ndarray
    values: np.ndarray
    offsets: np.ndarray
    _saved: _Saved = field(repr=False)
    _writable = ("_saved",)   # the caller's logits, which gradient reads again

    def __len__(self) -> int:
        return len(self.example_ids)

    def gradient(self, weights) -> np.ndarray:
        """``d(sum_k weights[k] * sums[k]) / d logits``, ``[rows, T, V]``.

        ``weights`` holds one finite real number per occurrence. The gradient has the
        precision the logits were read in (float32 or float64) and is exactly zero at
        every cell outside ``loss_mask``. It reads the logits again, so they must be
        unchanged since the forward. Extra memory: the gradient itself and 8 bytes per
        occurrence.
        """
        weights = _weights(weights, len(self))
        saved = self._saved
        dlogits = np.zeros_like(saved.logits)  # [cells, V]
        _loss.occurrence_logprob_backward(saved.logits, saved.rows, saved.targets, saved.normalizers,
                                          self.offsets, weights, dlogits)
        return dlogits.reshape(saved.shape)


def sequence_logprobs(logits, batch, *, binding=None) -> OccurrenceLogprobs:
    """The summed log-probability of each occurrence's supervised targets in ``batch``.

    ``logits`` is an array ``[rows, T, V]`` matching the batch's shape and its binding's
    vocabulary size (with ``binding``, the batch must carry exactly that binding). It is
    read in its own precision (float32 or float64 as given, float32 for float16, float64
    for integers; never widened to float64) with float64 accumulation, and only at
    ``loss_mask`` cells. An occurrence without supervised targets has count 0 and sum 0.0;
    a batch without any is not an error.

    Peak extra memory: at most 48 bytes per supervised target and 80 per occurrence (the
    batch's cached occurrence records included; plus the example ids), and no copy of the logits unless they are not a C-contiguous float32
    or float64 array (then one copy, in the precision they are read in). The result keeps
    the logits (or that copy) for ``gradient``, which adds one array of their size.

    Refused (``InvalidInputError``): a ``batch`` that is not a padded or packed batch;
    logits given as a tape ``Tensor``; logits of another shape; complex, bool,
    non-numeric or wider-than-float64 logits. A batch built under another ``binding``
    raises ``BindingError``; one whose occurrence records do not cover its supervised
    cells in row-major order (a corrupted batch: see ``batch.verify()``) raises
    ``VerificationError``.
    """
    if not isinstance(batch, BatchLayout):
        raise InvalidInputError(f"sequence_logprobs takes a padded or packed batch, not {type(batch).__name__}")
    if binding is not None:
        batch.ensure_binding(binding)
    if isinstance(logits, Tensor):
        raise InvalidInputError("sequence_logprobs reads logits as an array, not a tape Tensor: pass "
                                "tensor.value; gradient() gives the derivative with respect to it")
    check_logits(regular_array("logits", logits).shape, batch)
    array = _real_logits(logits)
    classes = array.shape[-1]
    _, rows, gold = _eligible(batch.targets, batch.loss_mask, classes, batch.shape, allow_none=True)
    offsets = _occurrence_offsets(batch, rows)
    flat = array.reshape(-1, classes)  # [cells, V], a view
    normalizers, losses = np.empty((rows.shape[0], 2)), np.empty(rows.shape[0])
    _loss.indexed_nll_forward(flat, rows, gold, normalizers, losses)
    values, sums = np.empty(rows.shape[0]), np.empty(offsets.shape[0] - 1)  # [N], [n]
    _loss.occurrence_logprob_sums(losses, offsets, values, sums)
    del losses
    records = batch.occurrence_records
    ordinals, counts = np.array(records["ordinal"], dtype=np.int64), np.diff(offsets)
    for output in (ordinals, sums, counts, values, offsets):
        output.flags.writeable = False
    return OccurrenceLogprobs(ordinals, batch.example_ids, sums, counts, values, offsets,
                            _Saved(flat, array.shape, rows, gold, normalizers))


def _occurrence_offsets(batch: BatchLayout, rows: np.ndarray) -> np.ndarray:
    """int64 ``[n + 1]``: occurrence ``k`` owns the supervised targets ``rows[offsets[k]:offsets[k + 1]]``.

    ``rows`` are the supervised flat cells in increasing order. Occurrences are sorted by
    row, then start, and do not overlap, so each one's targets form one run of ``rows``;
    the runs must follow one another and cover every target, or the batch is corrupt.
    """
    records = batch.occurrence_records
    width = batch.shape[1]
    first = records["row"] * width + records["start"]  # [n], flat cell of each occurrence's first column
    end = records["row"] * width + records["stop"]
    offsets = np.empty(records.shape[0] + 1, dtype=np.int64)
    offsets[:-1] = np.searchsorted(rows, first)
    offsets[-1] = rows.shape[0]
    ends = np.searchsorted(rows, end)
    if offsets[0] != 0 or not np.array_equal(ends, offsets[1:]):
        after = int(np.argmax(ends != offsets[1:])) if offsets[0] == 0 else -1
        raise VerificationError(
            f"the batch's {records.shape[0]} occurrence records do not cover its {rows.shape[0]} supervised "
            f"targets in row-major order ({'before the first occurrence' if after < 0 else f'after occurrence {after}'}"
            f"); batch.verify() names the broken invariant"
        )
    return offsets


def _weights(weights, count: int) -> np.ndarray:
    """``weights`` as contiguous float64 ``[count]``, finite."""
    array = np.asarray(weights)
    if array.dtype.kind not in "iuf" or (array.dtype.kind == "f" and array.dtype.itemsize > 8):
        raise InvalidInputError(f"weights must be real numbers no wider than float64, got dtype {array.dtype}")
    if array.shape != (count,):
        raise InvalidInputError(f"weights have shape {array.shape}; the batch has {count} occurrences, "
                                f"so they need shape ({count},)")
    array = np.ascontiguousarray(array, dtype=np.float64)
    finite = np.isfinite(array)
    if not finite.all():
        bad = int(np.argmin(finite))
        raise InvalidInputError(f"weight {bad} is {array[bad]}; every weight must be finite")
    return array
