"""The token-weighted masked loss, and the chapters' constructed loss probe.

The loss is ``-sum(m * log p(y)) / sum(m)`` over loss-eligible cells ``m`` (natural log):
every real target weighs the same, whatever its row or document. Eligible cells are
selected first and only their logit rows are read, so excluded cells (padding, or
anything in them, NaN included) never enter the arithmetic and get exactly zero
gradient. Zero eligible targets is an error: the mean has no denominator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidInputError
from . import _loss
from .autograd import Tensor, as_tensor, record


@dataclass
class MaskedLoss:
    """A token-weighted mean loss: ``mean = loss_sum / count``.

    ``target_losses`` holds ``-log p(y)`` of each eligible cell and ``cells`` its flat
    cell index (row-major order). ``backward()`` returns a new dict from each name in
    ``parameters`` to the gradient of ``mean`` with respect to it.
    """

    mean: float
    loss_sum: float
    count: int
    target_losses: np.ndarray
    cells: np.ndarray
    tensor: Tensor = field(repr=False)
    parameters: dict[str, Tensor] = field(repr=False)

    def backward(self) -> dict[str, np.ndarray]:
        self.tensor.backward()
        return {
            name: np.zeros_like(leaf.value) if leaf.grad is None else leaf.grad.copy()
            for name, leaf in self.parameters.items()
        }


def masked_nll(logits: Tensor, targets: np.ndarray, loss_mask: np.ndarray) -> MaskedLoss:
    """Mean NLL of ``logits`` ``[rows, T, V]`` over cells where ``loss_mask`` is true.

    ``targets`` ``[rows, T]`` is read only at eligible cells, where it must lie in
    ``[0, V)``. The returned loss has ``parameters = {"logits": logits}``.
    """
    logits = as_tensor(logits)
    classes = logits.shape[-1]
    cells = np.flatnonzero(np.asarray(loss_mask, dtype=bool))
    if cells.size == 0:
        raise InvalidInputError("the batch has zero loss-eligible targets; the mean loss is undefined")
    gold = np.asarray(targets).reshape(-1)[cells]
    outside = (gold < 0) | (gold >= classes)
    if outside.any():
        bad = int(np.argmax(outside))
        raise InvalidInputError(
            f"eligible target {int(gold[bad])} at flat cell {int(cells[bad])} is not below "
            f"the vocabulary size {classes}"
        )
    rows = np.ascontiguousarray(cells, dtype=np.intp)
    gold = np.ascontiguousarray(gold, dtype=np.int32)
    flat = np.ascontiguousarray(logits.value).reshape(-1, classes)  # [cells, V]
    logsumexp = np.empty(rows.shape[0])
    losses = np.empty(rows.shape[0])
    total = _loss.indexed_nll_forward(flat, rows, gold, logsumexp, losses)
    count = int(rows.shape[0])

    def backward(grad):
        dflat = np.zeros_like(flat)
        _loss.indexed_nll_backward(flat, rows, gold, logsumexp, float(grad) / count, dflat)
        logits.accumulate(dflat.reshape(logits.shape))

    mean = record(np.array(total / count), (logits,), backward)
    return MaskedLoss(
        mean=float(total / count),
        loss_sum=float(total),
        count=count,
        target_losses=losses,
        cells=cells,
        tensor=mean,
        parameters={"logits": logits},
    )


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
    ``{"logits": d mean / d logits}``.
    """
    if binding is not None:
        batch.ensure_binding(binding)
    if not isinstance(logits, Tensor):
        logits = Tensor(logits, requires_grad=True)
    check_logits(logits.shape, batch)
    return masked_nll(logits, batch.targets, batch.loss_mask)
