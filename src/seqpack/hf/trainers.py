"""What TRL's trainers count of a packed batch, counted as TRL's own padding-free batches count it.

TRL 1.16's ``SFTTrainer`` logs ``num_tokens`` from ``attention_mask.sum()``, else from
``position_ids.size(1)``: one row's width for :func:`~seqpack.hf.rows`' ``[rows, T]``
batches, which carry no ``attention_mask`` (a mask beside packed ``position_ids`` would make
transformers' sdpa and eager attention build a padding mask instead of the packed one).
:class:`SFTTokenCount` puts the right count in its place.
"""

from __future__ import annotations

import torch


def token_count(fields: dict) -> torch.Tensor:
    """The tokens of a :func:`~seqpack.hf.rows` batch as TRL's padding-free collator counts
    them: every example's input cells and its last target, ``sum(len(input_ids))`` of the
    features packed (an int64 scalar on the batch's device)."""
    lengths = fields["valid_lengths"]
    positions = fields["position_ids"]
    columns = torch.arange(positions.shape[1], device=positions.device)
    starts = (positions == 0) & (columns[None, :] < lengths[:, None])
    return lengths.sum() + starts.sum()


class SFTTokenCount:
    """A mixin for ``trl.SFTTrainer`` (before it in the bases) trained with
    :class:`~seqpack.hf.PackingCollator`: its ``num_tokens`` metric counts each batch's
    tokens (:func:`token_count`, gathered over processes) as TRL counts its own
    padding-free batches, instead of one row's width.

    ``class Trainer(seqpack.hf.SFTTokenCount, trl.SFTTrainer): pass``; batches without
    ``valid_lengths`` (not from :func:`~seqpack.hf.rows`) keep TRL's count. It reads TRL
    1.16's ``_total_train_tokens``, ``_tp_size`` and ``_metrics``.
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        before = self._total_train_tokens
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if self.model.training and "valid_lengths" in inputs:
            counted = self.accelerator.gather_for_metrics(token_count(inputs)).sum().item()
            self._total_train_tokens = before + counted // self._tp_size
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result
