"""The chapters' constructed loss probe: exact logits that expose wrong loss denominators.

The probe builds finite logits whose softmax gives each gold target a chosen
probability ``q`` (gold logit ``ln((V-1) q / (1-q))``, all others 0) and compares the
token-weighted mean with the wrong denominators (per storage cell, per row, per
document). The gold probabilities are the chapters' constructed values.
"""

from __future__ import annotations

import numpy as np

from ..data.binding import BatchBinding
from ..errors import InvalidInputError
from ..nn.loss import masked_loss
from .fixtures import DOCUMENTS, chapter_batch


def constructed_logits(batch, gold_probabilities: np.ndarray) -> np.ndarray:
    """Finite logits ``[rows, T, V]`` whose softmax gives each eligible target probability ``q``.

    ``gold_probabilities`` ``[rows, T]`` holds ``q`` in ``(0, 1)`` at eligible cells (other
    cells are ignored). The gold logit is ``ln((V-1) q / (1-q))`` and every other logit 0.
    """
    classes = batch.binding.vocabulary_size
    eligible = np.asarray(batch.loss_mask, dtype=bool)
    gold = np.asarray(gold_probabilities, dtype=np.float64)
    if gold.shape != eligible.shape:
        raise InvalidInputError(f"constructed gold probabilities have shape {gold.shape}; the batch is {eligible.shape}")
    q = gold[eligible]
    if not np.all((q > 0) & (q < 1)):  # NaN fails too
        raise InvalidInputError("constructed gold probabilities must lie strictly between 0 and 1")
    logits = np.zeros(tuple(batch.shape) + (classes,))
    rows, columns = np.nonzero(eligible)
    logits[rows, columns, batch.targets[rows, columns]] = np.log((classes - 1) * q / (1 - q))
    return logits


def loss_probe(batch, gold_probabilities: np.ndarray) -> dict[str, float | int]:
    """The constructed probe's loss and the wrong denominators it exposes.

    Returns the raw ``loss_sum``, ``count`` and token-weighted ``mean``, and three means
    that weight targets differently: ``per_cell_mean`` (divide by every storage cell),
    ``row_mean`` (average of row means) and ``document_mean`` (average of segment means).
    """
    loss = masked_loss(constructed_logits(batch, gold_probabilities), batch)
    width = batch.shape[1]
    return {
        "loss_sum": loss.loss_sum,
        "count": loss.count,
        "mean": loss.mean,
        "per_cell_mean": loss.loss_sum / (batch.shape[0] * width),
        "row_mean": _mean_of_group_means(loss.target_losses, loss.cells // width),
        "document_mean": _mean_of_group_means(
            loss.target_losses, np.asarray(batch.segments).reshape(-1)[loss.cells]
        ),
    }


def _mean_of_group_means(losses: np.ndarray, groups: np.ndarray) -> float:
    _, index = np.unique(groups, return_inverse=True)
    sums = np.bincount(index, weights=losses)
    counts = np.bincount(index)
    return float(np.mean(sums / counts))


# The constructed gold probability of every target, by document.
_GOLD = {
    "padded": {"short": [1 / 2, 1 / 4], "long": [1 / 2, 1 / 2, 1 / 4, 1 / 2]},
    "packed": {"A": [1 / 2] * 3, "B": [1 / 4] * 2, "C": [1 / 2] * 4},
}


def gold_probabilities(batch) -> np.ndarray:
    """``[rows, T]`` constructed gold probabilities of the chapter batch (NaN off-target)."""
    gold = np.full(batch.shape, np.nan)
    for occurrence, example in zip(batch.occurrences, batch.examples):
        expected = _FIXTURE_TOKENS.get(example.id)
        if expected is None or example.source_tokens.tolist() != expected:
            raise InvalidInputError(f"example {example.id!r} is not a chapter fixture example (its id and tokens)")
        gold[occurrence.row, occurrence.columns.start : occurrence.columns.stop] = _GOLD_BY_ID[example.id]
    return gold


_GOLD_BY_ID = {name: values for table in _GOLD.values() for name, values in table.items()}
_FIXTURE_TOKENS = {name: tokens for table in DOCUMENTS.values() for name, tokens in table.items()}


def loss_probe_section(kind: str) -> dict:
    """The constructed loss probe: sum, count, token-weighted mean and the wrong denominators."""
    binding = BatchBinding.fixture()
    batch = chapter_batch(kind, binding)
    probe = loss_probe(batch, gold_probabilities(batch))
    section = {
        "vocabulary_size": binding.vocabulary_size,
        "gold_logit_rule": "z_y = ln((V - 1) q / (1 - q)), other logits 0",
        "loss_sum": probe["loss_sum"],
        "valid_targets": probe["count"],
        "storage_cells": batch.shape[0] * batch.shape[1],
        "mean": probe["mean"],
        "wrong_document_mean": probe["document_mean"],
    }
    if kind == "padded":
        section["wrong_per_cell_mean"] = probe["per_cell_mean"]
    else:
        section["wrong_row_mean"] = probe["row_mean"]
    return section
