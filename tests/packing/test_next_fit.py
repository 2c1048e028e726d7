"""Next-fit packing: the ch05 fixture, limits beside their passing twins, budget honesty, properties."""

import dataclasses
import pickle
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
import reference as _reference
from seqpack.layout.sources import check_example_count as check_occurrence_count
from seqpack.packing.budget import epoch_bytes as packing_requirement
from seqpack.errors import InvalidInputError
from seqpack.errors import VerificationError
from seqpack.packing.gather import gather_ranges

pytestmark = pytest.mark.kernel

TRAIN = sp.Partition.TRAIN
BIG = 1 << 30


def make(name, tokens, binding):
    return sp.SequenceExample.from_document(name, sp.BatchDocument(name, tokens), binding)


def with_predictions(name, length, binding):
    """An example with ``length`` predictions: the first ``length + 1`` tokens of a document."""
    document = sp.BatchDocument(name, [0] + [99 + i % 100 for i in range(length)] + [1])
    return sp.SequenceExample.from_range(name, document, (0, length + 1), binding)


@pytest.fixture(scope="module")
def abc(binding):
    return [make("A", [0, 99, 100, 1], binding), make("B", [0, 101, 1], binding),
            make("C", [0, 102, 103, 104, 1], binding)]


@pytest.fixture(scope="module")
def ch05(abc, binding):
    return sp.pack(abc, sp.PackConfig(6, 2, 12, BIG), partition=TRAIN, binding=binding)


def test_ch05_fixture(ch05):
    assert ch05.row_count == 2 and ch05.occurrence_count == 3 and len(ch05.batches) == 1
    batch = ch05.batches[0]
    assert isinstance(batch, sp.PackedBatch) and isinstance(batch, sp.layout.BatchLayout)
    assert batch.shape == (2, 6)
    assert batch.inputs.tolist() == [[0, 99, 100, 0, 101, -1], [0, 102, 103, 104, -1, -1]]
    assert batch.targets.tolist() == [[99, 100, 1, 101, 1, -1], [102, 103, 104, 1, -1, -1]]
    assert batch.segments.tolist() == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    for field in (batch.token_valid, batch.target_valid, batch.loss_mask):
        assert field.tolist() == [[True] * 5 + [False], [True] * 4 + [False] * 2]
    assert batch.valid_lengths.tolist() == [5, 4]
    assert batch.segment_starts.tolist() == [[0, 0, 0, 3, 3, 0], [0, 0, 0, 0, 0, 0]]
    assert batch.cell_count == 12 and batch.target_count == 9
    assert batch.occurrences == [
        sp.layout.Occurrence(0, 0, range(0, 3), 0), sp.layout.Occurrence(1, 0, range(3, 5), 1),
        sp.layout.Occurrence(2, 1, range(0, 4), 2),
    ]
    batch.verify()


def test_ch05_permission(ch05):
    batch = ch05.batches[0]
    assert [k for k in range(6) if batch.allowed_key(0, 3, k)] == [3]  # B's first query
    assert [k for k in range(6) if batch.allowed_key(0, 4, k)] == [3, 4]
    for query in (3, 4):
        for key in (0, 1, 2):
            assert not batch.allowed_key(0, query, key)  # A is never B's context
    assert batch.allowed_keys(0) == [[0], [0, 1], [0, 1, 2], [3], [3, 4], []]
    assert batch.allowed_keys(1) == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [], []]


def test_counts(abc, binding, ch05):
    padded = sp.pad(abc, sp.PadConfig(rows_per_batch=3, max_cells=12), partition=TRAIN, binding=binding).batches[0].counts()
    packed = sp.layout.LayoutCounts.total(ch05.batches)
    assert (padded.storage_cells, padded.valid_targets, padded.valid_density) == (12, 9, 0.75)
    assert (packed.storage_cells, packed.valid_targets, packed.valid_density) == (12, 9, 0.75)
    assert padded.permitted_edges == packed.permitted_edges == 6 + 3 + 10
    examples = [with_predictions(n, l, binding) for n, l in zip("PQRS", (4, 4, 2, 2))]
    padded = sp.pad(examples, sp.PadConfig(rows_per_batch=4, max_cells=16), partition=TRAIN, binding=binding).batches[0].counts()
    packed = sp.layout.LayoutCounts.total(sp.pack(examples, sp.PackConfig(12, 1, 12, BIG), partition=TRAIN, binding=binding).batches)
    assert (padded.storage_cells, padded.valid_density, padded.dense_score_positions) == (16, 0.75, 64)
    assert (packed.storage_cells, packed.valid_density, packed.dense_score_positions) == (12, 1.0, 144)
    assert padded.permitted_edges == packed.permitted_edges == 26


def test_traversal_orders_agree(ch05):
    from seqpack.chapters.demo import edge_inventory

    batch = ch05.batches[0]
    in_order, tiled = edge_inventory(batch), edge_inventory(batch, tile_width=2)
    assert in_order != tiled and sorted(in_order) == sorted(tiled)
    assert len(in_order) == batch.counts().permitted_edges


# --- limits, each beside its passing twin ----------------------------------------------


def test_example_longer_than_capacity(binding):
    examples = [with_predictions("fits", 6, binding), with_predictions("wide", 7, binding)]
    sp.pack(examples[:1], sp.PackConfig(6, 1, 6, BIG), partition=TRAIN, binding=binding)
    with pytest.raises(sp.CapacityError, match="example 'wide' \\(index 1\\) has 7 predictions; capacity is 6") as caught:
        sp.pack(examples, sp.PackConfig(6, 1, 6, BIG), partition=TRAIN, binding=binding)
    assert (caught.value.cells, caught.value.maximum) == (7, 6)


def test_cells_per_call(binding):
    examples = [with_predictions(f"e{i}", 4, binding) for i in range(4)]
    assert len(sp.pack(examples, sp.PackConfig(4, 3, 12, BIG), partition=TRAIN, binding=binding).batches) == 2
    with pytest.raises(sp.CapacityError, match="3 rows x 4 columns has 12 cells; max_cells is 11") as caught:
        sp.pack(examples, sp.PackConfig(4, 3, 11, BIG), partition=TRAIN, binding=binding)
    assert (caught.value.cells, caught.value.maximum) == (12, 11)


def test_exact_fill_opens_no_empty_row(binding):
    examples = [with_predictions("x", 3, binding), with_predictions("y", 3, binding)]
    epoch = sp.pack(examples, sp.PackConfig(6, 4, 24, BIG), partition=TRAIN, binding=binding)
    assert epoch.row_count == 1 and epoch.batches[0].shape == (1, 6)
    assert epoch.batches[0].valid_lengths.tolist() == [6]


def test_rows_per_call_and_smaller_final_call(binding):
    examples = [with_predictions(f"e{i}", n, binding) for i, n in enumerate([3, 4, 2, 5, 1, 4, 4])]
    epoch = sp.pack(examples, sp.PackConfig(5, 2, 10, BIG), partition=TRAIN, binding=binding)
    # next-fit at capacity 5: [3] [4] [2] [5] [1, 4] [4]
    expected = _reference.next_fit_placements([3, 4, 2, 5, 1, 4, 4], 5)
    assert epoch.row_count == expected[-1][0] + 1 == 6
    assert [b.shape for b in epoch.batches] == [(2, 5), (2, 5), (2, 5)]
    epoch = sp.pack(examples[:6], sp.PackConfig(5, 4, 20, BIG), partition=TRAIN, binding=binding)
    assert [b.shape[0] for b in epoch.batches] == [4, 1]
    last = epoch.batches[-1]
    # Local rows, global ordinals and segments.
    assert [(o.ordinal, o.row, o.segment) for o in last.occurrences] == [(4, 0, 4), (5, 0, 5)]
    for batch in epoch.batches:
        batch.verify()


def test_duplicate_occurrences_are_distinct(binding):
    twin = make("twin", [0, 99, 100, 1], binding)
    batch = sp.pack([twin, twin], sp.PackConfig(6, 1, 6, BIG), partition=TRAIN, binding=binding).batches[0]
    assert batch.segments.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert not batch.allowed_key(0, 3, 2) and batch.allowed_key(0, 3, 3)
    assert [o.segment for o in batch.occurrences] == [0, 1]
    batch.verify()


def test_inputs_rejected(binding, abc):
    config = sp.PackConfig(6, 2, 12, BIG)
    with pytest.raises(sp.InvalidInputError, match="at least one example"):
        sp.pack([], config, partition=TRAIN, binding=binding)
    with pytest.raises(sp.BindingError, match="example 'A' \\(index 0\\) belongs to partition 'train', not 'test'"):
        sp.pack(abc, config, partition=sp.Partition.TEST, binding=binding)
    with pytest.raises(sp.InvalidInputError, match="PackConfig"):
        sp.pack(abc, sp.PadConfig(rows_per_batch=2, max_cells=12), partition=TRAIN, binding=binding)


@pytest.mark.parametrize(
    "args, message",
    [((0, 1, 6, 1), "capacity"), ((6, 0, 6, 1), "rows_per_batch"), ((6, 1, 5, 1), "max_cells 5 is below capacity 6"),
     ((6, 1, 6, 0), "max_memory_bytes"), ((2**31, 1, 2**31, 1), "the maximum is 2147483647")],
)
def test_config_validation(args, message):
    with pytest.raises(sp.InvalidInputError, match=message):
        sp.PackConfig(*args)
    sp.PackConfig(6, 1, 6, 1)
    sp.PackConfig(2**31 - 1, 1, 2**31 - 1, 1)


# replace(capacity=...) kept the default max_cells of the old capacity.
@pytest.mark.parametrize("changes", [{"capacity": 10}, {"rows_per_batch": 5}, {"capacity": 3, "rows_per_batch": 7},
                                     {"max_memory_bytes": 1}, {"capacity": 10, "max_cells": None}])
def test_replace_derives_a_default_max_cells_as_a_fresh_config_would(changes):
    default = sp.PackConfig(6, 2)
    copy = dataclasses.replace(default, **changes)
    fresh = sp.PackConfig(**{"capacity": 6, "rows_per_batch": 2, **changes})
    assert copy.max_cells == fresh.max_cells == fresh.rows_per_batch * fresh.capacity
    assert copy == fresh and hash(copy) == hash(fresh) and repr(copy) == repr(fresh)
    assert dataclasses.replace(copy, capacity=4).max_cells == 4 * fresh.rows_per_batch  # a copy of a copy too
    assert dataclasses.replace(pickle.loads(pickle.dumps(default)), **changes).max_cells == fresh.max_cells


def test_replace_keeps_a_given_max_cells():
    given = sp.PackConfig(6, 2, 20)
    assert dataclasses.replace(given, capacity=10).max_cells == 20
    assert dataclasses.replace(given, rows_per_batch=8).max_cells == 20
    assert dataclasses.replace(sp.PackConfig(6, 2, 12), capacity=10).max_cells == 12  # a full batch, but given
    replaced = dataclasses.replace(sp.PackConfig(6, 2), max_cells=30)
    assert replaced.max_cells == 30 and dataclasses.replace(replaced, capacity=10).max_cells == 30
    with pytest.raises(sp.InvalidInputError, match="max_cells 20 is below capacity 30: no row would fit"):
        dataclasses.replace(given, capacity=30)
    assert sp.PackConfig(6, 2) == sp.PackConfig(6, 2, 12)  # a default and a given full batch are the same limit
    # The old default's value, given, is kept: it was taken for the default and derived again (review).
    assert dataclasses.replace(sp.PackConfig(6, 2), capacity=10, max_cells=12).max_cells == 12
    assert dataclasses.replace(sp.PackConfig(6, 2), capacity=10, max_cells=np.int64(12)).max_cells == 12


def test_budget_equal_to_requirement_passes_one_less_fails(abc, binding):
    required = sp.pack(abc, sp.PackConfig(6, 2, 12, BIG), partition=TRAIN, binding=binding).memory_peak
    epoch = sp.pack(abc, sp.PackConfig(6, 2, 12, required), partition=TRAIN, binding=binding)
    assert epoch.memory_peak == required
    with pytest.raises(sp.MemoryBudgetError, match=f"needs {required} bytes; max_memory_bytes is {required - 1}") as caught:
        sp.pack(abc, sp.PackConfig(6, 2, 12, required - 1), partition=TRAIN, binding=binding)
    assert (caught.value.required, caught.value.maximum) == (required, required - 1)
    assert isinstance(caught.value, ValueError)


def test_planner_budget_checked_before_placement(abc, binding):
    with pytest.raises(sp.MemoryBudgetError) as caught:
        sp.pack(abc, sp.PackConfig(6, 2, 12, 10), partition=TRAIN, binding=binding)
    # Per occurrence: its length and tuple slot (16), a scan byte, next-fit's row and start (16).
    assert caught.value.required == 3 * 33 + 8 * 1024


def test_huge_requirement_raises_before_allocating(binding):
    one = [with_predictions("tiny", 2, binding)]
    config = sp.PackConfig(2**31 - 1, 4, 2**40, 2**30)  # one row of 2**31 cells: ~38 GiB of fields
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(sp.MemoryBudgetError) as caught:
        sp.pack(one, config, partition=TRAIN, binding=binding)
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert caught.value.required > 38 * 2**30 and peak < 1 << 20 and elapsed < 1.0


def test_size_arithmetic_near_integer_limits():
    check_occurrence_count(2**31)
    with pytest.raises(sp.InvalidInputError, match="2147483649 examples exceed the int32 segment namespace"):
        check_occurrence_count(2**31 + 1)
    # Exact integers, no wraparound: a requirement past 2**63 is reported as such.
    huge = packing_requirement(0, 1, 2**44, 2**41, 8, 0, 2**21)
    assert huge > 2**63 and huge == 2**44 * (2**21 * 19 + 8) + 36 + 44 + 2**41 * (3 * 1024 + 8)
    with pytest.raises(sp.InvalidInputError, match="cannot be indexed"):
        packing_requirement(0, 1, 2**41, 1, 2**41, 0, 2**21)
    packing_requirement(0, 1, 1, 1, 1, 0, (2**63 - 1) // 19)


@pytest.mark.slow
def test_budget_is_honest_under_tracemalloc(binding):
    """About 30k examples, lognormal lengths around 40, capacity 512, 8 rows per call."""
    rng = np.random.default_rng(7)
    lengths = np.clip(np.rint(rng.lognormal(np.log(40), 0.6, 30_000)), 1, 512).astype(int)
    body = rng.integers(2, 258, size=int(lengths.sum()), dtype=np.int32)
    cuts = np.cumsum(lengths)
    examples = [
        sp.SequenceExample.from_document(
            f"e{i}", sp.BatchDocument(f"d{i}", np.concatenate(([0], body[a:b - 1], [1]))), binding)
        for i, (a, b) in enumerate(zip(np.concatenate(([0], cuts[:-1])), cuts))
    ]
    config = sp.PackConfig(512, 8, 8 * 512, 1 << 34)
    tracemalloc.start()
    epoch = sp.pack(examples, config, partition=TRAIN, binding=binding)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"traced peak {peak} bytes, memory_peak {epoch.memory_peak} bytes")
    assert peak <= epoch.memory_peak + 64 * 1024
    assert epoch.memory_peak <= 2 * peak
    assert sum(b.target_count for b in epoch.batches) == lengths.sum()


# --- properties against the plain-Python reference --------------------------------------


@st.composite
def packings(draw):
    capacity = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, capacity), min_size=1, max_size=14))
    bodies = [draw(st.lists(st.integers(2, 265), min_size=n, max_size=n)) for n in lengths]
    max_rows = draw(st.integers(1, 4))
    duplicate = draw(st.booleans())
    return capacity, [[0, *b, 1] for b in bodies], lengths, max_rows, duplicate


@pytest.mark.slow
@settings(derandomize=True, max_examples=150, deadline=None)
@given(packings())
def test_matches_reference_and_verifies(binding, case):
    capacity, documents, lengths, max_rows, duplicate = case
    # The first n + 1 tokens of a document with n content tokens: n predictions, EOS excluded.
    examples = [sp.SequenceExample.from_range(f"x{i}", sp.BatchDocument(f"d{i}", d), (0, n + 1), binding)
                for i, (d, n) in enumerate(zip(documents, lengths))]
    sources = [d[: n + 1] for d, n in zip(documents, lengths)]
    if duplicate:
        examples.append(examples[0])
        sources = sources + [sources[0]]
    epoch = sp.pack(examples, sp.PackConfig(capacity, max_rows, capacity * max_rows, BIG), partition=TRAIN, binding=binding)
    expected = _reference.packed_rows(sources, capacity, max_rows)
    assert len(epoch.batches) == len(expected)
    assert epoch.row_count == sum(len(call["valid_lengths"]) for call in expected)
    for batch, call in zip(epoch.batches, expected):
        for name in ("inputs", "targets", "positions", "segments", "segment_starts", "valid_lengths"):
            assert getattr(batch, name).tolist() == call[name], name
        for name in ("token_valid", "target_valid", "loss_mask"):
            assert getattr(batch, name).tolist() == call["valid"], name
        assert batch.occurrences == [sp.layout.Occurrence(*o) for o in call["occurrences"]]
        assert batch.shape[1] == capacity
        batch.verify()
        # No permitted edge crosses a segment or touches padding.
        mask = batch.dense_mask()
        rows, queries, keys = np.nonzero(mask)
        assert (batch.segments[rows, queries] == batch.segments[rows, keys]).all()
        assert (batch.segments[rows, keys] != sp.NO_SEGMENT).all()
        assert mask.sum() == batch.counts().permitted_edges
    assert sum(b.token_valid.sum() for b in epoch.batches) == sum(len(s) - 1 for s in sources)


@pytest.mark.parametrize(
    "field, index, value, message",
    [
        # A packer that forgets to reset positions at B's start.
        ("positions", (0, 3), 3, "row 0, column 3: local position 3 does not step by one from 0 inside segment 1"),
        # A packer that lets A's last input predict B's BOS (a cross-document target).
        ("targets", (0, 2), 0, "occurrence 0 \\(example 'A', row 0\\), column 2: input or target differs"),
        # A packer that merges B into A's segment.
        ("segments", (0, 3), 0, "row 0, column 3: local position 0 does not step by one"),
        ("segment_starts", (0, 4), 0, "row 0, column 4: segment start 0 is not the first column of segment 1"),
        ("loss_mask", (1, 5), True, "row 1, column 5"),
    ],
)
def test_verify_catches_packer_bugs(ch05, corrupted, field, index, value, message):
    with pytest.raises(sp.VerificationError, match=message):
        corrupted(ch05.batches[0], field, index, value).verify()


def test_reused_buffers_give_the_same_batches(binding):
    examples = [with_predictions(f"e{i}", n, binding) for i, n in enumerate([3, 4, 2, 5, 1, 4, 4, 6, 2])]
    config = sp.PackConfig(6, 2, 12, BIG)
    expected = sp.pack(examples, config, partition=TRAIN, binding=binding).batches
    plan = sp.plan(examples, config, partition=TRAIN, binding=binding)
    seen = []
    for batch, fresh in zip(plan.batches(reuse_buffers=True), expected, strict=True):
        # Each reused batch equals the fresh one while it is current.
        for field in ("inputs", "targets", "positions", "segments", "segment_starts", "token_valid",
                      "target_valid", "loss_mask", "valid_lengths"):
            np.testing.assert_array_equal(getattr(batch, field), getattr(fresh, field))
        batch.verify()
        seen.append(batch)
    assert expected[-1].shape[0] < expected[0].shape[0]  # the smaller final call is covered
    # One set of memory: the first batch now shows the last call's rows.
    assert np.shares_memory(seen[0].inputs, seen[-1].inputs)


INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def table(binding):
    lengths = [3, 1, 5, 2, 4]
    tokens = np.array([0] + [99 + i for i in range(max(lengths))] + [1], dtype=np.int32)
    return sp.ExampleTable.from_arrays(tokens, [0, len(tokens)], binding,
                                       ranges=[(0, n + 1) for n in lengths], documents=[0] * len(lengths))


def test_plan_batch_rows_rejects_numbers_outside_the_plan(table, binding):
    plan = sp.plan(table, sp.PackConfig(5, 3), partition=TRAIN, binding=binding)
    assert plan.row_count == 4 and len(plan) == 2 and [plan.batch_rows(i) for i in range(2)] == [3, 1]
    assert plan.batch_rows(np.int64(1)) == 1
    # Before: -1 gave 3 rows, 2 gave -2 rows, 5 gave -11, True gave batch 1's rows.
    for number in (-1, 2, 5, True, 1.0, np.int64(INT64_MAX)):
        with pytest.raises(InvalidInputError, match="(outside this plan|not an int: this plan)"):
            plan.batch_rows(number)


@pytest.mark.parametrize("pad", [False, True])
def test_verify_catches_a_loss_mask_that_is_not_the_supervision(table, binding, pad):
    if pad:
        batch = sp.pad(table, sp.PadConfig(2), partition=TRAIN, binding=binding)[1]
    else:
        batch = sp.pack(table, sp.PackConfig(6, 3), partition=TRAIN, binding=binding)[0]
    batch.verify()
    loss_mask = batch.loss_mask.copy()
    loss_mask[0, 2] = False  # a real target dropped from the loss: the denominator shrinks
    batch.loss_mask = loss_mask
    with pytest.raises(VerificationError, match="row 0\\), column 2: loss_mask differs") as raised:
        batch.verify()
    assert (raised.value.row, raised.value.column) == (0, 2)


@pytest.mark.parametrize("policy", ["next-fit", "best-fit-decreasing"])
def test_epoch_index_rejects_bool(table, binding, policy):
    packed = sp.pack(table, sp.PackConfig(6, 1), partition=TRAIN, binding=binding, policy=policy)
    padded = sp.pad(table, sp.PadConfig(2), partition=TRAIN, binding=binding)
    for epoch in (packed, padded):
        assert epoch[np.int64(1)] is epoch[1]
        for index in (True, False, np.True_):
            with pytest.raises(InvalidInputError, match="bool"):
                epoch[index]  # before: True was batch 1, False batch 0
    with pytest.raises(InvalidInputError, match="bool"):
        packed.batches[True]
    # A bad slice of a padded epoch: Python's ValueError and TypeError, no SeqpackError (review).
    for epoch in (packed, padded):
        assert [b.target_count for b in epoch[::-1]] == [b.target_count for b in reversed(list(epoch))]
        for bad, message in ((slice(None, None, 0), "slice step cannot be zero"), (slice(0.5, None), "slice indices")):
            with pytest.raises(sp.BatchIndexError, match=rf"of this epoch's batches \[0, {len(epoch)}\): {message}"):
                epoch[bad]


def test_gather_ranges_place_past_int64_is_an_error():
    source = np.arange(10, dtype=np.int32)
    # Before: at + length wrapped negative; with out=None numpy raised a foreign error,
    # with out given the kernel wrote past the end of out (heap corruption).
    with pytest.raises(InvalidInputError, match="range 0 at place"):
        gather_ranges(source, [0], [3], at=[INT64_MAX - 1])
    with pytest.raises(InvalidInputError, match="range 1 at place"):
        gather_ranges(source, [0, 0], [3, 3], at=[0, INT64_MAX - 1], out=np.zeros(10, np.int32))
    # A place whose range ends exactly at the int64 limit is not refused for that reason.
    with pytest.raises(InvalidInputError, match="out must be"):
        gather_ranges(source, [0], [3], at=[INT64_MAX - 3], out=np.zeros(10, np.int32))


def test_gather_ranges_rejects_overlapping_places():
    source = np.arange(10, dtype=np.int32)
    # Before: [0, 5, 6, 7], range 0 silently overwritten by range 1.
    with pytest.raises(InvalidInputError, match="range 0 at place 0 .* overlaps range 1 at place 1"):
        gather_ranges(source, [0, 5], [3, 8], at=[0, 1])
    with pytest.raises(InvalidInputError, match="range 1 at place 0 .* overlaps range 2 at place 2"):
        gather_ranges(source, [0, 5, 1], [3, 8, 2], at=[6, 0, 2], out=np.zeros(9, np.int32))
    # Touching and out-of-order places are fine, and an empty range overlaps nothing.
    assert gather_ranges(source, [0, 5], [3, 8], at=[3, 0]).tolist() == [5, 6, 7, 0, 1, 2]
    assert gather_ranges(source, [0, 5, 2], [3, 8, 2], at=[0, 3, 1]).tolist() == [0, 1, 2, 5, 6, 7]


def test_gather_ranges_gaps_are_zero_not_uninitialized():
    source = np.arange(1, 11, dtype=np.int32)
    for _ in range(20):  # fresh allocations may reuse freed, dirty memory
        np.full(4096, 7, np.int32)
        out = gather_ranges(source, [0, 5], [2, 7], at=[0, 4000])
        assert out.shape == (4002,)
        assert out[:2].tolist() == [1, 2] and out[4000:].tolist() == [6, 7]
        assert not out[2:4000].any()


def test_a_plan_is_indexed_like_a_dataset(table, binding):
    """``plan[i]`` indexes like a dataset on disk: batch(i), negative numbers, slices."""
    plan = sp.plan(table, sp.PackConfig(5, 2), partition=TRAIN, binding=binding)
    for number in range(len(plan)):
        assert np.array_equal(plan[number].inputs, plan.batch(number).inputs)
    assert np.array_equal(plan[-1].inputs, plan.batch(len(plan) - 1).inputs)
    assert [b.target_count for b in plan[1:5]] == [plan.batch(i).target_count for i in range(1, len(plan))]
    for bad in (len(plan), -len(plan) - 1, True):
        with pytest.raises(InvalidInputError, match=rf"batch {bad!r} (is outside this plan's batches|is a bool, not an int: this plan's batches are numbered) \[0, {len(plan)}\)"):
            plan[bad]
    with pytest.raises(sp.BatchIndexError, match=r"slice\(0, 2, 0\) of this plan's batches \[0, \d+\): slice step"):
        plan[0:2:0]


def test_reuse_buffers_must_be_a_bool(table, binding):
    """The string "False" is truthy: it would hand out shared buffers the caller did not ask for."""
    plan = sp.plan(table, sp.PackConfig(5, 2), partition=TRAIN, binding=binding)
    with pytest.raises(InvalidInputError, match="reuse_buffers must be a bool"):
        next(plan.batches(reuse_buffers="False"))
    assert len(list(plan.batches(reuse_buffers=np.bool_(True)))) == len(plan)


def test_a_stream_names_a_bad_example_by_its_place_in_the_stream(table, binding):
    """The third example of a stream is index 2, not its place in its own one-item list."""
    other = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="elsewhere")
    stranger = sp.ExampleTable.from_texts(["xyz"], other, capacity=16).example(0)
    items = [table.example(0), table.example(1), stranger]
    with pytest.raises(sp.BindingError, match=r"\(index 2\) was built under a different binding"):
        list(sp.stream(items, sp.PackConfig(16, 2), partition=TRAIN, binding=binding))
    with pytest.raises(InvalidInputError, match="example 1 is a str"):
        list(sp.stream([table.example(0), "text"], sp.PackConfig(16, 2), partition=TRAIN, binding=binding))


@pytest.mark.parametrize("policy", ["next-fit", "best-fit-decreasing"])
def test_budget_counts_the_supervision_a_list_gathers(binding, policy):
    # Supervised list examples: their gathered supervision (a byte per token, with all-True
    # parts) was not counted, so the traced peak passed memory_peak by 256 KB here (review).
    rng = np.random.default_rng(0)
    examples = []
    for i in range(64):
        ids = np.concatenate(([0], rng.integers(2, 258, 4094), [1])).astype(np.int32)
        supervised = np.ones(ids.size, bool)
        supervised[1:2047] = i % 2 == 0  # half the examples have no unsupervised prompt
        examples.append(sp.SequenceExample.from_document(f"e{i}", sp.BatchDocument(f"d{i}", ids), binding,
                                                         supervised=supervised))
    config = sp.PackConfig(capacity=4096, rows_per_batch=64)
    sp.pack(examples, config, partition=TRAIN, binding=binding, policy=policy)  # warm-up
    tracemalloc.start()
    epoch = sp.pack(examples, config, partition=TRAIN, binding=binding, policy=policy)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak <= epoch.memory_peak <= 2 * peak
    exact = dataclasses.replace(config, max_memory_bytes=epoch.memory_peak)
    assert sp.pack(examples, exact, partition=TRAIN, binding=binding, policy=policy).memory_peak == epoch.memory_peak
