"""A batch as PyTorch tensors, sharing the batch's memory wherever the dtype allows.

The stored fields keep their dtypes and their memory (the batch's arrays are read-only;
the tensors must not be written in place). Two derived tensors are what PyTorch layers
take: ``input_ids`` (int64, padding replaced by ``PAD_INPUT_ID`` so an embedding lookup
never sees ``PAD_CELL``) and ``shift_labels`` (int64, each supervised cell's target,
``IGNORE_INDEX`` elsewhere: ``torch.nn.functional.cross_entropy``'s default
``ignore_index`` and transformers' already-shifted labels).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping

import numpy as np
import torch

from .._arguments import is_int
from ..data.supervision import IGNORE_INDEX
from ..errors import InvalidInputError
from ..layout.batch import BatchLayout
from ..layout.fields import CELL_FIELDS, FLAG_FIELDS

#: The ID padding cells get in ``input_ids``: always inside the vocabulary, never attended.
PAD_INPUT_ID = 0
#: The fields ``tensors`` shares with the batch, then the derived ones.
SHARED_FIELDS = (*CELL_FIELDS, *FLAG_FIELDS, "valid_lengths", "segment_starts")
#: Each key of a ``tensors`` dict and its dtype (all ``[rows, T]`` but ``valid_lengths``, ``[rows]``).
TENSOR_DTYPES = {**dict.fromkeys((*CELL_FIELDS, "segment_starts"), torch.int32),
                 **dict.fromkeys(FLAG_FIELDS, torch.bool),
                 "valid_lengths": torch.int64, "input_ids": torch.int64, "shift_labels": torch.int64}


def is_integer_tensor(value) -> bool:
    """Whether ``value`` is a tensor of an integer dtype (not bool, floating or complex)."""
    return isinstance(value, torch.Tensor) and not (
        value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)


#: Whether PyTorch has given its warning for read-only arrays, which it gives once a
#: process; the lock lets one thread at a time silence it.
_read_only_warned = False
_silencing = threading.Lock()


def shared_tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``array``'s memory, read-only arrays included, without a warning.

    PyTorch has no read-only tensors, so it warns on read-only arrays (once a process);
    the caller owns the promise not to write through the tensor. Only that first warning
    is silenced, under a lock: ``warnings.catch_warnings`` restores the process's filters
    as it found them, so threads inside it at once could leave its filter installed.
    """
    global _read_only_warned
    if array.flags.writeable or _read_only_warned:
        return torch.from_numpy(array)
    with _silencing:
        if not _read_only_warned:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                tensor = torch.from_numpy(array)
            _read_only_warned = True
            return tensor
    return torch.from_numpy(array)


def moved(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` on ``device`` (None: where it is): a ``torch.device``, a string such as
    ``"cpu"`` or an accelerator index. Any other value, or a device this PyTorch cannot
    reach, is an :class:`InvalidInputError`."""
    if device is None:
        return tensor
    if is_int(device):
        device = int(device)
    elif not isinstance(device, (str, torch.device)):
        raise InvalidInputError(
            f"device must be a torch.device, a string such as 'cpu' or an index, not {type(device).__name__}"
        )
    try:
        return tensor.to(torch.device(device))
    except (RuntimeError, AssertionError) as error:  # an unknown name, or a backend this build lacks
        raise InvalidInputError(f"device {str(device)!r} is not available: {error}") from None


def check_batch(batch) -> BatchLayout:
    if not isinstance(batch, BatchLayout):
        raise InvalidInputError(f"expected a padded or packed batch, not {type(batch).__name__}")
    return batch


def tensors(batch, device=None) -> dict[str, torch.Tensor]:
    """The batch's fields as tensors, plus ``input_ids`` and ``shift_labels``.

    Shared with the batch (no copy): ``inputs``, ``targets``, ``positions``,
    ``segments``, ``segment_starts`` (int32 ``[rows, T]``), ``token_valid``,
    ``target_valid``, ``loss_mask`` (bool) and ``valid_lengths`` (int64 ``[rows]``).
    New: ``input_ids`` (int64, padding -> ``PAD_INPUT_ID``) and ``shift_labels`` (int64,
    ``IGNORE_INDEX`` outside ``loss_mask``). ``device`` (None: the CPU) moves every
    tensor there, which copies to any other device; on the CPU the shared fields stay
    shared.
    """
    batch = check_batch(batch)
    result = {name: shared_tensor(getattr(batch, name)) for name in SHARED_FIELDS}
    result["input_ids"] = torch.from_numpy(
        np.where(batch.token_valid, batch.inputs, np.int32(PAD_INPUT_ID)).astype(np.int64)
    )
    result["shift_labels"] = torch.from_numpy(
        np.where(batch.loss_mask, batch.targets, np.int32(IGNORE_INDEX)).astype(np.int64)
    )
    if device is not None:
        result = {name: moved(tensor, device) for name, tensor in result.items()}
    return result


def batch_tensors(batch) -> dict[str, torch.Tensor]:
    """:func:`tensors` of a batch, or a dict :func:`tensors` made (an item of
    ``seqpack.torch.BatchDataset`` or ``IterableBatchDataset``) as it is, once its keys,
    dtypes, shapes and device (the CPU) are checked: what takes either reads only these."""
    if not isinstance(batch, Mapping):
        return tensors(check_batch(batch))
    missing, extra = TENSOR_DTYPES.keys() - batch.keys(), batch.keys() - TENSOR_DTYPES.keys()
    if missing or extra:
        problems = [f"lacks {', '.join(map(repr, sorted(missing)))}"] if missing else []
        problems += [f"has {', '.join(sorted(map(repr, extra)))}, which tensors() does not make"] if extra else []
        raise InvalidInputError(
            "expected a padded or packed batch or its tensors() dict (an item of seqpack.torch.BatchDataset or "
            f"IterableBatchDataset); this dict {' and '.join(problems)}"
        )
    inputs = batch["inputs"]
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
        raise InvalidInputError(f"the tensors() dict's inputs must be a [rows, T] tensor, not {_described(inputs)}")
    for name, dtype in TENSOR_DTYPES.items():
        value, shape = batch[name], inputs.shape[:1] if name == "valid_lengths" else inputs.shape
        if not (isinstance(value, torch.Tensor) and value.dtype == dtype and value.shape == shape
                and value.device.type == "cpu"):
            raise InvalidInputError(f"the tensors() dict's {name} must be a {dtype} tensor of shape {tuple(shape)} "
                                    f"on the CPU, as tensors() makes it, not {_described(value)}")
    return batch


def _described(value) -> str:
    """A tensor's dtype, shape and device, or any other value's type."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} on {value.device}"
    return type(value).__name__


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


def eligible_logits(logits: torch.Tensor, batch_or_targets) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logit rows, int64 targets)`` of the eligible cells, in row-major order: only
    those rows of ``logits`` ``[..., V]`` are read. A target outside the vocabulary is
    an error naming its cell (on the CPU; elsewhere ``cross_entropy``'s own device-side
    check, so that no host sync is needed)."""
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
    if gold.device.type == "cpu":
        outside = torch.nonzero((gold < 0) | (gold >= classes))
        if outside.numel():
            bad = int(outside[0, 0])
            raise InvalidInputError(f"cell {int(cells[bad])} (row-major) has target {int(gold[bad])}, outside the "
                                    f"vocabulary [0, {classes})")
    return logits.reshape(flat.numel(), classes).index_select(0, cells), gold


def eligible_targets(batch_or_targets) -> torch.Tensor:
    """Integer targets with ``IGNORE_INDEX`` at every cell that is not loss-eligible, in a
    signed dtype."""
    if isinstance(batch_or_targets, BatchLayout):
        batch = batch_or_targets
        return torch.where(shared_tensor(batch.loss_mask), shared_tensor(batch.targets), IGNORE_INDEX)
    if isinstance(batch_or_targets, Mapping):
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
