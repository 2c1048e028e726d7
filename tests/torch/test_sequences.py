"""Per-occurrence log-probabilities: one sum per example occurrence, from a batch or any of its dicts.

The oracle slices each occurrence's supervised logit rows out of the batch and takes their
``log_softmax`` alone in float64; the loss (``loss_sum``) must be minus the sum of the sums.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import seqpack as sp

torch = pytest.importorskip("torch", reason="seqpack.torch needs PyTorch: pip install 'seqpack[torch]'")
import seqpack.torch as st  # noqa: E402
from seqpack.chapters.fixtures import chapter_batch  # noqa: E402
from seqpack.chapters.probe import constructed_logits, gold_probabilities  # noqa: E402
from seqpack.torch.objective import loss_sum  # noqa: E402
from helpers import supervised_table  # noqa: E402

TRAIN = sp.Partition.TRAIN
BINDING = sp.BatchBinding.fixture()
VOCABULARY = BINDING.vocabulary_size
POLICIES = ["next-fit", "first-fit-decreasing", "best-fit-decreasing"]
BIG = 1 << 40


def hf():
    return pytest.importorskip("seqpack.hf", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")


def batches(lengths, rows, extra, policy, seed, padded=False):
    table = supervised_table(lengths, seed, BINDING)
    if padded:
        return list(sp.pad(table, sp.PadConfig(rows), partition=TRAIN, binding=BINDING))
    capacity = int(table.lengths.max()) + extra
    config = sp.PackConfig(capacity, rows, rows * capacity, BIG)
    return list(sp.pack(table, config, partition=TRAIN, binding=BINDING, policy=policy))


def random_logits(batch, seed, dtype=torch.float64):
    rng = np.random.default_rng(seed)
    return torch.tensor(3 * rng.standard_normal(batch.shape + (VOCABULARY,)), dtype=dtype)


def poisoned(logits, batch):
    """``logits`` with NaN in every logit row the loss excludes (padding, unsupervised targets)."""
    dirty = logits.detach().clone()
    dirty[torch.from_numpy(~batch.loss_mask)] = float("nan")
    return dirty


def reference(logits, batch):
    """Each occurrence's supervised rows sliced out and ``log_softmax``'d alone in float64:
    ``(sums, counts, per-target log p in occurrence order)``."""
    sums, counts, tokens = [], [], []
    for o in batch.occurrences:
        columns = slice(o.columns.start, o.columns.stop)
        mask = torch.from_numpy(batch.loss_mask[o.row, columns].copy())
        gold = torch.from_numpy(batch.targets[o.row, columns].astype(np.int64))[mask]
        rows = logits[o.row, columns][mask].double()
        picked = torch.log_softmax(rows, -1)[torch.arange(gold.numel()), gold]
        sums.append(picked.sum())
        counts.append(gold.numel())
        tokens.append(picked)
    return torch.stack(sums), torch.tensor(counts), torch.cat(tokens)


def flat_logits(logits, batch):
    """``[1, N, V]`` logits for ``hf.flat(batch)``: each cell's row at its flat position, NaN at
    every sequence's last token (which predicts nothing)."""
    rows = [logits[o.row, o.columns.start:o.columns.stop] for o in batch.occurrences]
    gap = torch.full((1, logits.shape[-1]), float("nan"), dtype=logits.dtype)
    return torch.cat([part for row in rows for part in (row, gap)])[None]


def close(a, b, absolute=1e-10, relative=1e-9):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return bool(torch.all((a - b).abs() <= absolute + relative * torch.maximum(a.abs(), b.abs())))


# --- the constructed probe ---------------------------------------------------------------


@pytest.mark.parametrize(("kind", "expected"), [
    ("packed", {"A": (-3, 3), "B": (-4, 2), "C": (-4, 4)}),
    ("padded", {"short": (-3, 2), "long": (-5, 4)}),
])
def test_the_chapters_probe_gives_each_example_its_constructed_sum(kind, expected):
    batch = chapter_batch(kind, BINDING)
    logits = torch.from_numpy(constructed_logits(batch, gold_probabilities(batch)))
    result = st.sequence_logprobs(logits, batch)
    assert result.example_ids == tuple(expected) and result.ordinals.tolist() == list(range(len(expected)))
    assert result.counts.tolist() == [count for _, count in expected.values()]
    for got, (twos, _) in zip(result.sums.tolist(), expected.values()):
        assert math.isclose(got, twos * math.log(2), rel_tol=1e-12)
    assert result.counts.dtype == torch.int64 and result.sums.dtype == torch.float64


# --- random batches against the oracle ---------------------------------------------------


@settings(derandomize=True, max_examples=30, deadline=None)
@given(hs.lists(hs.integers(1, 14), min_size=1, max_size=20), hs.integers(1, 4), hs.integers(0, 5),
       hs.sampled_from(POLICIES), hs.booleans(), hs.integers(0, 1 << 30))
def test_sums_match_the_oracle_and_the_loss(lengths, rows, extra, policy, padded, seed):
    for index, batch in enumerate(batches(lengths, rows, extra, policy, seed, padded)):
        logits = random_logits(batch, seed + index)
        result = st.sequence_logprobs(poisoned(logits, batch), batch)
        sums, counts, tokens = reference(logits, batch)
        assert close(result.sums, sums)
        assert torch.equal(result.counts, counts)
        total, count = loss_sum(logits, batch)
        assert close(result.sums.sum(), -total) and int(result.counts.sum()) == count == batch.target_count
        assert result.ordinals.tolist() == [o.ordinal for o in batch.occurrences]
        assert result.example_ids == tuple(example.id for example in batch.examples)
        values, offsets = st.token_logprobs(logits, batch)
        assert close(values, tokens) and torch.equal(offsets.diff(), counts) and int(offsets[0]) == 0


@settings(derandomize=True, max_examples=15, deadline=None)
@given(hs.lists(hs.integers(1, 12), min_size=1, max_size=12), hs.integers(1, 3), hs.integers(0, 4),
       hs.sampled_from(POLICIES), hs.booleans(), hs.integers(0, 1 << 30))
def test_a_batch_and_its_three_dicts_give_the_same_results(lengths, rows, extra, policy, padded, seed):
    collators = hf()
    for index, batch in enumerate(batches(lengths, rows, extra, policy, seed, padded)):
        logits = poisoned(random_logits(batch, seed + index), batch)
        inputs = [(logits, batch), (logits, st.tensors(batch)), (logits, collators.rows(batch)),
                  (flat_logits(logits, batch), collators.flat(batch))]
        results = [st.sequence_logprobs(*pair) for pair in inputs]
        tokens = [st.token_logprobs(*pair) for pair in inputs]
        for result, (values, offsets) in zip(results[1:], tokens[1:]):
            assert torch.equal(result.sums, results[0].sums) and torch.equal(result.counts, results[0].counts)
            assert result.ordinals is None and result.example_ids is None
            assert torch.equal(values, tokens[0][0]) and torch.equal(offsets, tokens[0][1])


def test_an_occurrence_without_targets_sums_to_zero_in_every_dict():
    collators = hf()
    (batch,) = batches([5, 3, 4], 1, 8, "next-fit", 7)  # one row of three occurrences
    logits = random_logits(batch, 1)
    middle = batch.occurrences[1]
    labels = st.tensors(batch)
    labels["shift_labels"] = labels["shift_labels"].clone()
    labels["shift_labels"][middle.row, middle.columns.start:middle.columns.stop] = st.IGNORE_INDEX
    rows = collators.rows(batch)
    rows["shift_labels"] = labels["shift_labels"]
    flat = collators.flat(batch)
    start = int(flat["cu_seq_lens_q"][1])
    flat["labels"] = flat["labels"].clone()
    flat["labels"][0, start:int(flat["cu_seq_lens_q"][2])] = st.IGNORE_INDEX
    full = st.sequence_logprobs(logits, batch)
    for result in (st.sequence_logprobs(logits, labels), st.sequence_logprobs(logits, rows),
                   st.sequence_logprobs(flat_logits(logits, batch), flat)):
        assert result.counts.tolist() == [full.counts[0], 0, full.counts[2]]
        assert result.sums[1].item() == 0.0
        assert torch.equal(result.sums[[0, 2]], full.sums[[0, 2]])


def test_a_flat_dict_reads_its_sequences_from_seq_idx_alone():
    collators = hf()
    batch = batches([4, 2, 6, 3], 2, 1, "first-fit-decreasing", 3)[0]
    logits = flat_logits(random_logits(batch, 2), batch)
    flat = collators.flat(batch)
    expected = st.sequence_logprobs(logits, flat)
    for key in ("cu_seq_lens_q", "seq_idx"):
        partial = {name: value for name, value in flat.items() if name != key}
        result = st.sequence_logprobs(logits, partial)
        assert torch.equal(result.sums, expected.sums) and torch.equal(result.counts, expected.counts)


def test_a_flat_sequence_s_last_token_predicts_nothing_whatever_label_follows():
    # transformers writes -100 at each sequence's first label; a dict that does not still
    # gives no target across the boundary (nor one at the very end).
    flat = {"labels": torch.tensor([[7, 1, 2, 9, 3]]), "cu_seq_lens_q": torch.tensor([0, 3, 5])}
    logits = torch.randn(1, 5, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    result = st.sequence_logprobs(logits, flat)
    picked = torch.log_softmax(logits[0], -1)[[0, 1, 3], [1, 2, 3]]
    assert result.counts.tolist() == [2, 1]
    assert close(result.sums, torch.stack([picked[0] + picked[1], picked[2]]))


@pytest.mark.parametrize("options", [{}, {"return_seq_idx": True}, {"return_flash_attn_kwargs": True},
                                     {"return_flash_attn_kwargs": True, "return_seq_idx": True}])
def test_every_output_of_transformers_flattening_collator_is_read(options):
    # By default the collator marks its sequences by position_ids alone.
    pytest.importorskip("transformers", reason="the oracle is transformers' collator: pip install 'seqpack[hf]'")
    from transformers import DataCollatorWithFlattening

    lengths = [4, 1, 6, 3]
    generator = torch.Generator().manual_seed(8)
    features = [{"input_ids": torch.randint(0, 10, (n,), generator=generator).tolist()} for n in lengths]
    flat = DataCollatorWithFlattening(**options)(features, return_tensors="pt")
    logits = torch.randn(1, sum(lengths), 10, dtype=torch.float64, generator=generator)
    result = st.sequence_logprobs(logits, flat)
    expected, start = [], 0
    for feature in features:
        tokens = torch.tensor(feature["input_ids"])
        rows = torch.log_softmax(logits[0, start:start + tokens.numel() - 1], -1)
        expected.append(rows[torch.arange(tokens.numel() - 1), tokens[1:]].sum())
        start += tokens.numel()
    assert result.counts.tolist() == [n - 1 for n in lengths] and close(result.sums, torch.stack(expected))
    # the same fields in a BatchEncoding (what transformers' padding collators return: a mapping, not a dict)
    from transformers import BatchEncoding

    assert torch.equal(st.sequence_logprobs(logits, BatchEncoding(dict(flat))).sums, result.sums)


def test_empty_layouts_give_empty_results():
    flat = {"labels": torch.zeros(1, 0, dtype=torch.int64), "cu_seq_lens_q": torch.tensor([0])}
    rows = {"shift_labels": torch.zeros(2, 0, dtype=torch.int64), "position_ids": torch.zeros(2, 0, dtype=torch.int64),
            "valid_lengths": torch.tensor([0, 0])}
    for batch, shape in ((flat, (1, 0, 5)), ({**flat, "seq_idx": torch.zeros(1, 0)}, (1, 0, 5)), (rows, (2, 0, 5))):
        batch = {k: v.long() for k, v in batch.items()}
        result = st.sequence_logprobs(torch.zeros(shape), batch)
        values, offsets = st.token_logprobs(torch.zeros(shape), batch)
        assert result.sums.numel() == result.counts.numel() == values.numel() == 0 and offsets.tolist() == [0]


# --- precision, gradients, excluded cells ---------------------------------------------


def test_a_long_float32_sequence_is_summed_without_drift():
    # 100,000 float32 log-probabilities added in float32 drift by about 5e-6 relative.
    generator = torch.Generator().manual_seed(0)
    size = 100_000
    flat = {"labels": torch.randint(0, 4, (1, size), generator=generator), "cu_seq_lens_q": torch.tensor([0, size])}
    logits = torch.randn(1, size, 4, generator=generator)
    (total,) = st.sequence_logprobs(logits, flat).sums
    exact = torch.log_softmax(logits[0, :-1].double(), -1)[torch.arange(size - 1), flat["labels"][0, 1:]].sum()
    assert total.dtype == torch.float32 and close(total, exact, relative=1e-7)


def test_gradcheck_in_float64():
    # A [2, 4] rows() dict of three sequences, one with no target, over 5 classes.
    batch = {"shift_labels": torch.tensor([[1, -100, 4, 0], [-100, -100, 3, -100]]),
             "position_ids": torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0]]),
             "valid_lengths": torch.tensor([4, 3])}
    logits = torch.randn(2, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                         requires_grad=True)
    assert st.sequence_logprobs(logits, batch).counts.tolist() == [1, 2, 0, 1]
    assert torch.autograd.gradcheck(lambda z: st.sequence_logprobs(z, batch).sums, (logits,), fast_mode=False)
    assert torch.autograd.gradcheck(lambda z: st.token_logprobs(z, batch)[0], (logits,), fast_mode=False)
    small = chapter_batch("packed", BINDING)
    packed = random_logits(small, 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda z: st.sequence_logprobs(z, small).sums, (packed,), fast_mode=True)


@pytest.mark.parametrize("padded", [False, True])
def test_weighted_gradients_match_the_oracle_and_nan_reaches_none(padded):
    for index, batch in enumerate(batches([6, 2, 9, 4, 1, 7, 3], 2, 2, "best-fit-decreasing", 11, padded)):
        excluded = torch.from_numpy(~batch.loss_mask)
        assert excluded.any()
        clean = random_logits(batch, index).requires_grad_()
        weights = torch.linspace(-1.5, 2.0, len(batch.occurrences), dtype=torch.float64)
        (weights * reference(clean, batch)[0]).sum().backward()
        dirty = poisoned(clean, batch).requires_grad_()
        result = st.sequence_logprobs(dirty, batch)
        (weights * result.sums).sum().backward()
        assert torch.isfinite(result.sums).all() and torch.isfinite(dirty.grad).all()
        assert (dirty.grad[excluded] == 0).all()
        assert close(dirty.grad, clean.grad, 1e-12, 1e-9)
        again = poisoned(clean, batch).nan_to_num(0.0).requires_grad_()  # the same logits, 0 where NaN was
        other = st.sequence_logprobs(again, batch)
        (weights * other.sums).sum().backward()
        assert torch.equal(other.sums, result.sums.detach()) and torch.equal(again.grad, dirty.grad)


def test_nan_in_every_unread_flat_position_changes_nothing():
    collators = hf()
    batch = batches([5, 8, 2, 6], 2, 0, "next-fit", 5)[0]
    logits = flat_logits(random_logits(batch, 4), batch)  # NaN at every sequence's last token already
    flat = collators.flat(batch)
    unread = torch.cat([flat["labels"][0, 1:] == st.IGNORE_INDEX, torch.tensor([True])])
    unread[flat["cu_seq_lens_q"][1:].long() - 1] = True
    clean = logits.nan_to_num(0.0).requires_grad_()
    dirty = clean.detach().clone()
    dirty[0, unread] = float("nan")
    dirty.requires_grad_()
    assert unread.sum() > len(batch.occurrences)  # unsupervised targets too, not only the last tokens
    for z in (clean, dirty):
        st.sequence_logprobs(z, flat).sums.sum().backward()
    assert torch.equal(st.sequence_logprobs(clean, flat).sums, st.sequence_logprobs(dirty, flat).sums)
    assert torch.isfinite(dirty.grad).all() and torch.equal(dirty.grad, clean.grad)
    assert (dirty.grad[0, unread] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_read_in_float32(dtype):
    batch = batches([7, 3, 5], 2, 1, "next-fit", 2)[0]
    half = random_logits(batch, 0, dtype).requires_grad_()
    widened = half.detach().float().requires_grad_()
    low, high = st.sequence_logprobs(half, batch), st.sequence_logprobs(widened, batch)
    assert low.sums.dtype == torch.float32 and torch.equal(low.sums, high.sums)
    low.sums.sum().backward()
    high.sums.sum().backward()
    assert half.grad.dtype == dtype and torch.equal(half.grad, widened.grad.to(dtype))
    assert close(low.sums, reference(half.detach().double(), batch)[0], 1e-5, 1e-5)
    assert st.sequence_logprobs(random_logits(batch, 0, torch.float64), batch).sums.dtype == torch.float64


@pytest.mark.parametrize("layout", ["transposed", "sliced classes", "contiguous"])
def test_strided_logits_give_the_contiguous_results_bit_for_bit(layout):
    # Rows are read through a [rows * T, V] view where the strides allow one, else by indexing.
    batch = batches([9, 12, 4, 11, 3], 2, 1, "best-fit-decreasing", 5)[0]
    dense = random_logits(batch, 2)
    if layout == "transposed":  # [rows, T] not mergeable: stride(0) < T * stride(1)
        logits = dense.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "sliced classes":
        logits = torch.cat([dense, torch.full_like(dense[..., :3], float("nan"))], 2)[..., :VOCABULARY]
    else:
        logits = dense.clone()
    logits.requires_grad_()
    dense.requires_grad_()
    for given in (logits, dense):
        result = st.sequence_logprobs(given, batch)
        (result.sums * torch.arange(1.0, 1.0 + result.sums.numel(), dtype=result.sums.dtype)).sum().backward()
    assert torch.equal(st.sequence_logprobs(logits, batch).sums, st.sequence_logprobs(dense, batch).sums)
    assert torch.equal(logits.grad, dense.grad)


def test_no_copy_of_the_logit_rows_is_kept_for_backward():
    batch = batches([9, 12, 4, 11], 2, 0, "next-fit", 9)[0]
    logits = random_logits(batch, 0, torch.float32).requires_grad_()
    kept = []

    def pack(tensor):
        if tensor.data_ptr() != logits.data_ptr():  # the logits themselves are no copy
            kept.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = st.sequence_logprobs(logits, batch)
    # Index and target vectors, lse and the segment lengths: a few numbers per target, none per class.
    assert sum(kept) <= 8 * batch.target_count + 2 * len(batch.occurrences)
    result.sums.sum().backward()
    assert logits.grad.shape == logits.shape


def test_results_are_bitwise_the_same_at_every_thread_count():
    # Three cells per row make one-row blocks, and 40,000 classes a row long enough for
    # PyTorch to split a lone row's sum across threads (which changes about half of them).
    generator = torch.Generator().manual_seed(0)
    batch = {"shift_labels": torch.tensor([[5, 39999, 7]]), "position_ids": torch.tensor([[0, 1, 0]]),
             "valid_lengths": torch.tensor([3])}
    cases = [(4 * torch.randn(1, 3, 40000, generator=generator)).requires_grad_() for _ in range(8)]
    threads = torch.get_num_threads()
    seen = []
    try:
        for count in (1, 2, 1, 2):
            torch.set_num_threads(count)
            outputs = []
            for logits in cases:
                logits.grad = None
                result = st.sequence_logprobs(logits, batch)
                result.sums.sum().backward()
                outputs += [result.sums.detach(), st.token_logprobs(logits, batch)[0].detach(), logits.grad.clone()]
            seen.append(outputs)
    finally:
        torch.set_num_threads(threads)
    for other in seen[1:]:
        assert all(torch.equal(a, b) for a, b in zip(seen[0], other))


def test_token_values_sum_to_the_sums_in_column_order():
    batch = batches([6, 1, 9, 3, 5], 2, 2, "first-fit-decreasing", 4)[0]
    generator = torch.Generator().manual_seed(5)
    long = {"shift_labels": torch.randint(0, 10, (1, 400), generator=generator),  # long enough for a
            "position_ids": torch.tensor([list(range(150)) + list(range(250))]),   # vectorized sum to
            "valid_lengths": torch.tensor([400])}                                   # add in another order
    for logits, layout in ((random_logits(batch, 6), batch),
                           (torch.randn(1, 400, 10, dtype=torch.float64, generator=generator), long)):
        result = st.sequence_logprobs(logits, layout)
        values, offsets = st.token_logprobs(logits, layout)
        assert offsets.dtype == torch.int64 and offsets.shape == (result.counts.numel() + 1,)
        assert int(offsets[0]) == 0 and int(offsets[-1]) == values.numel() == int(result.counts.sum())
        for k, (start, stop) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
            total = 0.0
            for value in values[start:stop].tolist():
                total += value
            assert total == result.sums[k].item() and stop - start == result.counts[k]
    assert result.counts.tolist() == [150, 250]


# --- refusals ----------------------------------------------------------------------------


def refusals():
    batch = chapter_batch("packed", BINDING)
    logits = random_logits(batch, 0)
    rows = {"shift_labels": torch.tensor([[1, 2, -100]]), "position_ids": torch.tensor([[0, 1, 0]]),
            "valid_lengths": torch.tensor([2])}
    flat = {"labels": torch.tensor([[-100, 1, 2, -100, 3]]), "cu_seq_lens_q": torch.tensor([0, 3, 5])}
    small = torch.zeros(1, 3, 5)
    return [
        (logits.long(), batch, "logits must be a floating-point tensor, not torch.int64"),
        ([[0.0]], batch, "logits must be a floating-point tensor, not list"),
        (logits[0], batch, r"logits have shape \(6, 266\); the batch needs \(2, 6\) \+ \(vocabulary,\)"),
        (logits[:1], batch, r"logits have shape \(1, 6, 266\); the batch needs \(2, 6\)"),
        (logits[..., :100], batch, r"the batch: row 0, column 1 has target 100, outside the vocabulary \[0, 100\)"),
        (logits, [batch], "expected a padded or packed batch or one of its dicts, not list"),
        (logits, {"input_ids": 0, "labels": 0}, r"this dict has 'input_ids', 'labels'"),
        (logits, {**st.tensors(batch), "extra": 1}, "has 'extra', which tensors\\(\\) does not make"),
        (small, {k: v for k, v in rows.items() if k != "valid_lengths"}, "the rows\\(\\) dict lacks 'valid_lengths'"),
        (small, {**rows, "shift_labels": rows["shift_labels"].float()},
         r"the rows\(\) dict's shift_labels must be an integer tensor of 2 dimensions, not torch.float32"),
        (small, {**rows, "valid_lengths": torch.tensor([4])}, r"row 0 has valid length 4, outside \[0, 3\]"),
        (small, {**rows, "shift_labels": torch.tensor([[1, 2, 3]])},
         "row 0, column 2 holds target 3 past the row's valid length 2"),
        (small, {**rows, "position_ids": torch.tensor([[1, 2, 0]])}, "row 0 begins at position 1"),
        (small, {**rows, "shift_labels": torch.tensor([[1, 5, -100]])},
         r"the rows\(\) dict: row 0, column 1 has target 5, outside the vocabulary \[0, 5\)"),
        (torch.zeros(1, 5, 5), {**flat, "labels": flat["labels"][0]}, "labels must be an integer tensor of 2 dim"),
        (torch.zeros(1, 5, 5), {**flat, "cu_seq_lens_q": torch.tensor([0, 3, 4])},
         r"cu_seq_lens_q must rise strictly from 0 to its 5 tokens, not \[0, 3, 4\]"),
        (torch.zeros(1, 5, 5), {**flat, "cu_seq_lens_q": torch.tensor([0, 3, 3, 5])}, "must rise strictly"),
        (torch.zeros(1, 5, 5), {**flat, "seq_idx": torch.tensor([[0, 0, 1, 1, 1]])},
         "seq_idx and cu_seq_lens_q describe different sequences"),
        (torch.zeros(2, 5, 5), flat, r"logits have shape \(2, 5, 5\); the flat\(\) dict needs \(1, 5\)"),
        (torch.zeros(1, 5, 3), flat, r"the flat\(\) dict: row 0, column 3 has target 3, outside the vocabulary"),
    ]


@pytest.mark.parametrize("index", range(len(refusals())))
def test_refusals_name_the_problem(index):
    logits, batch, message = refusals()[index]
    for function in (st.sequence_logprobs, st.token_logprobs):
        with pytest.raises(sp.InvalidInputError, match=message):
            function(logits, batch)


def test_the_refusals_twins_are_accepted():
    """Each refusal's input with its one fault mended is taken (the refusals are not blanket)."""
    rows = {"shift_labels": torch.tensor([[1, 2, -100]]), "position_ids": torch.tensor([[0, 1, 0]]),
            "valid_lengths": torch.tensor([2])}
    assert st.sequence_logprobs(torch.zeros(1, 3, 5), rows).counts.tolist() == [2]
    whole = {**rows, "valid_lengths": torch.tensor([3])}  # the last cell opens a sequence with no target
    assert st.sequence_logprobs(torch.zeros(1, 3, 5), whole).counts.tolist() == [2, 0]
    flat = {"labels": torch.tensor([[-100, 1, 2, -100, 3]]), "cu_seq_lens_q": torch.tensor([0, 3, 5]).int(),
            "seq_idx": torch.tensor([[0, 0, 0, 1, 1]]).int()}
    result = st.sequence_logprobs(torch.zeros(1, 5, 4, dtype=torch.float64), flat)
    assert result.counts.tolist() == [2, 1] and close(result.sums, [-2 * math.log(4), -math.log(4)])


def test_a_gradient_penalty_is_an_error_not_a_silent_zero():
    # create_graph=True went through once_differentiable with the second-order terms zero (review).
    batch = {"shift_labels": torch.tensor([[1, 2, -100]]), "position_ids": torch.tensor([[0, 1, 2]]),
             "valid_lengths": torch.tensor([3])}
    logits = torch.randn(1, 3, 5, dtype=torch.float64, requires_grad=True)
    sums = st.sequence_logprobs(logits, batch).sums
    first, = torch.autograd.grad(sums.sum(), logits, retain_graph=True)
    assert torch.isfinite(first).all()
    with pytest.raises(sp.InvalidInputError, match="sequence_logprobs is differentiable once"):
        torch.autograd.grad(sums.sum(), logits, create_graph=True)
