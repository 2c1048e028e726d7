"""Fused range attention against PyTorch SDPA with a dense boolean block-causal mask."""

import numpy as np
import pytest

from seqpack.nn.attention import range_attention_backward, range_attention_forward

torch = pytest.importorskip("torch", reason="the SDPA oracle needs the torch extra: pip install 'seqpack[torch]'")

pytestmark = pytest.mark.kernel


def dense_mask(valid_lengths, segment_starts):
    """[rows, 1, T, T] permission; inactive queries see only themselves (SDPA needs one key)."""
    width = segment_starts.shape[1]
    column = np.arange(width)
    active = column[None, :] < valid_lengths[:, None]
    starts = np.where(active, segment_starts, 0)
    keys, queries = column[None, None, :], column[None, :, None]
    mask = active[:, :, None] & active[:, None, :] & (keys >= starts[:, :, None]) & (keys <= queries)
    mask |= ~active[:, :, None] & (keys == queries)
    return mask[:, None], active


@pytest.mark.parametrize("width", [1, 17, 64, 129])
def test_matches_sdpa_with_a_dense_mask_in_float64(width):
    rng = np.random.default_rng(width)
    lengths = np.array([width, 0, width - width // 3])
    starts = np.zeros((3, width), dtype=np.int64)
    for column in range(width):
        starts[0, column] = column - column % 16  # segments of 16 tokens
        starts[2, column] = 0 if column < width // 2 else width // 2
    mask, active = dense_mask(lengths, starts)
    q, k, v, dout = (rng.standard_normal((3, 2, width, 8)) for _ in range(4))
    dout *= active[:, None, :, None]  # SDPA's padded queries must not feed the objective
    out, lse = range_attention_forward(q, k, v, lengths, starts)
    grads = range_attention_backward(q, k, v, out, lse, dout, lengths, starts)

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.from_numpy(mask)
    )
    expected.backward(torch.from_numpy(dout))
    valid = active[:, None, :, None]
    assert lengths[1] == 0 and not active[1].any()  # the all-padding row really occurs
    np.testing.assert_allclose(out * valid, expected.detach().numpy() * valid, rtol=1e-9, atol=1e-10)
    # Inactive queries (SDPA's only see themselves) are defined: exactly zero output and lse.
    np.testing.assert_array_equal(out * ~valid, 0.0)
    np.testing.assert_array_equal(lse * ~active[:, None, :], 0.0)
    for grad, tensor in zip(grads, (tq, tk, tv)):
        np.testing.assert_allclose(grad, tensor.grad.numpy() * valid, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["b", "c"])
def test_the_benchmarks_dense_mask_peer_computes_what_the_fused_kernels_do(name):
    # Its padding queries gave outputs and, through the upstream gradient there, dV (review).
    from seqpack.bench.attention import dense_mask_attention
    from seqpack.bench.workloads import workload

    w = workload(name)
    q, k, v, dout = w.tensors("float64")
    out, lse = range_attention_forward(q, k, v, w.valid_lengths, w.segment_starts)
    grads = range_attention_backward(q, k, v, out, lse, dout, w.valid_lengths, w.segment_starts)
    leaves = [torch.from_numpy(x).requires_grad_(True) for x in (q, k, v)]
    dense = dense_mask_attention(torch, w)(*leaves)
    dense.backward(torch.from_numpy(dout))
    for ours, theirs in zip((out, *grads), (dense, *(leaf.grad for leaf in leaves))):
        np.testing.assert_allclose(theirs.detach().numpy(), ours, rtol=1e-9, atol=1e-10)
