"""Eligible-target counts of an optimizer step: per micro-batch, summed over the step's
micro-batches and all-reduced over the ranks, so that every rank divides its loss sums by
the same count (see :mod:`seqpack.torch.objective`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .._arguments import INT64_MAX, check_bool, is_int, shown
from ..errors import InvalidInputError
from ..layout.batch import BatchLayout
from .tensors import IGNORE_INDEX, eligible_targets, is_integer_tensor


def _counted(name: str, value: torch.Tensor) -> int:
    """A count held in a one-element integer or floating tensor, as an int. Trainer's
    ``num_items_in_batch`` is a float tensor in transformers 5: the count divided by the
    tensor-, context- and sequence-parallel sizes, so a fraction is refused by name."""
    number = value.item()
    if isinstance(number, float) and not number.is_integer():
        raise InvalidInputError(f"{name} is {number}, not a whole number of targets (Trainer divides its "
                                f"num_items_in_batch by the tensor-, context- and sequence-parallel sizes)")
    return int(number)


def _is_count_tensor(value) -> bool:
    return is_integer_tensor(value) or (isinstance(value, torch.Tensor) and value.is_floating_point())


def check_denominator(value) -> int:
    if _is_count_tensor(value) and value.numel() == 1:
        value = _counted("denominator", value)
    if not is_int(value):
        raise InvalidInputError(f"denominator must be an int (a target count), not {type(value).__name__}")
    if value < 1:
        raise InvalidInputError(f"denominator is {shown(int(value))}: a step needs at least one eligible target")
    return int(value)


def divided(total: torch.Tensor, denominator: int) -> torch.Tensor:
    """``total / denominator``: a count past int64, which torch does not take as an int, as
    the float it rounds to (as torch rounds a smaller one)."""
    return total / (denominator if denominator <= INT64_MAX else float(denominator))


def call_denominator(denominator, count: int) -> int:
    """The divisor of one loss call of ``count`` eligible targets: ``count`` itself (None),
    or the step's ``denominator``, which must hold at least this call's targets."""
    if denominator is None:
        if count == 0:
            raise InvalidInputError("zero loss-eligible targets: the token-weighted mean is undefined")
        return count
    denominator = check_denominator(denominator)
    if count > denominator:
        raise InvalidInputError(
            f"denominator is {denominator} but this call alone has {count} eligible targets: "
            "the step's count must include them"
        )
    return denominator


def check_within_count(seen: int, counted: int, denominator: int) -> None:
    """A step's micro-batches so far hold ``seen`` eligible targets: no more than this rank
    ``counted`` (``denominator`` over every rank)."""
    if seen > counted:
        counted_as = (f"the step was counted as {counted} eligible targets" if counted == denominator
                      else f"this rank's micro-batches of the step were counted as {counted} eligible "
                           f"targets (of {denominator} over the ranks)")
        raise InvalidInputError(
            f"{counted_as} but its micro-batches so far hold {seen}: give LossAccumulator "
            f"every micro-batch of the step"
        )


def gradient_factor(ddp: bool, group) -> int:
    """What each loss is multiplied by so that DDP's average over ranks is the union's gradient."""
    if not check_bool("ddp", ddp):
        return 1
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise InvalidInputError("ddp=True needs an initialized torch.distributed process group")
    return torch.distributed.get_world_size(group)


def target_count(item) -> int:
    """Eligible targets of a batch, a ``tensors()`` dict or targets; a plain count (an int,
    a numpy integer or a 0-d integer or whole floating tensor such as Trainer's
    ``num_items_in_batch``) as is."""
    if isinstance(item, BatchLayout):
        return item.target_count
    if _is_count_tensor(item) and item.dim() == 0:
        item = _counted("a target count", item)
    if is_int(item):
        if item < 0:
            raise InvalidInputError(f"a target count must be non-negative, got {item}")
        return int(item)
    return int((eligible_targets(item) != IGNORE_INDEX).sum())


def micro_batches(batches) -> Iterable:
    """``batches`` when it is an iterable of micro-batches; one micro-batch (a batch, a dict,
    a tensor) or something not iterable is an :class:`InvalidInputError`."""
    if isinstance(batches, (Mapping, BatchLayout, torch.Tensor)):
        raise InvalidInputError(
            f"batches is one micro-batch ({type(batches).__name__}); pass the list of the step's micro-batches"
        )
    if not isinstance(batches, Iterable):
        raise InvalidInputError(f"batches must be a list of the step's micro-batches, not {type(batches).__name__}")
    return batches


def step_target_count(batches: Iterable, group=None) -> int:
    """The eligible targets of one optimizer step, summed over every rank of ``group``.

    ``batches``: this rank's micro-batches of the step (batches, ``tensors()`` dicts,
    targets, or plain counts: ints, numpy integers or 0-d tensors of a whole number). When
    ``torch.distributed`` is initialized the count is
    all-reduced over ``group`` (None: the default group, as in ``torch.distributed``), so
    every rank divides by the same global count.
    """
    return summed_over_ranks(sum(target_count(item) for item in micro_batches(batches)), group)


def summed_over_ranks(count: int, group) -> int:
    """``count`` all-reduced over ``group`` when ``torch.distributed`` is initialized. The
    sum is exact: the counts travel as int64 halves of 32 bits, whose sums cannot wrap (a
    sum of int64 counts past 2**63 - 1 wrapped to a negative count); a rank's count of
    2**63 or more is an :class:`InvalidInputError`."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        if count >= 2**63:
            raise InvalidInputError(f"this rank's eligible-target count {count} is past 2**63 - 1, the most "
                                    f"torch.distributed can sum")
        backend = distributed.get_backend(group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        halves = torch.tensor([count >> 32, count & 0xFFFF_FFFF], dtype=torch.int64, device=device)
        distributed.all_reduce(halves, op=distributed.ReduceOp.SUM, group=group)
        high, low = halves.tolist()
        count = (high << 32) + low
    return count
