"""The eligible-target loss: kernel vs numpy, the chapters' loss probe, poison and errors."""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import BindingError, DecodeLimits, InvalidInputError, masked_loss
from seqpack.nn import _loss
from seqpack.nn.autograd import Tensor
from seqpack.chapters.fixtures import chapter_batch
from seqpack.chapters.probe import gold_probabilities
from seqpack.chapters.probe import constructed_logits, loss_probe
from seqpack.nn.loss import masked_nll

pytestmark = pytest.mark.kernel


def reference_nll(logits, targets, mask):
    """Numpy: per-target -log softmax over the selected rows, and the mean-loss gradient."""
    classes = logits.shape[-1]
    flat = logits.reshape(-1, classes)
    cells = np.flatnonzero(mask)
    selected = flat[cells]
    top = selected.max(axis=1, keepdims=True)
    log_probs = selected - top - np.log(np.exp(selected - top).sum(axis=1, keepdims=True))
    gold = targets.reshape(-1)[cells]
    losses = -log_probs[np.arange(cells.size), gold]
    gradient = np.zeros_like(flat)
    gradient[cells] = np.exp(log_probs)
    gradient[cells, gold] -= 1.0
    return losses, (gradient / cells.size).reshape(logits.shape)


@settings(derandomize=True, max_examples=50, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**32 - 1))
def test_kernel_matches_numpy_reference(rows, columns, classes, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 5.0, (rows, columns, classes))
    targets = rng.integers(0, classes, (rows, columns)).astype(np.int32)
    mask = rng.random((rows, columns)) < 0.7
    mask.reshape(-1)[rng.integers(mask.size)] = True
    targets[~mask] = -1
    loss = masked_nll(Tensor(logits, requires_grad=True), targets, mask)
    losses, gradient = reference_nll(logits, targets, mask)
    np.testing.assert_allclose(loss.target_losses, losses, rtol=1e-12, atol=1e-14)
    assert loss.count == mask.sum()
    assert math.isclose(loss.loss_sum, losses.sum(), rel_tol=1e-12, abs_tol=1e-13)
    assert loss.mean == loss.loss_sum / loss.count
    np.testing.assert_allclose(loss.backward()["logits"], gradient, rtol=1e-12, atol=1e-15)


def test_float32_kernel():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 6)).astype(np.float32)
    rows = np.array([0, 2, 3], dtype=np.intp)
    targets = np.array([5, 0, 2], dtype=np.int32)
    normalizers, losses = np.empty((3, 2)), np.empty(3)
    total = _loss.indexed_nll_forward(logits, rows, targets, normalizers, losses)
    expected, gradient = reference_nll(logits.astype(np.float64)[None], np.array([[5, -1, 0, 2]]),
                                       np.array([[1, 0, 1, 1]], bool))
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert math.isclose(total, expected.sum(), rel_tol=1e-6)
    dlogits = np.zeros_like(logits)
    _loss.indexed_nll_backward(logits, rows, targets, normalizers, 1.0 / 3, dlogits)
    assert not dlogits[1].any() and abs(dlogits.sum()) < 1e-6
    # The sum of softmax-minus-one-hot is zero whatever the scale or the gold class: the
    # gradient itself is checked against the float64 reference (the mean over 3 targets).
    np.testing.assert_allclose(dlogits, gradient[0], rtol=1e-6, atol=1e-7)


def test_stable_for_huge_logits():
    logits = np.array([[[1000.0, 0.0, -1000.0]]])
    loss = masked_nll(logits, np.array([[0]]), np.array([[True]]))
    assert loss.loss_sum == pytest.approx(math.log1p(math.exp(-1000.0)), abs=1e-300)
    assert np.isfinite(loss.target_losses).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [1e15, 1e16, 1e30])
def test_a_row_of_huge_logits_loses_nothing_to_cancellation(dtype, offset):
    """The loss was (m + log sum) - x[target]: with m = 1e30 the log sum rounded away and every
    loss was 0, with gradients that did not sum to zero (review). Logits shifted by one
    offset give the loss and gradient of the logits as they are stored, shifted back."""
    stored = (np.array([[[0.5, -0.25, 1.0, 0.0]]]) + offset).astype(dtype)
    exact = stored.astype(np.float64) - float(stored.max())   # the same softmax, exactly (m is a logit)
    loss = masked_nll(stored, np.array([[1]]), np.array([[True]]))
    expected, gradient = reference_nll(exact, np.array([[1]]), np.array([[True]]))
    assert math.isclose(loss.loss_sum, float(expected.sum()), rel_tol=1e-12)
    np.testing.assert_allclose(loss.backward()["logits"], gradient, rtol=1e-6, atol=1e-7)
    assert abs(loss.backward()["logits"].sum()) < 1e-6


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("padded", {"loss_sum": 5.545177, "count": 6, "mean": 0.924196, "per_cell_mean": 0.693147,
                    "document_mean": 0.953077}),
        ("packed", {"loss_sum": 7.624619, "count": 9, "mean": 0.847180, "row_mean": 0.831777,
                    "document_mean": 0.924196}),
    ],
)
def test_loss_probe_reproduces_the_chapters(kind, expected, binding):
    probe = loss_probe(chapter_batch(kind, binding), gold_probabilities(chapter_batch(kind, binding)))
    for name, value in expected.items():
        assert round(probe[name], 6) == value, name
    ln2 = math.log(2)
    exact = {"padded": (8 * ln2, 8 * ln2 / 6), "packed": (11 * ln2, 11 * ln2 / 9)}[kind]
    assert math.isclose(probe["loss_sum"], exact[0], rel_tol=1e-12)
    assert math.isclose(probe["mean"], exact[1], rel_tol=1e-12)


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_analytic_logit_derivative(kind, binding):
    batch = chapter_batch(kind, binding)
    gold = gold_probabilities(batch)
    logits = constructed_logits(batch, gold)
    gradient = masked_loss(logits, batch, binding=binding).backward()["logits"]
    count = int(batch.loss_mask.sum())
    classes = binding.vocabulary_size
    expected = np.zeros_like(logits)
    rows, columns = np.nonzero(batch.loss_mask)
    q = gold[rows, columns]
    expected[rows, columns, :] = ((1 - q) / (classes - 1))[:, None] / count
    expected[rows, columns, batch.targets[rows, columns]] = (q - 1) / count
    np.testing.assert_allclose(gradient, expected, rtol=1e-9, atol=1e-15)
    assert not gradient[~batch.loss_mask].any()


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_poisoned_excluded_logits_change_nothing(poison, binding):
    batch = chapter_batch("packed", binding)
    assert (~batch.loss_mask).any()
    logits = constructed_logits(batch, gold_probabilities(batch))
    poisoned = logits.copy()
    poisoned[~batch.loss_mask] = poison
    clean, dirty = masked_loss(logits, batch), masked_loss(poisoned, batch)
    assert (clean.loss_sum, clean.mean, clean.count) == (dirty.loss_sum, dirty.mean, dirty.count)
    clean_grad, dirty_grad = clean.backward()["logits"], dirty.backward()["logits"]
    assert np.array_equal(clean_grad, dirty_grad)
    assert np.isfinite(dirty_grad).all() and not dirty_grad[~batch.loss_mask].any()


def test_micro_batches_recombine_by_sum_and_count_not_by_means(binding):
    batch = chapter_batch("packed", binding)
    logits = constructed_logits(batch, gold_probabilities(batch))
    whole = masked_nll(logits, batch.targets, batch.loss_mask)
    parts = [masked_nll(logits[row : row + 1], batch.targets[row : row + 1], batch.loss_mask[row : row + 1])
             for row in range(batch.shape[0])]
    recombined = sum(part.loss_sum for part in parts) / sum(part.count for part in parts)
    assert math.isclose(recombined, whole.mean, rel_tol=1e-15)
    mean_of_means = np.mean([part.mean for part in parts])
    assert abs(mean_of_means - whole.mean) > 1e-3


def test_zero_eligible_targets_is_an_error(binding):
    batch = chapter_batch("padded", binding)
    logits = np.zeros(batch.shape + (binding.vocabulary_size,))
    with pytest.raises(InvalidInputError, match="zero loss-eligible targets"):
        masked_nll(logits, batch.targets, np.zeros(batch.shape, dtype=bool))
    one = np.zeros(batch.shape, dtype=bool)
    one[0, 0] = True
    assert masked_nll(logits, batch.targets, one).count == 1


def test_logits_must_match_batch_shape_and_vocabulary(binding):
    batch = chapter_batch("padded", binding)
    rows, width = batch.shape
    masked_loss(np.zeros((rows, width, binding.vocabulary_size)), batch, binding=binding)
    with pytest.raises(InvalidInputError, match=r"logits have shape \(2, 4, 265\).*vocabulary size 266"):
        masked_loss(np.zeros((rows, width, binding.vocabulary_size - 1)), batch)
    with pytest.raises(InvalidInputError, match=r"logits have shape \(2, 5, 266\)"):
        masked_loss(np.zeros((rows, width + 1, binding.vocabulary_size)), batch)


def test_binding_mismatch_is_rejected(binding):
    batch = chapter_batch("padded", binding)
    other = dataclasses.replace(binding, limits=DecodeLimits(max_tokens=10, max_bytes=100))
    logits = np.zeros(batch.shape + (binding.vocabulary_size,))
    with pytest.raises(BindingError):
        masked_loss(logits, batch, binding=other)


def test_eligible_targets_outside_the_vocabulary_are_rejected():
    logits = np.zeros((1, 2, 5))
    with pytest.raises(InvalidInputError, match=r"eligible target 5 at flat cell 1 is outside \[0, 5\)"):
        masked_nll(logits, np.array([[4, 5]]), np.array([[True, True]]))
    with pytest.raises(InvalidInputError, match=r"eligible target -1 at flat cell 0 is outside \[0, 5\)"):
        masked_nll(logits, np.array([[-1, 2]]), np.array([[True, True]]))  # (it said "not below" 5: review)
    masked_nll(logits, np.array([[4, 5]]), np.array([[True, False]]))


def test_a_vocabulary_wider_than_int32_is_refused(tmp_path):
    # Targets past 2**31 - 1 wrapped to negative int32 in the kernel (a crash: review).
    wide = np.memmap(tmp_path / "logits", dtype=np.float32, mode="w+", shape=(1, 2**31 + 2))  # sparse on disk
    with pytest.raises(InvalidInputError, match=r"the logits have 2147483650 classes; the loss takes at most "
                                                r"2147483647"):
        masked_nll(wide, np.array([2**31 + 1]), np.array([True]))


def test_a_tape_loss_refuses_gradients_of_a_tensor_that_needs_none():
    # Its backward() gave zeros (review).
    logits, targets, mask = np.array([[1.0, 2.0, 0.5]]), np.array([0]), np.array([True])
    with pytest.raises(InvalidInputError, match=r"parameter 'logits' does not require a gradient"):
        masked_nll(Tensor(logits), targets, mask).backward()
    expected = masked_nll(logits, targets, mask).backward()["logits"]
    assert np.array_equal(masked_nll(Tensor(logits, requires_grad=True), targets, mask).backward()["logits"], expected)


def test_constructed_probabilities_must_be_open_unit_interval(binding):
    batch = chapter_batch("padded", binding)
    gold = gold_probabilities(batch)
    gold[0, 0] = 1.0
    with pytest.raises(InvalidInputError, match="strictly between 0 and 1"):
        constructed_logits(batch, gold)


# --- masked_nll: masks, targets and logits dtypes ------------------------------------------


def loss_case():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 3, 5))
    targets = rng.integers(0, 5, (2, 3))
    mask = np.ones((2, 3), bool)
    mask[1, 2] = False
    return logits, targets, mask


# Regression: loss masks and targets of another shape or of float/bool dtype were used silently.
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


# Regression: big-endian float64 logits were cut to float32.
def test_big_endian_float64_logits_keep_float64():
    logits, targets, mask = loss_case()
    expected = masked_nll(logits, targets, mask)
    swapped = masked_nll(logits.astype(">f8"), targets, mask)
    assert swapped.mean == expected.mean
    assert swapped.backward()["logits"].dtype == np.float64
    assert masked_nll(logits.astype(">f4"), targets, mask).backward()["logits"].dtype == np.float32


# Regression: logits wider than float64 (longdouble) are refused, naming their width.
@pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="longdouble is float64 here")
def test_logits_wider_than_float64_are_rejected():
    logits, targets, mask = loss_case()
    with pytest.raises(InvalidInputError, match="wider than float64"):
        masked_nll(logits.astype(np.longdouble), targets, mask)


def test_a_torch_tensor_that_requires_grad_is_named():
    # torch's RuntimeError from numpy() escaped (review); seqpack.torch is its place.
    torch = pytest.importorskip("torch", reason="the case is a torch tensor: pip install 'seqpack[torch]'")
    logits, targets, mask = loss_case()
    with pytest.raises(InvalidInputError, match=r"logits must be a numpy array \(seqpack.torch takes torch tensors\)"):
        masked_nll(torch.tensor(logits, requires_grad=True), targets, mask)
    assert masked_nll(torch.tensor(logits), targets, mask).mean == masked_nll(logits, targets, mask).mean


def test_the_chapter_probe_takes_only_the_chapter_examples():
    # An example named "A" of another length was a numpy broadcast ValueError; of the same
    # length but other tokens, it silently got the chapter's probabilities (review).
    import seqpack as sp

    binding = sp.BatchBinding.fixture()
    for tokens in ([0, 99, 100, 101, 1], [0, 99, 105, 1]):
        example = sp.SequenceExample.from_document("A", sp.BatchDocument("A", tokens), binding)
        batch = sp.pack([example], sp.PackConfig(6, 1), partition=sp.Partition.TRAIN, binding=binding).batches[0]
        with pytest.raises(InvalidInputError, match=r"example 'A' is not a chapter fixture example"):
            gold_probabilities(batch)
