"""Audit of the data layer and the numpy nn layer: inputs that used to give a wrong
answer (or a non-seqpack error) silently, each beside its passing twin."""

import numpy as np
import pytest

from seqpack import InvalidInputError
from seqpack.data import BatchBinding, ByteTokenizer, DecodeLimits, ExampleTable
from seqpack.errors import TokenizerError
from seqpack.nn import attention as A
from seqpack.nn.attention import range_attention_backward, range_attention_forward
from seqpack.nn.autograd import Tensor
from seqpack.nn.decoder import Decoder, DecoderConfig
from seqpack.nn.loss import masked_nll

BINDING = BatchBinding.for_tokenizer(ByteTokenizer(), split="audit")


def small_attention(dtype=np.float64):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 1, 4, 3)).astype(dtype) for _ in range(3))
    return q, k, v, np.array([4, 2]), np.array([[0, 0, 2, 2], [0, 1, 0, 0]])


# --- range attention: the scale must stay finite in q's dtype ---------------------------


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


def test_a_scale_too_large_for_a_float_is_an_input_error():
    q, k, v, lengths, starts = small_attention()
    range_attention_forward(q, k, v, lengths, starts, scale=10**300)
    with pytest.raises(InvalidInputError, match="scale is too large for a float"):
        range_attention_forward(q, k, v, lengths, starts, scale=10**400)


# --- attention on the tape (dense reference) ---------------------------------------------


def test_reference_attention_ignores_nan_in_padding():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 2, 4, 4)) for _ in range(3))
    lengths, starts = np.array([4, 2]), np.zeros((2, 4), int)
    leaves = [Tensor(x, requires_grad=True) for x in (q, k, v)]
    clean = A.causal_attention_with_ranges(*leaves, lengths, starts)
    clean.backward(np.ones(clean.shape))
    dirty_values = [x.copy() for x in (q, k, v)]
    for x in dirty_values:
        x[1, :, 2:] = np.nan
    dirty_leaves = [Tensor(x, requires_grad=True) for x in dirty_values]
    dirty = A.causal_attention_with_ranges(*dirty_leaves, lengths, starts)
    dirty.backward(np.ones(dirty.shape))
    assert np.array_equal(clean.value, dirty.value)  # inactive queries: zero mixture, not NaN
    assert not dirty.value[1, :, 2:].any()
    for a, b in zip(leaves, dirty_leaves):
        assert np.array_equal(a.grad, b.grad)
    fused = A.fused_range_attention(*(Tensor(x) for x in dirty_values), lengths, starts)
    np.testing.assert_allclose(fused.value, dirty.value, rtol=1e-12, atol=1e-14)


def test_reference_attention_does_not_broadcast_keys_across_rows():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 4, 3)) for _ in range(3))
    lengths, starts = [4, 4], np.zeros((2, 4), int)
    A.causal_attention_with_ranges(Tensor(q), Tensor(k), Tensor(v), lengths, starts)
    with pytest.raises(InvalidInputError, match=r"k has shape \(1, 4, 3\)"):
        A.causal_attention_with_ranges(Tensor(q), Tensor(k[:1]), Tensor(v), lengths, starts)
    with pytest.raises(InvalidInputError, match=r"v has shape \(1, 4, 3\)"):
        A.causal_attention_with_ranges(Tensor(q), Tensor(k), Tensor(v[:1]), lengths, starts)
    q4 = rng.standard_normal((2, 2, 4, 4))  # one shared key/value head still works
    shared = A.causal_attention_with_ranges(Tensor(q4), Tensor(q4[:, :1]), Tensor(q4[:, :1]), lengths, starts)
    fused = A.fused_range_attention(Tensor(q4), Tensor(q4[:, :1]), Tensor(q4[:, :1]), lengths, starts)
    np.testing.assert_allclose(shared.value, fused.value, rtol=1e-12, atol=1e-14)


# --- masked loss -------------------------------------------------------------------------


def loss_case():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 3, 5))
    targets = rng.integers(0, 5, (2, 3))
    mask = np.ones((2, 3), bool)
    mask[1, 2] = False
    return logits, targets, mask


@pytest.mark.parametrize("tape", [False, True])
@pytest.mark.parametrize(
    "change, message",
    [
        (dict(loss_mask=lambda m: m[:, :2]), r"loss_mask has shape \(2, 2\)"),
        (dict(loss_mask=lambda m: np.ones((2, 4), bool)), r"loss_mask has shape \(2, 4\)"),
        (dict(targets=lambda t: t[:, :2]), r"targets has shape \(2, 2\)"),
        (dict(targets=lambda t: t + 0.7), "targets must be integers, got dtype float64"),
        (dict(targets=lambda t: t > 2), "targets must be integers, got dtype bool"),
        (dict(loss_mask=lambda m: m * 0.5), "loss_mask must be bool, got dtype float64"),
        (dict(loss_mask=lambda m: m.astype(int) * 2), "loss_mask holds 2"),
        (dict(loss_mask=lambda m: np.where(m, np.nan, 0.0)), "loss_mask must be bool"),
    ],
)
def test_masks_and_targets_must_match_the_logits(change, message, tape):
    logits, targets, mask = loss_case()
    wrap = (lambda x: Tensor(x, requires_grad=True)) if tape else (lambda x: x)
    expected = masked_nll(wrap(logits), targets, mask)
    assert masked_nll(wrap(logits), targets, mask.astype(np.uint8)).mean == expected.mean  # 0/1 integers pass
    targets = change.get("targets", lambda t: t)(targets)
    mask = change.get("loss_mask", lambda m: m)(mask)
    with pytest.raises(InvalidInputError, match=message):
        masked_nll(wrap(logits), targets, mask)


def test_big_endian_float64_logits_keep_float64():
    logits, targets, mask = loss_case()
    expected = masked_nll(logits, targets, mask)
    swapped = masked_nll(logits.astype(">f8"), targets, mask)
    assert swapped.mean == expected.mean
    assert swapped.backward()["logits"].dtype == np.float64
    assert masked_nll(logits.astype(">f4"), targets, mask).backward()["logits"].dtype == np.float32


@pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="longdouble is float64 here")
def test_logits_wider_than_float64_are_rejected():
    logits, targets, mask = loss_case()
    with pytest.raises(InvalidInputError, match="wider than float64"):
        masked_nll(logits.astype(np.longdouble), targets, mask)


# --- decoder -----------------------------------------------------------------------------


def test_decoder_positions_must_be_integers_of_the_cells_shape():
    decoder = Decoder(DecoderConfig.small(10), seed=0)
    inputs, positions = np.array([[1, 2, 3, -1]]), np.array([[0, 1, 2, 0]])
    lengths, starts = np.array([3]), np.zeros((1, 4), int)
    decoder.forward_arrays(inputs, positions, lengths, starts)
    for bad, message in [(positions + 0.5, "positions must hold integers, got dtype float64"),
                         (positions > 0, "positions must hold integers, got dtype bool"),
                         (positions[:, :2], r"positions has shape \(1, 2\); expected \(1, 4\)"),
                         (positions[0], r"positions has shape \(4,\); expected \(1, 4\)")]:
        with pytest.raises(InvalidInputError, match=message):
            decoder.forward_arrays(inputs, bad, lengths, starts)


@pytest.mark.parametrize("seed, message", [(True, "seed must be an int"), (1.0, "seed must be an int"),
                                           (-1, "seed must be at least 0")])
def test_decoder_seed_is_a_non_negative_int(seed, message):
    config = DecoderConfig.small(10)
    first = Decoder(config, np.int64(1)).named_parameters()["embedding"]
    assert np.array_equal(first, Decoder(config, 1).named_parameters()["embedding"])
    with pytest.raises(InvalidInputError, match=message):
        Decoder(config, seed)


# --- data layer --------------------------------------------------------------------------


def test_decode_limits_beyond_int64_are_rejected_where_they_enter():
    limits = DecodeLimits(2**63 - 1, 2**63 - 1)
    binding = BatchBinding.for_tokenizer(ByteTokenizer(), split="audit", limits=limits)
    assert len(ExampleTable.from_arrays([0, 5, 1], [0, 3], binding)) == 1
    for name, arguments in [("max_tokens", (2**64, 10)), ("max_bytes", (10, 2**63))]:
        with pytest.raises(InvalidInputError, match=f"{name} is .*; the maximum is 9223372036854775807"):
            DecodeLimits(*arguments)


@pytest.mark.parametrize("token", [True, 2.0, "2"])
def test_token_bytes_takes_only_int_ids(token):
    tokenizer = ByteTokenizer()
    assert tokenizer.token_bytes(np.int64(67)) == b"A"
    with pytest.raises(TokenizerError, match="a token ID must be an int"):
        tokenizer.token_bytes(token)


def test_a_single_string_is_not_a_list_of_ids():
    tokens, offsets = [0, 5, 1, 0, 6, 1], [0, 3, 6]
    assert ExampleTable.from_arrays(tokens, offsets, BINDING, ids=["a", "b"]).example_id(1) == "b"
    with pytest.raises(InvalidInputError, match="ids must be a sequence of names, not a single str"):
        ExampleTable.from_arrays(tokens, offsets, BINDING, ids="ab")
    with pytest.raises(InvalidInputError, match="not a single str"):
        ExampleTable.from_texts(["x", "y"], BINDING, capacity=4, ids="ab")


def test_reference_attention_refuses_a_non_finite_valid_cell():
    """A NaN in one segment's v would reach the other segment through the dense P @ V."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 6, 4)) for _ in range(3))
    starts = np.array([[0, 0, 0, 3, 3, 3]])
    v[0, 1, 2] = np.nan
    with pytest.raises(InvalidInputError, match=r"v holds nan at row 0, cell 1"):
        A.causal_attention_with_ranges(q, k, v, np.array([6]), starts)
    v[0, 1, 2] = np.inf
    with pytest.raises(InvalidInputError, match=r"v holds inf at row 0, cell 1"):
        A.causal_attention_with_ranges(q, k, v, np.array([6]), starts)
