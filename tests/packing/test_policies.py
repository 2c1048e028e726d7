"""Packing policies, lazy plans, efficiency reports and metadata honesty for the table path."""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack.packing.placement import POLICIES

from helpers import BIG, assert_same_batches, example_list, predicting, random_table

pytestmark = pytest.mark.kernel

TRAIN = sp.Partition.TRAIN
DECREASING = ("first-fit-decreasing", "best-fit-decreasing")


def global_placements(epoch_batches, max_rows):
    """``{ordinal: (row, start, stop, segment)}`` with rows numbered across the epoch."""
    seen = {}
    for call, batch in enumerate(epoch_batches):
        for o in batch.occurrences:
            assert o.ordinal not in seen, f"occurrence {o.ordinal} placed twice"
            seen[o.ordinal] = (call * max_rows + o.row, o.columns.start, o.columns.stop, o.segment)
    return seen


@settings(derandomize=True, max_examples=40, deadline=None)
@given(st.lists(st.integers(2, 12), min_size=1, max_size=40), st.integers(0, 6), st.integers(1, 4))
def test_rows_follow_the_policy_and_ordinals_the_input(binding, lengths, extra, max_rows):
    capacity = max(lengths) + extra
    config = sp.PackConfig(capacity, max_rows, max_rows * capacity, BIG)
    table = random_table(lengths, binding)
    rows = {}
    for policy in POLICIES:
        placement = sp.place(lengths, capacity, policy)
        epoch = sp.pack(table, config, partition=TRAIN, binding=binding, policy=policy)
        assert epoch.row_count == placement.row_count and epoch.occurrence_count == len(lengths)
        placed = global_placements(epoch.batches, max_rows)
        assert sorted(placed) == list(range(len(lengths)))  # nothing dropped or duplicated
        for ordinal, (row, start, stop, segment) in placed.items():
            assert (row, start) == (placement.rows[ordinal], placement.starts[ordinal])
            assert stop - start == lengths[ordinal] and segment == ordinal  # not split
        for batch in epoch.batches:
            batch.verify()
            assert batch.shape[1] == capacity
        assert epoch.target_count == sum(lengths)
        rows[policy] = epoch.row_count
    assert rows["first-fit-decreasing"] <= rows["next-fit"]
    assert rows["best-fit-decreasing"] <= rows["next-fit"]


def test_decreasing_policy_fills_earlier_rows(binding):
    """FFD at capacity 6, lengths 2 5 3 4 2: visits 5 4 3 2 2 -> rows [5] [4 2] [3 2]."""
    lengths = [2, 5, 3, 4, 2]
    table = random_table(lengths, binding)
    epoch = sp.pack(table, sp.PackConfig(6, 2, 12, BIG), partition=TRAIN, binding=binding, policy="first-fit-decreasing")
    assert epoch.row_count == 3 and [b.shape for b in epoch.batches] == [(2, 6), (1, 6)]
    first, last = epoch.batches
    # Records are in row order; ordinals and segments keep the input order.
    assert first.occurrences == [sp.layout.Occurrence(1, 0, range(0, 5), 1), sp.layout.Occurrence(3, 1, range(0, 4), 3),
                                 sp.layout.Occurrence(0, 1, range(4, 6), 0)]
    assert last.occurrences == [sp.layout.Occurrence(2, 0, range(0, 3), 2), sp.layout.Occurrence(4, 0, range(3, 5), 4)]
    assert first.segments.tolist() == [[1, 1, 1, 1, 1, -1], [3, 3, 3, 3, 0, 0]]
    assert first.positions.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 1]]
    for batch in epoch.batches:
        batch.verify()


@pytest.mark.parametrize("policy", DECREASING)
def test_policy_list_path_equals_table_path(binding, policy):
    rng = np.random.default_rng(5)
    lengths = rng.integers(2, 30, size=200)
    documents = predicting(lengths)
    config = sp.PackConfig(32, 3, 96, BIG)
    table = sp.ExampleTable.from_arrays(np.concatenate(documents), np.cumsum([0] + [len(d) for d in documents]),
                                        binding)
    listed = sp.pack(example_list(documents, binding), config, partition=TRAIN, binding=binding, policy=policy)
    columnar = sp.pack(table, config, partition=TRAIN, binding=binding, policy=policy)
    assert_same_batches(columnar.batches, listed.batches)
    assert listed.row_count < sp.pack(table, config, partition=TRAIN, binding=binding).row_count


def test_unknown_policy_lists_the_choices(binding):
    table = random_table([3, 4], binding)
    config = sp.PackConfig(8, 1, 8, BIG)
    message = "unknown placement policy 'worst-fit'; choose one of next-fit, first-fit-decreasing, best-fit-decreasing"
    for function in (sp.pack, sp.plan):
        with pytest.raises(sp.InvalidInputError, match=message):
            function(table, config, partition=TRAIN, binding=binding, policy="worst-fit")
        function(table, config, partition=TRAIN, binding=binding, policy="best-fit-decreasing")


# --- lazy plans and efficiency reports -----------------------------------------------------


@pytest.fixture(scope="module")
def multi_call(binding):
    """About 400 examples over tens of model calls."""
    rng = np.random.default_rng(11)
    return random_table(np.clip(rng.lognormal(np.log(20), 0.7, 400).astype(np.int64), 2, 64), binding, seed=11)


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_equals_eager(binding, multi_call, policy):
    config = sp.PackConfig(64, 4, 256, BIG)
    plan = sp.plan(multi_call, config, partition=TRAIN, binding=binding, policy=policy)
    epoch = sp.pack(multi_call, config, partition=TRAIN, binding=binding, policy=policy)
    assert len(plan) == len(epoch.batches) > 4
    assert (plan.row_count, plan.occurrence_count, plan.policy) == (epoch.row_count, epoch.occurrence_count, policy)
    assert_same_batches(plan, epoch.batches)
    assert_same_batches([plan.batch(len(plan) - 1), plan.batch(0)], [epoch.batches[-1], epoch.batches[0]])
    assert plan.memory_peak < epoch.memory_peak
    assert plan.batch_targets().tolist() == [b.target_count for b in epoch.batches]
    for call in (-1, len(plan), True, 1.0):
        with pytest.raises(sp.InvalidInputError,
                           match=rf"batch {call!r} (is outside this plan's batches|.*: this plan's batches are "
                                 rf"numbered) \[0, {len(plan)}\)"):
            plan.batch(call)


@pytest.mark.parametrize("policy", POLICIES)
def test_report_matches_the_materialized_batches(binding, multi_call, policy):
    config = sp.PackConfig(64, 4, 256, BIG)
    plan = sp.plan(multi_call, config, partition=TRAIN, binding=binding, policy=policy)
    epoch = sp.pack(multi_call, config, partition=TRAIN, binding=binding, policy=policy)
    report = plan.report()
    batches = epoch.batches
    cells = sum(b.cell_count for b in batches)
    valid = sum(int(b.loss_mask.sum()) for b in batches)
    lengths = [len(o.columns) for b in batches for o in b.occurrences]
    assert report.policy == policy and report.capacity == 64
    assert (report.rows, report.batches) == (sum(b.shape[0] for b in batches), len(batches))
    assert report.cells == cells and report.valid_targets == valid == int(multi_call.lengths.sum())
    assert report.real_target_fraction == valid / cells
    assert report.padding_cells == cells - valid == sum(int((~b.token_valid).sum()) for b in batches)
    assert report.permitted_edges == sum(n * (n + 1) // 2 for n in lengths)
    assert report.permitted_edges == sum(int(b.dense_mask().sum()) for b in batches[:3]) + sum(
        b.counts().permitted_edges for b in batches[3:])
    assert report.dense_score_positions == sum(b.shape[0] * 64 * 64 for b in batches)
    assert report.permitted_fraction == report.permitted_edges / report.dense_score_positions
    assert report.batch_targets == tuple(b.target_count for b in batches)
    assert sp.packing.efficiency_report(epoch) == report  # every field, policy and call targets included
    assert sp.packing.efficiency_report(plan) == report
    assert report.as_dict() == {
        "policy": policy, "capacity": 64, "rows": report.rows, "batches": report.batches, "cells": cells,
        "valid_targets": valid, "real_target_fraction": valid / cells, "padding_cells": cells - valid,
        "permitted_edges": report.permitted_edges, "dense_score_positions": report.dense_score_positions,
        "permitted_fraction": report.permitted_fraction,
    }


def test_efficiency_report_rejects_other_objects():
    with pytest.raises(sp.InvalidInputError, match="expected a PackingPlan or PackedEpoch, not list"):
        sp.packing.efficiency_report([])


def test_decreasing_policies_use_fewer_rows_on_the_report(binding, multi_call):
    config = sp.PackConfig(64, 4, 256, BIG)
    reports = {p: sp.plan(multi_call, config, partition=TRAIN, binding=binding, policy=p).report() for p in POLICIES}
    best = sp.packing.lower_bound_rows(multi_call.lengths, 64)
    for policy in DECREASING:
        assert best <= reports[policy].rows < reports["next-fit"].rows
        assert reports[policy].real_target_fraction > reports["next-fit"].real_target_fraction
        assert reports[policy].valid_targets == reports["next-fit"].valid_targets


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_budget_equal_to_requirement_passes(binding, multi_call, policy):
    required = sp.plan(multi_call, sp.PackConfig(64, 4, 256, BIG), partition=TRAIN, binding=binding, policy=policy).memory_peak
    plan = sp.plan(multi_call, sp.PackConfig(64, 4, 256, required), partition=TRAIN, binding=binding, policy=policy)
    assert plan.memory_peak == required
    with pytest.raises(sp.MemoryBudgetError, match=f"needs {required} bytes") as caught:
        sp.plan(multi_call, sp.PackConfig(64, 4, 256, required - 1), partition=TRAIN, binding=binding, policy=policy)
    assert (caught.value.required, caught.value.maximum) == (required, required - 1)
    eager = sp.pack(multi_call, sp.PackConfig(64, 4, 256, BIG), partition=TRAIN, binding=binding, policy=policy).memory_peak
    sp.pack(multi_call, sp.PackConfig(64, 4, 256, eager), partition=TRAIN, binding=binding, policy=policy)
    with pytest.raises(sp.MemoryBudgetError, match=f"needs {eager} bytes"):
        sp.pack(multi_call, sp.PackConfig(64, 4, 256, eager - 1), partition=TRAIN, binding=binding, policy=policy)


# --- metadata honesty under tracemalloc ---------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_a_tiny_pack_stays_within_the_budget_it_asks_for(binding, policy):
    """The decreasing policies' reordering of the rows (a radix sort with a 512 KiB digit
    table) went uncounted: one example packed under exactly its requirement held 44 times it."""
    example = sp.SequenceExample.from_document("a", sp.BatchDocument("a", [0, 99, 100, 1], TRAIN), binding)
    need = sp.plan([example], sp.PackConfig(4), partition=TRAIN, binding=binding, policy=policy).epoch_requirement()
    tracemalloc.start()
    sp.pack([example], sp.PackConfig(4, max_memory_bytes=need), partition=TRAIN, binding=binding, policy=policy)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak <= need


@pytest.fixture(scope="module")
def honesty_table(binding):
    """About 30k examples, lognormal lengths around 40 predictions."""
    rng = np.random.default_rng(7)
    return random_table(np.clip(np.rint(rng.lognormal(np.log(40), 0.6, 30_000)), 2, 512).astype(np.int64),
                        binding, seed=7)


@pytest.mark.parametrize("policy", ["next-fit", "best-fit-decreasing"])
@pytest.mark.parametrize("function", [sp.pack, sp.plan])
def test_table_budget_is_honest_under_tracemalloc(binding, honesty_table, policy, function):
    """Capacity 512, 8 rows per batch; for plan the plan alone, nothing materialized."""
    config = sp.PackConfig(512, 8, 8 * 512, 1 << 34)
    tracemalloc.start()
    packed = function(honesty_table, config, partition=TRAIN, binding=binding, policy=policy)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"{function.__name__} {policy}: traced peak {peak} bytes, memory_peak {packed.memory_peak} bytes")
    assert peak <= packed.memory_peak + 64 * 1024
    assert packed.memory_peak <= 2 * peak
    assert packed.occurrence_count == len(honesty_table)
