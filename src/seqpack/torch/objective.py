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

from .._limits import is_int
from ..errors import InvalidInputError
from ..layout.batch import BatchLayout
from .tensors import IGNORE_INDEX, is_integer_tensor, shared_tensor


def _signed(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` in a signed dtype, so that ``-100`` compares by value: an unsigned tensor
    cannot hold -100 (every cell is a target), but ``uint8(156) == -100`` holds in torch.
    A uint64 value past int64 is an error."""
    if labels.is_signed():
        return labels
    signed = labels.to(torch.int64)
    if labels.dtype == torch.uint64 and bool((signed < 0).any()):
        raise InvalidInputError("the targets hold a uint64 value past int64, outside any vocabulary")
    return signed


def _targets(batch_or_targets) -> torch.Tensor:
    """Integer targets with ``IGNORE_INDEX`` at every cell that is not loss-eligible, in a
    signed dtype."""
    if isinstance(batch_or_targets, BatchLayout):
        batch = batch_or_targets
        return torch.where(shared_tensor(batch.loss_mask), shared_tensor(batch.targets), IGNORE_INDEX)
    if isinstance(batch_or_targets, dict):
        labels = batch_or_targets.get("shift_labels")
        if not is_integer_tensor(labels):
            found = labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise InvalidInputError(f"the dict's shift_labels must be an integer tensor, not {found}")
        return _signed(labels)
    if is_integer_tensor(batch_or_targets):
        return _signed(batch_or_targets)
    found = batch_or_targets.dtype if isinstance(batch_or_targets, torch.Tensor) else type(batch_or_targets).__name__
    raise InvalidInputError(
        f"expected a batch, its tensors() dict or integer targets with -100 where not eligible, not {found}"
    )


def loss_sum(logits: torch.Tensor, batch_or_targets) -> tuple[torch.Tensor, int]:
    """``(sum of -log p(target) over eligible cells, their count)``.

    ``logits`` ``[..., V]`` with leading dimensions those of the targets; bfloat16 and
    float16 logits are read in float32.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        found = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise InvalidInputError(f"logits must be a floating-point tensor, not {found}")
    targets = _targets(batch_or_targets)
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise InvalidInputError(
            f"logits have shape {tuple(logits.shape)}; expected {tuple(targets.shape)} + (vocabulary,)"
        )
    classes = logits.shape[-1]
    flat = targets.reshape(-1).to(logits.device)
    cells = torch.nonzero(flat != IGNORE_INDEX).squeeze(1)
    gold = flat.index_select(0, cells).long()
    if gold.numel() and (int(gold.min()) < 0 or int(gold.max()) >= classes):
        bad = int(torch.nonzero((gold < 0) | (gold >= classes))[0, 0])
        raise InvalidInputError(
            f"cell {int(cells[bad])} (row-major) has target {int(gold[bad])}, outside the "
            f"vocabulary [0, {classes})"
        )
    rows = logits.reshape(flat.numel(), classes).index_select(0, cells)
    if rows.dtype in (torch.bfloat16, torch.float16):
        rows = rows.float()
    return F.cross_entropy(rows, gold, reduction="sum"), int(cells.numel())


def _denominator(value) -> int:
    if is_integer_tensor(value) and value.numel() == 1:
        value = int(value.item())
    if not is_int(value):
        raise InvalidInputError(f"denominator must be an int (a target count), not {type(value).__name__}")
    if value < 1:
        raise InvalidInputError(f"denominator is {int(value)}: a step needs at least one eligible target")
    return int(value)


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
    denominator = _denominator(denominator)
    if count > denominator:
        raise InvalidInputError(
            f"denominator is {denominator} but this call alone has {count} eligible targets: "
            "the step's count must include them"
        )
    return total / denominator


def _count(item) -> int:
    """Eligible targets of a batch, a ``tensors()`` dict or targets; a plain count (an int,
    a numpy integer or a 0-d integer tensor such as Trainer's ``num_items_in_batch``) as is."""
    if isinstance(item, BatchLayout):
        return item.target_count
    if is_integer_tensor(item) and item.dim() == 0:
        item = int(item)
    if is_int(item):
        if item < 0:
            raise InvalidInputError(f"a target count must be non-negative, got {item}")
        return int(item)
    return int((_targets(item) != IGNORE_INDEX).sum())


def micro_batches(batches) -> Iterable:
    """``batches`` when it is an iterable of micro-batches; one micro-batch (a batch, a dict,
    a tensor) or something not iterable is an :class:`InvalidInputError`."""
    if isinstance(batches, (dict, BatchLayout, torch.Tensor)):
        raise InvalidInputError(
            f"batches is one micro-batch ({type(batches).__name__}); pass the list of the step's micro-batches"
        )
    if not isinstance(batches, Iterable):
        raise InvalidInputError(f"batches must be a list of the step's micro-batches, not {type(batches).__name__}")
    return batches


def step_target_count(batches: Iterable, group=None) -> int:
    """The eligible targets of one optimizer step, summed over every rank of ``group``.

    ``batches``: this rank's micro-batches of the step (batches, ``tensors()`` dicts,
    targets, or plain counts: ints, numpy integers or 0-d integer tensors). When ``torch.distributed`` is initialized the count is
    all-reduced over ``group`` (None: the default group, as in ``torch.distributed``), so
    every rank divides by the same global count.
    """
    return _summed_over_ranks(sum(_count(item) for item in micro_batches(batches)), group)


def _summed_over_ranks(count: int, group) -> int:
    """``count`` all-reduced over ``group`` when ``torch.distributed`` is initialized."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        backend = distributed.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        total = torch.tensor([count], dtype=torch.int64, device=device)
        distributed.all_reduce(total, op=distributed.ReduceOp.SUM, group=group)
        count = int(total.item())
    return count


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
        self.counted = sum(_count(item) for item in micro_batches(batches))  # this rank's
        self.denominator = _denominator(_summed_over_ranks(self.counted, group))
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
