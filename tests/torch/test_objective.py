"""The token-weighted objective: one division per step, across micro-batches and ranks.

Family 8 (loss normalization) with PyTorch autograd, and family 16: two ``gloo``
processes on loopback get the gradients of the single-process step over the union.
"""

from types import SimpleNamespace

import numpy as np
import pytest

import seqpack as sp

torch = pytest.importorskip("torch", reason="seqpack.torch needs PyTorch: pip install 'seqpack[torch]'")
import seqpack.torch as st  # noqa: E402
import seqpack.torch.datasets as datasets  # noqa: E402
import seqpack.torch.objective as objective  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from helpers import run_on_gloo_ranks  # noqa: E402
from packed_cases import packed_plan, padded_epoch, random_predictions  # noqa: E402

VOCABULARY = 266
PREDICTIONS = [3, 9, 2, 7, 1, 11, 4, 6, 5, 8, 2, 10, 3, 7]  # 14 examples, uneven per batch


class TinyModel(torch.nn.Module):
    """Embedding then a linear map to the vocabulary: enough parameters to compare gradients."""

    def __init__(self, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embedding = torch.nn.Parameter(torch.randn(VOCABULARY, 8, generator=generator, dtype=torch.float64))
        self.output = torch.nn.Parameter(torch.randn(8, VOCABULARY, generator=generator, dtype=torch.float64))

    def forward(self, tensors):
        return self.embedding[tensors["input_ids"]] @ self.output


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def union_of(batches):
    """One batch dict holding every row of ``batches`` (all as wide as the capacity)."""
    parts = [st.tensors(b) for b in batches]
    return {name: torch.cat([p[name] for p in parts]) for name in ("input_ids", "shift_labels")}


def close(a, b):
    return torch.all((a - b).abs() <= 1e-12 + 1e-12 * torch.maximum(a.abs(), b.abs())).item()


def test_the_loss_reads_only_eligible_cells():
    batch = packed_plan(PREDICTIONS, 16, 4).batch(0)
    rng = np.random.default_rng(0)
    logits = torch.tensor(rng.standard_normal(batch.shape + (VOCABULARY,)), requires_grad=True)
    excluded = torch.from_numpy(~batch.loss_mask)
    with torch.no_grad():
        logits[excluded] = float("nan")
    assert excluded.any()
    loss = st.token_weighted_loss(logits, batch)
    mask = torch.from_numpy(batch.loss_mask.copy())
    gold = torch.from_numpy(batch.targets[batch.loss_mask]).long()
    expected = -torch.log_softmax(logits.detach()[mask], -1).gather(1, gold[:, None]).sum() / batch.target_count
    assert abs(loss.item() - expected.item()) <= 1e-14 * abs(expected.item())
    loss.backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[excluded] == 0).all()
    for other in (st.tensors(batch), st.tensors(batch)["shift_labels"]):  # the same loss from each form
        assert st.token_weighted_loss(logits, other).item() == loss.item()


def test_low_precision_logits_are_read_in_float32():
    batch = padded_epoch([3, 5])[0]
    logits = torch.randn(batch.shape + (VOCABULARY,), generator=torch.Generator().manual_seed(1))
    # float8 too: torch's log_softmax has no float8 kernel (a NotImplementedError before; review)
    for narrow in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        loss = st.token_weighted_loss(logits.to(narrow), batch)
        assert loss.dtype == torch.float32
        assert loss.item() == st.token_weighted_loss(logits.to(narrow).float(), batch).item()
        accumulator = st.LossAccumulator([batch])
        assert accumulator(logits.to(narrow), batch).item() == loss.item()


def test_the_ddp_flag_is_a_bool():
    """ddp=0 or None was taken as False, and an array raised numpy's truth-value error."""
    batch = padded_epoch([3, 5])[0]
    for ddp in (0, None, np.array([1, 2]), "yes"):
        with pytest.raises(sp.InvalidInputError, match="ddp must be a bool"):
            st.LossAccumulator([batch], ddp=ddp)


def test_unsigned_targets_are_all_targets():
    """An unsigned tensor cannot hold -100, but torch finds uint8(156) == -100 and
    uint16(65436) == -100: each such target counts and weighs like any other."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 4, 65437, generator=generator, dtype=torch.float64)
    for dtype, value in ((torch.uint8, 156), (torch.uint16, 65436), (torch.uint32, 65436), (torch.uint64, 65436)):
        targets = torch.tensor([[3, value, 200, 7]], dtype=dtype)
        gold = torch.tensor([3, value, 200, 7])
        expected = torch.nn.functional.cross_entropy(logits[0], gold, reduction="mean")
        assert st.token_weighted_loss(logits, targets).item() == expected.item(), dtype
        assert st.step_target_count([targets]) == 4, dtype
        accumulator = st.LossAccumulator([targets])
        assert accumulator.denominator == 4, dtype
    past_int64 = torch.tensor([[2**63 + 1, 1]], dtype=torch.uint64)
    with pytest.raises(sp.InvalidInputError, match="a uint64 value past int64"):
        st.step_target_count([past_int64])


def test_errors_and_their_exact_twins():
    batch = padded_epoch([3, 5])[0]
    logits = torch.zeros(batch.shape + (VOCABULARY,), requires_grad=True)
    nothing = torch.full(batch.shape, st.IGNORE_INDEX)
    with pytest.raises(sp.InvalidInputError, match="zero loss-eligible targets"):
        st.token_weighted_loss(logits, nothing)
    empty = st.token_weighted_loss(logits, nothing, denominator=7)  # a micro-batch of a larger step
    empty.backward()
    assert empty.item() == 0 and (logits.grad == 0).all()
    with pytest.raises(sp.InvalidInputError, match="denominator is 0"):
        st.token_weighted_loss(logits, batch, denominator=0)
    st.token_weighted_loss(logits, batch, denominator=batch.target_count)
    with pytest.raises(sp.InvalidInputError, match=f"denominator is {batch.target_count - 1} but this call alone "
                       f"has {batch.target_count} eligible targets"):  # it cannot be this step's count
        st.token_weighted_loss(logits, batch, denominator=batch.target_count - 1)
    targets = st.tensors(batch)["shift_labels"].clone()
    targets[0, 0] = VOCABULARY
    with pytest.raises(sp.InvalidInputError, match=r"cell 0 \(row-major\) has target 266, outside the vocabulary"):
        st.token_weighted_loss(logits, targets)
    targets[0, 0] = VOCABULARY - 1
    st.token_weighted_loss(logits, targets)
    with pytest.raises(sp.InvalidInputError, match=r"logits have shape \(2, 5\); expected \(2, 5\) \+ \(vocabulary,\)"):
        st.token_weighted_loss(logits[..., 0], batch)
    with pytest.raises(sp.InvalidInputError, match="expected a batch"):
        st.token_weighted_loss(logits, targets.float())


def test_the_accumulator_equals_one_big_batch_and_the_mean_of_means_does_not():
    window = list(packed_plan(PREDICTIONS, 16, 2))
    counts = [b.target_count for b in window]
    assert len(window) >= 3 and len(set(counts)) > 1  # unequal micro-batches, or the bug cannot show

    model = TinyModel()
    big = st.token_weighted_loss(model(union_of(window)), union_of(window)["shift_labels"])
    big.backward()
    expected = gradients(model)

    model.zero_grad()
    accumulator = st.LossAccumulator(window)
    assert accumulator.denominator == sum(counts) == st.step_target_count(window)
    for batch in window:
        accumulator(model(st.tensors(batch)), batch).backward()
    assert accumulator.count == sum(counts) and abs(accumulator.mean - big.item()) < 1e-13
    for name, grad in gradients(model).items():
        assert close(grad, expected[name]), name

    model.zero_grad()
    for batch in window:  # the bug class of transformers PR 34191
        (st.token_weighted_loss(model(st.tensors(batch)), batch) / len(window)).backward()
    assert (gradients(model)["output"] - expected["output"]).abs().max() > 1e-3


def test_step_target_count_takes_every_form():
    batch = packed_plan(PREDICTIONS, 16, 2).batch(0)
    count = batch.target_count
    forms = [batch, st.tensors(batch), st.tensors(batch)["shift_labels"], count, np.int64(count), torch.tensor(count)]
    assert st.step_target_count(forms) == 6 * count  # a 0-d tensor (Trainer's num_items_in_batch) is a count
    assert st.LossAccumulator([torch.tensor(count)]).denominator == count
    with pytest.raises(sp.InvalidInputError, match="non-negative"):
        st.step_target_count([-1])
    with pytest.raises(sp.InvalidInputError, match="ddp=True needs an initialized torch.distributed"):
        st.LossAccumulator([batch], ddp=True)


def distributed_rank(rank: int, world_size: int) -> None:
    """One rank: its micro-batches (every other batch), plain all-reduced and DDP gradients
    against the single-process token-weighted step over all ranks' batches."""
    import torch.distributed as dist

    batches = list(packed_plan(PREDICTIONS, 16, 1))
    mine = batches[rank::world_size]
    assert sum(b.target_count for b in batches[0::2]) != sum(b.target_count for b in batches[1::2])

    reference = TinyModel()
    st.token_weighted_loss(reference(union_of(batches)), union_of(batches)["shift_labels"]).backward()
    expected = gradients(reference)

    model = TinyModel()
    accumulator = st.LossAccumulator(mine)
    assert accumulator.denominator == sum(b.target_count for b in batches)
    for batch in mine:
        accumulator(model(st.tensors(batch)), batch).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    for name, grad in gradients(model).items():
        assert close(grad, expected[name]), (rank, name)

    ddp = torch.nn.parallel.DistributedDataParallel(TinyModel())
    accumulator = st.LossAccumulator(mine, ddp=True)
    for index, batch in enumerate(mine):
        context = ddp.no_sync() if index < len(mine) - 1 else torch.enable_grad()
        with context:
            accumulator(ddp(st.tensors(batch)), batch).backward()
    for name, grad in gradients(ddp.module).items():
        assert close(grad, expected[name]), (rank, "ddp", name)

    # A rank that counted only its first micro-batch: the global count covers the
    # other rank's batches, but this rank's own uncounted one is still an error.
    accumulator = st.LossAccumulator(mine[:1])
    counted, total = mine[0].target_count, accumulator.denominator
    accumulator(model(st.tensors(mine[0])), mine[0])
    with pytest.raises(sp.InvalidInputError, match=(
            rf"^this rank's micro-batches of the step were counted as {counted} eligible targets \(of {total} "
            rf"over the ranks\) but its micro-batches so far hold {counted + mine[1].target_count}: ")):
        accumulator(model(st.tensors(mine[1])), mine[1])

    # Counts whose sum is past int64: it wrapped to a negative count (review).
    assert st.step_target_count([2**62 + rank]) == 2**63 + 1
    with pytest.raises(sp.InvalidInputError, match=f"count {2**63 + rank} is past 2\\*\\*63 - 1"):
        st.step_target_count([2**63 + rank])

    dataset = st.IterableBatchDataset(packed_plan(PREDICTIONS, 16, 1))  # rank and size from the group
    assert (dataset.rank, dataset.world_size) == (rank, world_size)
    shares = [None] * world_size
    dist.all_gather_object(shares, dataset.rank_batches(0).tolist())
    assert len(set(shares[0]) | set(shares[1])) == 2 * len(dataset) == len(batches) // 2 * 2


@pytest.mark.slow
def test_two_gloo_ranks_get_the_gradients_of_the_union():
    run_on_gloo_ranks(distributed_rank)


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


def test_a_denominator_past_int64_divides_as_the_float_it_rounds_to():
    # torch refused the int: OverflowError "int too big to convert" (review).
    batch = padded_epoch([3, 5])[0]
    logits = logits_for(batch)
    total, _ = objective.loss_sum(logits, batch)
    for denominator in (2**63 - 1, 2**64, 2**80):
        assert st.token_weighted_loss(logits, batch, denominator=denominator).item() == \
            (total / float(denominator)).item()
        accumulator = st.LossAccumulator([denominator])
        assert accumulator(logits, batch).item() == (total / float(denominator)).item()


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
    dataset = st.IterableBatchDataset(plan)
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
    dataset = st.IterableBatchDataset(plan, shuffle=False)
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


def test_a_window_may_hold_a_micro_batch_without_supervised_targets():
    # Prompt-only micro-batches (every label -100) are legal inside a step that has
    # supervised targets elsewhere; the step's count and gradients are those of the others.
    window = list(packed_plan(PREDICTIONS, 16, 2))[:2]
    prompts_only = {name: value.clone() for name, value in st.tensors(window[1]).items()}
    prompts_only["shift_labels"][...] = st.IGNORE_INDEX
    model = TinyModel()
    accumulator = st.LossAccumulator([window[0], prompts_only])
    assert accumulator.denominator == window[0].target_count
    for item in (window[0], prompts_only):
        accumulator(model(st.tensors(window[0]) if item is window[0] else item), item).backward()
    with_empty = gradients(model)
    model.zero_grad()
    st.token_weighted_loss(model(st.tensors(window[0])), window[0]).backward()
    for name, grad in gradients(model).items():
        assert close(with_empty[name], grad), name
    with pytest.raises(sp.InvalidInputError, match="a step needs at least one eligible target"):
        st.LossAccumulator([prompts_only])
