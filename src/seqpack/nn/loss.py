"""The token-weighted masked loss.

The loss is ``-sum(m * log p(y)) / sum(m)`` over loss-eligible cells ``m`` (natural log):
every real target weighs the same, whatever its row or document. Eligible cells are
selected first and only their logit rows are read, so excluded cells (padding, or
anything in them, NaN included) never enter the arithmetic and get exactly zero
gradient. Zero eligible targets is an error: the mean has no denominator.

Logits given as an array are read in their own precision (float32 or float64, never
copied to float64; sums accumulate in float64) and their gradient has their dtype, so
the loss and its backward hold about twice the logits' bytes at most. Logits given as
a :class:`~seqpack.nn.autograd.Tensor` go on the float64 tape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .._arguments import INT32_MAX, regular_array
from ..errors import InvalidInputError
from ..layout.batch import BatchLayout
from . import _loss
from .autograd import Tensor, record


@dataclass
class MaskedLoss:
    """A token-weighted mean loss: ``mean = loss_sum / count``.

    ``target_losses`` holds ``-log p(y)`` of each eligible cell and ``cells`` its flat
    cell index (row-major order). ``backward()`` returns a new dict from each
    parameter's name to the gradient of ``mean`` with respect to it (``"logits"``
    unless a model named its parameters); ``tensor`` is the mean on the tape, when the
    logits were a tensor.
    """

    mean: float
    loss_sum: float
    count: int
    target_losses: np.ndarray
    cells: np.ndarray
    gradients: Callable[[], dict[str, np.ndarray]] = field(repr=False)
    tensor: Tensor | None = field(default=None, repr=False)

    def backward(self) -> dict[str, np.ndarray]:
        return self.gradients()


def _eligible(targets, loss_mask, classes: int, cells_shape, *,
              allow_none: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat eligible cells, their row indices (intp) and their gold classes (int32).

    ``loss_mask`` (bool, or integers 0 and 1) and ``targets`` (integers) must have the
    logits' cell shape ``cells_shape``. No eligible cell at all is an error (the mean has
    no denominator) unless ``allow_none``."""
    mask = regular_array("loss_mask", loss_mask)
    targets = regular_array("targets", targets)
    for name, array in (("loss_mask", mask), ("targets", targets)):
        if array.shape != tuple(cells_shape):
            raise InvalidInputError(
                f"{name} has shape {array.shape}; the logits have cells {tuple(cells_shape)}"
            )
    if mask.dtype.kind in "iu" and mask.size and (mask.min() < 0 or mask.max() > 1):
        raise InvalidInputError(f"loss_mask holds {int(mask.max()) if mask.max() > 1 else int(mask.min())}; "
                                f"a mask holds only 0 and 1")
    if mask.dtype.kind not in "biu":
        raise InvalidInputError(f"loss_mask must be bool, got dtype {mask.dtype}")
    if targets.dtype.kind not in "iu":
        raise InvalidInputError(f"targets must be integers, got dtype {targets.dtype}")
    if classes > INT32_MAX:  # (the kernels read targets as int32)
        raise InvalidInputError(f"the logits have {classes} classes; the loss takes at most {INT32_MAX}")
    cells = np.flatnonzero(mask)
    if cells.size == 0 and not allow_none:
        raise InvalidInputError("the batch has zero loss-eligible targets; the mean loss is undefined")
    gold = targets.reshape(-1)[cells]
    outside = (gold < 0) | (gold >= classes)
    if outside.any():
        bad = int(np.argmax(outside))
        raise InvalidInputError(
            f"eligible target {int(gold[bad])} at flat cell {int(cells[bad])} is outside "
            f"[0, {classes}): the vocabulary size is {classes}"
        )
    return cells, np.ascontiguousarray(cells, dtype=np.intp), np.ascontiguousarray(gold, dtype=np.int32)


def _real_logits(logits) -> np.ndarray:
    """Logits as a C-contiguous float32 or float64 array (float16 widened to float32, integers
    to float64); complex, bool, non-numeric and wider-than-float64 logits are rejected."""
    array = regular_array("logits", logits)
    if array.dtype.kind == "f" and array.dtype.itemsize <= 8:  # either byte order
        dtype = np.float64 if array.dtype.itemsize == 8 else np.float32
    elif array.dtype.kind in "iu":
        dtype = np.float64
    elif array.dtype.kind == "f":
        raise InvalidInputError(f"logits wider than float64 would lose precision silently, got dtype {array.dtype}")
    else:
        raise InvalidInputError(f"logits must be real numbers, got dtype {array.dtype}")
    if array.ndim < 1 or array.shape[-1] < 1:
        raise InvalidInputError(f"logits must end in a vocabulary axis, got shape {array.shape}")
    return np.ascontiguousarray(array, dtype=dtype)


def masked_nll(logits, targets: np.ndarray, loss_mask: np.ndarray,
               parameters: dict[str, Tensor] | None = None) -> MaskedLoss:
    """Mean NLL of ``logits`` ``[..., V]`` over cells where ``loss_mask`` ``[...]`` is true.

    ``targets`` is read only at eligible cells, where it must lie in ``[0, V)``.
    ``logits`` is an array (computed in its own precision) or a tape ``Tensor``, whose
    loss's ``backward()`` gives ``parameters`` (default ``{"logits": logits}``).
    ``backward()`` reads the logits again (no copy is kept): they must be unchanged
    since this call.
    """
    if isinstance(logits, Tensor):
        return _masked_nll_on_tape(logits, targets, loss_mask, parameters or {"logits": logits})
    array = _real_logits(logits)
    classes = array.shape[-1]
    cells, rows, gold = _eligible(targets, loss_mask, classes, array.shape[:-1])
    flat = array.reshape(-1, classes)  # [cells, V], a view
    normalizers, losses = np.empty((rows.shape[0], 2)), np.empty(rows.shape[0])
    total = _loss.indexed_nll_forward(flat, rows, gold, normalizers, losses)
    count = int(rows.shape[0])

    def gradients() -> dict[str, np.ndarray]:
        dflat = np.zeros_like(flat)
        _loss.indexed_nll_backward(flat, rows, gold, normalizers, 1.0 / count, dflat)
        return {"logits": dflat.reshape(array.shape)}

    return MaskedLoss(float(total / count), float(total), count, losses, cells, gradients)


def _masked_nll_on_tape(logits: Tensor, targets, loss_mask, parameters) -> MaskedLoss:
    classes = logits.shape[-1]
    cells, rows, gold = _eligible(targets, loss_mask, classes, logits.shape[:-1])
    flat = np.ascontiguousarray(logits.value).reshape(-1, classes)  # [cells, V]
    normalizers, losses = np.empty((rows.shape[0], 2)), np.empty(rows.shape[0])
    total = _loss.indexed_nll_forward(flat, rows, gold, normalizers, losses)
    count = int(rows.shape[0])

    def backward(grad):
        dflat = np.zeros_like(flat)
        _loss.indexed_nll_backward(flat, rows, gold, normalizers, float(grad) / count, dflat)
        logits.accumulate(dflat.reshape(logits.shape))

    mean = record(np.array(total / count), (logits,), backward)

    def gradients() -> dict[str, np.ndarray]:
        idle = next((name for name, leaf in parameters.items() if not leaf.requires_grad), None)
        if idle is not None:  # (its gradient would read as zeros)
            raise InvalidInputError(f"parameter {idle!r} does not require a gradient: make it Tensor(value, requires_grad=True)")
        mean.backward()
        return {name: np.zeros_like(leaf.value) if leaf.grad is None else leaf.grad.copy()
                for name, leaf in parameters.items()}

    return MaskedLoss(float(total / count), float(total), count, losses, cells, gradients, mean)


def check_logits(logits_shape: tuple[int, ...], batch) -> int:
    """Return the vocabulary size after checking logits are ``[rows, T, V]`` for ``batch``."""
    classes = batch.binding.vocabulary_size
    expected = tuple(batch.shape) + (classes,)
    if tuple(logits_shape) != expected:
        raise InvalidInputError(
            f"logits have shape {tuple(logits_shape)}; the batch needs {expected} "
            f"(rows, columns, vocabulary size {classes})"
        )
    return classes


def masked_loss(logits, batch, *, binding=None) -> MaskedLoss:
    """The masked loss of ``logits`` (array or Tensor, ``[rows, T, V]``) on ``batch``.

    The logits must match the batch's shape and its binding's vocabulary size; with
    ``binding`` the batch must also carry exactly that binding. ``backward()`` returns
    ``{"logits": d mean / d logits}``; for an array, in the precision the logits are read
    in: float32 or float64 as given, float32 for float16, float64 for integers. It reads
    the logits again, so they must be unchanged since this call.
    """
    if not isinstance(batch, BatchLayout):
        raise InvalidInputError(f"masked_loss takes a padded or packed batch, not {type(batch).__name__}")
    if binding is not None:
        batch.ensure_binding(binding)
    check_logits(logits.shape if isinstance(logits, Tensor) else regular_array("logits", logits).shape, batch)
    return masked_nll(logits, batch.targets, batch.loss_mask)
