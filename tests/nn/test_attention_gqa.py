"""Grouped-query range attention and the score scale against an independent oracle.

The oracle repeats K and V over each group's query heads (in memory, as the kernel
must not), runs a dense masked softmax, and sums the repeated heads' dK and dV back.
"""

import math

import numpy as np
import pytest
from helpers import assert_close, mixed_layout, permitted, starts_from_lengths

from seqpack import InvalidInputError
from seqpack.nn.attention import range_attention_backward, range_attention_forward

pytestmark = pytest.mark.kernel

NAMES = ("out", "lse", "dq", "dk", "dv")


def repeated_oracle(q, k, v, dout, lengths, starts, scale=None):
    """out, lse, dq, dk, dv of sum(out * dout) with K/V repeated, dense and masked."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    mask, active = permitted(lengths, starts)
    mask, cells = mask[:, None], active[:, None, :, None]
    q, k, v, dout = (np.where(cells, x, 0) for x in (q, k, v, dout))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.where(mask, np.einsum("rhtd,rhsd->rhts", q, k) * scale, -np.inf)
    top = np.where(active[:, None], scores.max(axis=-1), 0)
    weights = np.where(mask, np.exp(scores - top[..., None]), 0)
    total = np.where(active[:, None], weights.sum(axis=-1), 1)
    probabilities = weights / total[..., None]  # [rows, heads, T, T]
    out = probabilities @ v
    lse = np.where(active[:, None], top + np.log(total), 0)
    dp = dout @ v.swapaxes(-1, -2)
    ds = probabilities * (dp - (probabilities * dp).sum(axis=-1, keepdims=True))
    dq = ds @ k * scale
    dk = ds.swapaxes(-1, -2) @ q * scale  # [rows, heads, T, d]
    dv = probabilities.swapaxes(-1, -2) @ dout
    rows, heads, width, head_dim = q.shape
    fold = (rows, heads // group, group, width, head_dim)
    return out, lse, dq, dk.reshape(fold).sum(axis=2), dv.reshape(fold).sum(axis=2)


def gqa_inputs(rng, rows, heads, kv_heads, width, head_dim, dtype=np.float64):
    q, dout = (rng.standard_normal((rows, heads, width, head_dim)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((rows, kv_heads, width, head_dim)).astype(dtype) for _ in range(2))
    return q, k, v, dout


def run_both(q, k, v, dout, lengths, starts, **options):
    out, lse = range_attention_forward(q, k, v, lengths, starts, **options)
    grads = range_attention_backward(q, k, v, out, lse, dout, lengths, starts, **options)
    return (out, lse, *grads)


@pytest.mark.parametrize(
    "heads, kv_heads, width, head_dim",
    [(4, 2, 65, 8), (8, 2, 129, 16), (3, 1, 17, 5), (6, 3, 64, 3), (2, 2, 40, 7), (4, 1, 150, 80)],
)
def test_grouped_heads_match_the_repeated_oracle_in_float64(heads, kv_heads, width, head_dim):
    rng = np.random.default_rng(heads * 100 + width)
    lengths, starts = mixed_layout(width, rng)
    assert lengths[1] == 0 and lengths[0] == width  # an all-padding row and a full row occur
    inputs = gqa_inputs(rng, len(lengths), heads, kv_heads, width, head_dim)
    fused = run_both(*inputs, lengths, starts)
    assert fused[3].shape == fused[4].shape == inputs[1].shape
    assert fused[2].shape == inputs[0].shape
    for name, a, b in zip(NAMES, fused, repeated_oracle(*inputs, lengths, starts)):
        assert_close(a, b, name)
    for array in fused:
        assert not array[1].any()  # the all-padding row is exactly zero


def test_grouped_heads_in_float32_are_close_to_the_float64_oracle():
    rng = np.random.default_rng(21)
    lengths, starts = mixed_layout(129, rng)
    inputs = gqa_inputs(rng, len(lengths), 8, 2, 129, 32)
    exact = repeated_oracle(*inputs, lengths, starts)
    low = [x.astype(np.float32) for x in inputs]
    fused = run_both(*low, lengths, starts)
    oracle = repeated_oracle(*low, lengths, starts)  # the same dense oracle, computed in float32
    for name, a, b, c in zip(NAMES, fused, exact, oracle):
        assert a.dtype == np.float32, name
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4 * np.abs(b).max(), err_msg=name)
        # The tolerance above would pass a 1e-4 error in the scale; the float32 kernel's error
        # must stay within a small multiple of a float32 oracle's (as in test_attention).
        fused_error, oracle_error = np.abs(a - b).max(), np.abs(c - b).max()
        assert fused_error <= 4 * oracle_error + 1e-7, (name, fused_error, oracle_error)


def test_grouped_forward_is_bitwise_the_repeated_heads_forward():
    """A query head reads its group's K and V exactly as it would read a repeated copy."""
    rng = np.random.default_rng(22)
    lengths, starts = mixed_layout(100, rng)
    q, k, v, dout = gqa_inputs(rng, len(lengths), 6, 2, 100, 16)
    grouped = run_both(q, k, v, dout, lengths, starts)
    repeated = run_both(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), dout, lengths, starts)
    for name, a, b in zip(NAMES[:3], grouped, repeated):
        assert np.array_equal(a, b), name
    for name, a, b in zip(NAMES[3:], grouped[3:], repeated[3:]):
        assert_close(a, b.reshape(a.shape[:1] + (2, 3) + a.shape[2:]).sum(axis=2), name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grouped_results_are_bitwise_equal_across_thread_counts(dtype):
    rng = np.random.default_rng(23)
    lengths = np.array([256, 230])
    starts = np.zeros((2, 256), dtype=np.int64)
    starts[1, 90:] = 90
    inputs = gqa_inputs(rng, 2, 8, 2, 256, 32, dtype)
    first = run_both(*inputs, lengths, starts, threads=1)
    for threads in (2, 1, 2):
        for name, a, b in zip(NAMES, first, run_both(*inputs, lengths, starts, threads=threads)):
            assert a.tobytes() == b.tobytes(), (name, threads)


def test_nan_in_another_group_leaves_a_group_bit_identical():
    rng = np.random.default_rng(24)
    row, used = starts_from_lengths([30, 20], 60, rng)
    lengths, starts = np.array([used]), row[None]
    q, k, v, dout = gqa_inputs(rng, 1, 4, 2, 60, 8)
    clean = run_both(q, k, v, dout, lengths, starts)
    q2, dout2, k2, v2 = q.copy(), dout.copy(), k.copy(), v.copy()
    q2[:, 2:], dout2[:, 2:], k2[:, 1:], v2[:, 1:] = np.nan, np.nan, np.nan, np.nan  # group 1
    poisoned = run_both(q2, k2, v2, dout2, lengths, starts)
    for name, a, b in zip(NAMES, clean, poisoned):
        heads = slice(0, 1) if name in ("dk", "dv") else slice(0, 2)
        assert np.array_equal(a[:, heads], b[:, heads]), name
        assert np.isnan(b[:, heads.stop :, :used]).all(), name  # the negative control


# --- scale ----------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [0.3, 2.0, -0.5, 0.0])
def test_given_scale_matches_the_oracle(scale):
    rng = np.random.default_rng(25)
    lengths, starts = mixed_layout(70, rng)
    inputs = gqa_inputs(rng, len(lengths), 4, 2, 70, 6)
    fused = run_both(*inputs, lengths, starts, scale=scale)
    for name, a, b in zip(NAMES, fused, repeated_oracle(*inputs, lengths, starts, scale=scale)):
        assert_close(a, b, name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_default_scale_is_one_over_root_head_dim_exactly(dtype):
    rng = np.random.default_rng(26)
    lengths, starts = mixed_layout(50, rng)
    inputs = gqa_inputs(rng, len(lengths), 2, 1, 50, 12, dtype)
    default = run_both(*inputs, lengths, starts)
    explicit = run_both(*inputs, lengths, starts, scale=np.float64(1 / math.sqrt(12)))
    other = run_both(*inputs, lengths, starts, scale=1 / math.sqrt(12) * 1.001)
    for name, a, b, c in zip(NAMES, default, explicit, other):
        assert a.tobytes() == b.tobytes(), name
    assert not np.array_equal(default[0], other[0])


@pytest.mark.parametrize(
    "bad, message",
    [(float("nan"), "scale must be finite"), (np.inf, "scale must be finite"),
     (True, "scale must be a real number or None, got bool"), ("0.5", "scale must be a real number")],
)
def test_bad_scales_are_rejected_beside_a_good_one(bad, message):
    rng = np.random.default_rng(27)
    q, k, v, dout = gqa_inputs(rng, 1, 2, 1, 4, 3)
    lengths, starts = np.array([4]), np.zeros((1, 4), dtype=np.int64)
    out, lse = range_attention_forward(q, k, v, lengths, starts, scale=np.float32(0.5))
    range_attention_backward(q, k, v, out, lse, dout, lengths, starts, scale=1)
    with pytest.raises(InvalidInputError, match=message):
        range_attention_forward(q, k, v, lengths, starts, scale=bad)
    with pytest.raises(InvalidInputError, match=message):
        range_attention_backward(q, k, v, out, lse, dout, lengths, starts, scale=bad)


# --- shapes and buffers -----------------------------------------------------------------


@pytest.mark.parametrize(
    "heads, kv_heads, k_shape, message",
    [(6, 4, None, "q has 6 heads, not a multiple of the 4 key/value heads of k"),
     (2, 0, None, "q has 2 heads, not a multiple of the 0 key/value heads of k"),
     (2, 1, (1, 1, 5, 3), r"k has shape \(1, 1, 5, 3\); expected \(rows, kv_heads, T, head_dim\)"),
     (2, 1, (1, 1, 4, 2), r"k has shape \(1, 1, 4, 2\)")],
)
def test_head_counts_that_do_not_group_are_rejected(heads, kv_heads, k_shape, message):
    lengths, starts = np.array([4]), np.zeros((1, 4), dtype=np.int64)
    q = np.zeros((1, heads, 4, 3))
    range_attention_forward(q, np.zeros((1, 2, 4, 3)), np.zeros((1, 2, 4, 3)), lengths, starts)
    k = np.zeros(k_shape or (1, kv_heads, 4, 3))
    with pytest.raises(InvalidInputError, match=message):
        range_attention_forward(q, k, np.zeros((1, kv_heads, 4, 3)), lengths, starts)
    with pytest.raises(InvalidInputError, match=r"v has shape \(1, 2, 4, 3\); expected \(1, 1, 4, 3\)"):
        range_attention_forward(np.zeros((1, 2, 4, 3)), np.zeros((1, 1, 4, 3)), np.zeros((1, 2, 4, 3)),
                                lengths, starts)


def test_gradient_buffers_have_their_own_shapes_and_must_not_alias():
    rng = np.random.default_rng(28)
    lengths, starts = mixed_layout(30, rng)
    q, k, v, dout = gqa_inputs(rng, len(lengths), 4, 2, 30, 4)
    out, lse = range_attention_forward(q, k, v, lengths, starts)
    expected = range_attention_backward(q, k, v, out, lse, dout, lengths, starts)
    buffers = [np.full_like(q, np.nan), np.full_like(k, np.nan), np.full_like(k, np.nan)]
    grads = range_attention_backward(q, k, v, out, lse, dout, lengths, starts,
                                     dq=buffers[0], dk=buffers[1], dv=buffers[2])
    assert all(g is b for g, b in zip(grads, buffers))
    assert all(np.array_equal(a, b) for a, b in zip(expected, buffers))
    with pytest.raises(InvalidInputError, match="dk has shape"):
        range_attention_backward(q, k, v, out, lse, dout, lengths, starts, dk=np.zeros_like(q))
    with pytest.raises(InvalidInputError, match="dk overlaps k in memory"):
        range_attention_backward(q, k, v, out, lse, dout, lengths, starts, dk=k)
    with pytest.raises(InvalidInputError, match="dk overlaps dv in memory"):
        range_attention_backward(q, k, v, out, lse, dout, lengths, starts, dk=buffers[1], dv=buffers[1])


# --- a scale that does not fit q's dtype ------------------------------------------------


def small_attention(dtype=np.float64):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 1, 4, 3)).astype(dtype) for _ in range(3))
    return q, k, v, np.array([4, 2]), np.array([[0, 0, 2, 2], [0, 1, 0, 0]])


# Regression: a scale that overflows float32 used to be taken silently.
@pytest.mark.parametrize("scale", [1e39, 1e300])
def test_a_scale_that_overflows_float32_is_rejected(scale):
    q, k, v, lengths, starts = small_attention(np.float32)
    out, lse = range_attention_forward(q, k, v, lengths, starts, scale=1e30)  # twin: fits float32
    assert np.isfinite(out).all()
    with pytest.raises(InvalidInputError, match="overflows float32"):
        range_attention_forward(q, k, v, lengths, starts, scale=scale)
    with pytest.raises(InvalidInputError, match="overflows float32"):
        range_attention_backward(q, k, v, out, lse, out, lengths, starts, scale=scale)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    assert np.isfinite(range_attention_forward(q64, k64, v64, lengths, starts, scale=1e39)[1]).all()


# Regression: a scale too large for a float (10**400) was a foreign error, not an InvalidInputError.
def test_a_scale_too_large_for_a_float_is_an_input_error():
    q, k, v, lengths, starts = small_attention()
    range_attention_forward(q, k, v, lengths, starts, scale=10**300)
    with pytest.raises(InvalidInputError, match="scale is too large for a float"):
        range_attention_forward(q, k, v, lengths, starts, scale=10**400)
