"""Preference pairs' log-probabilities: each pair's chosen and rejected sums, what DPO's
losses read.

Pair ``p`` is examples ``2p`` (chosen) and ``2p + 1`` (rejected). A batch holds whole
pairs: in occurrence order (row-major), each chosen directly followed by its rejected, as
``seqpack.pack(..., pairs=True)`` places them (side by side in one row). The sums are
:func:`~seqpack.torch.sequence_logprobs`' own (no second gather), so its rules hold here:
only supervised targets are read, NaN anywhere else reaches no sum and no gradient, and the
results are bitwise the same on every run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidInputError
from ..layout.batch import BatchLayout
from .sequences import sequence_logprobs
from .tensors import _described, batch_tensors, is_integer_tensor


@dataclass(frozen=True)
class PairLogprobs:
    """Each pair's summed ``log p`` of its chosen and of its rejected sequence's supervised
    targets, in the batch's pair order.

    ``chosen`` and ``rejected`` ``[P]``: differentiable with respect to the logits (float32
    for half-precision logits, else their dtype); ``chosen_counts`` and ``rejected_counts``
    ``[P]`` int64: their supervised targets. ``pair_ids`` ``[P]`` int64: each pair's number
    ``p`` (its chosen example's ordinal // 2) for a batch or its ``tensors()`` dict; for a
    ``rows()`` or ``flat()`` dict, the dict's own ``pair_ids`` (as
    ``seqpack.hf.PreferenceCollator`` records them), else None. All on the logits' device.
    """

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_counts: torch.Tensor
    rejected_counts: torch.Tensor
    pair_ids: torch.Tensor | None


def pair_logprobs(logits: torch.Tensor, batch) -> PairLogprobs:
    """Each preference pair's chosen and rejected summed log-probabilities.

    ``logits`` and ``batch`` as :func:`~seqpack.torch.sequence_logprobs` takes them (a
    padded or packed batch, its ``tensors()``, ``rows()`` or ``flat()`` dict); occurrences
    ``2k`` and ``2k + 1`` are pair ``k``'s chosen and rejected sequences. For a DPO loss:
    ``(policy.chosen - reference.chosen) - (policy.rejected - reference.rejected)``.

    Refused with :class:`~seqpack.InvalidInputError`, beside ``sequence_logprobs``'
    refusals: an odd number of occurrences; in a batch or its ``tensors()`` dict, an
    occurrence pair whose ordinals are not ``2p`` then ``2p + 1`` (named by occurrence);
    a dict's ``pair_ids`` that is not an integer tensor of one ID per pair.
    """
    ordinals, what = _ordinals(batch)
    if ordinals is not None:
        _check_whole_pairs(ordinals, batch, what)
    scored = sequence_logprobs(logits, batch)
    count = scored.sums.numel()
    if count % 2:
        raise InvalidInputError(f"{what} holds {count} occurrences, not whole preference pairs: pair p is "
                                f"examples 2p (chosen) and 2p + 1 (rejected), one after the other")
    if ordinals is not None:
        pair_ids = torch.from_numpy(ordinals[0::2] // 2)
    else:
        pair_ids = _recorded_pair_ids(batch, what, count // 2)
    return PairLogprobs(
        scored.sums[0::2], scored.sums[1::2], scored.counts[0::2], scored.counts[1::2],
        None if pair_ids is None else pair_ids.to(scored.sums.device),
    )


def _ordinals(batch) -> tuple[np.ndarray | None, str]:
    """The ordinal of each occurrence (int64, occurrence order) where the input records
    them (a batch, its ``tensors()`` dict: the segment of each occurrence's first cell),
    and the input as errors name it."""
    if isinstance(batch, BatchLayout):
        return batch.occurrence_records["ordinal"].astype(np.int64), "the batch"
    if isinstance(batch, Mapping) and "segments" in batch:
        fields = batch_tensors(batch)
        width = fields["positions"].shape[1]
        valid = torch.arange(width)[None, :] < fields["valid_lengths"][:, None]
        starts = valid & (fields["positions"] == 0)                                     # [rows, T], row-major
        return fields["segments"][starts].numpy().astype(np.int64), "the tensors() dict"
    if isinstance(batch, Mapping):
        return None, "the flat() dict" if "cu_seq_lens_q" in batch or "seq_idx" in batch else "the rows() dict"
    return None, "the input"  # sequence_logprobs refuses it


def _check_whole_pairs(ordinals: np.ndarray, batch, what: str) -> None:
    """Occurrences ``2k`` and ``2k + 1`` must be some pair's chosen (ordinal ``2p``) then its rejected."""
    if ordinals.size % 2:
        raise InvalidInputError(f"{what} holds {ordinals.size} occurrences, not whole preference pairs: pair p "
                                f"is examples 2p (chosen) and 2p + 1 (rejected), one after the other")
    chosen, rejected = ordinals[0::2], ordinals[1::2]
    broken = np.flatnonzero((chosen % 2 != 0) | (rejected != chosen + 1))
    if broken.size:
        k = 2 * int(broken[0])
        ids = batch.example_ids if isinstance(batch, BatchLayout) else None
        named = [f"occurrence {i} (ordinal {ordinals[i]}{'' if ids is None else f', example {ids[i]!r}'})"
                 for i in (k, k + 1)]
        raise InvalidInputError(
            f"{what}: {named[0]} and {named[1]} are not one preference pair, which is ordinals 2p (chosen) "
            f"then 2p + 1 (rejected), consecutive in occurrence order (pack with pairs=True)"
        )


def _recorded_pair_ids(batch: dict, what: str, pairs: int) -> torch.Tensor | None:
    """The dict's ``pair_ids`` (int64 on the CPU) once it holds one integer per pair, or None."""
    value = batch.get("pair_ids")
    if value is None:
        return None
    if not (is_integer_tensor(value) and value.shape == (pairs,)):
        raise InvalidInputError(f"{what}'s pair_ids must be an integer tensor of shape ({pairs},), one ID per "
                                f"pair of its {2 * pairs} occurrences, not {_described(value)}")
    return value.detach().cpu().long()
