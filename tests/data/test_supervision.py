"""Supervision in the core: which targets count in the loss, from examples and tables to batches.

The oracle is the supervision array itself: an occurrence of example ``i`` placed at
columns ``[a, b)`` must carry ``supervised[begin + 1 : end]`` as its ``loss_mask``,
whatever the policy, padding, streaming or epoch that placed it; every count of
targets (batch, epoch, plan, report) is the number of supervised ones.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack import BatchDocument, Decoder, DecoderConfig, InvalidInputError, SequenceExample, VerificationError
from seqpack.chapters.fixtures import packed_batch, padded_batch
from seqpack.chapters.trace import Comparison, SeparateExecution
from seqpack.nn.loss import masked_nll
from helpers import randomize

TRAIN = sp.Partition.TRAIN
BINDING = sp.BatchBinding.fixture()
POLICIES = ["next-fit", "first-fit-decreasing", "best-fit-decreasing"]
BIG = 1 << 40


def masked_table(lengths, seed, *, ranges=False):
    """Whole documents (or one interior range of each) with random content and a random
    supervision that leaves every example at least one supervised target."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    if not ranges:  # a whole document of one prediction would have no content
        lengths = np.maximum(lengths, 2)
    offsets = np.concatenate(([0], np.cumsum(lengths + 1 + 2 * ranges)))
    tokens = rng.integers(2, 258, size=int(offsets[-1]), dtype=np.int32)
    tokens[offsets[:-1]] = 0
    tokens[offsets[1:] - 1] = 1
    supervised = rng.random(tokens.shape[0]) < 0.6
    spans = np.stack([offsets[:-1] - offsets[:-1], np.diff(offsets)], 1)
    if ranges:  # drop each document's first and last token: interior ranges
        spans = spans + np.array([1, -1])
    begins = offsets[:-1] + spans[:, 0]
    supervised[begins + 1 + rng.integers(0, lengths)] = True
    table = sp.ExampleTable.from_arrays(tokens, offsets, BINDING, supervised=supervised,
                                        ranges=spans if ranges else None)
    return table, supervised, begins


def expected_masks(batch, supervised, begins):
    """Each occurrence's loss mask as the supervision array says."""
    for o in batch.occurrences:
        first = begins[o.ordinal] + 1
        yield o, supervised[first : first + len(o.columns)]


def check_batch(batch, supervised, begins):
    total = 0
    for o, mask in expected_masks(batch, supervised, begins):
        np.testing.assert_array_equal(batch.loss_mask[o.row, o.columns.start : o.columns.stop], mask)
        np.testing.assert_array_equal(batch.target_valid[o.row, o.columns.start : o.columns.stop], True)
        total += int(mask.sum())
    assert batch.target_count == total
    assert not (batch.loss_mask & ~batch.target_valid).any()
    batch.verify()
    return total


@settings(derandomize=True, max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 14), min_size=1, max_size=30), st.integers(0, 5), st.integers(1, 4),
       st.sampled_from(POLICIES), st.booleans(), st.integers(0, 1 << 30))
def test_random_masks_survive_every_policy_plan_epoch_and_stream(lengths, extra, rows, policy, ranges, seed):
    table, supervised, begins = masked_table(lengths, seed, ranges=ranges)
    lengths = table.lengths.tolist()
    capacity = max(lengths) + extra
    config = sp.PackConfig(capacity, rows, rows * capacity, BIG)
    plan = sp.plan(table, config, partition=TRAIN, binding=BINDING, policy=policy)
    per_batch = [check_batch(batch, supervised, begins) for batch in plan]
    assert plan.batch_targets().tolist() == per_batch
    epoch = plan.epoch()
    assert [check_batch(batch, supervised, begins) for batch in epoch] == per_batch
    assert epoch.target_count == sum(per_batch) == int(table.target_counts.sum())
    report = plan.report()
    assert report.supervised_targets == sum(per_batch) and report.valid_targets == sum(lengths)
    assert report.padding_cells == report.cells - sum(lengths)
    padded = sp.pad(table, sp.PadConfig(rows), partition=TRAIN, binding=BINDING)
    assert sum(check_batch(batch, supervised, begins) for batch in padded) == sum(per_batch)
    if policy == "next-fit":
        # A stream of table chunks and single examples gives the plan's batches.
        pieces = [table.chunk(0, len(lengths) // 2)] + [table.example(i) for i in range(len(lengths) // 2, len(lengths))]
        streamed = list(sp.stream(pieces, config, partition=TRAIN, binding=BINDING))
        assert [check_batch(batch, supervised, begins) for batch in streamed] == per_batch
        for one, other in zip(streamed, plan):
            np.testing.assert_array_equal(one.loss_mask, other.loss_mask)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_table_and_its_examples_pack_to_the_same_masks(policy):
    table, supervised, begins = masked_table([5, 3, 9, 1, 4, 7], 3, ranges=True)
    examples = [table.example(i) for i in range(len(table))]
    config = sp.PackConfig(10, 2, 20, BIG)
    for one, other in zip(sp.pack(table, config, partition=TRAIN, binding=BINDING, policy=policy),
                          sp.pack(examples, config, partition=TRAIN, binding=BINDING, policy=policy)):
        for field in ("inputs", "targets", "loss_mask", "target_valid", "token_valid", "segments"):
            np.testing.assert_array_equal(getattr(one, field), getattr(other, field))
        check_batch(other, supervised, begins)


def test_without_supervision_nothing_changes():
    table, supervised, _ = masked_table([4, 6, 2], 5)
    tokens, offsets = table._tokens, table._doc_offsets
    plain = sp.ExampleTable.from_arrays(tokens, offsets, BINDING)
    ones = sp.ExampleTable.from_arrays(tokens, offsets, BINDING, supervised=np.ones(tokens.shape[0], np.int8))
    assert plain.supervised is None and plain.target_counts is plain.lengths
    config = sp.PackConfig(8, 2, 16, BIG)
    a = sp.plan(plain, config, partition=TRAIN, binding=BINDING)
    b = sp.plan(ones, config, partition=TRAIN, binding=BINDING)
    assert a.report().as_dict() == b.report().as_dict()
    assert "supervised_targets" not in a.report().as_dict()
    for x, y in zip(a, b):
        assert x.loss_mask.all(where=x.token_valid) and np.array_equal(x.loss_mask, y.loss_mask)
    masked = sp.plan(table, config, partition=TRAIN, binding=BINDING).report().as_dict()
    assert masked["supervised_targets"] == int(table.target_counts.sum()) < masked["valid_targets"]


def test_sequence_example_supervision_and_its_errors():
    document = BatchDocument("d", [0, 40, 41, 42, 43, 1])
    mask = [0, 0, 0, 1, 1, 1]  # the prompt is tokens 1-2: targets 41 and 42's predecessors are not supervised
    example = SequenceExample.from_document("e", document, BINDING, supervised=mask)
    assert example.loss_mask.tolist() == [False, False, True, True, True] and example.target_count == 3
    assert not example.supervised.flags.writeable
    window = SequenceExample.from_range("w", document, range(2, 5), BINDING, supervised=mask)
    assert window.loss_mask.tolist() == [True, True] and window.source_supervised.tolist() == [False, True, True]
    with pytest.raises(InvalidInputError, match="example 'e': supervised must be a 1-D array of 6 entries"):
        SequenceExample.from_document("e", document, BINDING, supervised=[1, 1])
    with pytest.raises(InvalidInputError, match=r"supervised\[2\] is 2; supervision is 0 or 1"):
        SequenceExample.from_document("e", document, BINDING, supervised=[0, 1, 2, 1, 1, 1])
    with pytest.raises(InvalidInputError, match="must be bool"):
        SequenceExample.from_document("e", document, BINDING, supervised=np.ones(6, np.float32))
    with pytest.raises(InvalidInputError, match="example 'p': none of its 2 targets is supervised"):
        SequenceExample.from_range("p", document, range(0, 3), BINDING, supervised=mask)
    # The range's first token is no target: its supervision is never read.
    only_first = [0, 0, 1, 0, 0, 0]
    with pytest.raises(InvalidInputError, match="none of its 2 targets"):
        SequenceExample.from_range("q", document, range(2, 5), BINDING, supervised=only_first)
    forged = SequenceExample("f", document, range(0, 6), BINDING, np.ones(3, bool))
    with pytest.raises(InvalidInputError, match="supervised is not a bool array over its document's 6 tokens"):
        sp.pack([forged], sp.PackConfig(8, 1), partition=TRAIN, binding=BINDING)


def test_table_errors_name_the_example_with_no_supervised_target():
    tokens = np.array([0, 40, 41, 1, 0, 50, 51, 52, 1], np.int32)
    offsets = np.array([0, 4, 9])
    mask = np.array([1, 1, 1, 1, 1, 0, 0, 0, 0], bool)  # document 1's targets: none supervised
    with pytest.raises(InvalidInputError, match=r"example 'second' \(index 1\): none of its 4 targets is supervised"):
        sp.ExampleTable.from_arrays(tokens, offsets, BINDING, supervised=mask, ids=["first", "second"])
    with pytest.raises(InvalidInputError, match="supervised must be a 1-D array of 9 entries"):
        sp.ExampleTable.from_arrays(tokens, offsets, BINDING, supervised=mask[:-1])
    # A bad document is reported before its supervision.
    bad = tokens.copy()
    bad[-1] = 7
    with pytest.raises(InvalidInputError, match="document 1"):
        sp.ExampleTable.from_arrays(bad, offsets, BINDING, supervised=mask)
    table = sp.ExampleTable.from_arrays(tokens, offsets, BINDING, supervised=mask | (np.arange(9) == 8))
    assert table.target_counts.tolist() == [3, 1]
    chunk = table.chunk(1, 2)
    assert chunk.target_counts.tolist() == [1] and chunk.supervised is table.supervised
    assert table.example(1).loss_mask.tolist() == [False, False, False, True]


def test_verify_names_a_loss_mask_that_differs_from_the_supervision():
    table, supervised, begins = masked_table([6, 6], 11)
    batch = sp.pack(table, sp.PackConfig(14, 1), partition=TRAIN, binding=BINDING)[0]
    batch.verify()
    column = int(np.flatnonzero(~batch.loss_mask[0] & batch.token_valid[0])[0])
    changed = batch.loss_mask.copy()
    changed[0, column] = True  # an unsupervised target smuggled into the loss
    batch.loss_mask = changed
    with pytest.raises(VerificationError, match=f"column {column}: loss_mask differs from the example's supervision"):
        batch.verify()
    outside = changed.copy()
    outside[0, column] = False
    outside[0, 13] = True  # padding cell supervised: still a flag violation
    batch.loss_mask = outside
    with pytest.raises(VerificationError, match="outside the row's valid prefix"):
        batch.verify()


@pytest.mark.parametrize("attention", ["reference", "fused"])
def test_separate_padded_and_packed_agree_with_masked_prompts(attention):
    config = DecoderConfig.large()
    for seed in range(12):
        rng = np.random.default_rng([seed, 35])
        decoder = Decoder(config, seed, attention=attention)
        randomize(decoder, rng)
        examples = []
        for index in range(int(rng.integers(2, 6))):
            predictions = int(rng.integers(2, config.max_positions - 1))
            document = BatchDocument(f"d{index}", [0, *rng.integers(34, 129, predictions - 1).tolist(), 1])
            prompt = int(rng.integers(1, predictions))  # the first `prompt` targets are the prompt's
            mask = np.arange(len(document)) > prompt
            examples.append(SequenceExample.from_document(f"e{index}", document, BINDING, supervised=mask))
        separate = SeparateExecution.run(decoder, examples)
        assert separate.count == sum(example.target_count for example in examples) < sum(map(len, examples))
        capacity = int(rng.integers(max(map(len, examples)), config.max_positions + 1))
        for batch in (padded_batch(examples, BINDING), packed_batch(examples, BINDING, capacity)):
            assert batch.target_count == separate.count
            comparison = Comparison.run(decoder, separate, batch)
            assert comparison.failures == 0, (seed, comparison)


def test_nan_at_unsupervised_targets_never_reaches_the_loss():
    table, _, _ = masked_table([7, 5, 9], 19)
    batch = sp.pack(table, sp.PackConfig(12, 3), partition=TRAIN, binding=BINDING)[0]
    rng = np.random.default_rng(0)
    logits = rng.normal(size=batch.shape + (BINDING.vocabulary_size,))
    clean = masked_nll(logits, batch.targets, batch.loss_mask)
    poisoned = logits.copy()
    poisoned[~batch.loss_mask] = np.nan  # prompts and padding alike
    loss = masked_nll(poisoned, batch.targets, batch.loss_mask)
    assert loss.count == batch.target_count and np.isfinite(loss.loss_sum)
    assert loss.loss_sum == clean.loss_sum
    gradient = loss.backward()["logits"]
    assert np.isfinite(gradient).all() and not gradient[~batch.loss_mask].any()


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=60), st.data())
def test_flips_describe_supervision_and_its_placed_ranges(bits, data):
    # The disk format stores supervision as flips; every helper against the plain bool array.
    from seqpack.data.supervision import (flips_of, placed_flips, range_target_counts, supervision_of,
                                          unsupervised_before)
    supervised = np.array(bits)
    n = len(bits)
    flips = flips_of(supervised)
    assert np.array_equal(supervision_of(flips, 0, n), supervised)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    assert np.array_equal(supervision_of(flips, a, b), supervised[a:b])
    assert range_target_counts(flips, np.array([a]), np.array([a])).tolist() == [0]  # empty: none (it gave -1)
    assert np.array_equal(unsupervised_before(flips, np.arange(n + 1)), np.concatenate([[0], np.cumsum(~supervised)]))
    spans = []
    for _ in range(data.draw(st.integers(1, 5))):
        x = data.draw(st.integers(0, n - 2))
        spans.append((x, data.draw(st.integers(x + 2, n))))
    begins, ends = (np.array(side, dtype=np.int64) for side in zip(*spans))
    assert range_target_counts(flips, begins, ends).tolist() == [int(supervised[x + 1 : y].sum()) for x, y in spans]
    placed = placed_flips(flips, begins, ends)
    joined = supervision_of(placed, 0, int((ends - begins).sum()))
    at, before = 0, True
    for x, y in spans:  # every target as in its source; each first token as the token before it
        assert joined[at] == before and np.array_equal(joined[at + 1 : at + y - x], supervised[x + 1 : y])
        before, at = joined[at + y - x - 1], at + y - x
    assert np.array_equal(placed, flips_of(joined))  # the fewest flips: canonical


def trl_reference(tokens, offsets, columns, completion_only_loss):
    """TRL's rule token by token: the first entry that breaks it (columns in sorted order),
    else each token's supervision and the columns applied."""
    firsts = set(offsets.tolist())
    for name in sorted(columns):
        for j, value in enumerate(columns[name].tolist()):
            if name == "labels":
                wrong = j not in firsts and value not in (-100, -101, tokens[j])
            else:
                wrong = value not in (0, 1)
            if wrong:
                return (name, j), None, None
    masks = [name for name in sorted(columns) if name != "labels" and (name != "completion_mask" or completion_only_loss)]
    labels = columns.get("labels")
    supervised = []
    for j in range(len(tokens)):
        if labels is not None and labels[j] != -101:  # a labelled record: its labels alone
            supervised.append(bool(labels[j] != -100))
        else:  # no labels: every applied mask
            supervised.append(all(columns[name][j] == 1 for name in masks))
    if labels is None:
        applied = tuple(masks)
    else:
        applied = tuple(sorted({"labels", *(masks if (labels == -101).any() else ())}))
    return None, supervised, applied


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=5), st.sets(st.sampled_from(
    ["labels", "completion_mask", "assistant_masks"])), st.booleans(), st.data())
def test_trl_rule_against_a_token_by_token_reference(lengths, names, completion_only_loss, data):
    from seqpack.data.supervision import trl_fault, trl_supervised

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    tokens = np.array(data.draw(st.lists(st.integers(3, 6), min_size=n, max_size=n)), dtype=np.int64)
    columns = {}
    for name in sorted(names):
        if name == "labels":  # mostly valid: the token, -100 or no label (-101), now and then another ID
            choice = data.draw(st.lists(st.sampled_from(["token", "ignored", "none", "other"]), min_size=n, max_size=n))
            values = [{"token": t, "ignored": -100, "none": -101, "other": 9}[c] for t, c in zip(tokens.tolist(), choice)]
        else:
            values = data.draw(st.lists(st.sampled_from([0, 1, 1, 1, 2]), min_size=n, max_size=n))
        columns[name] = np.array(values, dtype=np.int64)
    fault, supervised, applied = trl_reference(tokens, offsets, columns, completion_only_loss)
    assert trl_fault(tokens, offsets, columns) == fault
    if fault is None:
        found, names_applied = trl_supervised(tokens, columns, completion_only_loss=completion_only_loss)
        assert found.tolist() == supervised and names_applied == applied


def test_trl_rule_reads_no_label_at_a_first_token_and_checks_masks_it_does_not_apply():
    from seqpack.data.supervision import IGNORE_INDEX, trl_fault, trl_supervised

    tokens, offsets = np.array([5, 6, 7, 8, 9]), np.array([0, 3, 5])
    labels = np.array([12345, 6, IGNORE_INDEX, 777, 9])  # entries 0 and 3 start documents: no targets
    assert trl_fault(tokens, offsets, {"labels": labels}) is None
    supervised, applied = trl_supervised(tokens, {"labels": labels, "completion_mask": np.array([0, 0, 1, 1, 1])},
                                         completion_only_loss=False)
    assert supervised[[1, 2, 4]].tolist() == [True, False, True] and applied == ("labels",)
    assert trl_fault(tokens, offsets, {"completion_mask": np.array([0, 0, 1, 3, 1])}) == ("completion_mask", 3)
    assert trl_fault(tokens, offsets, {"labels": np.array([5, 6, 8, 8, 9])}) == ("labels", 2)
