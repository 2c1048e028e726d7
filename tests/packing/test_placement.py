"""Placement kernels against plain-Python references, their invariants and their errors."""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import CapacityError, InvalidInputError, place
from seqpack.packing import lower_bound_rows, placement_bytes, real_target_fraction
from seqpack.packing.placement import BEST_FIT_MAX_CAPACITY, POLICIES, _longest_first

pytestmark = pytest.mark.kernel


def reference_next_fit(lengths, capacity):
    """Fill the current row in input order; open a row only to place an example."""
    rows, starts = [], []
    row_count, used = 0, 0
    for length in lengths:
        if row_count == 0 or used + length > capacity:
            row_count += 1
            used = 0
        rows.append(row_count - 1)
        starts.append(used)
        used += length
    return rows, starts, row_count


def reference_decreasing(lengths, capacity, best_fit):
    """Longest first (ties in input order) into the first, or the tightest, row that fits."""
    rows = [None] * len(lengths)
    starts = [None] * len(lengths)
    used = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fitting = [r for r in range(len(used)) if used[r] + lengths[i] <= capacity]
        if not fitting:
            used.append(0)
            row = len(used) - 1
        elif best_fit:
            row = min(fitting, key=lambda r: (capacity - used[r], r))
        else:
            row = fitting[0]
        rows[i] = row
        starts[i] = used[row]
        used[row] += lengths[i]
    return rows, starts, len(used)


REFERENCES = {
    "next-fit": reference_next_fit,
    "first-fit-decreasing": lambda lengths, capacity: reference_decreasing(lengths, capacity, False),
    "best-fit-decreasing": lambda lengths, capacity: reference_decreasing(lengths, capacity, True),
}


@st.composite
def length_lists(draw):
    """Random lengths, plus the edge families: all ones, all full rows, exact-fill pairs."""
    capacity = draw(st.integers(1, 40))
    family = draw(st.sampled_from(["random", "ones", "full", "pairs"]))
    size = draw(st.integers(0, 60))
    if family == "ones":
        lengths = [1] * size
    elif family == "full":
        lengths = [capacity] * size
    elif family == "pairs":
        firsts = draw(st.lists(st.integers(1, capacity), min_size=size, max_size=size))
        lengths = [part for first in firsts for part in (first, capacity - first) if part > 0]
    else:
        lengths = draw(st.lists(st.integers(1, capacity), min_size=size, max_size=size))
    return lengths, capacity


def assert_matches_reference(lengths, capacity, policy):
    placement = place(lengths, capacity, policy)
    rows, starts, row_count = REFERENCES[policy](list(lengths), capacity)
    assert placement.rows.tolist() == rows
    assert placement.starts.tolist() == starts
    assert placement.row_count == row_count
    assert placement.policy == policy


def assert_valid_placement(lengths, capacity, placement):
    """Every example placed once inside its row, no overlap, rows 0..row_count-1 all used."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows, starts = placement.rows, placement.starts
    assert rows.shape == starts.shape == lengths.shape
    assert sorted(set(rows.tolist())) == list(range(placement.row_count))
    assert (starts >= 0).all() and (starts + lengths <= capacity).all()
    order = np.lexsort((starts, rows))
    same_row = rows[order][1:] == rows[order][:-1]
    ends = (starts + lengths)[order]
    assert (starts[order][1:][same_row] >= ends[:-1][same_row]).all()


@pytest.mark.parametrize("policy", POLICIES)
@settings(derandomize=True, max_examples=150, deadline=None)
@given(case=length_lists())
def test_matches_reference_and_is_valid(policy, case):
    lengths, capacity = case
    assert_matches_reference(lengths, capacity, policy)
    assert_valid_placement(lengths, capacity, place(lengths, capacity, policy))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("capacity", [1, 7, 64, 300, 100_000])
def test_matches_reference_on_larger_random_input(policy, capacity):
    rng = np.random.default_rng(capacity)
    lengths = np.minimum(rng.geometric(min(1.0, 4.0 / capacity), size=3000), capacity)
    assert_matches_reference(lengths, capacity, policy)
    assert_valid_placement(lengths, capacity, place(lengths, capacity, policy))


def test_chapter_fixture_next_fit():
    placement = place([3, 2, 4], 6)
    assert placement.rows.tolist() == [0, 0, 1]
    assert placement.starts.tolist() == [0, 3, 0]
    assert placement.row_count == 2
    assert placement.policy == "next-fit"


def test_decreasing_policies_on_the_chapter_lengths():
    # Longest first: C (4) opens row 0, A (3) does not fit its 2 cells and opens row 1,
    # B (2) fits row 0 exactly under both policies.
    for policy in ("first-fit-decreasing", "best-fit-decreasing"):
        placement = place([3, 2, 4], 6, policy)
        assert placement.rows.tolist() == [1, 0, 0]
        assert placement.starts.tolist() == [0, 4, 0]


def test_first_fit_and_best_fit_differ_where_the_rule_says():
    # Longest first at capacity 10: 8 opens row 0 (room 2), 6 opens row 1 (room 4), 3 fits
    # only row 1 (room 1). The 1 then goes to row 0 under first fit (the first with room)
    # and to row 1 under best fit (the least room).
    lengths = [3, 1, 8, 6]
    first = place(lengths, 10, "first-fit-decreasing")
    best = place(lengths, 10, "best-fit-decreasing")
    assert first.rows.tolist() == [1, 0, 0, 1] and first.starts.tolist() == [6, 8, 0, 0]
    assert best.rows.tolist() == [1, 1, 0, 1] and best.starts.tolist() == [6, 9, 0, 0]


def test_best_fit_ties_go_to_the_lowest_row():
    # Two rows with equal room 3 (rows 0 and 1); the 3 goes to row 0, the next 3 to row 1.
    placement = place([7, 7, 3, 3], 10, "best-fit-decreasing")
    assert placement.rows.tolist() == [0, 1, 0, 1]
    assert placement.starts.tolist() == [0, 0, 7, 7]


def test_exact_fill_opens_no_empty_row():
    for policy in POLICIES:
        assert place([4, 2], 6, policy).row_count == 1
        assert place([6, 6, 6], 6, policy).row_count == 3


def test_empty_input_has_no_rows():
    for policy in POLICIES:
        placement = place([], 5, policy)
        assert placement.row_count == 0
        assert placement.rows.shape == placement.starts.shape == (0,)
        assert placement.rows.dtype == placement.starts.dtype == np.int64


def test_next_fit_never_revisits_a_row():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 50, size=5000)
    rows = place(lengths, 50).rows
    assert (np.diff(rows) >= 0).all()
    assert (np.diff(rows) <= 1).all()


@pytest.mark.parametrize("policy", ["first-fit-decreasing", "best-fit-decreasing"])
def test_decreasing_rows_are_numbered_in_opening_order(policy):
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 100, size=4000)
    placement = place(lengths, 100, policy)
    order = np.argsort(-lengths, kind="stable")
    first_seen = np.unique(placement.rows[order], return_index=True)[1]
    assert (np.diff(first_seen) > 0).all()
    # Within a row, starts increase in assignment order.
    visited = placement.rows[order], placement.starts[order]
    for row in range(0, placement.row_count, 97):
        assert (np.diff(visited[1][visited[0] == row]) > 0).all()


def test_outputs_are_read_only_and_deterministic():
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 512, size=2000)
    for policy in POLICIES:
        first, second = place(lengths, 512, policy), place(lengths, 512, policy)
        assert np.array_equal(first.rows, second.rows)
        assert np.array_equal(first.starts, second.starts)
        with pytest.raises(ValueError, match="read-only"):
            first.rows[0] = 1
        with pytest.raises(ValueError, match="read-only"):
            first.starts[0] = 1


@pytest.mark.parametrize("policy", POLICIES)
def test_array_layouts_are_accepted(policy):
    base = np.random.default_rng(2).integers(1, 30, size=400)
    expected = place(base, 30, policy)
    strided = np.repeat(base, 2).astype(np.int32)[::2]
    read_only = base.astype(np.uint16)
    read_only.flags.writeable = False
    for lengths in (strided, read_only, base.tolist(), tuple(base.tolist())):
        placement = place(lengths, 30, policy)
        assert np.array_equal(placement.rows, expected.rows)
        assert np.array_equal(placement.starts, expected.starts)


@pytest.mark.parametrize("policy", POLICIES)
def test_length_at_capacity_passes_and_one_more_names_the_example(policy):
    assert place([3, 512, 1], 512, policy).row_count == (3 if policy == "next-fit" else 2)
    with pytest.raises(CapacityError, match=r"^example 1 has 513 predictions; capacity is 512$") as caught:
        place([3, 513, 1, 600], 512, policy)
    assert caught.value.cells == 513
    assert caught.value.maximum == 512


def test_huge_unsigned_length_is_a_capacity_error():
    lengths = np.array([1, 2**64 - 1], dtype=np.uint64)
    with pytest.raises(CapacityError, match=rf"^example 1 has {2**64 - 1} predictions; capacity is 8$"):
        place(lengths, 8)


@pytest.mark.parametrize("policy", POLICIES)
def test_length_one_passes_and_zero_names_the_example(policy):
    assert place([1, 1], 1, policy).row_count == 2
    needs_one = r"^example 2 has 0 predictions; every example needs at least 1$"
    with pytest.raises(InvalidInputError, match=needs_one):
        place([1, 1, 0, -4], 1, policy)
    with pytest.raises(InvalidInputError, match=r"^example 0 has -4 predictions"):
        place([-4], 1, policy)


def test_unknown_policy_lists_the_choices():
    with pytest.raises(
        InvalidInputError,
        match=r"unknown placement policy 'worst-fit'; "
        r"choose one of next-fit, first-fit-decreasing, best-fit-decreasing$",
    ):
        place([1], 4, "worst-fit")


@pytest.mark.parametrize("capacity", [0, -3, True, 2.0, "8", 2**63])
def test_capacity_must_be_a_positive_int64(capacity):
    with pytest.raises(InvalidInputError, match="capacity must be"):
        place([1], capacity)


@pytest.mark.parametrize("policy", ["next-fit", "first-fit-decreasing"])
def test_capacity_at_int64_max_passes(policy):
    assert place(np.array([2**62, 2**62 - 1]), 2**63 - 1, policy).row_count == 1
    assert place(np.array([2**62, 2**62, 2**63 - 1]), 2**63 - 1, policy).row_count == 3
    assert place([1], np.int32(1)).row_count == 1


def test_best_fit_capacity_limit_with_its_twin():
    assert place([1, BEST_FIT_MAX_CAPACITY], BEST_FIT_MAX_CAPACITY, "best-fit-decreasing").row_count == 2
    with pytest.raises(InvalidInputError, match=rf"capacity {BEST_FIT_MAX_CAPACITY + 1} is too large"):
        place([1], BEST_FIT_MAX_CAPACITY + 1, "best-fit-decreasing")


@pytest.mark.parametrize("lengths", [[[1, 2]], np.array(3), [1.0, 2.0], [True], ["1"]])
def test_lengths_must_be_one_dimensional_integers(lengths):
    with pytest.raises(InvalidInputError, match="lengths must be"):
        place(lengths, 4)


def test_lower_bound_and_real_target_fraction():
    assert lower_bound_rows([3, 2, 4], 6) == 2
    assert lower_bound_rows([3, 3], 6) == 1
    assert lower_bound_rows([], 6) == 0
    assert real_target_fraction([3, 2, 4], 2, 6) == 0.75
    assert real_target_fraction([3, 3], 1, 6) == 1.0
    assert lower_bound_rows(np.full(4, 2**62), 2**63 - 1) == 3
    with pytest.raises(InvalidInputError, match="1 rows of capacity 6 cannot hold 9 predictions"):
        real_target_fraction([3, 2, 4], 1, 6)
    with pytest.raises(CapacityError, match=r"^example 0 has 7 predictions; capacity is 6$"):
        lower_bound_rows([7], 6)
    assert lower_bound_rows([6], 6) == 1  # its exact-limit twin
    with pytest.raises(InvalidInputError, match="row_count must be an integer"):
        real_target_fraction([3], 1.0, 6)


def test_best_fit_decreasing_is_close_to_the_bound_on_lognormal_lengths():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(250), 1.0, size=20000)), 1, 2048).astype(np.int64)
    bound = lower_bound_rows(lengths, 2048)
    best = real_target_fraction(lengths, bound, 2048)
    fractions = {policy: real_target_fraction(lengths, place(lengths, 2048, policy).row_count, 2048)
                 for policy in POLICIES}
    assert fractions["best-fit-decreasing"] >= 0.99 * best
    assert fractions["first-fit-decreasing"] >= 0.99 * best
    assert fractions["next-fit"] < fractions["best-fit-decreasing"]


@pytest.mark.parametrize("capacity", [5, 2**16, 2**16 + 1, 2**40])
def test_longest_first_is_a_stable_descending_order(capacity):
    # Capacities up to max(count, 2**16) take the counting sort, larger ones numpy's sort.
    rng = np.random.default_rng(capacity % 1000)
    lengths = np.minimum(rng.integers(1, 6, size=2000) * (capacity // 5), capacity)
    lengths = np.maximum(lengths, 1)
    order, sorted_lengths = _longest_first(lengths, capacity)
    assert order.tolist() == sorted(range(2000), key=lambda i: (-lengths[i], i))
    assert np.array_equal(sorted_lengths, lengths[order])


def assert_honest(required: int, placing) -> None:
    """``placing()``'s traced peak is within 64 KiB above ``required`` and at least half of it."""
    tracemalloc.start()
    try:
        placement = placing()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert placement.row_count > 0
    assert peak <= required + 64 * 1024
    assert required <= 2 * peak


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("capacity", [512, 100_000])
def test_placement_bytes_is_honest_both_ways(policy, capacity):
    rng = np.random.default_rng(1)
    lengths = np.clip(np.rint(rng.lognormal(np.log(40), 1.0, size=30000)), 1, 512).astype(np.int64)
    assert_honest(placement_bytes(lengths, capacity, policy), lambda: place(lengths, capacity, policy))


def test_placement_bytes_of_nothing_and_its_errors():
    assert placement_bytes([], 8) == 0
    with pytest.raises(CapacityError, match="example 0 has 9 predictions"):
        placement_bytes([9], 8)
    with pytest.raises(InvalidInputError, match="unknown placement policy"):
        placement_bytes([1], 8, "any-fit")


@pytest.mark.parametrize("largest", [0, 1, 2**16 - 1, 2**16, 2**31 - 1, 2**40, 2**48 + 5, 2**63 - 1])
@pytest.mark.parametrize("count", [0, 1, 7, 70_000])
def test_the_radix_order_is_numpys_stable_argsort(largest, count):
    """The interruptible radix sort behind large-capacity decreasing orders and a plan's
    (row, start) order: every pass count, ties in index order, empty input."""
    from seqpack.packing.placement import stable_order

    rng = np.random.default_rng(count)
    keys = rng.integers(0, largest, count, endpoint=True, dtype=np.int64) if largest else np.zeros(count, np.int64)
    keys[::5] = keys[0] if count else 0  # ties
    assert np.array_equal(stable_order(keys, largest), np.argsort(keys, kind="stable"))
    # Flipped (longest first, no flipped copy): the stable argsort of largest - key.
    assert np.array_equal(stable_order(keys, largest, flip_from=largest), np.argsort(largest - keys, kind="stable"))


# --- preference pairs: examples 2p and 2p + 1 placed as one item ----------------------------


@pytest.mark.parametrize("policy", POLICIES)
@settings(derandomize=True, max_examples=100, deadline=None)
@given(case=length_lists(), data=st.data())
def test_pairs_are_placed_as_their_joined_lengths(policy, case, data):
    """Each item of ``length_lists`` cut into a chosen and a rejected part: the pairs take the
    rows and starts the items take alone, the chosen at the start and the rejected right after."""
    pair_lengths, capacity = case
    pair_lengths = [n for n in pair_lengths if n > 1] if capacity > 1 else []
    chosen = [data.draw(st.integers(1, n - 1)) for n in pair_lengths]
    lengths = [part for whole, first in zip(pair_lengths, chosen) for part in (first, whole - first)]
    alone = place(pair_lengths, capacity, policy)
    paired = place(lengths, capacity, policy, pairs=True)
    assert paired.row_count == alone.row_count and paired.policy == policy
    assert paired.rows.tolist() == np.repeat(alone.rows, 2).tolist()
    assert paired.starts[0::2].tolist() == alone.starts.tolist()
    assert (paired.starts[1::2] == paired.starts[0::2] + np.asarray(chosen, dtype=np.int64)).all()
    assert_valid_placement(lengths, capacity, paired)
    with pytest.raises(ValueError, match="read-only"):
        paired.starts[0] = 1


def test_unpaired_placement_is_unchanged_by_the_keyword():
    lengths = np.random.default_rng(4).integers(1, 20, size=300)
    for policy in POLICIES:
        default, unpaired = place(lengths, 20, policy), place(lengths, 20, policy, pairs=False)
        assert np.array_equal(default.rows, unpaired.rows) and np.array_equal(default.starts, unpaired.starts)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pair_at_capacity_passes_and_one_more_names_the_pair(policy):
    assert place([3, 2, 1, 1], 5, policy, pairs=True).row_count == 2  # pair 0 fills its row exactly
    with pytest.raises(CapacityError, match=r"^pair 1 \(examples 2 and 3\) has 6 predictions; capacity is 5; a pair's "
                                            r"chosen and rejected sequences share one row$") as caught:
        place([3, 2, 1, 5, 4, 4], 5, policy, pairs=True)
    assert (caught.value.cells, caught.value.maximum) == (6, 5)
    with pytest.raises(CapacityError, match=r"^example 3 has 6 predictions; capacity is 5$"):
        place([3, 2, 1, 6], 5, policy, pairs=True)  # a sequence too long on its own is named first


@pytest.mark.parametrize("policy", ["next-fit", "first-fit-decreasing"])
def test_a_pair_past_int64_is_a_capacity_error(policy):
    """Two lengths that each fit a capacity near 2**63 add up past int64 (family 10)."""
    assert place(np.array([2**62, 2**62 - 1]), 2**63 - 1, policy, pairs=True).row_count == 1
    with pytest.raises(CapacityError, match=rf"^pair 1 \(examples 2 and 3\) has {2**64 - 2} predictions; "
                                            rf"capacity is {2**63 - 1}"):
        place(np.array([1, 1, 2**63 - 1, 2**63 - 1]), 2**63 - 1, policy, pairs=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_an_odd_count_is_no_set_of_pairs(policy):
    assert place([1, 1, 1, 1], 2, policy, pairs=True).row_count == 2
    assert place([], 2, policy, pairs=True).row_count == 0
    with pytest.raises(InvalidInputError, match=r"^3 examples cannot be preference pairs: pair p is examples 2p and "
                                                r"2p \+ 1$"):
        place([1, 1, 1], 2, policy, pairs=True)


@pytest.mark.parametrize("pairs", [1, "yes", None])
def test_pairs_must_be_a_bool(pairs):
    with pytest.raises(InvalidInputError, match=f"^pairs must be a bool, got {type(pairs).__name__}$"):
        place([1, 1], 2, pairs=pairs)
    with pytest.raises(InvalidInputError, match=f"^pairs must be a bool, got {type(pairs).__name__}$"):
        placement_bytes([1, 1], 2, pairs=pairs)


@pytest.mark.parametrize("policy", POLICIES)
def test_paired_placement_bytes_is_honest_both_ways(policy):
    rng = np.random.default_rng(2)
    lengths = np.clip(np.rint(rng.lognormal(np.log(40), 1.0, size=30000)), 1, 256).astype(np.int64)
    required = placement_bytes(lengths, 512, policy, pairs=True)
    assert required == placement_bytes(lengths, 512, policy, pairs=np.bool_(True))
    assert_honest(required, lambda: place(lengths, 512, policy, pairs=True))
    with pytest.raises(CapacityError, match=r"^pair 0 \(examples 0 and 1\) has 257 predictions; capacity is 256"):
        placement_bytes([128, 129], 256, policy, pairs=True)
    assert placement_bytes([128, 128], 256, policy, pairs=True) > 0
