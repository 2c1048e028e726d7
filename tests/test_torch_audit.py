"""Inputs of seqpack.torch that once gave a silent wrong answer (or a non-seqpack error)."""

from types import SimpleNamespace

import numpy as np
import pytest

import seqpack as sp

torch = pytest.importorskip("torch", reason="seqpack.torch needs PyTorch: pip install 'seqpack[torch]'")
import seqpack.torch as st  # noqa: E402
import seqpack.torch.datasets as datasets  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from packed_cases import packed_plan, padded_epoch, random_predictions  # noqa: E402

VOCABULARY = 266


def logits_for(batch):
    return torch.randn(batch.shape + (VOCABULARY,), generator=torch.Generator().manual_seed(0))


def test_a_denominator_below_the_calls_own_count_or_a_bool_tensor_is_an_error():
    batch = padded_epoch([3, 5])[0]
    logits = logits_for(batch)
    with pytest.raises(sp.InvalidInputError, match="denominator must be an int"):
        st.token_weighted_loss(logits, batch, denominator=torch.tensor(True))
    with pytest.raises(sp.InvalidInputError, match=f"this call alone has {batch.target_count} eligible"):
        st.token_weighted_loss(logits, batch, denominator=batch.target_count - 1)
    exact = st.token_weighted_loss(logits, batch, denominator=batch.target_count)
    assert exact.item() == st.token_weighted_loss(logits, batch).item()


def test_the_accumulator_rejects_micro_batches_it_did_not_count():
    first, second = padded_epoch([3, 5, 4, 6])[:2]
    accumulator = st.LossAccumulator([first])
    accumulator(logits_for(first), first)
    with pytest.raises(sp.InvalidInputError, match=f"counted as {first.target_count} eligible targets but its "
                       f"micro-batches so far hold {first.target_count + second.target_count}"):
        accumulator(logits_for(second), second)
    assert accumulator.count == first.target_count  # the rejected call left no trace


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_non_integer_targets_are_never_truncated(dtype):
    batch = padded_epoch([3, 5])[0]
    labels = st.tensors(batch)["shift_labels"].to(dtype) + 0.5  # 3.5 would have become 3
    labels[labels == st.IGNORE_INDEX + 0.5] = st.IGNORE_INDEX
    for given in (labels, {"shift_labels": labels}):
        with pytest.raises(sp.InvalidInputError, match="integer"):
            st.token_weighted_loss(logits_for(batch), given)
        with pytest.raises(sp.InvalidInputError, match="integer"):
            st.step_target_count([given])
    with pytest.raises(sp.InvalidInputError, match="shift_labels must be an integer tensor, not NoneType"):
        st.step_target_count([{"input_ids": labels}])
    with pytest.raises(sp.InvalidInputError, match="expected a batch"):
        st.step_target_count([torch.tensor(3 + 0j)])  # not a count either


def test_logits_must_be_a_floating_tensor_and_an_empty_vocabulary_is_handled():
    batch = padded_epoch([3, 5])[0]
    for logits in (logits_for(batch).long(), logits_for(batch).numpy()):
        with pytest.raises(sp.InvalidInputError, match="logits must be a floating-point tensor"):
            st.token_weighted_loss(logits, batch)
    nothing = torch.full(batch.shape, st.IGNORE_INDEX)
    assert st.token_weighted_loss(torch.zeros(batch.shape + (0,)), nothing, denominator=3).item() == 0


def test_a_loaded_position_past_the_epochs_end_is_an_error():
    plan = packed_plan(random_predictions(np.random.default_rng(3), 60, 12), 16, 1, 3)
    dataset = st.PackedIterableDataset(plan)
    state = dataset.state_dict(consumed=len(dataset))
    dataset.load_state_dict(state)
    assert list(dataset) == []  # the epoch's end: nothing left
    with pytest.raises(sp.InvalidInputError, match=f"position is {len(dataset) + 1}; the maximum is {len(dataset)}"):
        dataset.load_state_dict(dict(state, position=len(dataset) + 1))
    for bad in (None, {k: v for k, v in state.items() if k != "epoch"}):
        with pytest.raises(sp.InvalidInputError, match="the state must be a dict from state_dict()"):
            dataset.load_state_dict(bad)
    with pytest.raises(sp.InvalidInputError, match="epoch must be an int, got bool"):
        dataset.rank_batches(True)
    with pytest.raises(sp.InvalidInputError, match="epoch must be at least 0"):
        dataset.rank_batches(-1)


def test_worker_states_stay_within_the_epoch(monkeypatch):
    """A worker past its last batch records the epoch's end, which loads (and resumes nothing)."""
    plan = packed_plan(random_predictions(np.random.default_rng(3), 60, 12), 16, 1, 3)
    dataset = st.PackedIterableDataset(plan, shuffle=False)
    monkeypatch.setattr(datasets, "get_worker_info", lambda: SimpleNamespace(id=0, num_workers=4))
    positions = [dataset.state_dict()["position"] for _ in dataset]  # worker 0 of 4
    monkeypatch.undo()
    assert positions[-1] == len(dataset) == max(positions)
    dataset.load_state_dict(dataset.state_dict())
    assert list(DataLoader(dataset, batch_size=None)) == []


def test_block_size_is_a_positive_int():
    batch = packed_plan([3, 4, 5, 6, 7], 16, 2).batch(0)
    for bad, message in ((True, "block_size must be an int, got bool"), (0, "block_size must be at least 1"),
                         (2.0, "block_size must be an int, got float")):
        with pytest.raises(sp.InvalidInputError, match=message):
            st.document_block_mask(batch, block_size=bad)
    assert st.document_block_mask(batch, block_size=np.int64(8)).shape == (2, 1, 16, 16)


def test_range_attention_scale_and_layout_integers_are_checked():
    q = torch.randn(2, 2, 5, 4, generator=torch.Generator().manual_seed(0))
    starts = torch.zeros(2, 5, dtype=torch.int64)
    for bad in (True, "0.5", torch.tensor(0.5)):
        with pytest.raises(sp.InvalidInputError, match="scale must be a real number or None"):
            st.range_attention(q, q, q, segment_starts=starts, scale=bad)
    huge = np.full(2, 2**64 - 5, dtype=np.uint64)  # was wrapped to -5 in the message
    with pytest.raises(sp.InvalidInputError, match="valid_lengths holds 18446744073709551611, outside the int64"):
        st.range_attention(q, q, q, segment_starts=starts, valid_lengths=huge)
    with pytest.raises(sp.InvalidInputError, match=r"valid_lengths has shape \(\); expected \(2,\)"):
        st.range_attention(q, q, q, segment_starts=starts, valid_lengths=5)
    empty = torch.zeros(0, 2, 5, 4)
    assert st.range_attention(empty, empty, empty, segment_starts=np.zeros((0, 5), np.int64),
                              valid_lengths=[]).shape == (0, 2, 5, 4)


def test_a_device_that_is_not_one_is_an_error():
    """A device torch cannot name or reach was a RuntimeError or an AssertionError from torch."""
    batch = packed_plan([3, 4, 5], 16, 2).batch(0)
    bad = [("nonsense", "device 'nonsense' is not available"),
           (3.5, "device must be a torch.device, a string such as 'cpu' or an index, not float"),
           (True, "device must be .* not bool")]
    if not torch.cuda.is_available():
        bad.append(("cuda", "device 'cuda' is not available: Torch not compiled with CUDA"))
    for device, message in bad:
        for export in (st.position_ids, st.document_ids, st.seq_lens, st.cu_seqlens, st.tensors):
            with pytest.raises(sp.InvalidInputError, match=message):
                export(batch, device=device)
    for device in ("cpu", torch.device("cpu")):
        assert st.document_ids(batch, device=device).equal(st.document_ids(batch))
        assert st.tensors(batch, device=device)["input_ids"].equal(st.tensors(batch)["input_ids"])


def test_step_target_count_takes_the_list_of_micro_batches_only():
    """One micro-batch or a count was a TypeError; a 1-D tensor of targets was summed as counts (5 + 7)."""
    batch = padded_epoch([3, 5])[0]
    for lone, found in ((batch, "PaddedBatch"), (st.tensors(batch), "dict"), (torch.tensor([5, 7]), "Tensor")):
        with pytest.raises(sp.InvalidInputError, match=f"batches is one micro-batch \\({found}\\); pass the list"):
            st.step_target_count(lone)
    with pytest.raises(sp.InvalidInputError, match="batches must be a list of the step's micro-batches, not int"):
        st.step_target_count(5)
    labels = st.tensors(batch)["shift_labels"]
    assert st.step_target_count(iter([batch, labels])) == st.step_target_count((batch, labels))
    assert st.step_target_count([batch, labels]) == 2 * batch.target_count
