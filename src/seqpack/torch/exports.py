"""A batch's permission metadata as tensors, and as a FlexAttention ``BlockMask``.

The same exports as :mod:`seqpack.layout.exports` (see it for their meaning), as CPU
tensors in PyTorch's dtypes: ``position_ids`` int64, ``document_ids`` int32,
``seq_lens`` and ``cu_seqlens`` int32 (flash-attn's varlen convention), ``max_seqlen`` a
Python int. ``document_block_mask`` builds FlexAttention's block mask from the document
ids; on the CPU FlexAttention runs forward only (its backward raises there in torch 2.13
to 2.15): for training on the CPU use :func:`seqpack.torch.range_attention`.
"""

from __future__ import annotations

import torch

from .._arguments import check_int
from ..layout import exports
from .tensors import check_batch, moved


def position_ids(batch, device=None) -> torch.Tensor:
    """Local positions, int64 ``[rows, T]`` (padding 0)."""
    return moved(torch.from_numpy(exports.position_ids(batch)), device)


def document_ids(batch, device=None) -> torch.Tensor:
    """Each valid cell's document index in row-major order, int32 ``[rows, T]``; padding -1."""
    return moved(torch.from_numpy(exports.document_ids(batch)), device)


def seq_lens(batch, device=None) -> torch.Tensor:
    """Token counts of the batch's documents in row-major order, int32."""
    return moved(torch.from_numpy(exports.seq_lens(batch)), device)


def cu_seqlens(batch, device=None) -> torch.Tensor:
    """int32 ``[documents + 1]``: 0, then running token totals (an error at 2**31 or more)."""
    return moved(torch.from_numpy(exports.cu_seqlens(batch)), device)


def max_seqlen(batch) -> int:
    """The longest document's token count (0 for none)."""
    return exports.max_seqlen(batch)


def document_block_mask(batch, *, block_size: int = 128, device=None):
    """A FlexAttention ``BlockMask`` for ``[rows, heads, T, T]`` scores of ``batch``.

    ``mask_mod(b, h, q, kv) = (doc[b, q] == doc[b, kv]) & (q >= kv)`` with the
    :func:`document_ids` ``doc``: a valid query sees the earlier-or-equal keys of its own
    document, exactly ``allowed_key``. Padding queries see earlier padding only (they
    need some key; their outputs are not valid results). The mask broadcasts over heads.
    ``block_size`` is a positive int. Forward only on the CPU.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    batch = check_batch(batch)
    block_size = check_int("block_size", block_size, 1)
    doc = document_ids(batch, device)
    rows, width = batch.shape

    def same_document_causal(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    return create_block_mask(same_document_causal, rows, None, width, width,
                             device="cpu" if device is None else device, BLOCK_SIZE=block_size)
