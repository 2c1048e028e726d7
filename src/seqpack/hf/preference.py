"""Preference pairs for ``trl.DPOTrainer``: TRL's prepared features packed into rows, beside
the per-sequence view TRL's loss code reads.

Pair ``p`` of a call is feature ``p``: its chosen sequence ``prompt_ids + chosen_ids`` and its
rejected ``prompt_ids + rejected_ids``, supervised on the completion only (TRL's
``completion_mask``: a token counts as a target from the completion's first token on; a
sequence's first token is never a target). The two sequences of a pair share one row,
side by side, so a pair never spans batches (``seqpack.pack(..., pairs=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..errors import CapacityError, InvalidInputError
from ..packing.config import PackConfig
from .collators import check_feature, check_features, collator_setup, one_batch, rows, token_ids

#: The token IDs of a feature, as TRL's ``DPOTrainer`` prepares them.
PAIR_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")
#: The reference log-probabilities ``precompute_ref_log_probs=True`` adds to each feature.
REFERENCE_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
#: The key under which a call's packed rows travel.
PACKED_KEY = "packed_rows"


class PreferenceCollator:
    """A ``data_collator`` for ``trl.DPOTrainer``: packs a list of preference features into one
    batch.

    ``PreferenceCollator(config, *, tokenizer_identity, policy="best-fit-decreasing",
    split="hf-collator")``: each feature holds TRL's ``prompt_ids``, ``chosen_ids`` and
    ``rejected_ids`` (IDs of ``tokenizer_identity``'s vocabulary, taken as given: the collator
    adds no token), and ``ref_chosen_logps`` and ``ref_rejected_logps`` when TRL precomputed
    them. Feature ``p`` is pair ``p``; ``policy`` places each pair whole, its two sequences
    side by side in one row of ``config.capacity`` predictions.

    The call returns what TRL's ``DataCollatorForPreference`` returns (``input_ids``,
    ``attention_mask``, ``completion_mask``: int64 ``[2P, S]``, every chosen sequence then
    every rejected one, right-padded with 0; the reference log-probabilities as TRL stacks
    them), which TRL's loss code reads, plus ``packed_rows``: :func:`~seqpack.hf.rows` of the
    packed batch and ``pair_ids`` (int64 ``[P]``: the feature of each packed pair, in
    occurrence order), from which :class:`~seqpack.hf.PackedDPO` runs the model and
    ``seqpack.torch.pair_logprobs(logits, packed_rows)`` reads each pair's sums. Unlike
    TRL's collator it never truncates: every sequence is packed whole.

    Refused with an :class:`~seqpack.InvalidInputError` naming the feature: a missing
    ``prompt_ids``, ``chosen_ids`` or ``rejected_ids``; IDs that are not a 1-D integer
    sequence, or outside the vocabulary; an empty completion; a sequence of one token (no
    target); a reference log-probability in some features only, or not a number. A pair
    with more predictions than ``config.capacity``, or more rows than
    ``config.rows_per_batch``, is a :class:`~seqpack.CapacityError`. Other keys are ignored,
    as TRL's collator ignores them.
    """

    def __init__(self, config: PackConfig, *, tokenizer_identity, policy: str = "best-fit-decreasing",
                 split: str = "hf-collator"):
        self.config, self.policy, self.binding = collator_setup(config, tokenizer_identity, policy, split)

    def __call__(self, features: Sequence[dict]) -> dict:
        check_features("PreferenceCollator", features)
        pairs = [self._pair(index, feature) for index, feature in enumerate(features)]
        references = _references(features)
        documents = [np.concatenate([prompt, completion]) for prompt, *completions in pairs
                     for completion in completions]                         # pair p: documents 2p and 2p + 1
        prompt_lengths = np.repeat([prompt.size for prompt, _, _ in pairs], 2)
        supervision = [np.arange(d.size) >= n for d, n in zip(documents, prompt_lengths.tolist())]
        names = [f"feature {p} {side}" for p in range(len(pairs)) for side in ("chosen", "rejected")]
        batch = one_batch(documents, supervision, self.config, self.policy, self.binding,
                          features=len(features), pairs=True, ids=names)
        packed = rows(batch)
        packed["pair_ids"] = torch.from_numpy(batch.occurrence_records["ordinal"][0::2].astype(np.int64) // 2)
        order = [*range(0, len(documents), 2), *range(1, len(documents), 2)]  # TRL's: every chosen, then rejected
        return {**_padded([documents[i] for i in order], prompt_lengths[order]), **references, PACKED_KEY: packed}

    def _pair(self, index: int, feature: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(prompt, chosen, rejected)`` IDs of feature ``index``, once they make a pair that fits a row."""
        check_feature(index, feature)
        missing = [key for key in PAIR_KEYS if key not in feature]
        if missing:
            raise InvalidInputError(f"feature {index} lacks {', '.join(missing)}; its keys are {sorted(feature)} "
                                    f"(trl.DPOTrainer prepares {', '.join(PAIR_KEYS)})")
        prompt, chosen, rejected = (token_ids(index, key, feature[key]) for key in PAIR_KEYS)
        for key, completion in (("chosen_ids", chosen), ("rejected_ids", rejected)):
            if not completion.size:
                raise InvalidInputError(f"feature {index}: {key} is empty; a completion needs at least one token")
            if prompt.size + completion.size < 2:
                raise InvalidInputError(f"feature {index}: prompt_ids and {key} make a sequence of one token, "
                                        f"which has no target")
        predictions = (prompt.size + chosen.size - 1, prompt.size + rejected.size - 1)
        if sum(predictions) > self.config.capacity:
            raise CapacityError(
                f"feature {index}'s chosen and rejected sequences have {predictions[0]} + {predictions[1]} = "
                f"{sum(predictions)} predictions, and a pair shares one row; PackConfig's capacity is "
                f"{self.config.capacity}: raise it to at least {sum(predictions)}",
                sum(predictions), self.config.capacity,
            )
        return prompt, chosen, rejected


def _references(features: Sequence[dict]) -> dict:
    """Each of TRL's precomputed reference keys the features carry, stacked as TRL stacks it
    (``torch.tensor`` of the values), once every feature carries it and it makes a 1-D
    real tensor: integers stay integers, as TRL keeps them (its loss promotes them)."""
    stacked = {}
    for key in REFERENCE_KEYS:
        lacking = [index for index, feature in enumerate(features) if key not in feature]
        if len(lacking) == len(features):
            continue
        if lacking:
            raise InvalidInputError(f"feature {lacking[0]} lacks {key}, which feature "
                                    f"{next(i for i in range(len(features)) if i not in lacking)} carries")
        try:
            values = torch.tensor([feature[key] for feature in features])
        except (TypeError, ValueError, RuntimeError) as error:
            raise InvalidInputError(f"{key} must be one number per feature: {error}") from None
        if values.shape != (len(features),) or values.dtype == torch.bool or values.is_complex():
            raise InvalidInputError(f"{key} must be one real number per feature; the features give a "
                                    f"{values.dtype} tensor of shape {tuple(values.shape)}")
        stacked[key] = values
    return stacked


def _padded(sequences: list, prompt_lengths: np.ndarray) -> dict:
    """TRL's ``input_ids``, ``attention_mask`` and ``completion_mask`` of ``sequences``: int64
    ``[n, S]`` rows, right-padded with 0, ``S`` the longest."""
    lengths = np.array([sequence.size for sequence in sequences], dtype=np.int64)
    columns = np.arange(lengths.max())[None, :]
    present = columns < lengths[:, None]                                               # [n, S]
    input_ids = np.zeros(present.shape, dtype=np.int64)
    input_ids[present] = np.concatenate(sequences)
    completion = present & (columns >= prompt_lengths[:, None])
    return {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(present.astype(np.int64)),
            "completion_mask": torch.from_numpy(completion.astype(np.int64))}
