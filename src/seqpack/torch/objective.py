"""The token-weighted objective: one denominator per optimizer step, across micro-batches and ranks.

The loss of a step is ``sum of -log p(target) over every eligible target of the step /
the number of those targets``: every target weighs the same, whichever micro-batch or
rank holds it. seqpack knows every batch's eligible-target count before the forward
pass, so each micro-batch's loss is its own sum divided by the step's count (all-reduced
over the ranks), and the accumulated gradients are exactly those of one big batch; a mean
of micro-batch means is not (the bug class transformers PR 34191 fixed). Only eligible
logit rows are read: excluded cells (NaN included) never enter the arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from ..errors import InvalidInputError
from .counts import (
    check_denominator,
    micro_batches,
    summed_over_ranks,
    target_count,
)
from .tensors import IGNORE_INDEX, eligible_targets


def loss_sum(logits: torch.Tensor, batch_or_targets) -> tuple[torch.Tensor, int]:
    """``(sum of -log p(target) over eligible cells, their count)``.

    ``logits`` ``[..., V]`` with leading dimensions those of the targets; bfloat16 and
    float16 logits are read in float32.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        found = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise InvalidInputError(f"logits must be a floating-point tensor, not {found}")
    targets = eligible_targets(batch_or_targets)
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise InvalidInputError(
            f"logits have shape {tuple(logits.shape)}; expected {tuple(targets.shape)} + (vocabulary,)"
        )
    classes = logits.shape[-1]
    flat = targets.reshape(-1).to(logits.device)
    cells = torch.nonzero(flat != IGNORE_INDEX).squeeze(1)
    gold = flat.index_select(0, cells).long()
    if gold.device.type == "cpu":  # elsewhere cross_entropy's own device-side check, without a host sync
        outside = torch.nonzero((gold < 0) | (gold >= classes))
        if outside.numel():
            bad = int(outside[0, 0])
            raise InvalidInputError(f"cell {int(cells[bad])} (row-major) has target {int(gold[bad])}, outside the "
                                    f"vocabulary [0, {classes})")
    rows = logits.reshape(flat.numel(), classes).index_select(0, cells)
    if rows.dtype in (torch.bfloat16, torch.float16):
        rows = rows.float()
    return F.cross_entropy(rows, gold, reduction="sum"), int(cells.numel())


def token_weighted_loss(logits: torch.Tensor, batch_or_targets, *, denominator=None) -> torch.Tensor:
    """Sum of ``-log p(target)`` over eligible cells, divided once by ``denominator``.

    ``batch_or_targets``: a padded or packed batch, its :func:`~seqpack.torch.tensors`
    dict (its ``shift_labels``), or integer targets with ``-100`` at excluded cells.
    ``denominator`` (None: this call's eligible count, which must be positive) is the
    step's count when the step spans micro-batches or ranks (:func:`step_target_count`),
    so at least this call's count; a micro-batch without eligible targets then
    contributes a zero loss with a graph.
    """
    total, count = loss_sum(logits, batch_or_targets)
    if denominator is None:
        if count == 0:
            raise InvalidInputError("zero loss-eligible targets: the token-weighted mean is undefined")
        return total / count
    denominator = check_denominator(denominator)
    if count > denominator:
        raise InvalidInputError(
            f"denominator is {denominator} but this call alone has {count} eligible targets: "
            "the step's count must include them"
        )
    return total / denominator


class LossAccumulator:
    """The token-weighted loss of one optimizer step over micro-batches (and ranks).

    ``LossAccumulator(batches, group=None, ddp=False)`` counts the step's eligible
    targets once (:func:`step_target_count`: this rank's ``batches``, all-reduced over
    ``group``); calling it on each micro-batch's ``(logits, batch_or_targets)`` returns
    that micro-batch's loss sum divided by the step's count, ready for ``backward()``:
    the gradients accumulated over the step are those of one token-weighted batch over
    the union (this rank's micro-batches holding more eligible targets than it counted
    are an error).
    ``ddp=True`` when the gradients are then averaged over the group's ranks
    (``DistributedDataParallel`` does): each loss is multiplied by the group's size so
    the average is still the union's gradient. ``loss_sum`` and ``count`` are what this
    rank has seen; ``mean`` is its share of the step's loss (all-reduce-sum it over the
    ranks for the step's mean; on one rank it is the mean).
    """

    def __init__(self, batches: Iterable, *, group=None, ddp: bool = False):
        self.counted = sum(target_count(item) for item in micro_batches(batches))  # this rank's
        self.denominator = check_denominator(summed_over_ranks(self.counted, group))
        if ddp and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise InvalidInputError("ddp=True needs an initialized torch.distributed process group")
        self.factor = torch.distributed.get_world_size(group) if ddp else 1
        self.loss_sum = 0.0
        self.count = 0

    def __call__(self, logits: torch.Tensor, batch_or_targets) -> torch.Tensor:
        total, count = loss_sum(logits, batch_or_targets)
        if self.count + count > self.counted:
            counted = (f"the step was counted as {self.counted} eligible targets" if self.counted == self.denominator
                       else f"this rank's micro-batches of the step were counted as {self.counted} eligible "
                            f"targets (of {self.denominator} over the ranks)")
            raise InvalidInputError(
                f"{counted} but its micro-batches so far hold {self.count + count}: give LossAccumulator "
                f"every micro-batch of the step"
            )
        self.loss_sum += float(total.detach())
        self.count += count
        loss = total / self.denominator
        return loss * self.factor if self.factor != 1 else loss

    @property
    def mean(self) -> float:
        return self.loss_sum / self.denominator
