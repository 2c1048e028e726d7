"""A seqpack batch in the keys, dtypes and values transformers models and Trainer take.

Two shapes:

* :func:`flat` is exactly what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
  return_seq_idx=True)`` returns for the batch's examples in row-major order: one
  ``[1, N]`` row of every example's whole token range, unshifted ``labels`` (the model
  shifts them) with -100 at each example's first token.
* :func:`rows` keeps the batch's ``[rows, T]`` cells, one prediction per cell:
  ``shift_labels`` holds each cell's target. It works with sdpa, eager, flex and
  seqpack attention alike (no ``attention_mask``; padding is its own segment, which
  seqpack attention skips through ``valid_lengths``).

transformers ignores packing when a cache is on (``config.use_cache`` defaults to True):
:func:`rows` therefore carries ``use_cache=False`` for the model's forward, and seqpack
attention raises rather than run with a cache. :func:`flat` must equal transformers'
collator, so it cannot: set ``model.config.use_cache = False`` (Trainer does, from
``TrainingArguments.use_cache``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..data.binding import BatchBinding, Partition
from ..data.table import ExampleTable
from ..errors import CapacityError, InvalidInputError
from ..layout.exports import cumulative_lengths
from ..packing.config import PackConfig
from ..packing.planning import pack
from ..torch.attention import int_array
from ..torch.counts import micro_batches, step_target_count
from ..torch.tensors import IGNORE_INDEX, check_batch, tensors


def _row(values: np.ndarray, dtype) -> torch.Tensor:
    """A ``[1, N]`` tensor of ``values`` in ``dtype``."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=dtype)[None, :])


def flat(batch) -> dict:
    """The batch's examples flattened as ``DataCollatorWithFlattening`` flattens them.

    Keys, dtypes and values of ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
    return_seq_idx=True)`` called on ``[{"input_ids": tokens}, ...]`` with each
    example's token range (its inputs and its last target) in row-major order of the
    batch: ``input_ids``, ``labels``, ``position_ids`` (int64 ``[1, N]``), ``seq_idx``
    (int32 ``[1, N]``), ``cu_seq_lens_q``/``_k`` (int32 ``[examples + 1]``),
    ``max_length_q``/``_k`` (Python ints). A target the batch does not supervise
    (``loss_mask`` False) is -100 in ``labels``.
    """
    batch = check_batch(batch)
    valid = batch.token_valid.ravel()
    inputs = batch.inputs.ravel()[valid].astype(np.int64)
    targets = batch.targets.ravel()[valid].astype(np.int64)
    supervised = np.where(batch.loss_mask.ravel()[valid], targets, IGNORE_INDEX)
    positions = batch.positions.ravel()[valid].astype(np.int64)
    starts = np.flatnonzero(positions == 0)
    if starts.size == 0:
        raise InvalidInputError("the batch holds no example: nothing to flatten")
    ends = np.append(starts[1:], inputs.size)
    lengths = ends - starts + 1                       # an example's tokens: its cells and its last target
    cu = cumulative_lengths(lengths)
    return {
        "input_ids": _row(np.insert(inputs, ends, targets[ends - 1]), np.int64),
        "labels": _row(np.insert(supervised, starts, IGNORE_INDEX), np.int64),
        "position_ids": _row(np.insert(positions, ends, positions[ends - 1] + 1), np.int64),
        "seq_idx": _row(np.repeat(np.arange(lengths.size), lengths), np.int32),
        "cu_seq_lens_q": torch.from_numpy(cu),
        "cu_seq_lens_k": torch.from_numpy(cu.copy()),
        "max_length_q": int(lengths.max()),
        "max_length_k": int(lengths.max()),
    }


def rows(batch) -> dict:
    """The batch's ``[rows, T]`` cells for a transformers causal-LM forward.

    ``input_ids`` (int64, padding 0), ``position_ids`` (int64 local positions; each
    row's padding suffix counts from 0 as a segment of its own, so no attention
    implementation lets a valid query see it), ``shift_labels`` (int64 targets, -100
    where not loss-eligible: what ``ForCausalLMLoss`` and Trainer's item count read),
    ``labels`` (the same targets one column to the right, -100 in column 0: the model
    computes a loss only when ``labels`` is given, then reads ``shift_labels``),
    ``valid_lengths`` (int64 ``[rows]``: seqpack attention skips the padding; other
    implementations ignore it) and ``use_cache=False``. No ``attention_mask``.
    """
    fields = tensors(check_batch(batch))
    lengths = fields["valid_lengths"]
    columns = torch.arange(batch.shape[1], dtype=torch.int64)
    padding = columns[None, :] >= lengths[:, None]
    position_ids = torch.where(padding, columns[None, :] - lengths[:, None], fields["positions"].long())
    shift_labels = fields["shift_labels"]
    labels = torch.full_like(shift_labels, IGNORE_INDEX)
    labels[:, 1:] = shift_labels[:, :-1]
    return {
        "input_ids": fields["input_ids"],
        "position_ids": position_ids,
        "shift_labels": shift_labels,
        "labels": labels,
        "valid_lengths": lengths.clone(),
        "use_cache": False,
    }


def _eligible(item) -> int:
    """Eligible targets of one micro-batch, by Trainer's rule."""
    if isinstance(item, dict):
        if "shift_labels" in item:
            return int(np.count_nonzero(int_array("shift_labels", item["shift_labels"]) != IGNORE_INDEX))
        if "labels" in item:
            labels = int_array("labels", item["labels"])
            if labels.ndim == 0:
                raise InvalidInputError("labels must be a sequence of targets, got a single value")
            return int(np.count_nonzero(labels[..., 1:] != IGNORE_INDEX))
        raise InvalidInputError(f"a batch dict needs shift_labels or labels; got keys {sorted(item)}")
    return check_batch(item).target_count


def num_items_in_batch(batches: Iterable, group=None) -> int:
    """The ``num_items_in_batch`` Trainer passes to the model for one optimizer step.

    Trainer's rule: the eligible targets of every micro-batch of the accumulation window
    (``shift_labels`` != -100 when present, else ``labels[..., 1:]`` != -100), summed
    over the ranks of ``group`` when ``torch.distributed`` is initialized. ``batches``:
    a list (or iterable) of seqpack batches or dicts from :func:`flat`, :func:`rows` or any
    collator, whose labels are integers (tensors, arrays or lists). Passing it
    to ``ForCausalLMLoss`` (or the model) makes each micro-batch's loss its sum over
    the window's count, the token-weighted loss of :mod:`seqpack.torch`.
    """
    return step_target_count([_eligible(item) for item in micro_batches(batches)], group)


# Each optional feature key: what it must equal for its document to be packed as it is
# (every token an input, every target supervised), and why.
_FEATURE_RULES = {
    "labels": ("input_ids", "every target of a packed document is supervised, so masked labels "
                            "(such as -100 for prompt tokens) cannot be kept"),
    "attention_mask": ("all ones", "each feature must be one unpadded document"),
    "completion_mask": ("all ones", "every target of a packed document is supervised"),
    "assistant_masks": ("all ones", "every target of a packed document is supervised"),
}


def _check_feature(index: int, feature: dict, document: np.ndarray) -> None:
    """Raise unless every key of ``feature`` besides ``input_ids`` agrees with packing
    ``document`` whole and supervising all of it (``_FEATURE_RULES``)."""
    for key, value in feature.items():
        if key == "input_ids":
            continue
        if key not in _FEATURE_RULES:
            raise InvalidInputError(
                f"feature {index} carries {key!r}, which PackingCollator does not use: pass input_ids only "
                f"(known keys: {', '.join(['input_ids', *_FEATURE_RULES])})"
            )
        equal_to, reason = _FEATURE_RULES[key]
        expected = document if equal_to == "input_ids" else np.ones_like(document)
        values = np.asarray(value)
        if values.shape != document.shape or not np.array_equal(values, expected):
            raise InvalidInputError(f"feature {index}: {key} must be {equal_to}: {reason}")


class PackingCollator:
    """A ``data_collator`` for ``transformers.Trainer``: packs a list of features into one batch.

    ``PackingCollator(config, *, tokenizer_identity, policy="best-fit-decreasing",
    split="hf-collator")``: each feature's ``input_ids`` must be one framed document
    (``[BOS, content..., EOS]`` under ``tokenizer_identity``, a
    :class:`~seqpack.TokenizerIdentity` or :class:`~seqpack.ByteTokenizer`); the call
    packs the documents with ``policy`` into rows of ``config.capacity`` predictions and
    returns :func:`rows` of that batch. More rows than ``config.rows_per_batch`` is a
    :class:`~seqpack.CapacityError` (lower ``per_device_train_batch_size``). Trainer's
    label smoothing shifts ``labels`` itself and would drop each full row's last
    target: leave it off.

    Every target of a packed document is supervised, so a feature may carry other keys
    only where they say the same: ``labels`` equal to its ``input_ids``, and an all-ones
    ``attention_mask``, ``completion_mask`` or ``assistant_masks``. Masked labels (prompt
    tokens at -100), padding or any other key is an :class:`~seqpack.InvalidInputError`
    naming the feature, never silently ignored.
    """

    def __init__(self, config: PackConfig, *, tokenizer_identity, policy: str = "best-fit-decreasing",
                 split: str = "hf-collator"):
        if not isinstance(config, PackConfig):
            raise InvalidInputError(f"config must be a PackConfig, not {type(config).__name__}")
        self.config = config
        self.policy = policy
        self.binding = BatchBinding.for_tokenizer(tokenizer_identity, split=split)

    def __call__(self, features: Sequence[dict]) -> dict:
        if not features:
            raise InvalidInputError("PackingCollator received no features")
        documents = []
        for index, feature in enumerate(features):
            if "input_ids" not in feature:
                raise InvalidInputError(f"feature {index} has no input_ids; its keys are {sorted(feature)}")
            document = np.asarray(feature["input_ids"])
            if document.ndim != 1 or (document.size and document.dtype.kind not in "iu"):
                raise InvalidInputError(
                    f"feature {index}: input_ids must be a 1-D sequence of integer token ids, got "
                    f"shape {document.shape} and dtype {document.dtype}"
                )
            documents.append(document)
            _check_feature(index, feature, documents[-1])
        offsets = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum([document.size for document in documents], out=offsets[1:])
        table = ExampleTable.from_arrays(np.concatenate(documents), offsets, self.binding,
                                         partition=Partition.TRAIN)
        epoch = pack(table, self.config, partition=Partition.TRAIN, binding=self.binding, policy=self.policy)
        if len(epoch.batches) > 1:
            needed = sum(batch.shape[0] for batch in epoch.batches)
            raise CapacityError(
                f"{len(features)} features need {needed} rows of {self.config.capacity}; the config allows "
                f"{self.config.rows_per_batch} per batch: lower per_device_train_batch_size or raise rows_per_batch",
                needed * self.config.capacity, self.config.max_cells,
            )
        return rows(epoch.batches[0])
