"""Per-occurrence log-probabilities from the loss kernel: the chapters' probe, the float64 oracle,
the gradient, poisoned cells, determinism, degenerate occurrences, memory and errors.

The oracle takes each occurrence's supervised logit rows alone, in float64, and reads its
targets' ``log_softmax``; its gradient is ``weight * (onehot - softmax)`` on those rows.
"""

import dataclasses
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack import BatchDocument, BindingError, DecodeLimits, InvalidInputError, SequenceExample, VerificationError
from seqpack.chapters.fixtures import chapter_batch
from seqpack.chapters.probe import constructed_logits, gold_probabilities
from seqpack.nn import OccurrenceLogprobs, masked_loss, sequence_logprobs
from seqpack.nn import _loss
from seqpack.nn.autograd import Tensor
from helpers import assert_close, numerical_gradient, supervised_table

pytestmark = pytest.mark.kernel

TRAIN = sp.Partition.TRAIN
BINDING = sp.BatchBinding.fixture()
VOCABULARY = BINDING.vocabulary_size
POLICIES = ["next-fit", "first-fit-decreasing", "best-fit-decreasing"]
BIG = 1 << 40


def reference(logits, batch, weights=None):
    """Float64, one occurrence at a time: each one's supervised targets' log p, their sum and
    count, and (given ``weights``) the gradient of ``sum_k weights[k] * sums[k]``."""
    logits = np.asarray(logits, dtype=np.float64)
    gradient = np.zeros_like(logits)
    sums, counts, values = [], [], []
    for k, occurrence in enumerate(batch.occurrences):
        columns = np.arange(occurrence.columns.start, occurrence.columns.stop)
        columns = columns[batch.loss_mask[occurrence.row, columns]]
        rows = logits[occurrence.row, columns]  # [m, V]
        top = rows.max(axis=1, keepdims=True) if columns.size else 0.0
        log_probs = rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))
        gold = batch.targets[occurrence.row, columns]
        mine = log_probs[np.arange(columns.size), gold]
        values.extend(mine.tolist())
        sums.append(float(mine.sum()))
        counts.append(columns.size)
        if weights is not None:
            onehot = np.zeros_like(rows)
            onehot[np.arange(columns.size), gold] = 1.0
            gradient[occurrence.row, columns] += weights[k] * (onehot - np.exp(log_probs))
    return np.array(sums), np.array(counts), np.array(values), gradient


def batches(lengths, rows, extra, policy, seed):
    table = supervised_table(lengths, seed, BINDING, ids=True)
    if policy == "padded":
        return list(sp.pad(table, sp.PadConfig(rows), partition=TRAIN, binding=BINDING))
    capacity = int(table.lengths.max()) + extra
    config = sp.PackConfig(capacity, rows, rows * capacity, BIG)
    return list(sp.pack(table, config, partition=TRAIN, binding=BINDING, policy=policy))


def random_logits(batch, seed, dtype=np.float64):
    return (3 * np.random.default_rng(seed).standard_normal(batch.shape + (VOCABULARY,))).astype(dtype)


def poison(logits, batch, value=np.nan):
    """A copy of ``logits`` with ``value`` in every vocabulary entry of every cell outside ``loss_mask``."""
    poisoned = logits.copy()
    poisoned[~batch.loss_mask] = value
    return poisoned


# --- the chapters' constructed probe --------------------------------------------------------


def test_packed_probe_gives_each_document_its_chapter_sum(binding):
    # ch05: gold 1/2 for A's three targets, 1/4 for B's two, 1/2 for C's four.
    batch = chapter_batch("packed", binding)
    scores = sequence_logprobs(constructed_logits(batch, gold_probabilities(batch)), batch)
    ln2 = math.log(2)
    assert scores.example_ids == ("A", "B", "C")
    assert scores.ordinals.tolist() == [0, 1, 2] and scores.counts.tolist() == [3, 2, 4]
    assert scores.offsets.tolist() == [0, 3, 5, 9]
    for value, expected in zip(scores.sums, (-3 * ln2, -4 * ln2, -4 * ln2)):
        assert math.isclose(value, expected, rel_tol=1e-12)
    # The chapter's printed numbers: the loss sum and the (wrong) mean of document means.
    assert round(-float(scores.sums.sum()), 6) == 7.624619
    assert round(float(np.mean(-scores.sums / scores.counts)), 6) == 0.924196
    expected_values = np.log([1 / 2] * 3 + [1 / 4] * 2 + [1 / 2] * 4)
    np.testing.assert_allclose(scores.values, expected_values, rtol=1e-12)


def test_padded_probe_gives_each_document_its_chapter_sum(binding):
    # ch04: "short" has gold 1/2, 1/4 and "long" 1/2, 1/2, 1/4, 1/2: 3 ln 2 and 5 ln 2 nats.
    batch = chapter_batch("padded", binding)
    scores = sequence_logprobs(constructed_logits(batch, gold_probabilities(batch)), batch)
    assert scores.example_ids == ("short", "long") and scores.counts.tolist() == [2, 4]
    assert math.isclose(scores.sums[0], -3 * math.log(2), rel_tol=1e-12)
    assert math.isclose(scores.sums[1], -5 * math.log(2), rel_tol=1e-12)
    assert round(float(np.mean(-scores.sums / scores.counts)), 6) == 0.953077


def test_probe_gradient_is_the_analytic_derivative(binding):
    batch = chapter_batch("packed", binding)
    gold = gold_probabilities(batch)
    logits = constructed_logits(batch, gold)
    weights = np.array([0.5, -2.0, 3.0])
    gradient = sequence_logprobs(logits, batch).gradient(weights)
    # d log q / dz: (1 - q) at the gold class, -(1 - q)/(V - 1) at every other class.
    expected = np.zeros_like(logits)
    weight = np.zeros(batch.shape)
    for k, occurrence in enumerate(batch.occurrences):
        weight[occurrence.row, occurrence.columns.start:occurrence.columns.stop] = weights[k]
    rows, columns = np.nonzero(batch.loss_mask)
    q, w = gold[rows, columns], weight[rows, columns]
    expected[rows, columns, :] = (-w * (1 - q) / (VOCABULARY - 1))[:, None]
    expected[rows, columns, batch.targets[rows, columns]] = w * (1 - q)
    np.testing.assert_allclose(gradient, expected, rtol=1e-9, atol=1e-15)


# --- the float64 oracle and the masked loss ---------------------------------------------------


@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 17), min_size=1, max_size=7),
    st.integers(1, 3),
    st.integers(0, 4),
    st.sampled_from(["padded", *POLICIES]),
    st.sampled_from([np.float64, np.float32]),
    st.integers(0, 2**32 - 1),
)
def test_sums_match_the_oracle_and_the_masked_loss(lengths, rows, extra, policy, dtype, seed):
    for number, batch in enumerate(batches(lengths, rows, extra, policy, seed)):
        logits = random_logits(batch, seed + number, dtype)
        scores = sequence_logprobs(logits, batch)
        loss = masked_loss(logits, batch)
        sums, counts, values, _ = reference(logits, batch)
        total = float(scores.sums.sum())
        assert abs(total + loss.loss_sum) <= 1e-10 + 1e-9 * max(abs(total), abs(loss.loss_sum))
        assert int(scores.counts.sum()) == loss.count
        assert np.array_equal(scores.values, -loss.target_losses)
        assert_close(scores.sums, sums, "sums")
        assert_close(scores.values, values, "values")
        assert np.array_equal(scores.counts, counts)
        assert np.array_equal(scores.offsets, np.concatenate(([0], np.cumsum(counts))))
        assert np.array_equal(scores.ordinals, batch.occurrence_records["ordinal"])
        assert scores.example_ids == tuple(example.id for example in batch.examples)
        for name in ("ordinals", "sums", "counts", "values", "offsets"):
            assert getattr(scores, name).dtype == (np.float64 if name in ("sums", "values") else np.int64)
            assert not getattr(scores, name).flags.writeable


@settings(derandomize=True, max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 12), min_size=1, max_size=6),
    st.integers(1, 3),
    st.sampled_from(["padded", *POLICIES]),
    st.integers(0, 2**32 - 1),
)
def test_gradient_matches_the_oracle_for_random_weights(lengths, rows, policy, seed):
    rng = np.random.default_rng(seed)
    for number, batch in enumerate(batches(lengths, rows, 1, policy, seed)):
        logits = random_logits(batch, seed + number)
        scores = sequence_logprobs(logits, batch)
        weights = rng.normal(0.0, 2.0, len(scores))
        gradient = scores.gradient(weights)
        assert gradient.dtype == np.float64 and gradient.shape == logits.shape
        assert_close(gradient, reference(logits, batch, weights)[3], "gradient")
        assert not gradient[~batch.loss_mask].any()
        # float32 logits: the gradient in float32, the same derivative to float32 precision.
        narrow = logits.astype(np.float32)
        gradient32 = sequence_logprobs(narrow, batch).gradient(weights)
        assert gradient32.dtype == np.float32
        np.testing.assert_allclose(gradient32, reference(narrow, batch, weights)[3], rtol=2e-5, atol=2e-6)


def test_gradient_matches_central_differences():
    # Small: one packed row of two short examples and part of a third, float64.
    batch = batches([2, 3, 2], 2, 0, "next-fit", seed=4)[0]
    logits = np.random.default_rng(5).normal(0.0, 2.0, batch.shape + (VOCABULARY,))
    weights = np.array([1.5, -0.75, 2.0])[: len(batch.occurrences)]

    def objective():
        return float(weights @ sequence_logprobs(logits, batch).sums)

    expected = numerical_gradient(objective, logits)
    gradient = sequence_logprobs(logits, batch).gradient(weights)
    np.testing.assert_allclose(gradient, expected, rtol=1e-6, atol=1e-8)
    assert not gradient[~batch.loss_mask].any()


def test_weights_of_one_give_minus_the_loss_sum_gradient(binding):
    batch = batches([5, 3, 8, 2], 2, 2, "best-fit-decreasing", seed=9)[0]
    logits = random_logits(batch, 3)
    loss = masked_loss(logits, batch)
    gradient = sequence_logprobs(logits, batch).gradient(np.ones(len(batch.occurrences)))
    assert_close(gradient, -loss.count * loss.backward()["logits"], "gradient")


# --- poisoned excluded cells ----------------------------------------------------------------


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 1e30])
@pytest.mark.parametrize("policy", ["padded", *POLICIES])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_poison_at_every_excluded_cell_changes_nothing(value, policy, dtype):
    for number, batch in enumerate(batches([9, 4, 13, 2, 6], 2, 3, policy, seed=17)):
        logits = random_logits(batch, number, dtype)
        # Both kinds of excluded cell occur: unsupervised targets of examples, and padding.
        assert (batch.token_valid & ~batch.loss_mask).any()
        clean, dirty = sequence_logprobs(logits, batch), sequence_logprobs(poison(logits, batch, value), batch)
        weights = np.linspace(-1.0, 2.0, len(clean))
        for name in ("sums", "values", "counts", "offsets"):
            assert getattr(clean, name).tobytes() == getattr(dirty, name).tobytes(), name
        clean_grad = clean.gradient(weights)
        dirty_grad = dirty.gradient(weights)
        assert clean_grad.tobytes() == dirty_grad.tobytes()
        assert np.isfinite(dirty.sums).all() and np.isfinite(dirty_grad).all()
        assert not dirty_grad[~batch.loss_mask].any()


def test_poison_control_a_supervised_cell_does_reach_its_sum(binding):
    # The negative control: NaN at one supervised cell reaches exactly its occurrence.
    batch = chapter_batch("packed", binding)
    logits = constructed_logits(batch, gold_probabilities(batch))
    logits[0, 4, 7] = np.nan  # row 0, column 4: B's second target
    scores = sequence_logprobs(logits, batch)
    assert np.isnan(scores.sums).tolist() == [False, True, False]
    assert np.isnan(scores.values).tolist() == [False] * 4 + [True] + [False] * 4


# --- determinism ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_repeated_runs_are_bitwise_identical(dtype):
    batch = batches(list(range(1, 40, 3)), 3, 5, "first-fit-decreasing", seed=23)[0]
    logits = random_logits(batch, 1, dtype)
    weights = np.random.default_rng(2).normal(size=len(batch.occurrences))
    first = sequence_logprobs(logits, batch)
    runs = [sequence_logprobs(logits.copy(), batch) for _ in range(3)]
    gradient = first.gradient(weights).tobytes()
    for run in runs:
        for name in ("sums", "values", "counts", "offsets", "ordinals"):
            assert getattr(run, name).tobytes() == getattr(first, name).tobytes(), name
        assert run.gradient(weights).tobytes() == gradient
    assert first.gradient(weights).tobytes() == gradient


def test_the_sum_kernel_adds_in_index_order():
    # Sequential from 0.0: (1 + 1e17) - 1e17 == 0 in float64, (1e17 - 1e17) + 1 == 1; any
    # other order of either occurrence gives the other answer.
    values = np.array([1.0, 1e17, -1e17, 1e17, -1e17, 1.0])
    offsets = np.array([0, 3, 3, 6], dtype=np.int64)
    written, sums = np.empty(6), np.empty(3)
    _loss.occurrence_logprob_sums(-values, offsets, written, sums)
    assert written.tolist() == values.tolist()
    assert sums.tolist() == [0.0, 0.0, 1.0]


# --- degenerate occurrences -----------------------------------------------------------------


def unsupervised(id, content, binding):
    """An example none of whose targets is supervised: the constructor stores what it is
    given, and only it can make one (``from_range`` refuses it)."""
    document = BatchDocument(id, [0, *content, 1])
    mask = np.zeros(len(document), dtype=bool)
    mask.flags.writeable = False
    return SequenceExample(id, document, range(0, len(document)), binding, mask)


def test_an_occurrence_without_supervised_targets_sums_to_zero(binding):
    examples = [
        SequenceExample.from_document("a", BatchDocument("a", [0, 40, 41, 1]), binding),
        unsupervised("quiet", [50, 51, 52], binding),
        SequenceExample.from_document("b", BatchDocument("b", [0, 60, 1]), binding),
    ]
    batch = sp.pack(examples, sp.PackConfig(16, rows_per_batch=1), partition=TRAIN, binding=binding)[0]
    logits = random_logits(batch, 0)
    scores = sequence_logprobs(poison(logits, batch), batch)
    assert scores.example_ids == ("a", "quiet", "b")
    assert scores.counts.tolist() == [3, 0, 2]  # the zero-count occurrence really occurs
    assert scores.sums[1] == 0.0 and scores.offsets.tolist() == [0, 3, 3, 5]
    assert_close(scores.sums, reference(logits, batch)[0], "sums")
    gradient = scores.gradient(np.array([1.0, 5.0, -1.0]))
    quiet = batch.occurrences[1]
    assert not gradient[quiet.row, quiet.columns.start:quiet.columns.stop].any()
    assert_close(gradient, reference(logits, batch, [1.0, 5.0, -1.0])[3], "gradient")


def test_a_batch_without_supervised_targets_is_not_an_error(binding):
    batch = sp.pack([unsupervised("x", [40, 41], binding), unsupervised("y", [42], binding)],
                    sp.PackConfig(8, rows_per_batch=1), partition=TRAIN, binding=binding)[0]
    assert batch.target_count == 0
    scores = sequence_logprobs(np.full(batch.shape + (VOCABULARY,), np.nan), batch)
    assert scores.sums.tolist() == [0.0, 0.0] and scores.counts.tolist() == [0, 0] and scores.values.size == 0
    assert not scores.gradient([1.0, 1.0]).any()


def test_examples_of_a_list_and_a_table_without_ids_are_named(binding):
    batch = chapter_batch("padded", binding)
    assert sequence_logprobs(np.zeros(batch.shape + (VOCABULARY,)), batch).example_ids == ("short", "long")
    tokens = np.array([0, 40, 41, 1, 0, 42, 43, 44, 1], np.int32)
    table = sp.ExampleTable.from_arrays(tokens, [0, 4, 9], binding)
    batch = sp.pack(table, sp.PackConfig(8), partition=TRAIN, binding=binding)[0]
    scores = sequence_logprobs(np.zeros(batch.shape + (VOCABULARY,), np.float32), batch)
    assert scores.example_ids == ("#0", "#1")
    assert np.allclose(scores.sums, -scores.counts * math.log(VOCABULARY))


# --- memory ---------------------------------------------------------------------------------


def test_extra_memory_stays_within_the_documented_bound():
    batch = batches(list(range(20, 220, 7)), 8, 0, "next-fit", seed=1)[0]
    logits = np.random.default_rng(0).standard_normal(batch.shape + (VOCABULARY,), dtype=np.float32)
    targets, occurrences = batch.target_count, len(batch.occurrences)
    _ = batch.occurrence_records, batch.example_ids  # built and cached before measuring
    tracemalloc.start()
    scores = sequence_logprobs(logits, batch)
    forward, forward_peak = tracemalloc.get_traced_memory()
    gradient = scores.gradient(np.ones(occurrences))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    bound = 48 * targets + 80 * occurrences + 16384  # the docstring's bound, plus Python objects
    assert forward_peak <= bound, (forward_peak, bound)
    assert gradient.dtype == np.float32
    assert peak <= forward + gradient.nbytes + 8 * occurrences + 16384


# --- errors ---------------------------------------------------------------------------------


def test_wrong_inputs_are_refused_naming_the_problem(binding):
    batch = chapter_batch("packed", binding)
    logits = constructed_logits(batch, gold_probabilities(batch))
    with pytest.raises(InvalidInputError, match="takes a padded or packed batch, not ndarray"):
        sequence_logprobs(logits, batch.targets)
    with pytest.raises(InvalidInputError, match="not dict"):
        sequence_logprobs(logits, {"targets": batch.targets})
    with pytest.raises(InvalidInputError, match=r"logits have shape \(2, 6\); the batch needs \(2, 6, 266\)"):
        sequence_logprobs(logits[..., 0], batch)
    with pytest.raises(InvalidInputError, match=r"logits have shape \(2, 6, 265\).*vocabulary size 266"):
        sequence_logprobs(logits[..., 1:], batch)
    with pytest.raises(InvalidInputError, match=r"logits have shape \(2, 5, 266\)"):
        sequence_logprobs(logits[:, 1:], batch)
    with pytest.raises(InvalidInputError, match="not a tape Tensor"):
        sequence_logprobs(Tensor(logits), batch)
    with pytest.raises(InvalidInputError, match="logits must be real numbers, got dtype complex128"):
        sequence_logprobs(logits.astype(complex), batch)
    with pytest.raises(InvalidInputError, match="logits must be real numbers, got dtype bool"):
        sequence_logprobs(logits > 0, batch)
    other = dataclasses.replace(binding, limits=DecodeLimits(max_tokens=10, max_bytes=100))
    with pytest.raises(BindingError, match="different binding"):
        sequence_logprobs(logits, batch, binding=other)
    # Exactly right: the batch's shape, its binding, strided and read-only logits.
    strided = np.asfortranarray(logits)
    strided.flags.writeable = False
    assert sequence_logprobs(strided, batch, binding=binding).sums.tobytes() == \
        sequence_logprobs(logits, batch).sums.tobytes()


def test_wrong_weights_are_refused_naming_the_problem(binding):
    batch = chapter_batch("packed", binding)
    scores = sequence_logprobs(constructed_logits(batch, gold_probabilities(batch)), batch)
    with pytest.raises(InvalidInputError, match=r"weights have shape \(2,\); the batch has 3 occurrences"):
        scores.gradient([1.0, 2.0])
    with pytest.raises(InvalidInputError, match=r"weights have shape \(\); the batch has 3 occurrences"):
        scores.gradient(1.0)
    with pytest.raises(InvalidInputError, match="weight 1 is nan; every weight must be finite"):
        scores.gradient([1.0, np.nan, 0.0])
    with pytest.raises(InvalidInputError, match="weight 2 is inf"):
        scores.gradient([1.0, 0.0, np.inf])
    with pytest.raises(InvalidInputError, match="weights must be real numbers no wider than float64, got dtype bool"):
        scores.gradient(np.ones(3, bool))
    with pytest.raises(InvalidInputError, match="got dtype complex128"):
        scores.gradient(np.ones(3, complex))
    # Exactly right: three weights, integers or floats.
    assert np.array_equal(scores.gradient([1, 2, 3]), scores.gradient(np.array([1.0, 2.0, 3.0], np.float32)))


def test_records_that_miss_a_supervised_cell_are_a_verification_error(binding):
    batch = chapter_batch("packed", binding)
    logits = constructed_logits(batch, gold_probabilities(batch))
    batch._records = batch.occurrence_records[[0, 2]]  # drop B: its two targets lie in no occurrence
    with pytest.raises(VerificationError, match=r"2 occurrence records do not cover its 9 supervised targets "
                                                r"in row-major order \(after occurrence 0\)"):
        sequence_logprobs(logits, batch)
    batch._records = chapter_batch("packed", binding).occurrence_records[[1, 2]]  # drop A: before the first
    with pytest.raises(VerificationError, match="before the first occurrence"):
        sequence_logprobs(logits, batch)


def test_result_is_frozen(binding):
    batch = chapter_batch("packed", binding)
    scores = sequence_logprobs(constructed_logits(batch, gold_probabilities(batch)), batch)
    assert isinstance(scores, OccurrenceLogprobs) and len(scores) == 3
    with pytest.raises(AttributeError):
        scores.sums = None
    with pytest.raises(ValueError, match="read-only"):
        scores.sums[0] = 0.0
