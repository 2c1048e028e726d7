"""Eager epochs stored as epoch-wide arrays, threaded fills, derived segment starts, bulk validation."""

import multiprocessing
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack.data import _validate
from seqpack.layout import _fill as _layout
from seqpack import packing
from seqpack.layout.fields import FieldArrays, supervision_bytes
from helpers import BIG, assert_same_batches, example_list, random_table

pytestmark = pytest.mark.kernel

TRAIN = sp.Partition.TRAIN
STORED = ("inputs", "targets", "positions", "segments", "token_valid", "target_valid", "loss_mask", "valid_lengths")


@pytest.fixture(scope="module")
def small_epoch(binding):
    rng = np.random.default_rng(5)
    table = random_table(rng.integers(2, 30, 60), binding, seed=5)
    return table, sp.pack(table, sp.PackConfig(32, 3, 96, BIG), partition=TRAIN, binding=binding)


def test_calls_are_views_of_the_epoch_arrays(small_epoch):
    _, epoch = small_epoch
    assert len(epoch) == len(epoch.batches) > 3
    assert set(epoch.fields) == set(STORED)
    for name in STORED:
        whole = epoch.fields[name]
        assert whole.shape[0] == epoch.row_count and not whole.flags.writeable
        np.testing.assert_array_equal(np.concatenate([getattr(b, name) for b in epoch.batches]), whole)
        assert all(np.shares_memory(getattr(b, name), whole) for b in epoch.batches)
    assert epoch.target_count == sum(b.target_count for b in epoch.batches)


def test_epoch_calls_behave_like_a_list(small_epoch):
    _, epoch = small_epoch
    calls = epoch.batches
    assert calls[0] is calls[0] and calls[-1] is calls[len(calls) - 1]
    assert calls[1:3] == [calls[1], calls[2]] and calls[::-1][0] is calls[-1]
    assert list(calls) == [calls[i] for i in range(len(calls))]
    with pytest.raises(IndexError):
        calls[len(calls)]
    with pytest.raises(IndexError):
        calls[-len(calls) - 1]
    with pytest.raises(sp.BatchIndexError, match=r"batch '0' is a str, not an int: this epoch's batches are numbered \[0, "):
        calls["0"]
    # A zero step or a float bound: numpy's ValueError and a TypeError before (review).
    for bad, message in ((slice(0, 2, 0), "slice step cannot be zero"), (slice(0, 1.5), "slice indices must be")):
        with pytest.raises(sp.BatchIndexError, match=rf"^slice .* of this epoch's batches \[0, {len(calls)}\): {message}"):
            calls[bad]
    for batch in calls:
        batch.verify()


@pytest.mark.parametrize("policy", ["next-fit", "best-fit-decreasing"])
def test_threaded_fill_equals_call_by_call(binding, policy):
    # Over a million cells: the eager epoch fills in one run split between threads;
    # the plan's calls (8 rows each) fill single-threaded.
    rng = np.random.default_rng(17)
    table = random_table(rng.integers(2, 4000, 700), binding, seed=17)
    config = sp.PackConfig(4096, 8, 8 * 4096, BIG)
    epoch = sp.pack(table, config, partition=TRAIN, binding=binding, policy=policy)
    assert epoch.row_count * 4096 >= 1 << 20
    assert_same_batches(sp.plan(table, config, partition=TRAIN, binding=binding, policy=policy), epoch.batches)
    for call in (0, len(epoch) // 2, len(epoch) - 1):
        epoch.batches[call].verify()


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_fill_is_the_same_for_every_thread_count(binding, threads):
    rng = np.random.default_rng(23)
    table = random_table(rng.integers(2, 60, 300), binding, seed=23)
    placement = sp.place(table.lengths, 64, "best-fit-decreasing")
    order = np.argsort(placement.rows * 64 + placement.starts, kind="stable")
    tokens, supervised, begins, ends = table.gather(order)
    segments = order.astype(np.int32)
    filled = []
    for count in (1, threads):
        fields = FieldArrays.allocate(placement.row_count, 64)
        _layout.fill_rows(tokens, supervision_bytes(supervised), begins, ends, placement.rows[order], placement.starts[order], segments,
                          fields.cells, fields.flags.view(np.uint8), fields.valid_lengths, count)
        filled.append(fields)
    for one, many in zip(*filled):
        np.testing.assert_array_equal(one, many)


def test_list_source_fills_in_bounded_runs(binding, monkeypatch):
    rng = np.random.default_rng(3)
    documents = [[0, *rng.integers(2, 266, size).tolist(), 1] for size in rng.integers(1, 40, 80)]
    examples = example_list(documents, binding)
    config = sp.PackConfig(48, 2, 96, BIG)
    whole = sp.pack(examples, config, partition=TRAIN, binding=binding)
    monkeypatch.setattr(packing.budget, "FILL_BLOCK_BYTES", 1)  # runs gather no more than the largest call
    plan = sp.plan(examples, config, partition=TRAIN, binding=binding)
    blocks = plan.fill_blocks()
    assert len(blocks) > len(plan) // 2 and blocks[0][0] == 0 and blocks[-1][1] == len(plan)
    assert all(end > first == previous for (first, end), (_, previous) in zip(blocks[1:], blocks))
    assert plan.fill_block_bytes() <= plan.largest_gather
    runs = sp.pack(examples, config, partition=TRAIN, binding=binding)
    assert runs.memory_peak < whole.memory_peak
    assert_same_batches(runs.batches, whole.batches)
    assert_same_batches(plan, whole.batches)


def test_segment_starts_are_derived_from_positions(small_epoch):
    _, epoch = small_epoch
    batch = epoch.batches[1]
    starts = batch.segment_starts
    assert starts is batch.segment_starts and starts.dtype == np.int32 and not starts.flags.writeable
    columns = np.arange(batch.shape[1])
    for row in range(batch.shape[0]):
        expected = [
            next(o.columns.start for o in batch.occurrences if o.row == row and column in o.columns)
            if column < batch.valid_lengths[row] else 0
            for column in columns
        ]
        assert starts[row].tolist() == expected


# --- bulk validation kernels against plain references -----------------------------------


def reference_first_bad(tokens, offsets, pieces, bos, eos, max_tokens, max_bytes, as_given=()):
    """Document by document, the rules ``first_bad_document`` applies (``bos`` -1: no BOS;
    ``as_given[d]``: document ``d`` is any IDs in the vocabulary)."""
    for d in range(len(offsets) - 1):
        doc = tokens[offsets[d]:offsets[d + 1]]
        given = len(as_given) and as_given[d]
        if len(doc) > max_tokens:
            return d, _validate.DocumentFault.BROKEN_RULE
        if given:
            content = doc
        else:
            first = 1 if bos >= 0 else 0
            if len(doc) < first + 1 or (first and doc[0] != bos) or doc[-1] != eos:
                return d, _validate.DocumentFault.BROKEN_RULE
            content = doc[first:-1]
        controls = np.zeros(len(content), bool) if given else (content == bos) | (content == eos)
        if ((content < 0) | (content >= len(pieces)) | controls).any():
            return d, _validate.DocumentFault.BROKEN_RULE
        if pieces[content].sum() > max_bytes:
            return d, _validate.DocumentFault.BROKEN_RULE
        if len(doc) < 2 if given else len(content) == 0:
            return d, _validate.DocumentFault.EMPTY_CONTENT
    return -1, _validate.DocumentFault.DOCUMENT_OK


def run_kernel(tokens, offsets, pieces, max_tokens, max_bytes, threads=2, bos=0, as_given=None):
    copy = np.full_like(tokens, -7)
    given = np.zeros(0, np.uint8) if as_given is None else np.asarray(as_given, np.uint8)
    found = _validate.first_bad_document(tokens, offsets, pieces, len(pieces), bos, 1, given, max_tokens,
                                         max_bytes, copy, threads)
    return found, copy


@st.composite
def document_sets(draw):
    """Documents over a 12-ID vocabulary (BOS 0 unless ``bos`` is -1, EOS 1), framed or
    taken as given, some possibly broken: ``(documents, bos, as_given)``."""
    bos = draw(st.sampled_from([0, -1]))
    documents, as_given = [], []
    for _ in range(draw(st.integers(1, 80))):
        given = draw(st.booleans())
        content = draw(st.lists(st.integers(0 if given else 2, 11), max_size=8))
        doc = content if given else [0, *content, 1] if bos == 0 else [*content, 1]
        if doc and draw(st.integers(0, 9)) == 0:  # break one token: framing, a control, the ID range
            doc[draw(st.integers(0, len(doc) - 1))] = draw(st.sampled_from([-3, 0, 1, 5, 12, 99]))
        documents.append(doc)
        as_given.append(given)
    return documents, bos, as_given


@pytest.mark.slow
@settings(derandomize=True, max_examples=300, deadline=None)
@given(document_sets(), st.integers(2, 12), st.integers(0, 30), st.sampled_from([1, 2, 5]), st.booleans())
def test_first_bad_document_matches_the_reference(drawn, max_tokens, max_bytes, threads, mixed):
    documents, bos, as_given = drawn
    as_given = as_given if mixed else [False] * len(documents)
    if not mixed:  # framed only: the documents drawn as given are framed too
        documents = [doc if not g else ([0, *[t % 10 + 2 for t in doc], 1] if bos == 0 else [*[t % 10 + 2 for t in doc], 1])
                     for doc, g in zip(documents, drawn[2])]
    pieces = np.array([0, 0, 1, 2, 3, 1, 1, 4, 1, 2, 1, 5], dtype=np.int64)
    tokens = np.array([t for doc in documents for t in doc], dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum([len(doc) for doc in documents]))).astype(np.int64)
    (document, fault), copy = run_kernel(tokens, offsets, pieces, max_tokens, max_bytes, threads, bos,
                                         as_given if mixed else None)
    expected = reference_first_bad(tokens, offsets, pieces, bos, 1, max_tokens, max_bytes, as_given)
    assert (document, fault) == expected
    valid_end = offsets[document] if document >= 0 else len(tokens)
    np.testing.assert_array_equal(copy[:valid_end], tokens[:valid_end])  # valid documents before it are copied


def test_threaded_validation_names_the_first_bad_document():
    # Over a million tokens, split into runs between threads: the earliest fault wins
    # wherever the runs end, and a clean array is copied whole.
    rng = np.random.default_rng(2)
    sizes = rng.integers(3, 60, 40_000)
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    tokens = rng.integers(2, 12, int(offsets[-1])).astype(np.int32)
    tokens[offsets[:-1]], tokens[offsets[1:] - 1] = 0, 1
    pieces = np.ones(12, dtype=np.int64)
    assert len(tokens) >= 1 << 20
    (document, _), copy = run_kernel(tokens, offsets, pieces, 100, 100)
    assert document == -1
    np.testing.assert_array_equal(copy, tokens)
    for bad in ([39_999], [25_000, 39_000], [1, 30_000], [0]):
        broken = tokens.copy()
        for d in bad:
            broken[offsets[d] + 1] = 0  # BOS inside the content
        assert run_kernel(broken, offsets, pieces, 100, 100)[0] == (min(bad), _validate.DocumentFault.BROKEN_RULE)
    # The byte limit is counted only where it can bind, and binds there.
    (document, _), _ = run_kernel(tokens, offsets, pieces, 100, int(sizes[0]) - 3)
    assert document == 0


def test_a_lazy_plan_checks_the_epoch_budget_before_allocating(small_epoch, binding):
    table, eager = small_epoch
    required = eager.memory_peak
    config = sp.PackConfig(32, 3, 96, required - 1)
    plan = sp.plan(table, config, partition=TRAIN, binding=binding)  # one call at a time fits
    assert plan.memory_peak < required == plan.epoch_requirement()
    with pytest.raises(sp.MemoryBudgetError, match=f"the packed epoch needs {required} bytes") as caught:
        plan.epoch()
    assert (caught.value.required, caught.value.maximum) == (required, required - 1)
    with pytest.raises(sp.MemoryBudgetError, match=f"the packed epoch needs {required} bytes"):
        sp.pack(table, config, partition=TRAIN, binding=binding)
    exact = sp.plan(table, sp.PackConfig(32, 3, 96, required), partition=TRAIN, binding=binding).epoch()
    assert exact.memory_peak == required
    assert_same_batches(exact.batches, eager.batches)



def reference_first_bad_range(spans, documents, offsets):
    """Example by example, the rules ``first_bad_range`` applies."""
    Fault = _validate.RangeFault
    for i, ((start, stop), document) in enumerate(zip(spans.tolist(), documents.tolist())):
        if not 0 <= document < len(offsets) - 1:
            return i, Fault.DOCUMENT_INDEX
        if start < 0 or stop < 0:
            return i, Fault.NEGATIVE_BOUND
        if start > stop or stop > offsets[document + 1] - offsets[document]:
            return i, Fault.OUTSIDE_DOCUMENT
        if stop - start < 2:
            return i, Fault.TOO_SHORT
    return -1, Fault.RANGE_OK


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=6),
       st.lists(st.tuples(st.integers(-2, 12), st.integers(-2, 12), st.integers(-1, 6)), min_size=1, max_size=30))
def test_first_bad_range_matches_the_reference(sizes, examples):
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    spans = np.array([[start, stop] for start, stop, _ in examples], dtype=np.int64)
    documents = np.array([document for _, _, document in examples], dtype=np.int64)
    begins = np.full(len(examples), -9, dtype=np.int64)
    ends = begins.copy()
    found = _validate.first_bad_range(spans, documents, offsets, begins, ends)
    assert found == reference_first_bad_range(spans, documents, offsets)
    valid = found[0] if found[0] >= 0 else len(examples)
    np.testing.assert_array_equal(begins[:valid], offsets[documents[:valid]] + spans[:valid, 0])
    np.testing.assert_array_equal(ends[:valid], offsets[documents[:valid]] + spans[:valid, 1])

# --- forked children ---------------------------------------------------------------------


def threaded_work(binding):
    """A table of over a million tokens packed into over a million cells, then attention."""
    rng = np.random.default_rng(29)
    table = random_table(rng.integers(2, 60, 40_000), binding, seed=29)
    epoch = sp.pack(table, sp.PackConfig(64, 512, 512 * 64, BIG), partition=TRAIN, binding=binding)
    assert epoch.row_count * 64 >= 1 << 20 and epoch.target_count == int(table.lengths.sum())
    batch = epoch.batches[0]
    q = np.random.default_rng(0).standard_normal((*batch.shape[:1], 4, 64, 16))
    sp.range_attention_forward(q, q, q, batch.valid_lengths, batch.segment_starts)


def child_main(binding):
    threaded_work(binding)
    os._exit(0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_kernels_run_in_a_forked_child(binding):
    # GNU OpenMP cannot start parallel regions in a child forked after the parent's
    # threads ran; seqpack's kernels run single-threaded there instead of hanging.
    threaded_work(binding)
    child = multiprocessing.get_context("fork").Process(target=child_main, args=(binding,))
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in a kernel")
    assert child.exitcode == 0
