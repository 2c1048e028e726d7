"""PyTorch integration: a batch's tensors and exports, range attention with autograd, the
token-weighted objective across micro-batches and ranks, per-occurrence and per-pair
log-probabilities, and resumable datasets.

Importable only when PyTorch is installed (``pip install 'seqpack[torch]'``); ``import
seqpack`` never imports it. Tensors are CPU tensors in PyTorch's conventions
(``[B, H, T, D]`` attention inputs, int64 indices, ``-100`` ignored targets).
"""

try:
    import torch  # noqa: F401 (absolute: PyTorch itself, not this package)
except ImportError as error:  # pragma: no cover - exercised in a subprocess without torch
    raise ImportError(
        "seqpack.torch needs PyTorch, which is not installed: pip install 'seqpack[torch]'"
    ) from error

from .attention import range_attention
from .counts import step_target_count
from .datasets import BatchDataset, IterableBatchDataset
from .exports import (
    cu_seqlens,
    document_block_mask,
    document_ids,
    max_seqlen,
    position_ids,
    seq_lens,
)
from .objective import LossAccumulator, token_weighted_loss
from .pairs import PairLogprobs, pair_logprobs
from .sequences import SequenceLogprobs, sequence_logprobs, token_logprobs
from .tensors import IGNORE_INDEX, tensors

__all__ = [
    "IGNORE_INDEX", "LossAccumulator", "BatchDataset", "IterableBatchDataset", "cu_seqlens",
    "document_block_mask", "document_ids", "max_seqlen", "PairLogprobs", "pair_logprobs", "position_ids",
    "range_attention", "seq_lens",
    "SequenceLogprobs", "sequence_logprobs", "step_target_count", "tensors", "token_logprobs", "token_weighted_loss",
]
