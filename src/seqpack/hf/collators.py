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

Both write -100 at every target the batch does not supervise (``loss_mask`` False).
:class:`PackingCollator` packs Trainer's features, with TRL's supervision masks, into
:func:`rows`.

transformers ignores packing when a cache is on (``config.use_cache`` defaults to True):
:func:`rows` therefore carries ``use_cache=False`` for the model's forward, and seqpack
attention raises rather than run with a cache. :func:`flat` must equal transformers'
collator, so it cannot: set ``model.config.use_cache = False`` (Trainer does, from
``TrainingArguments.use_cache``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from .._arguments import integer_array
from ..data.binding import BatchBinding, Partition
from ..data.supervision import IGNORE_INDEX, first_reserved_label, trl_fault, trl_supervised
from ..data.table import ExampleTable
from ..errors import CapacityError, InvalidInputError
from ..layout.exports import cumulative_lengths
from ..packing.config import PackConfig
from ..packing.placement import check_policy
from ..packing.planning import pack
from ..torch.attention import int_array
from ..torch.counts import check_denominator, micro_batches, step_target_count
from ..torch.tensors import batch_tensors, check_batch


def _row(values: np.ndarray, dtype) -> torch.Tensor:
    """A ``[1, N]`` tensor of ``values`` in ``dtype``."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=dtype)[None, :])


def flat(batch) -> dict:
    """The batch's examples flattened as ``DataCollatorWithFlattening`` flattens them.

    ``batch``: a padded or packed batch, or its ``seqpack.torch.tensors`` dict as
    ``seqpack.torch.BatchDataset`` and ``IterableBatchDataset`` yield it (the same result).

    Keys, dtypes and values of ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
    return_seq_idx=True)`` called on ``[{"input_ids": tokens}, ...]`` with each
    example's token range (its inputs and its last target) in row-major order of the
    batch: ``input_ids``, ``labels``, ``position_ids`` (int64 ``[1, N]``), ``seq_idx``
    (int32 ``[1, N]``), ``cu_seq_lens_q``/``_k`` (int32 ``[examples + 1]``),
    ``max_length_q``/``_k`` (Python ints). A target the batch does not supervise
    (``loss_mask`` False) is -100 in ``labels``.
    """
    fields = {name: tensor.numpy() for name, tensor in batch_tensors(batch).items()}
    valid = fields["token_valid"].ravel()
    inputs = fields["input_ids"].ravel()[valid]                       # the inputs, int64
    targets = fields["targets"].ravel()[valid].astype(np.int64)
    supervised = fields["shift_labels"].ravel()[valid]                # the targets, -100 where not supervised
    positions = fields["positions"].ravel()[valid].astype(np.int64)
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

    ``batch``: a padded or packed batch, or its ``seqpack.torch.tensors`` dict as
    ``seqpack.torch.BatchDataset`` and ``IterableBatchDataset`` yield it (the same result).
    """
    fields = batch_tensors(batch)
    lengths = fields["valid_lengths"]
    columns = torch.arange(fields["input_ids"].shape[1], dtype=torch.int64)
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
    """Eligible targets of one micro-batch, by Trainer's rule (a dict, or any mapping such as
    transformers' ``BatchEncoding``)."""
    if isinstance(item, Mapping):
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
    the window's count, the token-weighted loss of :mod:`seqpack.torch`. A window without
    an eligible target is an :class:`~seqpack.InvalidInputError` (its loss would be 0 / 0).
    """
    return check_denominator(step_target_count([_eligible(item) for item in micro_batches(batches)], group))


#: The keys a feature may carry besides ``input_ids`` (their rules: ``PackingCollator``).
_FEATURE_KEYS = ("labels", "completion_mask", "assistant_masks", "attention_mask")


def _per_token(index: int, key: str, value, length: int, kinds: str, what: str) -> np.ndarray:
    """``feature[key]`` as a 1-D array of ``length`` ``what`` (a dtype kind in ``kinds``)."""
    array = _regular_array(index, key, value)
    if array.shape != (length,) or (array.size and array.dtype.kind not in kinds):
        raise InvalidInputError(
            f"feature {index}: {key} must be a 1-D sequence of {length} {what} (one per input_ids token), got "
            f"shape {array.shape} and dtype {array.dtype}"
        )
    return array


def _supervision(index: int, feature: dict, document: np.ndarray, completion_only_loss) -> np.ndarray:
    """Which of ``document``'s tokens, as targets, ``feature`` supervises: TRL's rule
    (:func:`~seqpack.data.supervision.trl_supervised`), ``PackingCollator``'s."""
    length = document.shape[0]
    columns = {}
    for key, value in feature.items():
        if key == "input_ids":
            continue
        if key not in _FEATURE_KEYS:
            raise InvalidInputError(
                f"feature {index} carries {key!r}, which PackingCollator does not use "
                f"(known keys: {', '.join(['input_ids', *_FEATURE_KEYS])})"
            )
        integers = key == "labels"
        columns[key] = _per_token(index, key, value, length, "iu" if integers else "biuf",
                                  "integers" if integers else "0s and 1s")
    bounds = np.array([0, length])
    reserved = None if "labels" not in columns else first_reserved_label(columns["labels"], bounds)
    fault = ("labels", reserved) if reserved is not None else trl_fault(document, bounds, columns)
    # (attention_mask is a 0/1 mask too)
    if fault is not None:
        key, j = fault
        if key == "labels":
            raise InvalidInputError(
                f"feature {index}: labels[{j}] is {columns[key][j]} but input_ids[{j}] is {document[j]}: a packed "
                f"target is the document's next token, so labels may only copy input_ids or be -100"
            )
        raise InvalidInputError(f"feature {index}: {key}[{j}] is {columns[key][j]}; a mask holds 0 and 1")
    attention = columns.pop("attention_mask", None)
    if attention is not None and not attention.all():
        raise InvalidInputError(f"feature {index}: attention_mask must be all ones: each feature must be "
                                f"one unpadded document")
    supervised, _ = trl_supervised(document, columns, completion_only_loss=completion_only_loss is not False)
    if length < 2:
        raise InvalidInputError(f"feature {index} has {length} token{'' if length == 1 else 's'}: a document needs "
                                f"2 to hold a target; drop it from the dataset")
    if not supervised[1:].any():
        raise InvalidInputError(
            f"feature {index}: none of its {length - 1} targets is supervised (labels -100 or a mask 0 at every "
            f"token after the first): it adds nothing to the loss; drop it from the dataset"
        )
    return supervised


class PackingCollator:
    """A ``data_collator`` for ``transformers.Trainer`` and ``trl.SFTTrainer``: packs a list of
    features into one batch.

    ``PackingCollator(config, *, tokenizer_identity, policy="best-fit-decreasing",
    split="hf-collator", completion_only_loss=None)``: each feature's ``input_ids`` is one
    document taken as given, as TRL prepared it (IDs of ``tokenizer_identity``'s vocabulary,
    a :class:`~seqpack.TokenizerIdentity` such as ``TokenizerFile(...).identity`` or a
    :class:`~seqpack.ByteTokenizer`; with or without BOS, any EOS where the tokenizer or the
    chat template put it; the collator adds no token); the call packs the documents with
    ``policy`` into rows of ``config.capacity``
    predictions and returns :func:`rows` of that batch. More rows than
    ``config.rows_per_batch`` is a :class:`~seqpack.CapacityError` (lower
    ``per_device_train_batch_size``). Trainer's label smoothing and a ``compute_loss_func``
    shift ``labels`` themselves and would drop each full row's last target: leave them off
    (:class:`~seqpack.hf.SFTTokenCount` refuses them). A ``compute_metrics`` that shifts
    ``label_ids`` likewise misses those targets: give Trainer ``label_names=["shift_labels"]``,
    whose entry ``j`` is the target of the logits at ``j`` (predictions and labels come per
    packed row, ``[rows, capacity]``, not per example).

    Supervision is TRL's (``SFTTrainer`` turns the masks into -100 labels, its collator
    reads them): entry ``j`` of ``labels``, ``completion_mask`` and ``assistant_masks`` is
    about token ``j`` as a target. Given ``labels``, token ``j`` is supervised when its
    label is not -100, whatever the masks say (TRL uses given labels as they are); else
    when every given mask is 1. ``completion_mask`` is read unless ``completion_only_loss``
    is False (as ``SFTConfig(completion_only_loss=False)`` ignores it), ``assistant_masks``
    always. Entry 0 is no target (transformers' and TRL's
    collators write -100 there): its value never counts. A plain ``transformers.Trainer``
    drops every column its model's ``forward`` does not name before the collator sees it,
    ``completion_mask`` included (TRL 1.16's ``SFTTrainer`` has turned the masks into
    ``labels`` by then): give such a Trainer ``remove_unused_columns=False``, or the
    prompts are supervised too.

    Refused with an :class:`~seqpack.InvalidInputError` naming the feature: a label other
    than -100 that differs from the ``input_ids`` token (packing cannot carry arbitrary
    labels); a mask or ``labels`` not as long as ``input_ids``, or a mask holding other than
    0 and 1; an ``attention_mask`` with a zero (padding); a feature of fewer than 2 tokens
    or with no supervised target; any other key.
    """

    def __init__(self, config: PackConfig, *, tokenizer_identity, policy: str = "best-fit-decreasing",
                 split: str = "hf-collator", completion_only_loss: bool | None = None):
        if completion_only_loss is not None and not isinstance(completion_only_loss, bool):
            raise InvalidInputError(f"completion_only_loss must be None, True or False, not {completion_only_loss!r}")
        self.config, self.policy, self.binding = collator_setup(config, tokenizer_identity, policy, split)
        self.completion_only_loss = completion_only_loss

    def __call__(self, features: Sequence[dict]) -> dict:
        check_features("PackingCollator", features)
        documents, supervision = [], []
        for index, feature in enumerate(features):
            check_feature(index, feature)
            if "input_ids" not in feature:
                raise InvalidInputError(f"feature {index} has no input_ids; its keys are {sorted(feature)}")
            document = token_ids(index, "input_ids", feature["input_ids"])
            predictions, capacity = document.size - 1, self.config.capacity
            if predictions > capacity:
                # Here, so that the error names the feature and the remedy (the table below names an example).
                raise CapacityError(
                    f"feature {index} has {predictions} predictions ({document.size} input_ids); PackConfig's "
                    f"capacity is {capacity}: raise it to at least {predictions} (with TRL, to at least "
                    f"SFTConfig's max_length - 1), or set SFTConfig's max_length to at most {capacity + 1} so that "
                    f"TRL truncates every feature to fit",
                    predictions, capacity,
                )
            documents.append(document)
            supervision.append(_supervision(index, feature, document, self.completion_only_loss))
        return rows(one_batch(documents, supervision, self.config, self.policy, self.binding, features=len(features)))


def collator_setup(config, tokenizer_identity, policy: str, split: str) -> tuple[PackConfig, str, BatchBinding]:
    """A collator's ``(config, policy, binding)``, once ``config`` is a :class:`~seqpack.PackConfig`
    and ``policy`` one of :data:`seqpack.POLICIES`."""
    if not isinstance(config, PackConfig):
        raise InvalidInputError(f"config must be a PackConfig, not {type(config).__name__}")
    check_policy(policy, config.capacity)
    return config, policy, BatchBinding.for_tokenizer(tokenizer_identity, split=split)


def _regular_array(index: int, key: str, value) -> np.ndarray:
    """``feature[key]`` as an array; a ragged or unreadable value is an error naming both."""
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as error:
        raise InvalidInputError(f"feature {index}: {key} is not a regular array: {error}") from None


def check_features(collator: str, features) -> None:
    """Refuse features that are not a non-empty list (a sequence) of features, naming ``collator``."""
    if not isinstance(features, Sequence) or isinstance(features, (str, bytes)):
        raise InvalidInputError(f"{collator} takes a list of features (dicts), not {type(features).__name__}")
    if not features:
        raise InvalidInputError(f"{collator} received no features")


def check_feature(index: int, feature) -> None:
    """Refuse a feature that is not a mapping of keys to values, naming it."""
    if not isinstance(feature, Mapping):
        raise InvalidInputError(f"feature {index} is a {type(feature).__name__}, not a dict of token IDs")


def token_ids(index: int, key: str, value) -> np.ndarray:
    """``feature[key]`` as a 1-D int32 array (empty allowed); an ID past int32 is named
    with its feature, never wrapped."""
    array = _regular_array(index, key, value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidInputError(f"feature {index}: {key} must be a 1-D sequence of integer token ids, got "
                                f"shape {array.shape} and dtype {array.dtype}")
    return integer_array(f"feature {index}: {key}", array, np.int32)


def one_batch(documents: list, supervision: list, config: PackConfig, policy: str, binding: BatchBinding, *,
              features: int, pairs: bool = False, ids: list[str] | None = None):
    """The one batch that packs ``documents``, each taken as given (IDs of ``binding``) and
    supervised where ``supervision`` says (documents ``2p`` and ``2p + 1`` as preference pair
    ``p`` with ``pairs``); ``ids`` name them in the table's errors. More rows than
    ``config.rows_per_batch`` is a :class:`~seqpack.CapacityError` naming the ``features``."""
    offsets = np.zeros(len(documents) + 1, dtype=np.int64)
    np.cumsum([document.size for document in documents], out=offsets[1:])
    supervised = np.concatenate(supervision)
    table = ExampleTable.from_arrays(np.concatenate(documents), offsets, binding, ids=ids,
                                     partition=Partition.TRAIN, as_given=True,
                                     supervised=None if supervised.all() else supervised)
    epoch = pack(table, config, partition=Partition.TRAIN, binding=binding, policy=policy, pairs=pairs)
    if len(epoch.batches) > 1:
        needed = sum(batch.shape[0] for batch in epoch.batches)
        raise CapacityError(
            f"{features} features need {needed} rows of {config.capacity}; the config allows "
            f"{config.rows_per_batch} per batch: lower the batch size that made it (per_device_train_batch_size, "
            f"per_device_eval_batch_size or precompute_ref_batch_size) or raise rows_per_batch",
            needed * config.capacity, config.max_cells,
        )
    return epoch.batches[0]
