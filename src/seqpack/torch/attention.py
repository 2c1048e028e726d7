"""Range attention for PyTorch: an autograd function over the fused edge-only kernels.

``range_attention(q, k, v, ...)`` takes CPU tensors in PyTorch's layout, q ``[B, H, T, D]``
and k, v ``[B, H_kv, T, D]`` with ``H`` a multiple of ``H_kv`` (grouped-query attention:
query head ``h`` uses key/value head ``h // (H // H_kv)``; K and V are never repeated),
and calls :func:`seqpack.nn.attention.range_attention_forward` / ``_backward`` on views
of their memory. The backward recomputes scores from the saved output and log-sum-exp;
``dk``/``dv`` sum over the query heads of their group in a fixed order, so gradients are
bitwise repeatable. float32 and float64 run natively; bfloat16 and float16 are computed
in float32 and returned in the input dtype.

The layout is the batch's: valid query ``t`` of row ``r`` attends to keys
``segment_starts[r, t] .. t``; queries at or past ``valid_lengths[r]`` give zero output
and zero gradients. ``position_ids`` alone is enough: a segment starts where the
position is 0, so ``segment_starts = column - position``.
"""

from __future__ import annotations

import numpy as np
import torch

from .._arguments import integer_array, query_starts, regular_array
from ..errors import InvalidInputError
from ..nn.attention import range_attention_backward, range_attention_forward
from .tensors import is_integer_tensor

#: Dtypes the kernels compute in, and dtypes computed in float32 and cast back.
NATIVE = (torch.float32, torch.float64)
WIDENED = (torch.bfloat16, torch.float16)


def integer_values(name: str, values, shape: tuple | None = None) -> np.ndarray:
    """An integer layout argument (tensor, array or nested list) as a numpy array of its
    own integer dtype, of ``shape`` when given."""
    if isinstance(values, torch.Tensor):
        if not is_integer_tensor(values):
            raise InvalidInputError(f"{name} must hold integers, got {values.dtype}")
        if values.layout != torch.strided:
            raise InvalidInputError(f"{name} is a {str(values.layout).removeprefix('torch.')} tensor; the layout "
                                    f"takes dense integers")
        if values.device.type == "meta":
            raise InvalidInputError(f"{name} is on meta, which holds no values")
        values = values.detach().resolve_neg().cpu().numpy()
    array = regular_array(name, values)
    if array.size and array.dtype.kind not in "iu":
        raise InvalidInputError(f"{name} must hold integers, got dtype {array.dtype}")
    if shape is not None and array.shape != shape:
        raise InvalidInputError(f"{name} has shape {tuple(array.shape)}; expected {shape}")
    return array


def int_array(name: str, values, shape: tuple | None = None) -> np.ndarray:
    """:func:`integer_values` as int64 (a value outside it is named, never wrapped)."""
    array = integer_values(name, values, shape)
    return integer_array(name, array).reshape(array.shape)  # a 0-d input stays 0-d


def starts_from_positions(position_ids: np.ndarray, valid_lengths: np.ndarray) -> np.ndarray:
    """Segment starts ``column - position`` of int64 ``[B, T]`` positions, checked.

    Inside each row's valid prefix a position must be 0 (a segment starts) or the
    previous column's plus 1; cells past the prefix are ignored (start 0).
    """
    rows, width = position_ids.shape
    columns = np.arange(width, dtype=np.int64)
    valid = columns[None, :] < valid_lengths[:, None]
    previous = np.concatenate([np.full((rows, 1), -1, np.int64), position_ids[:, :-1]], axis=1)
    broken = valid & (position_ids != 0) & (position_ids != previous + 1)
    if broken.any():
        row, column = (int(i) for i in np.argwhere(broken)[0])
        before = f"the previous position {previous[row, column]}" if column else "a row's first column"
        raise InvalidInputError(
            f"position_ids[{row}, {column}] = {position_ids[row, column]} after {before}: a position "
            f"must be 0 (a new segment) or the previous one plus 1"
        )
    return np.where(valid, columns[None, :] - position_ids, 0)


def _layout(q: torch.Tensor, segment_starts, valid_lengths, position_ids) -> tuple[np.ndarray, np.ndarray]:
    rows, width = q.shape[0], q.shape[2]
    if valid_lengths is None:
        lengths = np.full(rows, width, dtype=np.int64)
    else:
        lengths = int_array("valid_lengths", valid_lengths, (rows,))  # its range is the kernel's check
    if (segment_starts is None) == (position_ids is None):
        raise InvalidInputError("give exactly one of segment_starts and position_ids")
    # (read where a query is active: an inactive cell's value, even past int64, is never used)
    if segment_starts is not None:
        starts = integer_values("segment_starts", segment_starts, (rows, width))
        return lengths, query_starts("segment_starts", starts, lengths, np.int64)
    positions = integer_values("position_ids", position_ids, (rows, width))
    return lengths, starts_from_positions(query_starts("position_ids", positions, lengths, np.int64), lengths)


def check_kernel_tensor(name: str, tensor, where: str) -> None:
    """``tensor`` can be read by the kernels: a dense (strided) floating CPU tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInputError(f"{name} must be a torch.Tensor, not {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise InvalidInputError(f"{name} is on {tensor.device}; {where} runs on the CPU")
    if tensor.layout != torch.strided:
        raise InvalidInputError(f"{name} is a {str(tensor.layout).removeprefix('torch.')} tensor; {where} takes "
                                f"dense (strided) tensors")
    if tensor.dtype not in NATIVE + WIDENED:
        raise InvalidInputError(f"{name} has dtype {tensor.dtype}; expected a floating dtype")


def kernel_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a float32/float64 CPU tensor, strides kept (bfloat16/float16 widened
    to float32; a lazily negated view, such as ``torch._neg_view``'s, materialized)."""
    tensor = tensor.detach().resolve_neg()
    if tensor.dtype in WIDENED:
        tensor = tensor.float()
    return tensor.numpy()


def check_first_order(what: str = "seqpack attention") -> None:
    """Refuse a backward asked to build a graph (``create_graph=True``: a gradient penalty,
    double backward): the kernels' gradients are not differentiable, and torch's
    ``once_differentiable`` lets such a graph through with the second-order terms
    silently zero when the incoming gradient needs none."""
    if torch.is_grad_enabled():
        raise InvalidInputError(
            f"{what} is differentiable once: its gradients cannot be differentiated again "
            f"(create_graph=True, double backward, gradient penalties)"
        )


def kernel_gradient(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An incoming gradient in the forward's compute ``dtype``, rows of head_dim contiguous
    (an expanded gradient has stride 0 there), never a lazily negated view."""
    grad = grad.resolve_neg()
    if grad.dtype != dtype:
        grad = grad.to(dtype)
    return grad if grad.stride(-1) == 1 else grad.contiguous()


class RangeAttention(torch.autograd.Function):
    """``out = softmax(scale * q k^T) v`` over each query's permitted keys; see the module."""

    @staticmethod
    def forward(ctx, q, k, v, lengths, starts, scale):
        out, lse = range_attention_forward(kernel_view(q), kernel_view(k), kernel_view(v),
                                           lengths, starts, scale=scale)
        out, lse = torch.from_numpy(out), torch.from_numpy(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        # copies: the caller may write into its layout before the backward, which reads it again
        ctx.layout = (lengths.copy(), starts.copy(), scale)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        check_first_order()
        q, k, v, out, lse = ctx.saved_tensors
        lengths, starts, scale = ctx.layout
        dout = kernel_gradient(dout, out.dtype)
        dq, dk, dv = range_attention_backward(
            kernel_view(q), kernel_view(k), kernel_view(v), out.numpy(), lse.numpy(), dout.numpy(),
            lengths, starts, scale=scale,
        )
        grads = [torch.from_numpy(g).to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v))]
        return (*grads, None, None, None)


def range_attention(q, k, v, *, segment_starts=None, valid_lengths=None, position_ids=None, scale=None):
    """Range attention of CPU tensors q ``[B, H, T, D]``, k and v ``[B, H_kv, T, D]``.

    The layout: ``segment_starts`` ``[B, T]`` (each query's first permitted key column)
    or ``position_ids`` ``[B, T]`` (local positions; starts are ``column - position``,
    checked), exactly one of them; ``valid_lengths`` ``[B]`` (None: every cell valid).
    Any integer dtype, as tensors or arrays. ``scale`` (a finite real number, not a bool)
    multiplies the scores (None: ``1 / sqrt(D)``). ``H`` must be a multiple of ``H_kv``.
    Returns ``[B, H, T, D]`` in q's dtype; differentiable in q, k and v (once).
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        check_kernel_tensor(name, tensor, "range_attention")
        if tensor.dim() != 4:
            raise InvalidInputError(f"{name} must be [B, heads, T, D], got shape {tuple(tensor.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise InvalidInputError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    lengths, starts = _layout(q, segment_starts, valid_lengths, position_ids)
    return RangeAttention.apply(q, k, v, lengths, starts, scale)
