"""TRL's trainers on packed batches: SFT's token count as TRL's padding-free batches count
it, and DPO's log-probabilities from packed preference pairs.

TRL 1.16's ``SFTTrainer`` logs ``num_tokens`` from ``attention_mask.sum()``, else from
``position_ids.size(1)``: one row's width for :func:`~seqpack.hf.rows`' ``[rows, T]``
batches, which carry no ``attention_mask`` (a mask beside packed ``position_ids`` would make
transformers' sdpa and eager attention build a padding mask instead of the packed one).
:class:`SFTTokenCount` puts the right count in its place.

TRL 1.16's ``DPOTrainer`` reads per-token log-probabilities from its models' fused LM head
on a padded ``[2P, S]`` batch; :class:`PackedDPO` makes its models answer that call from
:class:`~seqpack.hf.PreferenceCollator`'s packed rows, so TRL's loss code stays in charge.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping

import torch

from ..data.supervision import IGNORE_INDEX
from ..errors import InvalidInputError
from ..torch.pairs import pair_logprobs
from ..torch.sequences import target_statistics
from .attention import check_runs_attention_functions


def token_count(fields: dict) -> torch.Tensor:
    """The tokens of a :func:`~seqpack.hf.rows` batch as TRL's padding-free collator counts
    them: every example's input cells and its last target, ``sum(len(input_ids))`` of the
    features packed (an int64 scalar on the batch's device)."""
    if not isinstance(fields, Mapping) or not {"valid_lengths", "position_ids"} <= fields.keys():
        raise InvalidInputError("token_count takes the fields of a seqpack.hf.rows() batch (with valid_lengths and "
                                f"position_ids), not {type(fields).__name__}"
                                + (f" with keys {sorted(fields)}" if isinstance(fields, Mapping) else ""))
    lengths = fields["valid_lengths"]
    positions = fields["position_ids"]
    columns = torch.arange(positions.shape[1], device=positions.device)
    starts = (positions == 0) & (columns[None, :] < lengths[:, None])
    return lengths.sum() + starts.sum()


class SFTTokenCount:
    """A mixin for ``trl.SFTTrainer`` (before it in the bases) trained with
    :class:`~seqpack.hf.PackingCollator`: its ``num_tokens`` metric counts each batch's
    tokens (:func:`token_count`, gathered over processes) as TRL counts its own
    padding-free batches, instead of one row's width; so does Trainer's
    ``num_input_tokens_seen`` with ``include_num_input_tokens_seen="non_padding"`` (it
    counted a row's padding cells as tokens whenever the pad token is not ID 0).

    ``class Trainer(seqpack.hf.SFTTokenCount, trl.SFTTrainer): pass``; batches without
    ``valid_lengths`` (not from :func:`~seqpack.hf.rows`) keep TRL's count. It reads TRL
    1.16's ``_total_train_tokens``, ``_tp_size`` and ``_metrics``.

    On such batches a ``compute_loss_func`` or label smoothing is refused with an
    :class:`~seqpack.InvalidInputError`: they shift ``labels`` themselves, and a full row's
    last target lies past the end of its ``labels`` (the model reads ``shift_labels``).
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if "valid_lengths" in inputs and (self.compute_loss_func is not None or self.label_smoother is not None):
            what = "a compute_loss_func" if self.compute_loss_func is not None else "label smoothing"
            raise InvalidInputError(f"{what} shifts the labels of seqpack.hf.rows() batches itself, and would drop "
                                    f"each full row's last target (the model reads shift_labels): leave it off")
        before = self._total_train_tokens
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if self.model.training and "valid_lengths" in inputs:
            counted = self.accelerator.gather_for_metrics(token_count(inputs)).sum().item()
            self._total_train_tokens = before + counted // self._tp_size
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result

    def _track_num_input_tokens(self, inputs):  # (transformers 5's Trainer hook)
        if self.args.include_num_input_tokens_seen != "non_padding" or "valid_lengths" not in inputs:
            return super()._track_num_input_tokens(inputs)
        counted = token_count(inputs).to(self.args.device)
        self.state.num_input_tokens_seen += self.accelerator.gather(counted).sum().item()


class PackedDPO:
    """A mixin for ``trl.DPOTrainer`` (before it in the bases) trained on
    :class:`~seqpack.hf.PreferenceCollator`'s batches: the policy and the reference run on
    the packed rows, and TRL's own code computes everything else.

    The lines that make a TRL 1.16 DPO script packed::

        seqpack.hf.register()       # then: from_pretrained(..., attn_implementation="seqpack")
        collator = seqpack.hf.PreferenceCollator(seqpack.PackConfig(capacity=4096, rows_per_batch=8),
                                                 tokenizer_identity=TokenizerFile(path, eos=eos).identity)
        class Trainer(seqpack.hf.PackedDPO, trl.DPOTrainer): pass
        trainer = Trainer(model=model, args=DPOConfig(..., max_length=None), train_dataset=dataset,
                          processing_class=tokenizer, data_collator=collator)

    TRL asks its models for per-token log-probabilities with ``model(..., labels=labels,
    fused_lm_head=True)``. Given a batch's ``packed_rows``, the policy and the reference
    (wrapped when the trainer is built; a ``copy.deepcopy`` of a wrapped model, such as the
    next round's reference in iterative DPO, runs its own weights) run on the packed rows instead, take each
    sequence's sum from :func:`seqpack.torch.pair_logprobs` and answer in the layout of
    TRL's padded batch: ``log_probs`` ``[2P, 1]`` (one sum per sequence, which TRL sums over
    dim 1) and the per-token ``entropy``, ``mean_logits`` and ``is_top1`` of its completion
    tokens. TRL's loss types (``sigmoid``, ``ipo``, ``hinge``...), ``beta``,
    ``precompute_ref_log_probs`` and metrics (``rewards/*``, ``logps/*``, ``logits/*``,
    ``entropy``, ``mean_token_accuracy``, ``num_tokens``) then behave exactly as in TRL's
    padded run. Unlike TRL's fused head, the model builds its logits (``[rows, T, V]``) for
    the packed rows.

    Refused with an :class:`~seqpack.InvalidInputError`: options that read each token's
    log-probability (``ld_alpha``, ``use_weighting``, ``loss_type="sft"``) and the MoE
    auxiliary loss, and a model that never calls an attention function (OpenAI GPT), when
    the trainer is built; a model call without ``packed_rows`` (a
    collator other than ``PreferenceCollator``), and a sequence longer than
    ``DPOConfig.max_length``, which TRL would truncate where ``PreferenceCollator`` never
    does (set ``max_length=None``: the capacity bounds the pairs).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._run_on_packed_rows()

    def _precompute_ref_logps(self, dataset, name, batch_size):
        self._run_on_packed_rows()  # TRL precomputes inside its __init__, before ours continues
        return super()._precompute_ref_logps(dataset, name, batch_size)

    def _run_on_packed_rows(self) -> None:
        """Refuse what a sum per sequence cannot give, then wrap the policy and the reference (once)."""
        refused = {
            "DPOConfig(ld_alpha=...) weighs each token's log-probability": self.ld_alpha is not None,
            "DPOConfig(use_weighting=True) weighs each token's log-probability": self.use_weighting,
            "loss_type 'sft' averages each token's log-probability": "sft" in self.loss_types,
            "the MoE auxiliary loss needs the router logits of a padded batch (set router_aux_loss_coef=0.0)":
                self.aux_loss_enabled,
        }
        for reason, applies in refused.items():
            if applies:
                raise InvalidInputError(f"{reason}; PackedDPO gives TRL one sum per sequence")
        from accelerate.utils import is_peft_model

        policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
        for model in (policy, self.ref_model):
            if model is not None:
                model = self.accelerator.unwrap_model(model)
                check_runs_attention_functions(model)
                _wrap(model, self.args.max_length)


#: The keys of ``packed_rows`` the model's forward takes.
_MODEL_KEYS = ("input_ids", "position_ids", "valid_lengths", "use_cache")


def _wrap(model, max_length: int | None) -> None:
    """Make ``model``'s fused forward (TRL's) run on a call's ``packed_rows``.

    The new forward is bound to the model, and reads the model it runs through ``self``
    on each call, so a ``copy.deepcopy`` of the model (an iterative-DPO reference) runs
    its own weights; a call without ``fused_lm_head`` goes to the forward it replaced. A
    later trainer on the same model (TRL wraps our forward in its own again) wraps anew
    under an attribute of its own, so each wrapper goes on to the forward it replaced.
    """
    if getattr(model.forward, "runs_packed_rows", False):
        return
    wraps = getattr(model, "_seqpack_wraps", 0)
    replaced = f"_seqpack_unpacked_forward_{wraps}"
    setattr(model, replaced, model.forward)
    model._seqpack_wraps = wraps + 1

    @functools.wraps(type(model).forward)  # its signature, as TRL keeps it for generate
    def forward(self, *args, packed_rows=None, fused_lm_head=False, **kwargs):
        if not fused_lm_head:  # generation, or TRL's extra forward for logits: its padded batch
            return getattr(self, replaced)(*args, **kwargs)
        if packed_rows is None:
            raise InvalidInputError("PackedDPO's models run on packed rows, and this batch has none: give the "
                                    "trainer a seqpack.hf.PreferenceCollator as its data_collator")
        return _packed_output(functools.partial(type(self).forward, self), packed_rows, kwargs["labels"],
                              max_length)

    forward.runs_packed_rows = True
    model.forward = types.MethodType(forward, model)


def _packed_output(run, packed: dict, labels: torch.Tensor, max_length: int | None):
    """TRL's fused-head output for its padded batch (``labels`` ``[2P, S]``, -100 outside the
    completions, every chosen sequence then every rejected one), computed on ``packed``."""
    from trl.trainer.utils import FusedCausalLMOutput

    if max_length is not None and labels.shape[1] > max_length:
        raise InvalidInputError(
            f"a sequence of this batch has {labels.shape[1]} tokens; DPOConfig's max_length is {max_length}, so TRL "
            f"would truncate it, and PreferenceCollator never truncates: set max_length=None"
        )
    logits = run(**{key: packed[key] for key in _MODEL_KEYS}).logits                    # [rows, T, V]
    pairs = pair_logprobs(logits, packed)
    mask = labels[:, 1:] != IGNORE_INDEX                                                # [2P, S - 1]
    where, counts = _padded_rows(pairs, mask)
    sums = torch.stack([pairs.chosen, pairs.rejected], 1).flatten()                    # [2P], occurrence order
    order = torch.argsort(torch.repeat_interleave(where, counts), stable=True)         # the targets in TRL's order
    entropy, mean_logits, is_top1 = (value[order] for value in target_statistics(logits, packed))
    return FusedCausalLMOutput(
        log_probs=sums[where.argsort()][:, None],
        entropy=entropy.new_zeros(mask.shape).masked_scatter(mask, entropy),
        mean_logits=mean_logits.new_zeros(mask.shape).masked_scatter(mask, mean_logits),
        is_top1=is_top1.new_zeros(mask.shape).masked_scatter(mask, is_top1),
        label_mask=mask,
    )


def _padded_rows(pairs, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, counts)`` ``[2P]`` in occurrence order: the row of TRL's padded batch holding each
    packed sequence (pair ``k``'s chosen: ``pair_ids[k]``, its rejected: ``P + pair_ids[k]``) and
    its supervised targets, once ``mask`` (the padded batch's targets) has these very rows."""
    count = pairs.chosen.numel()
    if pairs.pair_ids is not None and mask.shape[0] == 2 * count:
        rows = torch.stack([pairs.pair_ids, pairs.pair_ids + count], 1).flatten()
        counts = torch.stack([pairs.chosen_counts, pairs.rejected_counts], 1).flatten()
        if torch.equal(rows.sort().values, torch.arange(2 * count, device=rows.device)) and \
                torch.equal(mask.sum(1)[rows], counts):
            return rows, counts
    raise InvalidInputError("packed_rows and the padded batch beside it hold different sequences: pass "
                            "PreferenceCollator's batches as they are")
