"""Preference pairs (``pairs=True``): examples 2p and 2p + 1 never split, under every entry point and policy.

Families 7 (metadata invariants, hypothesis) and 9 (every error beside its exact-limit twin).
"""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack.packing.placement import POLICIES

from helpers import BIG, assert_same_batches, preference_table

pytestmark = pytest.mark.kernel

TRAIN = sp.Partition.TRAIN
KINDS = ("random", "ones", "exact")


@st.composite
def paired_lengths(draw):
    """``(lengths, capacity)``: whole pairs that each fit a row, from one family or mixed:
    random, one-token sequences, pairs exactly filling a row."""
    capacity = draw(st.integers(2, 20))
    family = draw(st.sampled_from([*KINDS, "mixed"]))
    lengths = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(KINDS)) if family == "mixed" else family
        if kind == "ones":
            lengths += [1, 1]
        else:
            chosen = draw(st.integers(1, capacity - 1))
            lengths += [chosen, capacity - chosen if kind == "exact" else draw(st.integers(1, capacity - chosen))]
    return lengths, capacity


def packed(function, examples, config, binding, **options):
    result = function(examples, config, partition=TRAIN, binding=binding, pairs=True, **options)
    return list(result)


def assert_whole_pairs(batches, table, rows_per_batch, shares_row=True):
    """Every batch holds whole pairs, each chosen directly before its rejected (in one row, or
    in consecutive rows when ``shares_row`` is False), and every occurrence's cells are its
    own example's. Returns ``{ordinal: (epoch row, start)}``."""
    placed = {}
    for number, batch in enumerate(batches):
        assert batch.pairs
        batch.verify()
        records = batch.occurrence_records
        chosen, rejected = records[0::2], records[1::2]
        assert len(records) % 2 == 0
        assert (chosen["ordinal"] % 2 == 0).all() and (rejected["ordinal"] == chosen["ordinal"] + 1).all()
        if shares_row:
            assert (rejected["row"] == chosen["row"]).all() and (rejected["start"] == chosen["stop"]).all()
        else:
            assert (rejected["row"] == chosen["row"] + 1).all() and (rejected["start"] == 0).all()
        for occurrence in batch.occurrences:
            example, row, columns = table.example(occurrence.ordinal), occurrence.row, occurrence.columns
            assert occurrence.ordinal not in placed, f"occurrence {occurrence.ordinal} placed twice"
            assert len(columns) == len(example) and occurrence.segment == occurrence.ordinal
            assert (batch.segments[row, columns.start:columns.stop] == occurrence.ordinal).all()
            assert batch.positions[row, columns.start:columns.stop].tolist() == list(range(len(example)))
            for field in ("inputs", "targets", "loss_mask"):
                cells = getattr(batch, field)[row, columns.start:columns.stop]
                assert cells.tolist() == getattr(example, field).tolist(), field
            placed[occurrence.ordinal] = (number * rows_per_batch + row, columns.start)
    assert sorted(placed) == list(range(len(table)))  # nothing dropped or duplicated
    return placed


# --- pack, plan, stream and pad: properties ------------------------------------------------


@settings(derandomize=True, max_examples=100, deadline=None)
@given(paired_lengths(), st.integers(1, 3), st.integers(0, 2**16))
def test_every_policy_places_each_pair_in_one_row(binding, case, rows_per_batch, seed):
    lengths, capacity = case
    table = preference_table(lengths, seed, binding)
    config = sp.PackConfig(capacity, rows_per_batch, max_memory_bytes=BIG)
    for policy in POLICIES:
        placement = sp.place(lengths, capacity, policy, pairs=True)
        epoch = sp.pack(table, config, partition=TRAIN, binding=binding, policy=policy, pairs=True)
        plan = sp.plan(table, config, partition=TRAIN, binding=binding, policy=policy, pairs=True)
        assert epoch.pairs and plan.pairs and epoch.row_count == plan.row_count == placement.row_count
        placed = assert_whole_pairs(epoch.batches, table, rows_per_batch)
        assert placed == {o: (int(placement.rows[o]), int(placement.starts[o])) for o in range(len(lengths))}
        assert_same_batches(plan, epoch.batches)
        last = len(plan) - 1
        assert_same_batches([plan.batch(last), plan[0]], [epoch[last], epoch[0]])
        pairs = [len(batch.occurrences) // 2 for batch in epoch.batches]
        assert plan.batch_pairs().tolist() == pairs and sum(pairs) == len(lengths) // 2
        report = plan.report()
        assert report == epoch.report() and report.pairs == len(lengths) // 2 == report.as_dict()["pairs"]
        assert report.valid_targets == sum(lengths) and report.supervised_targets == int(table.target_counts.sum())
        assert report.batch_targets == tuple(batch.target_count for batch in epoch.batches)


@settings(derandomize=True, max_examples=100, deadline=None)
@given(paired_lengths(), st.integers(1, 3), st.data())
def test_stream_of_pairs_equals_pack_wherever_the_items_divide_them(binding, case, rows_per_batch, data):
    lengths, capacity = case
    table = preference_table(lengths, len(lengths), binding)
    config = sp.PackConfig(capacity, rows_per_batch, max_memory_bytes=BIG)
    expected = sp.pack(table, config, partition=TRAIN, binding=binding, pairs=True).batches
    count = len(table)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, count - 1), max_size=count))))
    items = []
    for start, stop in zip([0, *cuts], [*cuts, count]):  # a chunk may end between a chosen and its rejected
        if data.draw(st.booleans()):
            items += [table.chunk(start, stop), table.chunk(stop, stop)]  # an empty chunk is skipped
        else:
            items += [table.example(i) for i in range(start, stop)]
    streamed = packed(sp.stream, items, config, binding)
    assert_same_batches(streamed, expected)
    assert_whole_pairs(streamed, table, rows_per_batch)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(paired_lengths(), st.integers(1, 3), st.integers(0, 2**16))
def test_padding_gives_a_pair_consecutive_rows_of_one_batch(binding, case, half, seed):
    lengths, _ = case
    table = preference_table(lengths, seed, binding)
    config = sp.PadConfig(rows_per_batch=2 * half)
    epoch = sp.pad(table, config, partition=TRAIN, binding=binding, pairs=True)
    assert epoch.pairs
    placed = assert_whole_pairs(epoch.batches, table, 2 * half, shares_row=False)
    assert placed == {o: (o, 0) for o in range(len(lengths))}  # one example per row, in input order
    assert_same_batches(epoch, sp.pad(table, config, partition=TRAIN, binding=binding))  # the same layout


def test_a_pair_that_next_fit_alone_would_split_stays_together(binding):
    """Capacity 4, lengths 2 1 | 1 3: example by example, next-fit puts the second pair's chosen
    in row 0 and its rejected in row 1, another batch; as pairs, the pair opens row 1."""
    table = preference_table([2, 1, 1, 3], 0, binding)
    config = sp.PackConfig(4, 1, max_memory_bytes=BIG)
    apart = sp.pack(table, config, partition=TRAIN, binding=binding)
    assert [[o.ordinal for o in batch.occurrences] for batch in apart] == [[0, 1, 2], [3]]
    together = sp.pack(table, config, partition=TRAIN, binding=binding, pairs=True)
    assert [[o.ordinal for o in batch.occurrences] for batch in together] == [[0, 1], [2, 3]]
    assert_whole_pairs(together, table, 1)
    # verify() refuses a batch that claims pairs it does not hold (the negative control).
    apart[0].pairs = True
    with pytest.raises(sp.VerificationError, match="^the batch holds 3 occurrences: not whole preference pairs$"):
        apart[0].verify()
    two_rows = sp.pack(table, sp.PackConfig(4, 2, max_memory_bytes=BIG), partition=TRAIN, binding=binding)[0]
    two_rows.pairs = True
    with pytest.raises(sp.VerificationError, match=r"^occurrences 2 \(row 0, columns \[3, 4\)\) and 3 \(row 1, "
                                                   r"columns \[0, 3\)\) are not one preference pair's") as caught:
        two_rows.verify()
    assert caught.value.row == 0
    first_fit = sp.pack(table, sp.PackConfig(4, 2, max_memory_bytes=BIG), partition=TRAIN, binding=binding,
                        policy="first-fit-decreasing")[0]
    assert [o.ordinal for o in first_fit.occurrences] == [3, 1, 0, 2]  # longest first tears both pairs apart
    first_fit.pairs = True
    with pytest.raises(sp.VerificationError, match=r"^occurrences 3 \(row 0"):
        first_fit.verify()


def test_unpaired_packing_is_unchanged_and_says_so(binding):
    table = preference_table([2, 1, 1, 3, 4, 4], 2, binding)
    config = sp.PackConfig(8, 2, max_memory_bytes=BIG)
    for policy in POLICIES:
        plan = sp.plan(table, config, partition=TRAIN, binding=binding, policy=policy)
        epoch = sp.pack(table, config, partition=TRAIN, binding=binding, policy=policy, pairs=False)
        assert not plan.pairs and not epoch.pairs and not any(batch.pairs for batch in epoch)
        assert plan.batch_pairs().tolist() == [0] * len(plan)
        assert epoch.report().pairs == 0 and "pairs" not in epoch.report().as_dict()
        assert_same_batches(plan, epoch.batches)
    assert not sp.pad(table, partition=TRAIN, binding=binding).pairs


# --- errors, each beside its exact-limit twin ------------------------------------------------


ENTRY_POINTS = {
    "pack": lambda table, config, binding, policy: packed(sp.pack, table, config, binding, policy=policy),
    "plan": lambda table, config, binding, policy: packed(sp.plan, table, config, binding, policy=policy),
    "stream": lambda table, config, binding, policy: packed(sp.stream, [table], config, binding),
    "stream of examples": lambda table, config, binding, policy: packed(
        sp.stream, [table.example(i) for i in range(len(table))], config, binding),
}


@pytest.mark.parametrize("entry, policy", [*((entry, policy) for entry in ("pack", "plan") for policy in POLICIES),
                                           ("stream", "next-fit"), ("stream of examples", "next-fit")])
def test_a_pair_at_capacity_passes_and_one_more_names_it(binding, entry, policy):
    run = ENTRY_POINTS[entry]
    table = preference_table([3, 5, 2, 7], 4, binding, ids=True)
    batches = run(table, sp.PackConfig(9, 1, max_memory_bytes=BIG), binding, policy)
    assert sorted(len(batch.occurrences) for batch in batches) == [2, 2]
    with pytest.raises(sp.CapacityError, match=r"^pair 1 \(examples 'c1' and 'r1', indices 2 and 3\) has 9 "
                                               r"predictions; capacity is 8; a pair's chosen and rejected "
                                               r"sequences share one row$") as caught:
        run(table, sp.PackConfig(8, 1, max_memory_bytes=BIG), binding, policy)
    assert (caught.value.cells, caught.value.maximum) == (9, 8)
    # A sequence longer than the capacity is named as an example, before its pair.
    with pytest.raises(sp.CapacityError, match=r"^example 'r0' \(index 1\) has 5 predictions; capacity is 4$"):
        run(table, sp.PackConfig(4, 1, max_memory_bytes=BIG), binding, policy)


@settings(derandomize=True, max_examples=40, deadline=None)
@given(paired_lengths(), st.data())
def test_one_pair_at_capacity_plus_one_is_named_wherever_it_is(binding, case, data):
    lengths, capacity = case
    pair = data.draw(st.integers(0, len(lengths) // 2 - 1))
    chosen = data.draw(st.integers(1, capacity))
    lengths[2 * pair:2 * pair + 2] = [chosen, capacity + 1 - chosen]
    table = preference_table(lengths, pair, binding, ids=True)
    config = sp.PackConfig(capacity, 2, max_memory_bytes=BIG)
    message = (rf"^pair {pair} \(examples 'c{pair}' and 'r{pair}', indices {2 * pair} and {2 * pair + 1}\) has "
               rf"{capacity + 1} predictions; capacity is {capacity};")
    runs = [lambda: packed(sp.stream, [table.example(i) for i in range(len(table))], config, binding)]
    runs += [lambda policy=policy, function=function: packed(function, table, config, binding, policy=policy)
             for policy in POLICIES for function in (sp.pack, sp.plan)]
    for run in runs:
        with pytest.raises(sp.CapacityError, match=message):
            run()


@pytest.mark.parametrize("function", [sp.pack, sp.plan])
def test_an_odd_example_count_is_no_set_of_pairs(binding, function):
    table = preference_table([2, 3, 1, 1], 5, binding)
    config = sp.PackConfig(8, 2, max_memory_bytes=BIG)
    assert len(function(table, config, partition=TRAIN, binding=binding, pairs=True)) == 1
    with pytest.raises(sp.InvalidInputError, match="^3 examples cannot be preference pairs: pair p is examples 2p "
                                                   "and 2p \\+ 1$"):
        function(table.chunk(0, 3), config, partition=TRAIN, binding=binding, pairs=True)
    assert len(function(table.chunk(0, 3), config, partition=TRAIN, binding=binding)) == 1


def test_a_stream_that_ends_inside_a_pair_names_it(binding):
    table = preference_table([2, 3, 4, 1, 3, 2], 6, binding, ids=True)
    config = sp.PackConfig(5, 1, max_memory_bytes=BIG)
    examples = [table.example(i) for i in range(6)]
    unfinished = (r"^the stream ended after example 'c2' \(index 4\), the chosen sequence of pair 2: its rejected "
                  r"sequence \(index 5\) never came$")
    for items in (examples[:5], [table.chunk(0, 5)], [table.chunk(0, 3), table.chunk(3, 5), table.chunk(5, 5)]):
        batches = sp.stream(items, config, partition=TRAIN, binding=binding, pairs=True)
        assert [o.ordinal for o in next(batches).occurrences] == [0, 1]  # the batches before the last come
        with pytest.raises(sp.InvalidInputError, match=unfinished):
            next(batches)
    for items in (examples, [table.chunk(0, 5), examples[5]], [table]):  # the twin: the rejected arrives
        assert len(packed(sp.stream, items, config, binding)) == 3
    assert packed(sp.stream, [], config, binding) == []


def test_padding_pairs_needs_an_even_rows_per_batch(binding):
    table = preference_table([2, 3, 1, 1], 7, binding)
    assert [batch.shape for batch in sp.pad(table, sp.PadConfig(rows_per_batch=2), partition=TRAIN,
                                            binding=binding, pairs=True)] == [(2, 3), (2, 1)]
    for rows in (1, 3):
        with pytest.raises(sp.InvalidInputError, match=f"^rows_per_batch {rows} is odd: padding gives each sequence "
                                                       "its own row, so a batch would split a preference pair"):
            sp.pad(table, sp.PadConfig(rows_per_batch=rows), partition=TRAIN, binding=binding, pairs=True)
        unpaired = sp.pad(table, sp.PadConfig(rows_per_batch=rows), partition=TRAIN, binding=binding)[0]
        unpaired.pairs = True  # what pairs=True would have given: a pair split between batches
        with pytest.raises(sp.VerificationError, match=f"^the batch holds {rows} occurrences: not whole"):
            unpaired.verify()
    with pytest.raises(sp.InvalidInputError, match="^3 examples cannot be preference pairs"):
        sp.pad(table.chunk(0, 3), sp.PadConfig(rows_per_batch=2), partition=TRAIN, binding=binding, pairs=True)


@pytest.mark.parametrize("pairs", [1, "yes", None])
def test_pairs_must_be_a_bool(binding, pairs):
    table = preference_table([1, 1], 0, binding)
    message = f"^pairs must be a bool, got {type(pairs).__name__}$"
    for function, examples, config in ((sp.pack, table, sp.PackConfig(4)), (sp.plan, table, sp.PackConfig(4)),
                                       (sp.stream, [table], sp.PackConfig(4)),
                                       (sp.pad, table, sp.PadConfig(rows_per_batch=2))):
        with pytest.raises(sp.InvalidInputError, match=message):
            function(examples, config, partition=TRAIN, binding=binding, pairs=pairs)
        assert len(list(function(examples, config, partition=TRAIN, binding=binding, pairs=np.bool_(True)))) == 1


# --- the memory budget ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("function", [sp.plan, sp.pack])
def test_paired_budget_equal_to_requirement_passes(binding, policy, function):
    table = preference_table(np.random.default_rng(3).integers(1, 12, 300), 3, binding)

    def run(memory):
        return function(table, sp.PackConfig(24, 4, max_memory_bytes=memory), partition=TRAIN, binding=binding,
                        policy=policy, pairs=True)

    required = run(BIG).memory_peak
    assert run(required).memory_peak == required
    with pytest.raises(sp.MemoryBudgetError, match=f"needs {required} bytes; max_memory_bytes is {required - 1}"):
        run(required - 1)


@pytest.mark.parametrize("policy", ["next-fit", "best-fit-decreasing"])
def test_paired_plan_budget_is_honest_under_tracemalloc(binding, policy):
    """A plan of 10,000 pairs holds what its ``memory_peak`` says (within 64 KiB), and not half of it."""
    rng = np.random.default_rng(9)
    table = preference_table(np.clip(np.rint(rng.lognormal(np.log(30), 0.6, 20_000)), 1, 255).astype(np.int64), 9,
                             binding)
    config = sp.PackConfig(512, 8, max_memory_bytes=1 << 34)
    tracemalloc.start()
    plan = sp.plan(table, config, partition=TRAIN, binding=binding, policy=policy, pairs=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak <= plan.memory_peak + 64 * 1024
    assert plan.memory_peak <= 2 * peak
