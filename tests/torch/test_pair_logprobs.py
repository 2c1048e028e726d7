"""Preference pairs' log-probabilities: ``sequence_logprobs`` read two by two, whole pairs checked.

The oracles: ``sequence_logprobs`` itself (pair ``k`` is occurrences ``2k`` and ``2k + 1``) on
a batch and each of its dicts, and, for a float64 attention model, each chosen and rejected
sequence run alone with plain causal SDPA.
"""

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import seqpack as sp

torch = pytest.importorskip("torch", reason="seqpack.torch needs PyTorch: pip install 'seqpack[torch]'")
import torch.nn.functional as F  # noqa: E402

import seqpack.torch as st  # noqa: E402
from helpers import preference_table, supervised_table  # noqa: E402
from seqpack.errors import InvalidInputError  # noqa: E402

TRAIN = sp.Partition.TRAIN
BINDING = sp.BatchBinding.fixture()
VOCABULARY = BINDING.vocabulary_size
POLICIES = ["next-fit", "first-fit-decreasing", "best-fit-decreasing"]
README = Path(__file__).resolve().parents[2] / "README.md"


def hf():
    return pytest.importorskip("seqpack.hf", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")


def paired_batches(lengths, rows, extra=0, policy="best-fit-decreasing", seed=0, padded=False):
    """The pairs of ``lengths`` (chosen, rejected, chosen...) packed (``pairs=True``, rows of the
    longest pair plus ``extra``) or padded, ``rows`` rows (padded: pairs) per batch."""
    table = preference_table(lengths, seed, BINDING, ids=True)
    if padded:
        return list(sp.pad(table, sp.PadConfig(2 * rows), partition=TRAIN, binding=BINDING, pairs=True))
    capacity = int(table.lengths.reshape(-1, 2).sum(1).max()) + extra
    return list(sp.pack(table, sp.PackConfig(capacity, rows), partition=TRAIN, binding=BINDING, policy=policy,
                        pairs=True))


def random_logits(shape, seed, dtype=torch.float64):
    return torch.tensor(3 * np.random.default_rng(seed).standard_normal(tuple(shape) + (VOCABULARY,)), dtype=dtype)


def assert_pairs_of(result, scored):
    """``result`` is ``scored`` (a SequenceLogprobs) two by two, bit for bit."""
    assert torch.equal(result.chosen, scored.sums[0::2]) and torch.equal(result.rejected, scored.sums[1::2])
    assert torch.equal(result.chosen_counts, scored.counts[0::2])
    assert torch.equal(result.rejected_counts, scored.counts[1::2])


@pytest.mark.slow
@settings(derandomize=True, max_examples=15, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(1, 12), hs.integers(1, 12)), min_size=1, max_size=10), hs.integers(1, 3),
       hs.integers(0, 6), hs.sampled_from(POLICIES), hs.booleans(), hs.integers(0, 1 << 30))
def test_pairs_are_sequence_logprobs_two_by_two_in_every_input(pairs, rows, extra, policy, padded, seed):
    lengths = [n for pair in pairs for n in pair]
    seen = []
    for index, batch in enumerate(paired_batches(lengths, rows, extra, policy, seed, padded)):
        logits = random_logits(batch.shape, seed + index)
        scored = st.sequence_logprobs(logits, batch)
        ordinals = scored.ordinals
        for given_input in (batch, st.tensors(batch)):
            result = st.pair_logprobs(logits, given_input)
            assert_pairs_of(result, scored)
            assert torch.equal(result.pair_ids, ordinals[0::2] // 2) and result.pair_ids.dtype == torch.int64
        seen += (ordinals[0::2] // 2).tolist()
        assert ordinals[1::2].tolist() == (ordinals[0::2] + 1).tolist()
        if padded:
            continue
        collators = hf()
        rows_dict = collators.rows(batch)
        assert st.pair_logprobs(logits, rows_dict).pair_ids is None
        recorded = {**rows_dict, "pair_ids": torch.arange(100, 100 + ordinals.numel() // 2, dtype=torch.int32)}
        result = st.pair_logprobs(logits, recorded)
        assert_pairs_of(result, scored)
        assert result.pair_ids.tolist() == list(range(100, 100 + ordinals.numel() // 2))
        assert result.pair_ids.dtype == torch.int64
        flat = collators.flat(batch)
        flat_logits = random_logits((1, flat["input_ids"].shape[1]), seed)
        assert_pairs_of(st.pair_logprobs(flat_logits, flat), st.sequence_logprobs(flat_logits, flat))
    assert sorted(seen) == list(range(len(pairs)))                 # every pair once, whole


class TinyAttention(torch.nn.Module):
    """A float64 decoder layer: embedding, two attention heads, a tied output. Packed rows use
    ``range_attention``; a sequence alone uses plain causal SDPA."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.heads = heads
        self.embed = torch.nn.Parameter(torch.randn(VOCABULARY, width, generator=generator, dtype=torch.float64))
        self.qkv = torch.nn.Parameter(torch.randn(width, 3 * width, generator=generator, dtype=torch.float64) / 4)

    def forward(self, ids, positions=None, valid_lengths=None):
        x = self.embed[ids]                                                                # [B, T, width]
        q, k, v = ((x @ self.qkv).chunk(3, -1))
        q, k, v = (t.view(*x.shape[:2], self.heads, -1).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        if valid_lengths is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = st.range_attention(q, k, v, position_ids=positions, valid_lengths=valid_lengths)
        return (x + out.transpose(1, 2).reshape(x.shape)) @ self.embed.T                   # [B, T, V]


def close(a, b):
    a, b = a.detach(), b.detach()
    return bool(((a - b).abs() <= 1e-10 + 1e-9 * torch.maximum(a.abs(), b.abs())).all())


def test_each_pair_equals_its_sequences_run_alone_with_their_gradients():
    (batch,) = paired_batches([9, 4, 2, 13, 7, 7, 1, 3, 16, 11], rows=4, extra=5, seed=3)
    assert batch.shape[0] < 5                                      # several pairs share rows
    fields = st.tensors(batch)
    packed, alone = TinyAttention(), TinyAttention()
    weights = torch.linspace(0.5, 2.0, 10, dtype=torch.float64)   # any objective of the sums
    result = st.pair_logprobs(packed(fields["input_ids"], fields["positions"], fields["valid_lengths"]), batch)
    (weights[0::2] @ result.chosen - weights[1::2] @ result.rejected).backward()

    expected = []
    for example in batch.examples:                                 # occurrence order: c, r, c, r...
        logits = alone(torch.from_numpy(example.inputs.astype(np.int64))[None])[0]
        picked = logits.log_softmax(-1)[torch.arange(len(example.targets)), torch.from_numpy(example.targets)]
        expected.append((picked[torch.from_numpy(example.loss_mask)].sum(), int(example.loss_mask.sum())))
    sums = torch.stack([s for s, _ in expected])
    (weights[0::2] @ sums[0::2] - weights[1::2] @ sums[1::2]).backward()
    assert close(result.chosen, sums[0::2]) and close(result.rejected, sums[1::2])
    assert result.chosen_counts.tolist() == [n for _, n in expected[0::2]]
    assert result.rejected_counts.tolist() == [n for _, n in expected[1::2]]
    assert result.pair_ids.tolist() == [o // 2 for o in batch.occurrence_records["ordinal"][0::2].tolist()]
    for (name, ours), theirs in zip(packed.named_parameters(), alone.parameters()):
        assert close(ours.grad, theirs.grad), name


def test_gradients_are_those_of_each_sequence_s_log_softmax():
    (batch,) = paired_batches([5, 3, 8, 2, 4, 6], rows=3, extra=2, seed=5)
    logits, dense = (random_logits(batch.shape, 4).requires_grad_() for _ in range(2))
    result = st.pair_logprobs(logits, batch)
    F.logsigmoid(0.1 * (result.chosen - result.rejected)).sum().backward()

    picked = dense.log_softmax(-1).gather(-1, torch.from_numpy(batch.targets.astype(np.int64)).clamp(min=0)[..., None])
    mask = torch.from_numpy(batch.loss_mask.copy())
    sums = {o.ordinal: picked[o.row, o.columns, 0][mask[o.row, o.columns]].sum() for o in batch.occurrences}
    F.logsigmoid(0.1 * torch.stack([sums[2 * p] - sums[2 * p + 1] for p in result.pair_ids.tolist()])).sum().backward()
    assert sorted(result.pair_ids.tolist()) == [0, 1, 2]
    assert close(logits.grad, dense.grad)


def test_nan_at_prompt_targets_and_padding_reaches_no_sum_and_no_gradient():
    (batch,) = paired_batches([6, 9, 3, 3, 10, 2, 5, 8], rows=4, extra=7, seed=11)
    mask = torch.from_numpy(batch.loss_mask.copy())
    assert torch.from_numpy(batch.target_valid & ~batch.loss_mask).any()  # prompt targets occur ...
    assert not torch.from_numpy(batch.token_valid).all()                  # ... and padding
    clean = random_logits(batch.shape, 8)
    dirty = clean.clone()
    dirty[~mask] = float("nan")
    clean, dirty = clean.requires_grad_(), dirty.requires_grad_()
    results = [st.pair_logprobs(logits, batch) for logits in (clean, dirty)]
    for field in ("chosen", "rejected", "chosen_counts", "rejected_counts", "pair_ids"):
        assert torch.equal(getattr(results[0], field), getattr(results[1], field)), field
    for result in results:
        (result.chosen.sum() - 2 * result.rejected.sum()).backward()
    assert torch.equal(clean.grad, dirty.grad) and torch.isfinite(dirty.grad).all()
    assert not dirty.grad[~mask].any()
    # the control: log_softmax over every cell before masking lets the NaN into the gradient
    control = dirty.detach().clone().requires_grad_()
    gold = control.log_softmax(-1).gather(-1, torch.from_numpy(batch.targets.astype(np.int64)).clamp(min=0)[..., None])
    total = torch.where(mask, gold[..., 0], 0.0).sum()
    total.backward()
    assert torch.isfinite(total) and not torch.isfinite(control.grad).all()


def test_target_statistics_are_each_supervised_target_s_distribution():
    """What PackedDPO reports for TRL's metrics: per supervised target, in occurrence order, the
    entropy, the mean logit and whether the target is the first most likely token; NaN in the
    excluded cells changes nothing."""
    from seqpack.torch.sequences import target_statistics

    (batch,) = paired_batches([6, 9, 3, 3, 10, 2], rows=3, extra=4, seed=2)
    mask = torch.from_numpy(batch.loss_mask.copy())
    targets = torch.from_numpy(batch.targets.astype(np.int64))
    logits = random_logits(batch.shape, 6)
    (first, second), gold = mask.nonzero()[:2].tolist(), targets[mask][:2].tolist()
    logits[first[0], first[1], (gold[0] + 1) % VOCABULARY] = logits[first[0], first[1], gold[0]] = 50.0  # a tie
    logits[second[0], second[1], (gold[1] - 1) % VOCABULARY] = logits[second[0], second[1], gold[1]] = 50.0
    dirty = logits.clone()
    dirty[~mask] = float("nan")
    entropy, mean, top = target_statistics(dirty.requires_grad_(), batch)
    rows = logits[mask]                                                        # row-major: occurrence order
    assert close(entropy, -(rows.softmax(-1) * rows.log_softmax(-1)).sum(-1)) and not entropy.requires_grad
    assert close(mean, rows.mean(-1)) and torch.equal(top, rows.argmax(-1) == targets[mask])
    assert top[0].item() is (gold[0] + 1 < VOCABULARY) and top[1].item() is not (gold[1] > 0)  # first on ties
    assert entropy.numel() == batch.target_count == int(st.token_logprobs(logits, batch)[1][-1])


def test_target_statistics_are_bitwise_the_same_at_every_thread_count():
    # Three cells make one-row blocks, and 40,000 classes a row long enough for PyTorch to
    # split a lone row's reduction across threads.
    from seqpack.torch.sequences import target_statistics

    generator = torch.Generator().manual_seed(3)
    batch = {"shift_labels": torch.tensor([[5, 39999, 7]]), "position_ids": torch.tensor([[0, 1, 0]]),
             "valid_lengths": torch.tensor([3])}
    cases = [4 * torch.randn(1, 3, 40000, generator=generator) + 1 for _ in range(8)]
    threads = torch.get_num_threads()
    seen = []
    try:
        for count in (1, 2, 1, 2):
            torch.set_num_threads(count)
            seen.append([value for logits in cases for value in target_statistics(logits, batch)])
    finally:
        torch.set_num_threads(threads)
    for other in seen[1:]:
        assert all(torch.equal(a, b) for a, b in zip(seen[0], other))


# --- whole pairs, or an error naming the occurrence ------------------------------------------


def unpaired(table, policy, capacity, rows=4):
    """``table`` packed as plain examples (``pairs=False``): its one batch."""
    (batch,) = sp.pack(table, sp.PackConfig(capacity, rows), partition=TRAIN, binding=BINDING, policy=policy)
    return batch


def test_a_broken_pair_is_an_error_naming_its_occurrences_and_pair_order_is_enough():
    # best-fit-decreasing without pairs=True puts the longest sequence (c1, ordinal 2) first
    table = preference_table([3, 4, 9, 2], 0, BINDING, ids=True)
    broken = unpaired(table, "best-fit-decreasing", capacity=9)
    assert broken.occurrence_records["ordinal"].tolist()[:2] == [2, 1]
    logits = random_logits(broken.shape, 0)
    message = (r"the batch: occurrence 0 \(ordinal 2, example 'c1'\) and occurrence 1 \(ordinal 1, example 'r0'\) "
               r"are not one preference pair")
    with pytest.raises(InvalidInputError, match=message):
        st.pair_logprobs(logits, broken)
    with pytest.raises(InvalidInputError, match=r"the tensors\(\) dict: occurrence 0 \(ordinal 2\) and occurrence 1"):
        st.pair_logprobs(logits, st.tensors(broken))
    # the twin: next-fit keeps input order, so each chosen is directly followed by its rejected
    kept = unpaired(table, "next-fit", capacity=9)
    assert kept.occurrence_records["ordinal"].tolist() == [0, 1, 2, 3] and not kept.pairs
    result = st.pair_logprobs(random_logits(kept.shape, 0), kept)
    assert result.pair_ids.tolist() == [0, 1]


def test_an_odd_number_of_occurrences_is_an_error_in_every_input():
    odd = unpaired(supervised_table([3, 4, 5], 0, BINDING), "next-fit", capacity=12)
    logits = random_logits(odd.shape, 1)
    for given_input, what in ((odd, "the batch"), (st.tensors(odd), r"the tensors\(\) dict")):
        with pytest.raises(InvalidInputError, match=f"{what} holds 3 occurrences, not whole preference pairs"):
            st.pair_logprobs(logits, given_input)
    collators = hf()
    with pytest.raises(InvalidInputError, match=r"the rows\(\) dict holds 3 occurrences, not whole"):
        st.pair_logprobs(logits, collators.rows(odd))
    flat = collators.flat(odd)
    with pytest.raises(InvalidInputError, match=r"the flat\(\) dict holds 3 occurrences, not whole"):
        st.pair_logprobs(random_logits((1, flat["input_ids"].shape[1]), 1), flat)
    even = unpaired(supervised_table([3, 4, 5, 2], 0, BINDING), "next-fit", capacity=14)  # the twin: one more
    assert st.pair_logprobs(random_logits(even.shape, 1), hf().rows(even)).chosen.numel() == 2


def test_a_dict_s_pair_ids_must_name_each_pair():
    (batch,) = paired_batches([4, 5, 6, 3], rows=2)
    rows_dict = hf().rows(batch)
    logits = random_logits(batch.shape, 2)
    for bad, found in ((torch.arange(3), r"torch.int64 \(3,\)"), (torch.zeros(2), r"torch.float32 \(2,\)"),
                       ([0, 1], "list")):
        message = rf"the rows\(\) dict's pair_ids must be an integer tensor of shape \(2,\), one ID per pair of its 4"
        with pytest.raises(InvalidInputError, match=rf"{message} occurrences, not {found}"):
            st.pair_logprobs(logits, {**rows_dict, "pair_ids": bad})
    assert st.pair_logprobs(logits, {**rows_dict, "pair_ids": torch.tensor([7, 3])}).pair_ids.tolist() == [7, 3]


# --- the README's DPO loop -----------------------------------------------------------------


@pytest.mark.slow
def test_the_readme_dpo_loop_runs_and_widens_the_margin(capsys):
    hf()
    blocks = re.findall(r"```python dpo\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    torch.manual_seed(0)
    exec(compile(blocks[0], str(README), "exec"), {})  # noqa: S102 (the README block is the test)
    lines = capsys.readouterr().out.splitlines()
    found = [re.fullmatch(r"step (\d): loss (\d+\.\d{4}), reward margin (-?\d+\.\d{4})", line) for line in lines]
    assert len(found) == 4 and all(found), lines
    losses, margins = [float(m[2]) for m in found], [float(m[3]) for m in found]
    assert losses[0] == 0.6931 and margins[0] == 0.0         # the policy starts as its reference: log 2
    assert all(a > b for a, b in zip(losses, losses[1:])) and all(a < b for a, b in zip(margins, margins[1:]))
