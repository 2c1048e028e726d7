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

from .counts import (
    call_denominator,
    check_denominator,
    check_within_count,
    divided,
    gradient_factor,
    micro_batches,
    summed_over_ranks,
    target_count,
)
from .tensors import eligible_logits


def loss_sum(logits: torch.Tensor, batch_or_targets) -> tuple[torch.Tensor, int]:
    """``(sum of -log p(target) over eligible cells, their count)``.

    ``logits`` ``[..., V]`` with leading dimensions those of the targets; logits narrower
    than float32 (bfloat16, float16, float8) are read in float32.
    """
    rows, gold = eligible_logits(logits, batch_or_targets)
    if rows.element_size() < 4:
        rows = rows.float()
    return F.cross_entropy(rows, gold, reduction="sum"), int(gold.numel())


def token_weighted_loss(logits: torch.Tensor, batch_or_targets, *, denominator=None) -> torch.Tensor:
    """Sum of ``-log p(target)`` over eligible cells, divided once by ``denominator``.

    ``batch_or_targets``: a padded or packed batch, its :func:`~seqpack.torch.tensors`
    dict (its ``shift_labels``), or integer targets with ``-100`` at excluded cells.
    ``denominator`` (None: this call's eligible count, which must be positive) is the
    step's count when the step spans micro-batches or ranks (:func:`step_target_count`, or
    Trainer's ``num_items_in_batch``: an int or a one-element tensor of a whole number),
    so at least this call's count; a micro-batch without eligible targets then
    contributes a zero loss with a graph.
    """
    total, count = loss_sum(logits, batch_or_targets)
    return divided(total, call_denominator(denominator, count))


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
        self.factor = gradient_factor(ddp, group)
        self.loss_sum = 0.0
        self.count = 0

    def __call__(self, logits: torch.Tensor, batch_or_targets) -> torch.Tensor:
        total, count = loss_sum(logits, batch_or_targets)
        check_within_count(self.count + count, self.counted, self.denominator)
        self.loss_sum += float(total.detach())
        self.count += count
        loss = divided(total, self.denominator)
        return loss * self.factor if self.factor != 1 else loss

    @property
    def mean(self) -> float:
        return self.loss_sum / self.denominator
