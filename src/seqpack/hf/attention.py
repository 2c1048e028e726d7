"""seqpack range attention inside Hugging Face transformers models.

:func:`register` adds an attention function and a mask function named ``"seqpack"`` to
``transformers.AttentionInterface`` and ``AttentionMaskInterface``; a model built with
``attn_implementation="seqpack"`` (or switched with ``model.set_attn_implementation``)
then runs the fused edge-only kernels with autograd. The rule it keeps: every valid
query attends to exactly the keys of its own segment up to itself, and nothing else is
computed.

* No T x T mask is built: the mask function returns ``None``, or the ``[B, T]`` boolean
  padding mask when one was given with padding in it, or a :class:`LayerMask` carrying
  what a layer needs beyond it (the sequences transformers found packed, a window).
* The segments come from the ``cu_seq_lens_q`` keyword (flash-attention's offsets over
  the flattened ``[B * T]`` cells), else ``seq_idx`` (a segment index per cell), else
  ``position_ids`` (a new segment wherever a position is not the previous one plus 1:
  transformers' own packed-sequence rule), else the packed sequences of the model's
  ``position_ids`` by that rule, read when transformers built the mask (some models,
  GPTBigCode and Persimmon among them, do not hand ``position_ids`` to their attention;
  the rule holds with a 2-D ``attention_mask`` too, where transformers does not look for
  packed sequences), else one segment per row. A :func:`seqpack.hf.rows` batch
  (``valid_lengths``) whose positions reached neither the attention call nor the mask
  (Qwen2-VL and its kin derive rotary positions of their own and drop them) is refused:
  its examples could not be told apart.
* Valid cells: the ``valid_lengths`` keyword (``[B]``, as :func:`seqpack.hf.rows` gives
  it), else a right-padded 2-D ``attention_mask``, else the end of ``cu_seq_lens_q``,
  else every cell. Cells past a row's valid length are skipped: zero output, zero
  gradients, never read by a valid query.
* Query ``[B, H, T, D]`` and key/value ``[B, H_kv, T, D]`` views (grouped-query heads
  are not repeated) are read where they are; the output is written straight into
  ``[B, T, H, D]`` storage, and the gradients into ``[B, T, heads, D]`` storage, so the
  projections' reshapes never copy.
* Clear errors instead of silent fallbacks: dropout > 0, a cache (``use_cache=True``, a
  cache the model built, or keys longer than the queries), a sliding window or attention
  chunk narrower than a segment, softcapping, attention sinks, position biases (ALiBi
  included), sparse key or block selections, bidirectional attention or bidirectional
  blocks (``block_sequence_ids``), extra mask functions, ``output_attentions=True``, and
  segment, position and padding keywords that disagree with each other.
"""

from __future__ import annotations

import functools
import importlib
import sys
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch

from .._arguments import check_int, check_scale
from ..errors import InvalidInputError
from ..nn.attention import range_attention_backward, range_attention_forward
from ..torch.attention import (
    WIDENED,
    check_first_order,
    check_kernel_tensor,
    kernel_gradient,
    kernel_view,
)
from .segments import check_window, layout, segment_lengths

#: The name under which :func:`register` installs seqpack attention.
NAME = "seqpack"


def _given(value) -> bool:
    return value is not None


def _cache_error(detail: str) -> InvalidInputError:
    return InvalidInputError(
        f"seqpack attention does not use a cache ({detail}): pass use_cache=False or set "
        f"model.config.use_cache = False for training on packed rows"
    )


#: Attention-call keywords that ask for what range attention does not compute: each
#: keyword, whether its value asks for it, and the refusal.
_REFUSED = {
    "use_cache": (bool, str(_cache_error("use_cache=True"))),
    "output_attentions": (bool, ("seqpack attention computes no attention weights; this call asked for them "
                                 "(output_attentions=True): use attn_implementation='eager' to see them")),
    "is_causal": (lambda value: value is False,
                  "seqpack attention is causal; this module asked for bidirectional attention"),
    **{keyword: (_given, f"seqpack attention does not compute {feature} ({keyword}=...)") for keyword, feature in (
        ("softcap", "logit softcapping"),
        ("s_aux", "attention sinks"),
        ("sinks", "attention sinks"),
        ("position_bias", "an additive position bias"),
        ("indices", "sparse attention over selected keys"),
        ("block_indices", "block-sparse attention over selected blocks"),
    )},
}

def register(name: str = NAME) -> str:
    """Register seqpack attention and its mask function under ``name``; returns ``name``.

    Idempotent. Afterwards ``from_config(config, attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` selects it.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, seqpack_attention)
    AttentionMaskInterface.register(name, seqpack_mask)
    return name


#: Whether the mask of the model's forward now running saw its ``position_ids`` (set by
#: :func:`seqpack_mask`, read by :func:`seqpack_attention`; None: no mask built yet).
_MASK_SAW_POSITIONS: ContextVar[bool | None] = ContextVar("seqpack_mask_saw_positions", default=None)
#: The keywords that carry a batch's segments to an attention call.
SEGMENT_KEYWORDS = ("cu_seq_lens_q", "seq_idx", "position_ids")


@dataclass(frozen=True)
class LayerMask:
    """What :func:`seqpack_mask` hands a layer beyond its 2-D padding mask (or ``None``):

    * ``span``: a layer with local attention (a sliding window or chunks of ``span``
      positions) equals plain causal attention within segments only while every segment
      fits in the span, which :func:`seqpack_attention` checks;
    * ``sequences``: the ``[B, T]`` sequence index per cell that transformers found in the
      model's ``position_ids`` (packed rows), the segments when the attention call itself
      gets no segment keyword.
    """

    padding: torch.Tensor | None
    span: int | None = None
    sequences: torch.Tensor | None = None

    def __getattr__(self, name: str):
        # A model that reads the mask as a tensor in its own code before attention (Doge's
        # dynamic mask) would compute on it past seqpack's reach.
        if name.startswith("__"):
            raise AttributeError(name)
        raise _reads_mask(repr(name))

    def __getitem__(self, index):
        raise _reads_mask("cells")


def _reads_mask(what: str) -> InvalidInputError:
    return InvalidInputError(
        f"this model reads the attention mask's {what} in its own code before attention, so it needs a dense mask "
        f"that seqpack attention never builds: use attn_implementation='sdpa' or 'eager' for it"
    )


def seqpack_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, use_vmap=False, local_size=None, **kwargs):
    """transformers' mask hook: never a T x T mask, only ``None`` or the 2-D padding mask
    (wrapped in a :class:`LayerMask` for a sliding-window or chunked layer, or for rows
    transformers found packed)."""
    from transformers.masking_utils import bidirectional_mask_function

    config = kwargs.get("config")
    _check_dispatches_attention(config)
    _check_only_attention_mixes(config)
    if getattr(config, "alibi", False):
        raise InvalidInputError("seqpack attention does not compute an additive position bias (this model's config "
                                "has alibi=True)")
    if getattr(config, "index_topk", None) is not None:
        raise InvalidInputError("this model's indexer (sparse attention, as in DeepSeek-V3.2) picks each query's keys "
                                "from a dense mask in its own code, which seqpack attention never builds: use "
                                "attn_implementation='sdpa' or 'eager' for it")
    builder = _mask_builder_locals(sys._getframe(1))
    if builder.get("cache") is not None:
        raise _cache_error("the model built a cache for this call")
    if mask_function is bidirectional_mask_function:
        raise InvalidInputError("seqpack attention is causal; this model asked for bidirectional attention")
    if use_vmap:
        raise InvalidInputError(
            "seqpack attention cannot apply extra mask functions (or_mask_function / and_mask_function)"
        )
    if _bidirectional_blocks(mask_function):
        raise InvalidInputError(
            "seqpack attention is causal; this model's mask lets blocks of tokens attend to each other "
            "bidirectionally (block_sequence_ids, e.g. from token_type_ids)"
        )
    if int(q_offset) or int(kv_offset) or kv_length != q_length:
        raise _cache_error(f"keys span {kv_length} cells for {q_length} queries")
    padding = None if attention_mask is None or bool(attention_mask.all()) else attention_mask
    sequences = _packed_sequences(mask_function)
    if sequences is None and builder.get("position_ids") is not None:
        # transformers looks for packed sequences only without a 2-D mask; the rule here is the same with one
        from transformers.masking_utils import find_packed_sequence_indices

        sequences = find_packed_sequence_indices(builder["position_ids"].expand(batch_size, -1))
    _MASK_SAW_POSITIONS.set(builder.get("position_ids") is not None or sequences is not None)
    if local_size is None and sequences is None:
        return padding
    return LayerMask(padding, None if local_size is None else int(local_size), sequences)


def _mask_builder_locals(frame) -> dict:
    """The local variables of the ``transformers.masking_utils`` function that called the
    mask hook (``create_causal_mask`` and its sliding-window and chunked kin), or ``{}``.

    They hold what the hook's arguments leave out: the ``cache`` the model built (a model
    such as GPTBigCode or Persimmon hands ``use_cache`` to no attention call) and its
    ``position_ids`` (which transformers reads for packed sequences only when no 2-D
    ``attention_mask`` is given, and which such a model does not hand on either).
    """
    for _ in range(3):  # the builder calls the hook directly; a wrapper or two are allowed
        if frame is None:
            break
        if frame.f_globals.get("__name__") == "transformers.masking_utils" and "cache" in frame.f_code.co_varnames:
            return frame.f_locals
        frame = frame.f_back
    return {}


#: ``config.layer_types`` entries of layers that mix a row's positions outside attention (a
#: convolution, a state space, linear attention, a recurrence; ``hybrid``: one beside
#: attention), across a packed row's examples.
NON_ATTENTION_LAYERS = frozenset({"conv", "short_conv", "linear_attention", "mamba", "hybrid", "recurrent"})
#: Parts of the class names of layers that mix positions outside attention (state spaces,
#: convolutions, linear attention, recurrences).
RECURRENT_LAYERS = ("Mamba", "ShortConv", "GatedDeltaNet", "LinearAttention", "Rglru", "RecurrentBlock", "Rwkv")


def check_runs_attention_functions(model) -> None:
    """Refuse a transformers model that would mix a packed row's examples where seqpack
    cannot stop it: one whose modeling module has no attention functions (OpenAI GPT,
    CPM-Ant: it computes its own causal attention, yet transformers accepts
    ``attn_implementation="seqpack"`` for it), and one with layers that mix positions
    outside attention (:data:`NON_ATTENTION_LAYERS`, :data:`RECURRENT_LAYERS`: LFM2's
    convolutions, Mamba and linear-attention layers). A wrapper (a PEFT model) is
    checked through the model it wraps, by its modules."""
    module = type(model).__module__
    if module.startswith("transformers.models.") and not hasattr(importlib.import_module(module),
                                                                  "ALL_ATTENTION_FUNCTIONS"):
        raise InvalidInputError(
            f"{type(model).__name__} computes attention in its own code, never through transformers' "
            f"AttentionInterface, so seqpack attention cannot run inside it (its packed rows would attend across "
            f"their examples)"
        )
    _check_only_attention_mixes(getattr(model, "config", None))
    for name, layer in model.named_modules():
        if any(part in type(layer).__name__ for part in RECURRENT_LAYERS):
            raise InvalidInputError(f"{type(model).__name__}'s layer {name} ({type(layer).__name__}) mixes positions "
                                    f"outside attention, across a packed row's examples: seqpack packs models whose "
                                    f"every sequence layer is attention")


def _check_only_attention_mixes(config) -> None:
    """Refuse a config whose ``layer_types`` name one of :data:`NON_ATTENTION_LAYERS`."""
    types = getattr(config, "layer_types", None)
    other = next((kind for kind in types if kind in NON_ATTENTION_LAYERS), None) if isinstance(types, (list, tuple)) \
        else None
    if other is not None:
        raise InvalidInputError(f"{getattr(config, 'model_type', type(config).__name__)} has {other!r} layers, which "
                                f"mix positions outside attention, across a packed row's examples: seqpack packs models "
                                f"whose every sequence layer is attention")


def _check_dispatches_attention(config) -> None:
    """Refuse a transformers model whose code computes attention itself instead of through
    ``AttentionInterface`` (Bloom, MPT...): it would never call seqpack attention and would
    read this hook's ``None`` as no mask at all, not even a causal one. Known by its
    modeling module, which then has no ``ALL_ATTENTION_FUNCTIONS``; a config from outside
    ``transformers.models`` is not checked."""
    module = type(config).__module__ if config is not None else ""
    if not module.startswith("transformers.models.") or ".configuration_" not in module:
        return
    try:
        modeling = importlib.import_module(module.replace(".configuration_", ".modeling_"))
    except ImportError:
        return
    if not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS"):
        raise InvalidInputError(
            f"{getattr(config, 'model_type', type(config).__name__)} models compute attention in their own code, "
            f"not through transformers' AttentionInterface, so seqpack attention cannot run inside them: use "
            f"attn_implementation='sdpa' or 'eager' for this model"
        )


def _composed_with(mask_function, factory: str) -> list[list] | None:
    """The closure contents of every function inside ``mask_function`` (transformers
    composes mask functions as closures over closures) that ``transformers.masking_utils``'s
    ``factory(None)`` makes; None when this transformers has no such factory."""
    try:
        from transformers import masking_utils

        code = getattr(masking_utils, factory)(None).__code__
    except (ImportError, AttributeError, TypeError):
        return None
    found, pending, seen = [], [mask_function], set()
    while pending:
        function = pending.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        contents = []
        for cell in getattr(function, "__closure__", None) or ():
            try:
                contents.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        if getattr(function, "__code__", None) is code:
            found.append(contents)
            continue
        for value in contents:
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if callable(item) and not isinstance(item, torch.Tensor):
                    pending.append(item)
    return found


def _bidirectional_blocks(mask_function) -> bool:
    """Whether transformers composed ``mask_function`` with a blockwise overlay (its
    ``block_sequence_ids``) holding a block, which no ``use_vmap`` flag announces."""
    for contents in _composed_with(mask_function, "blockwise_overlay") or ():
        ids = [c for c in contents if isinstance(c, torch.Tensor)]
        if not ids or any(_has_block(t) for t in ids):
            return True
    return False


def _packed_sequences(mask_function) -> torch.Tensor | None:
    """The ``[B, T]`` sequence indices transformers found packed in the model's
    ``position_ids`` and composed into ``mask_function``, or None."""
    for contents in _composed_with(mask_function, "packed_sequence_mask_function") or ():
        for value in contents:
            if isinstance(value, torch.Tensor):
                return value
    return None


def _has_block(ids: torch.Tensor) -> bool:
    """Whether some row of ``block_sequence_ids`` has a block (an id >= 0) of two or more tokens."""
    if ids.dim() != 2:
        return True
    ordered = ids.sort(dim=-1).values
    return bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any())


def _capturing_attentions(caller) -> bool:
    """Whether this forward collects attention weights: through transformers' output hooks
    (``output_attentions=True`` on a model, such as GPT-2 or OPT, that does not hand the
    flag to its attention calls), or in the attention module's own ``forward`` (``caller``,
    its frame), which keeps the flag to return weights itself (Falcon)."""
    if caller is not None and caller.f_locals.get("output_attentions") is True:
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output hooks passes the flag to the call
        return False
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected


def seqpack_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention hook: range attention of ``query`` ``[B, H, T, D]`` and
    ``key``/``value`` ``[B, H_kv, T, D]``; returns ``([B, T, H, D] output, None)``.

    The segments come from ``cu_seq_lens_q``, else ``seq_idx``, else ``position_ids`` (a
    new segment wherever a position is not the previous one plus 1), else the packed
    sequences transformers found in the model's ``position_ids`` when it built the mask;
    the valid cells from ``valid_lengths`` (``[B]``), else a right-padded 2-D
    ``attention_mask``. Views are read in place and the output written into ``[B, T, H,
    D]`` storage.

    Refused with an :class:`~seqpack.errors.InvalidInputError`, never a silent fallback:
    dropout > 0; a cache (``use_cache=True``, or keys longer than the queries); a sliding
    window or attention chunk narrower than a segment (a wider one changes nothing);
    softcapping; attention sinks; position biases; sparse key or block selections
    (``indices``, ``block_indices``); a 4-D mask; left padding; bidirectional attention or
    blocks (a prefix marked by ``token_type_ids``); extra mask functions;
    ``output_attentions=True``; value heads narrower than the query heads (multi-head latent
    attention); query, key and value of different dtypes outside autocast; rotary
    frequencies that follow the forward's largest position (``longrope``, ``dynamic``) past
    their threshold, beside a sequence that alone would get others; Llama 4's query
    temperature (``attn_temperature_tuning``) where a sequence's columns and positions give
    different ones; models that number positions otherwise (RoBERTa's family counts from
    padding_idx + 1; the CSM depth decoder by column); a graph asked of the backward
    (``create_graph=True``); and segment, position and padding keywords that disagree
    (``cu_seq_lens_q`` ending before the valid cells, positions restarting inside one of its
    sequences, ``valid_lengths`` against ``attention_mask``). Models that compute attention
    themselves instead of through ``AttentionInterface`` (Bloom, MPT) cannot use it, nor can
    ALiBi models (Falcon with ``alibi=True``).
    """
    if dropout:
        raise InvalidInputError(f"seqpack attention has no dropout; the model asked for {dropout}")
    for keyword, (asks, reason) in _REFUSED.items():
        if asks(kwargs.get(keyword)):
            raise InvalidInputError(reason)
    if not getattr(module, "is_causal", True):
        raise InvalidInputError(_REFUSED["is_causal"][1])
    if _capturing_attentions(sys._getframe(1)):
        raise InvalidInputError(_REFUSED["output_attentions"][1])
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            found = f"shape {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise InvalidInputError(f"{name} must be a [B, heads, T, D] tensor, got {found}")
    if key.shape[2] != query.shape[2]:
        raise _cache_error(f"{key.shape[2]} keys for {query.shape[2]} queries")
    if value.shape[3] != query.shape[3] or key.shape[3] != query.shape[3]:
        raise InvalidInputError(
            f"seqpack attention needs query, key and value heads of one size; this model's are {query.shape[3]}, "
            f"{key.shape[3]} and {value.shape[3]} (multi-head latent attention, as in DeepSeek-V2 and V3, has "
            f"narrower value heads): use attn_implementation='sdpa' or 'eager' for it"
        )
    layer = attention_mask if isinstance(attention_mask, LayerMask) else None
    segmented = any(kwargs.get(k) is not None for k in SEGMENT_KEYWORDS)
    if layer is not None:
        attention_mask = layer.padding
        if layer.sequences is not None and not segmented:
            kwargs, segmented = {**kwargs, "seq_idx": layer.sequences}, True
    if kwargs.get("valid_lengths") is not None and not segmented and _MASK_SAW_POSITIONS.get() is False:
        raise InvalidInputError(
            "this model hands neither its attention nor its mask the batch's position_ids (it derives rotary "
            "positions of its own, as Qwen2-VL does), so the examples packed in a seqpack.hf.rows() batch cannot "
            "be told apart: give it seqpack.hf.flat(batch), whose cu_seq_lens_q reaches attention"
        )
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        check_kernel_tensor(name, tensor, "seqpack attention")
    if not query.dtype == key.dtype == value.dtype:
        device = query.device.type
        if not torch.is_autocast_enabled(device):
            raise InvalidInputError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype} and "
                                    f"{value.dtype}")
        # Under autocast, rotary or norm layers in float32 leave some of them wider, as SDPA
        # (an autocast op) finds them too: like it, run all three in the autocast dtype.
        query, key, value = (tensor.to(torch.get_autocast_dtype(device)) for tensor in (query, key, value))
    lengths, starts = layout(query.shape[0], query.shape[2], attention_mask, kwargs)
    _check_rotary_frequencies(getattr(module, "config", None), lengths, starts, kwargs.get("position_ids"))
    _check_query_temperature(module, lengths, starts)
    _check_own_positions(module)
    if kwargs.get("sliding_window") is not None:
        check_window(check_int("sliding_window", kwargs["sliding_window"], 0), lengths, starts)
    if layer is not None and layer.span is not None:
        check_window(layer.span, lengths, starts)
    output = AttentionIntoCells.apply(query, key, value, lengths, starts, check_scale("scaling", scaling))
    return output, None


def _batch_wide_rotary(config) -> list[tuple[str, int]]:
    """``(rope_type, threshold)`` of each rotary embedding of ``config`` whose frequencies
    transformers picks from the forward's largest position: ``longrope`` (its long factors
    past ``original_max_position_embeddings``) and the ``dynamic`` kinds (rescaled past
    ``max_position_embeddings``, and kept across calls)."""
    parameters = getattr(config, "rope_parameters", None)
    if not isinstance(parameters, dict):
        return []
    groups = [parameters] if "rope_type" in parameters else [p for p in parameters.values() if isinstance(p, dict)]
    found = []
    for group in groups:
        kind = str(group.get("rope_type", ""))
        if kind == "longrope":
            found.append((kind, group.get("original_max_position_embeddings")))
        elif "dynamic" in kind:
            found.append((kind, getattr(config, "max_position_embeddings", None)))
    return [(kind, int(threshold)) for kind, threshold in found if threshold is not None]


def _check_rotary_frequencies(config, lengths, starts, position_ids) -> None:
    """Refuse a forward whose sequences would not get the rotary frequencies each gets alone
    (see :func:`_batch_wide_rotary`): one past the threshold beside a shorter one."""
    rules = _batch_wide_rotary(config)
    if not rules:
        return
    spans = segment_lengths(lengths, starts)
    if not spans.size:
        return
    longest = reach = int(spans.max())   # the forward's largest position + 1, as the rotary embedding saw it
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.numel():
        reach = max(reach, int(position_ids.max()) + 1)
    shortest = int(spans.min())
    for kind, threshold in rules:
        if reach > threshold and (shortest <= threshold if kind == "longrope" else shortest < reach):
            remedy = (f"give each sequence of more than {threshold} positions a forward of its own" if longest > threshold
                      else f"the padding's positions reach {reach}: give the batch as seqpack.hf.flat(batch), "
                           f"which has none")
            raise InvalidInputError(
                f"this model's rotary embedding (rope_type {kind!r}) takes its frequencies from the forward's "
                f"largest position, {reach} positions, past {threshold}; a sequence of {shortest} here would get "
                f"other frequencies alone: {remedy}"
            )


def _check_query_temperature(module, lengths, starts) -> None:
    """Refuse a forward in which Llama 4's query temperature (``attn_temperature_tuning``, on
    its layers without rotary embeddings) differs from a sequence's own: it is taken from
    the row's column, ``log1p(floor((column + 1) / floor_scale))``, not from the position."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return
    scale = int(module.floor_scale)
    columns = np.arange(starts.shape[1])
    valid = columns[None, :] < lengths[:, None]
    differ = valid & ((columns[None, :] + 1) // scale != (columns[None, :] - starts + 1) // scale)
    if differ.any():
        row, column = (int(index[0]) for index in np.nonzero(differ))
        raise InvalidInputError(
            f"this model scales the queries of its layers without rotary embeddings by a temperature of the row's "
            f"column, not of the position (attn_temperature_tuning, floor_scale {scale}): the sequence at row "
            f"{row}, column {int(starts[row, column])} would get another one than alone; keep each row under "
            f"{scale - 1} columns (seqpack.hf.flat and evaluate make one row of a whole batch)"
        )


#: Why models whose positions are not seqpack's (each sequence's from 0) are refused.
_OTHER_POSITIONS = {
    "offset": "this model numbers its positions from padding_idx + 1 (RoBERTa's convention: the positions it makes "
              "itself start at config.pad_token_id + 1), while seqpack's layouts give each sequence positions from "
              "0: its packed results would differ from the model alone",
    "columns": "the CSM depth decoder replaces the position_ids it is given with the row's columns (and picks its "
               "codebook embeddings and heads by column): the examples of a packed row would not be told apart",
}


def _check_own_positions(module) -> None:
    """Refuse a model that does not take each sequence's positions from 0 as given."""
    if getattr(getattr(module, "config", None), "model_type", None) == "csm_depth_decoder_model":
        raise InvalidInputError(_OTHER_POSITIONS["columns"])
    if _numbers_positions_from_padding(type(module)):
        raise InvalidInputError(_OTHER_POSITIONS["offset"])


@functools.cache
def _numbers_positions_from_padding(kind: type) -> bool:
    """Whether the module defining attention class ``kind`` makes positions from its padding
    index, as transformers' RoBERTa family does (``create_position_ids_from_input_ids``)."""
    source = sys.modules.get(kind.__module__)
    return source is not None and any(hasattr(value, "create_position_ids_from_input_ids")
                                      for value in vars(source).values() if isinstance(value, type))


def _cells_first(shape, dtype) -> torch.Tensor:
    """Fresh ``[B, T, heads, D]`` storage for a ``[B, heads, T, D]`` result, returned as that view."""
    rows, heads, width, head_dim = shape
    return torch.empty((rows, width, heads, head_dim), dtype=dtype).transpose(1, 2)


class AttentionIntoCells(torch.autograd.Function):
    """Range attention whose output and gradients live in ``[B, T, heads, D]`` storage.

    ``forward(q, k, v, lengths, starts, scale)`` returns the ``[B, T, H, D]`` output;
    the backward recomputes from the saved output and log-sum-exp (see
    :mod:`seqpack.nn.attention`) and hands q, k, v gradients back as ``[B, heads, T, D]``
    views of ``[B, T, heads, D]`` storage, which the projections' transposes and views
    then pass on without a copy.
    """

    @staticmethod
    def forward(ctx, q, k, v, lengths, starts, scale):
        compute = torch.float32 if q.dtype in WIDENED else q.dtype
        out = _cells_first(q.shape, compute)                       # [B, H, T, D] view of [B, T, H, D]
        _, lse = range_attention_forward(kernel_view(q), kernel_view(k), kernel_view(v), lengths, starts,
                                         out=out.numpy(), scale=scale)
        lse = torch.from_numpy(lse)                                # [B, H, T]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = (lengths.copy(), starts.copy(), scale)   # (the caller's may change before the backward)
        cells = out.transpose(1, 2)                                # [B, T, H, D], contiguous
        return cells if cells.dtype == q.dtype else cells.to(q.dtype)

    @staticmethod
    def backward(ctx, dcells):
        check_first_order()
        q, k, v, out, lse = ctx.saved_tensors
        lengths, starts, scale = ctx.layout
        dcells = kernel_gradient(dcells, out.dtype)
        dq, dk, dv = (_cells_first(t.shape, out.dtype) for t in (q, k, v))
        range_attention_backward(
            kernel_view(q), kernel_view(k), kernel_view(v), out.numpy(), lse.numpy(),
            dcells.transpose(1, 2).numpy(), lengths, starts, dq=dq.numpy(), dk=dk.numpy(), dv=dv.numpy(),
            scale=scale,
        )
        grads = [g if g.dtype == t.dtype else g.to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v))]
        return (*grads, None, None, None)
