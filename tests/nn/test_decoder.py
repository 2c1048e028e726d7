"""The reference decoder: definition, entry-point checks, poison and finite differences."""


import time

import numpy as np
import pytest

from seqpack import (
    BatchBinding,
    BatchDocument,
    CapacityError,
    Decoder,
    DecoderConfig,
    InvalidInputError,
    MemoryBudgetError,
    SequenceExample,
)
from seqpack.nn import ops as F
from helpers import numerical_gradient
from seqpack.chapters.fixtures import chapter_batch, chapter_examples, packed_batch, padded_batch

BINDING = BatchBinding.fixture()


def test_parameter_names_shapes_and_counts():
    decoder = Decoder(DecoderConfig.large(), seed=0)
    shapes = {name: value.shape for name, value in decoder.named_parameters().items()}
    assert list(shapes)[:2] == ["embedding", "blocks.0.attn_norm"] and list(shapes)[-1] == "final_norm"
    assert shapes["embedding"] == (266, 8)
    for i in range(2):
        assert shapes[f"blocks.{i}.attn_norm"] == shapes[f"blocks.{i}.ffn_norm"] == (8,)
        assert all(shapes[f"blocks.{i}.{w}"] == (8, 8) for w in ("wq", "wk", "wv", "wo"))
        assert shapes[f"blocks.{i}.w_gate"] == shapes[f"blocks.{i}.w_up"] == (8, 16)
        assert shapes[f"blocks.{i}.w_down"] == (16, 8)
    assert len(shapes) == 1 + 2 * 9 + 1
    assert decoder.parameter_count() == 3448 == sum(int(np.prod(s)) for s in shapes.values())
    assert Decoder(DecoderConfig.small(), seed=0).parameter_count() == 1188


def test_seeded_initialisation_is_documented_and_deterministic():
    parameters = Decoder(DecoderConfig.large(), seed=7).named_parameters()
    again = Decoder(DecoderConfig.large(), seed=7).named_parameters()
    other = Decoder(DecoderConfig.large(), seed=8).named_parameters()
    assert all(np.array_equal(parameters[name], again[name]) for name in parameters)
    assert not np.array_equal(parameters["embedding"], other["embedding"])
    rng = np.random.default_rng(7)
    assert np.array_equal(parameters["embedding"], rng.normal(0.0, 0.02, (266, 8)))
    assert np.array_equal(parameters["blocks.0.wq"], rng.normal(0.0, 0.02, (8, 8)))
    assert all(np.array_equal(parameters[n], np.ones(8)) for n in parameters if n.endswith("norm"))


def test_named_parameters_are_live():
    decoder = Decoder(DecoderConfig.small(), seed=0)
    (example,) = chapter_examples("padded", BINDING)[:1]
    before = decoder.forward_separate(example).logits
    decoder.named_parameters()["final_norm"][:] = 2.0
    after = decoder.forward_separate(example).logits
    np.testing.assert_allclose(after, 2.0 * before, rtol=1e-12)


def test_config_is_validated():
    with pytest.raises(InvalidInputError, match="heads of even size"):
        DecoderConfig(266, width=6, heads=2, ffn_width=4, layers=1, max_positions=4)
    with pytest.raises(InvalidInputError, match="decoder layers must be at least 1"):
        DecoderConfig(266, width=4, heads=2, ffn_width=4, layers=0, max_positions=4)
    with pytest.raises(InvalidInputError, match="attention must be one of"):
        Decoder(DecoderConfig.small(), seed=0, attention="dense")


def test_forward_shapes_and_padding_logits():
    decoder = Decoder(DecoderConfig.large(), seed=1)
    batch = chapter_batch("padded", BINDING)
    logits = decoder.forward_padded(batch).logits
    assert logits.shape == (2, 4, 266)
    assert not logits[0, 2:].any()  # padding cells stay exact zeros through the stack
    example = chapter_examples("padded", BINDING)[1]
    assert decoder.forward_separate(example).logits.shape == (1, 4, 266)
    packed = chapter_batch("packed", BINDING)
    assert decoder.forward_packed(packed).logits.shape == (2, 6, 266)


def test_token_ids_are_checked_before_lookup():
    decoder = Decoder(DecoderConfig.small(), seed=0)
    positions = np.array([[0, 1, 0]])
    args = (positions, np.array([2]), np.zeros((1, 3), np.int32))
    decoder.forward_arrays(np.array([[265, 0, -1]]), *args)  # V - 1 and PAD_CELL pass
    with pytest.raises(InvalidInputError, match=r"token ID 266 at cell \(0, 1\)"):
        decoder.forward_arrays(np.array([[0, 266, -1]]), *args)
    with pytest.raises(InvalidInputError, match=r"token ID -2 at cell \(0, 0\)"):
        decoder.forward_arrays(np.array([[-2, 0, -1]]), *args)


def test_raw_arrays_keep_padding_out_of_the_inputs_and_the_targets():
    """forward_arrays embedded a PAD_CELL inside a row's valid length as a zero row that
    later queries attended, and loss_arrays scored a loss cell past the valid length (a
    padding cell) as a target: 3 targets for a row of 2."""
    decoder = Decoder(DecoderConfig.small(), seed=0)
    starts = np.zeros((1, 4), np.int32)
    with pytest.raises(InvalidInputError, match=r"row 0 cell 1 holds PAD_CELL inside the row's valid length 3"):
        decoder.forward_arrays(np.array([[0, -1, 99, -1]]), np.array([[0, 1, 2, 0]]), np.array([3]), starts)
    arrays = (np.array([[0, 99, -1, -1]]), np.array([[0, 1, 0, 0]]), np.array([2]), starts, np.array([[99, 1, 5, 5]]))
    with pytest.raises(InvalidInputError, match=r"row 0 cell 2 is a loss cell past the row's valid length 2"):
        decoder.loss_arrays(*arrays, np.array([[True, True, True, False]]))
    assert decoder.loss_arrays(*arrays, np.array([[True, True, False, False]])).count == 2


def test_batch_wider_than_max_positions_is_rejected():
    decoder = Decoder(DecoderConfig.small(), seed=0)
    examples = chapter_examples("packed", BINDING)
    decoder.forward_padded(padded_batch(examples, BINDING))  # 4 columns == max_positions
    with pytest.raises(CapacityError, match="5 columns wide exceeds the decoder's max_positions 4") as error:
        decoder.forward_packed(packed_batch(examples, BINDING, 5))
    assert (error.value.cells, error.value.maximum) == (5, 4)
    long = SequenceExample.from_document("long", BatchDocument("long", [0, 99, 100, 101, 102, 1]), BINDING)
    with pytest.raises(CapacityError, match="5 columns wide"):
        decoder.loss_separate(long)


def test_batch_kind_and_vocabulary_mismatch_are_rejected():
    """Each entry point takes its own kind of batch; the batch's binding sets the vocabulary."""
    batch = chapter_batch("padded", BINDING)
    decoder = Decoder(DecoderConfig.small(), seed=0)
    with pytest.raises(InvalidInputError, match="loss_padded takes a PaddedBatch, not PackedBatch"):
        decoder.loss_padded(chapter_batch("packed", BINDING))
    with pytest.raises(InvalidInputError, match="forward_packed takes a PackedBatch, not PaddedBatch"):
        decoder.forward_packed(batch)
    wrong_vocabulary = Decoder(DecoderConfig.small(vocabulary_size=300), seed=0)
    with pytest.raises(InvalidInputError, match="vocabulary size 266; the decoder has 300"):
        wrong_vocabulary.forward_padded(batch)
    with pytest.raises(InvalidInputError, match="example 'short' has vocabulary size 266"):
        wrong_vocabulary.forward_separate(chapter_examples("padded", BINDING)[0])


def test_zero_eligible_targets_is_an_error():
    decoder = Decoder(DecoderConfig.small(), seed=0)
    with pytest.raises(InvalidInputError, match="zero loss-eligible targets"):
        decoder.loss_arrays(
            np.array([[0, 99]]), np.array([[0, 1]]), np.array([2]), np.zeros((1, 2), np.int32),
            np.array([[99, 1]]), np.zeros((1, 2), bool),
        )


def randomized(decoder, seed, std=0.5):
    """Overwrite the parameters with larger random values, so attention is far from uniform."""
    rng = np.random.default_rng(seed)
    for name, value in decoder.named_parameters().items():
        value[...] = 1.0 + rng.normal(0.0, 0.2, value.shape) if name.endswith("norm") else rng.normal(0.0, std, value.shape)
    return decoder


def fd_batch():
    """Packed at capacity 4: a 2-prediction and a 1-prediction example share row 0; row 1 has padding."""
    documents = [BatchDocument("B", [0, 101, 1]), BatchDocument("one", [0, 103, 104, 1]), BatchDocument("A", [0, 99, 100, 1])]
    examples = [
        SequenceExample.from_document("B", documents[0], BINDING),
        SequenceExample.from_range("one", documents[1], range(1, 3), BINDING),
        SequenceExample.from_document("A", documents[2], BINDING),
    ]
    return packed_batch(examples, BINDING, 4)


@pytest.mark.slow
def test_whole_small_decoder_matches_central_differences():
    decoder = randomized(Decoder(DecoderConfig.small(), seed=3), seed=3)
    batch = fd_batch()
    assert batch.segment_starts[0, 2] == 2 and not batch.token_valid.all()
    analytic = decoder.loss_packed(batch).backward()
    for name, value in decoder.named_parameters().items():
        numeric = numerical_gradient(lambda: decoder.loss_packed(batch).mean, value)
        np.testing.assert_allclose(analytic[name], numeric, rtol=0, atol=1e-8, err_msg=name)


def poisoned_run(decoder, batch, poison):
    """Loss, gradients and logits with ``poison`` added to every padding cell of the embedded input."""
    embedded = decoder.embed(batch.inputs)
    offset = np.zeros(embedded.shape)
    if poison is not None:
        offset[~batch.token_valid] = poison
    embedded = F.add(embedded, offset)
    logits = decoder.forward_embedded(embedded, batch.positions, batch.valid_lengths, batch.segment_starts)
    loss = decoder.masked_loss(logits, batch.targets, batch.loss_mask)
    return loss, loss.backward(), logits.value


@pytest.mark.parametrize("poison", [np.nan, np.inf, 1e300])
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_poisoned_padding_embeddings_change_nothing(kind, poison):
    decoder = randomized(Decoder(DecoderConfig.large(), seed=5), seed=5)
    batch = chapter_batch(kind, BINDING)
    assert (~batch.token_valid).any()
    clean_loss, clean_grad, clean_logits = poisoned_run(decoder, batch, None)
    dirty_loss, dirty_grad, dirty_logits = poisoned_run(decoder, batch, poison)
    assert (dirty_loss.loss_sum, dirty_loss.mean) == (clean_loss.loss_sum, clean_loss.mean)
    for name in clean_grad:
        assert np.array_equal(dirty_grad[name], clean_grad[name]), name
        assert np.isfinite(dirty_grad[name]).all(), name
    assert np.array_equal(dirty_logits, clean_logits) and np.isfinite(dirty_logits).all()


def test_fused_and_reference_attention_agree():
    batch = chapter_batch("packed", BINDING)
    reference = randomized(Decoder(DecoderConfig.large(), seed=9), seed=9)
    fused = Decoder(DecoderConfig.large(), seed=9, attention="fused")
    for name, value in reference.named_parameters().items():
        fused.named_parameters()[name][...] = value
    a, b = reference.loss_packed(batch), fused.loss_packed(batch)
    assert abs(a.loss_sum - b.loss_sum) <= 1e-10 + 1e-9 * abs(a.loss_sum)
    grads_a, grads_b = a.backward(), b.backward()
    for name in grads_a:
        np.testing.assert_allclose(grads_b[name], grads_a[name], rtol=1e-9, atol=1e-10)


def test_parameters_over_the_memory_budget_are_refused_before_allocation():
    """DecoderConfig(300_000, 4096, ...) asked numpy for 9.2 GiB: a raw MemoryError, or
    with overcommit gigabytes of random initialisation."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(MemoryBudgetError, match=r"the decoder's float64 parameters needs 10367762432 bytes; "
                                                   r"max_memory_bytes is 8589934592"):
        Decoder(DecoderConfig(300_000, 4096, 2, 4, 1, 4), 0)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: nothing was allocated
    small = DecoderConfig.small()
    Decoder(small, 0, max_memory_bytes=8 * 266 * 4 + 10_000)
    with pytest.raises(MemoryBudgetError, match="max_memory_bytes is 1000"):
        Decoder(small, 0, max_memory_bytes=1000)
    began = time.perf_counter()  # a million layers: refused from the config, before any per-layer list
    with pytest.raises(MemoryBudgetError, match="needs 768008544 bytes; max_memory_bytes is 1024"):
        Decoder(DecoderConfig(266, 4, 2, 2, 1_000_000, 4), 0, max_memory_bytes=1024)
    assert time.perf_counter() - began < 0.5


# Regression: float or broadcast decoder positions were used silently.
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
    # A padding cell's position is never read, even one past int64 (it was refused; review).
    unread = np.array([[0, 1, 2, 2**64 - 1]], np.uint64)
    assert np.array_equal(decoder.forward_arrays(inputs, unread, lengths, starts).logits,
                          decoder.forward_arrays(inputs, positions, lengths, starts).logits, equal_nan=True)
    with pytest.raises(InvalidInputError, match="positions holds 18446744073709551615, outside the int64 range"):
        decoder.forward_arrays(inputs, np.array([[0, 2**64 - 1, 2, 0]], np.uint64), lengths, starts)


# Regression (review): malformed inputs gave numpy's broadcast, unpacking and ragged-array errors, an
# AttributeError or an IndexError; the two attention modes disagreed on empty and broken layouts.
def test_decoder_entry_points_name_malformed_inputs_and_the_modes_agree_on_layouts():
    decoder = Decoder(DecoderConfig.small(10), seed=0)
    width = decoder.config.width
    layout = (np.array([3]), np.zeros((1, 3), int), np.zeros((1, 3), int))   # positions, lengths, starts
    for x, message in [(F.Tensor(np.zeros((1, 3, width + 1))), rf"x must be \[rows, T, {width}\]"),
                       (F.Tensor(np.zeros((1, 3))), r"got shape \(1, 3\)"),
                       (np.zeros((1, 3, width)), "x must be a seqpack.nn Tensor, not ndarray")]:
        with pytest.raises(InvalidInputError, match=message):
            decoder.forward_embedded(x, layout[0], *layout[1:])
    for inputs, message in [(5, r"inputs must be 2-dimensional, got shape \(\)"),
                            ([[1, 2], [3]], "inputs is not a regular array")]:
        with pytest.raises(InvalidInputError, match=message):
            decoder.forward_arrays(inputs, np.zeros((1, 2), int), np.array([2]), np.zeros((1, 2), int))
    modes = [Decoder(DecoderConfig.small(10), seed=0, attention=mode) for mode in ("fused", "reference")]
    empty = [m.forward_arrays(np.zeros((2, 0), int), np.zeros((2, 0), int), np.zeros(2, int), np.zeros((2, 0), int))
             for m in modes]
    assert [e.logits.shape for e in empty] == [(2, 0, 10)] * 2
    broken = (np.array([[1, 2, 3, 4]]), np.array([[0, 1, 0, 3]]), np.array([4]), np.array([[0, 0, 2, 0]]))
    for mode in modes:   # query 3 reached back across the segment that starts at column 2 (reference mode)
        with pytest.raises(InvalidInputError, match=r"segment_starts\[0, 3\] = 0 .* segments must be contiguous"):
            mode.forward_arrays(*broken)


# Regression: a bool seed was taken as a number.
@pytest.mark.parametrize("seed, message", [(True, "seed must be an int"), (1.0, "seed must be an int"),
                                           (-1, "seed must be at least 0")])
def test_decoder_seed_is_a_non_negative_int(seed, message):
    config = DecoderConfig.small(10)
    first = Decoder(config, np.int64(1)).named_parameters()["embedding"]
    assert np.array_equal(first, Decoder(config, 1).named_parameters()["embedding"])
    with pytest.raises(InvalidInputError, match=message):
        Decoder(config, seed)
