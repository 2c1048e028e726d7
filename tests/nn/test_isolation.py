"""Packed occurrences cannot see each other (ch05 optional practice).

In the ch05 packed row 0, A owns columns 0-2, B columns 3-4 and column 5 is padding.
Perturbing A's activations leaves B's logits, B-only loss and every parameter gradient of
the B-only objective unchanged; derivatives of B's objective into A's and padding's
activations are exactly zero; removing the range guard (segment starts all 0) shows A's
influence. B's first query has exactly zero derivative into future and padding cells.
"""

import numpy as np
import pytest

from seqpack import BatchBinding, Decoder, DecoderConfig
from seqpack.nn import attention as attention_ops, ops as F
from seqpack.nn.autograd import Tensor
from seqpack.chapters.fixtures import chapter_batch

BINDING = BatchBinding.fixture()
A, B, PADDING = slice(0, 3), slice(3, 5), slice(5, 6)
ATTENTION = ["reference", "fused"]


@pytest.fixture(scope="module")
def batch():
    batch = chapter_batch("packed", BINDING)
    assert batch.segments[0].tolist() == [0, 0, 0, 1, 1, -1]
    return batch


def decoder_for(attention):
    decoder = Decoder(DecoderConfig.large(), 11, attention=attention)
    rng = np.random.default_rng(11)
    for value in decoder.named_parameters().values():
        value[...] += rng.normal(0.0, 0.4, value.shape)
    return decoder


def b_only_run(decoder, batch, perturbation, starts=None):
    """B-only loss on embedded inputs plus a leaf ``delta``; returns logits, loss, grads, d/d delta."""
    delta = Tensor(perturbation, requires_grad=True)
    embedded = F.add(decoder.embed(batch.inputs), delta)
    starts = batch.segment_starts if starts is None else starts
    logits = decoder.forward_embedded(embedded, batch.positions, batch.valid_lengths, starts)
    loss = decoder.masked_loss(logits, batch.targets, batch.segments == 1)
    gradients = loss.backward()
    return logits.value, loss, gradients, delta.grad


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("scale", [1.0, 1e10])
def test_perturbing_a_leaves_b_unchanged(batch, attention, scale):
    decoder = decoder_for(attention)
    zero = np.zeros(batch.shape + (decoder.config.width,))
    perturbed = zero.copy()
    perturbed[0, A] = scale * np.random.default_rng(1).normal(size=perturbed[0, A].shape)
    logits, loss, gradients, into_activations = b_only_run(decoder, batch, zero)
    logits2, loss2, gradients2, _ = b_only_run(decoder, batch, perturbed)
    assert loss.count == 2
    assert np.array_equal(logits[0, B], logits2[0, B])
    assert not np.array_equal(logits[0, A], logits2[0, A])  # the perturbation did reach A
    assert (loss.loss_sum, loss.mean) == (loss2.loss_sum, loss2.mean)
    assert sum(value.size for value in gradients.values()) == 3448
    for name in gradients:
        assert np.array_equal(gradients[name], gradients2[name]), name
    assert not into_activations[0, A].any() and not into_activations[0, PADDING].any()
    assert not into_activations[1].any()  # the other row (C) is another segment too
    assert np.abs(into_activations[0, B]).min() > 0


@pytest.mark.parametrize("attention", ATTENTION)
def test_negative_control_without_the_range_guard(batch, attention):
    decoder = decoder_for(attention)
    zero = np.zeros(batch.shape + (decoder.config.width,))
    perturbed = zero.copy()
    perturbed[0, A] = np.random.default_rng(1).normal(size=perturbed[0, A].shape)
    unguarded = np.zeros_like(batch.segment_starts)
    logits, loss, gradients, into_activations = b_only_run(decoder, batch, zero, unguarded)
    logits2, loss2, gradients2, _ = b_only_run(decoder, batch, perturbed, unguarded)
    assert np.abs(logits[0, B] - logits2[0, B]).max() > 1e-6
    assert loss.loss_sum != loss2.loss_sum
    assert np.abs(into_activations[0, A]).max() > 1e-6
    assert not into_activations[0, PADDING].any()  # the valid length still excludes padding


def test_whole_batch_gradient_may_change_through_a_own_loss(batch):
    """Shared parameters learn from A too: that is not a cross-example context edge."""
    decoder = decoder_for("reference")
    zero = np.zeros(batch.shape + (decoder.config.width,))
    perturbed = zero.copy()
    perturbed[0, A] = 1.0
    runs = []
    for delta in (zero, perturbed):
        embedded = F.add(decoder.embed(batch.inputs), delta)
        logits = decoder.forward_embedded(embedded, batch.positions, batch.valid_lengths, batch.segment_starts)
        runs.append(decoder.masked_loss(logits, batch.targets, batch.loss_mask).backward())
    assert not np.array_equal(runs[0]["blocks.0.wq"], runs[1]["blocks.0.wq"])


@pytest.mark.parametrize("attention", ATTENTION)
def test_b_first_query_has_no_future_or_padding_derivatives(batch, attention):
    decoder = decoder_for(attention)
    delta = Tensor(np.zeros(batch.shape + (decoder.config.width,)), requires_grad=True)
    embedded = F.add(decoder.embed(batch.inputs), delta)
    logits = decoder.forward_embedded(embedded, batch.positions, batch.valid_lengths, batch.segment_starts)
    seed = np.zeros(logits.shape)
    seed[0, 3] = np.random.default_rng(2).normal(size=logits.shape[-1])
    logits.backward(seed)
    assert np.abs(delta.grad[0, 3]).max() > 0
    assert not delta.grad[0, 4:].any() and not delta.grad[0, A].any() and not delta.grad[1].any()


def attention_inputs(rng):
    """q, k, v ``[1, 2 heads, 6, 4]`` for ch05 row 0: valid length 5, starts [0,0,0,3,3,0]."""
    return [rng.normal(size=(1, 2, 6, 4)) for _ in range(3)]


LENGTHS = np.array([5])
STARTS = np.array([[0, 0, 0, 3, 3, 0]])


@pytest.mark.parametrize("attention", [attention_ops.causal_attention_with_ranges, attention_ops.fused_range_attention])
def test_attention_level_isolation_and_negative_control(attention):
    rng = np.random.default_rng(3)
    q, k, v = attention_inputs(rng)
    weights = rng.normal(size=(1, 2, 6, 4))
    weights[:, :, :3] = 0.0
    weights[:, :, 5:] = 0.0  # the objective reads B's outputs only

    def run(starts, q, k, v):
        leaves = [Tensor(array, requires_grad=True) for array in (q, k, v)]
        out = attention(*leaves, LENGTHS, starts)
        out.backward(weights)
        return out.value, [leaf.grad for leaf in leaves]

    out, grads = run(STARTS, q, k, v)
    for grad in grads:
        assert not grad[:, :, A].any() and not grad[:, :, PADDING].any()
    changed = [array.copy() for array in (q, k, v)]
    for array in changed:
        array[:, :, A] = 1e10
    out2, _ = run(STARTS, *changed)
    assert np.array_equal(out[:, :, B], out2[:, :, B])
    unguarded = np.zeros_like(STARTS)
    out3, grads3 = run(unguarded, q, k, v)
    assert np.abs(grads3[1][:, :, A]).max() > 1e-6 and np.abs(grads3[2][:, :, A]).max() > 1e-6
    out4, _ = run(unguarded, *changed)
    assert not np.allclose(out3[:, :, B], out4[:, :, B])
