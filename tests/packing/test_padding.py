"""Right-padded batches: the ch04 fixture, every error beside its passing twin, and properties."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp

pytestmark = pytest.mark.kernel

TRAIN = sp.Partition.TRAIN


def example(name, tokens, binding, partition=TRAIN, source_range=None):
    document = sp.BatchDocument(name, tokens, partition)
    if source_range is None:
        return sp.SequenceExample.from_document(name, document, binding)
    return sp.SequenceExample.from_range(name, document, source_range, binding)


@pytest.fixture(scope="module")
def ch04(binding):
    examples = [example("short", [0, 99, 1], binding), example("long", [0, 100, 101, 102, 1], binding)]
    return sp.pad(examples, sp.PadConfig(rows_per_batch=2, max_cells=8), partition=TRAIN, binding=binding).batches[0]


def test_ch04_fixture_fields(ch04):
    assert ch04.shape == (2, 4)
    assert ch04.inputs.tolist() == [[0, 99, -1, -1], [0, 100, 101, 102]]
    assert ch04.targets.tolist() == [[99, 1, -1, -1], [100, 101, 102, 1]]
    assert ch04.positions.tolist() == [[0, 1, 0, 0], [0, 1, 2, 3]]
    assert ch04.segments.tolist() == [[0, 0, -1, -1], [1, 1, 1, 1]]
    for field in (ch04.token_valid, ch04.target_valid, ch04.loss_mask):
        assert field.dtype == np.bool_
        assert field.tolist() == [[True, True, False, False], [True, True, True, True]]
    # Three distinct arrays even where they agree.
    assert len({id(ch04.token_valid), id(ch04.target_valid), id(ch04.loss_mask)}) == 3
    assert ch04.valid_lengths.tolist() == [2, 4]
    assert ch04.segment_starts.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]
    assert ch04.cell_count == 8
    assert ch04.target_count == 6
    assert sp.PAD_CELL == -1 and sp.NO_SEGMENT == -1


def test_ch04_allowed_keys(ch04):
    assert ch04.allowed_keys(0) == [[0], [0, 1], [], []]
    assert ch04.allowed_keys(1) == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    assert ch04.allowed_key(0, 1, 0) and not ch04.allowed_key(0, 2, 2) and not ch04.allowed_key(0, 0, 1)
    for bad in [(2, 0, 0), (0, 4, 0), (0, 0, 4), (-1, 0, 0)]:
        with pytest.raises(sp.InvalidInputError, match="outside this batch"):
            ch04.allowed_key(*bad)
    with pytest.raises(sp.InvalidInputError, match="row 2"):
        ch04.allowed_keys(2)


def test_fields_are_read_only(ch04):
    with pytest.raises(ValueError, match="read-only"):
        ch04.inputs[0, 0] = 5
    ch04.verify()


def test_occurrences(ch04):
    assert ch04.occurrences == [
        sp.layout.Occurrence(0, 0, range(0, 2), 0),
        sp.layout.Occurrence(1, 1, range(0, 4), 1),
    ]
    assert [e.id for e in ch04.examples] == ["short", "long"]


# --- errors, each beside the exact-limit case that passes -------------------------------


def test_empty_example_list(binding):
    with pytest.raises(sp.InvalidInputError, match="at least one example"):
        sp.pad([], sp.PadConfig(rows_per_batch=2, max_cells=8), partition=TRAIN, binding=binding).batches[0]


def test_rows_over_rows_per_batch(binding):
    """More examples than rows_per_batch start the next batch; the last keeps its row count."""
    examples = [example(f"e{i}", [0, 99, 1], binding) for i in range(3)]
    assert len(sp.pad(examples[:2], sp.PadConfig(rows_per_batch=2, max_cells=100), partition=TRAIN, binding=binding)) == 1
    epoch = sp.pad(examples, sp.PadConfig(rows_per_batch=2, max_cells=100), partition=TRAIN, binding=binding)
    assert [batch.shape for batch in epoch] == [(2, 2), (1, 2)]


def test_cells_over_max_cells(binding):
    examples = [example("short", [0, 99, 1], binding), example("long", [0, 100, 101, 102, 1], binding)]
    assert sp.pad(examples, sp.PadConfig(rows_per_batch=2, max_cells=8), partition=TRAIN, binding=binding).batches[0].cell_count == 8
    with pytest.raises(sp.CapacityError, match="8 cells; max_cells is 7") as caught:
        sp.pad(examples, sp.PadConfig(rows_per_batch=2, max_cells=7), partition=TRAIN, binding=binding).batches[0]
    assert (caught.value.cells, caught.value.maximum) == (8, 7)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, sp.SeqpackError)


def test_example_wider_than_max_width(binding):
    examples = [example("short", [0, 99, 1], binding), example("long", [0, 100, 101, 102, 1], binding)]
    sp.pad(examples, sp.PadConfig(rows_per_batch=2, max_cells=8, max_width=4), partition=TRAIN, binding=binding).batches[0]
    with pytest.raises(sp.CapacityError, match="example 'long' \\(index 1\\) has 4 predictions; max_width is 3"):
        sp.pad(examples, sp.PadConfig(rows_per_batch=2, max_cells=8, max_width=3), partition=TRAIN, binding=binding).batches[0]


def test_partition_mismatch(binding):
    train = example("a", [0, 99, 1], binding)
    validation = example("v", [0, 99, 1], binding, partition=sp.Partition.VALIDATION)
    sp.pad([validation], sp.PadConfig(rows_per_batch=2, max_cells=8), partition=sp.Partition.VALIDATION, binding=binding).batches[0]
    with pytest.raises(sp.BindingError, match="example 'v' \\(index 1\\) belongs to partition 'validation'"):
        sp.pad([train, validation], sp.PadConfig(rows_per_batch=2, max_cells=8), partition=TRAIN, binding=binding).batches[0]


def test_binding_mismatch(binding):
    other = sp.BatchBinding(sp.ByteTokenizer().identity, binding.split_receipt_digest, binding.limits, sp.ByteTokenizer())
    mine = example("a", [0, 99, 1], binding)
    theirs = example("b", [0, 99, 1], other)
    equal = sp.BatchBinding(sp.ByteTokenizer.fixture().identity, binding.split_receipt_digest, binding.limits, sp.ByteTokenizer.fixture())
    sp.pad([mine], sp.PadConfig(rows_per_batch=1, max_cells=8), partition=TRAIN, binding=equal).batches[0]  # equal by value
    with pytest.raises(sp.BindingError, match="example 'b' \\(index 1\\) was built under a different binding"):
        sp.pad([mine, theirs], sp.PadConfig(rows_per_batch=2, max_cells=8), partition=TRAIN, binding=binding).batches[0]


def test_not_examples(binding):
    with pytest.raises(sp.InvalidInputError, match="example 0 is a str"):
        sp.pad(["x"], sp.PadConfig(rows_per_batch=2, max_cells=8), partition=TRAIN, binding=binding).batches[0]
    with pytest.raises(sp.InvalidInputError, match="list or tuple"):
        sp.pad("xy", sp.PadConfig(rows_per_batch=2, max_cells=8), partition=TRAIN, binding=binding).batches[0]


@pytest.mark.parametrize(
    "kwargs, name",
    [({"rows_per_batch": 0, "max_cells": 8}, "rows_per_batch"),
     ({"rows_per_batch": 2, "max_cells": -1}, "max_cells"),
     ({"rows_per_batch": 2, "max_cells": 8, "max_width": 0}, "max_width"),
     ({"rows_per_batch": 2.0, "max_cells": 8}, "rows_per_batch"),
     ({"rows_per_batch": True, "max_cells": 8}, "rows_per_batch"),
     ({"rows_per_batch": 2, "max_memory_bytes": 0}, "max_memory_bytes")],
)
def test_config_validation(kwargs, name):
    with pytest.raises(sp.InvalidInputError, match=name):
        sp.PadConfig(**kwargs)
    sp.PadConfig(rows_per_batch=1, max_cells=1, max_width=1)


def test_epoch_cuts_in_supplied_order(binding):
    lengths = [2, 5, 1, 3, 4]
    examples = [example(f"e{i}", [0] + [99] * n + [1], binding, source_range=(0, n + 1))
                for i, n in enumerate(lengths)]
    epoch = sp.pad(examples, sp.PadConfig(rows_per_batch=2, max_cells=10), partition=TRAIN, binding=binding)
    assert [b.shape for b in epoch.batches] == [(2, 5), (2, 3), (1, 4)]
    assert [o.ordinal for b in epoch.batches for o in b.occurrences] == [0, 1, 2, 3, 4]
    assert epoch.batches[1].segments[:, 0].tolist() == [2, 3]  # segments are example ordinals
    assert epoch.target_count == sum(lengths)
    for batch in epoch.batches:
        batch.verify()
    with pytest.raises(sp.CapacityError, match="batch 0 \\(examples 0..1\\) has 2 rows x 5 columns = 10 cells; max_cells is 9"):
        sp.pad(examples, sp.PadConfig(rows_per_batch=2, max_cells=9), partition=TRAIN, binding=binding)


# --- properties against a plain-Python reference ----------------------------------------


def reference_fields(sources):
    """Cell-by-cell reference of a padded batch of the given source token lists."""
    width = max(len(s) - 1 for s in sources)
    fields = {name: [[None] * width for _ in sources] for name in
              ("inputs", "targets", "positions", "segments", "valid", "segment_starts")}
    for row, source in enumerate(sources):
        for column in range(width):
            inside = column < len(source) - 1
            fields["inputs"][row][column] = source[column] if inside else -1
            fields["targets"][row][column] = source[column + 1] if inside else -1
            fields["positions"][row][column] = column if inside else 0
            fields["segments"][row][column] = row if inside else -1
            fields["valid"][row][column] = inside
            fields["segment_starts"][row][column] = 0
    return fields


documents = st.lists(st.integers(2, 265), min_size=1, max_size=12).map(lambda body: [0, *body, 1])


@st.composite
def example_sets(draw):
    docs = draw(st.lists(documents, min_size=1, max_size=6))
    chosen = []
    for doc in docs:
        start = draw(st.integers(0, len(doc) - 2))
        stop = draw(st.integers(start + 2, len(doc)))
        chosen.append((doc, (start, stop)))
    return chosen


@pytest.mark.slow
@settings(derandomize=True, max_examples=150, deadline=None)
@given(example_sets(), st.sampled_from(["int32", "int64", "uint16", "list"]))
def test_kernel_matches_reference(binding, chosen, dtype):
    examples = []
    for i, (doc, (start, stop)) in enumerate(chosen):
        tokens = doc if dtype == "list" else np.asarray(doc, dtype=dtype)
        examples.append(example(f"x{i}", tokens, binding, source_range=(start, stop)))
    batch = sp.pad(examples, sp.PadConfig(rows_per_batch=len(examples), max_cells=10**6), partition=TRAIN, binding=binding).batches[0]
    sources = [doc[start:stop] for doc, (start, stop) in chosen]
    ref = reference_fields(sources)
    for name in ("inputs", "targets", "positions", "segments", "segment_starts"):
        assert getattr(batch, name).tolist() == ref[name], name
    for name in ("token_valid", "target_valid", "loss_mask"):
        assert getattr(batch, name).tolist() == ref["valid"], name
    assert batch.valid_lengths.tolist() == [len(s) - 1 for s in sources]
    assert batch.target_count == sum(len(s) - 1 for s in sources)
    # Positions restart at zero in every row; the permission relation equals brute force.
    assert (batch.positions[:, 0] == 0).all()
    brute = np.zeros((len(sources), batch.shape[1], batch.shape[1]), dtype=bool)
    for r in range(batch.shape[0]):
        for q in range(batch.shape[1]):
            for k in range(batch.shape[1]):
                brute[r, q, k] = bool(ref["valid"][r][q] and ref["valid"][r][k]
                                      and ref["segments"][r][q] == ref["segments"][r][k]
                                      and ref["positions"][r][k] <= ref["positions"][r][q])
                assert batch.allowed_key(r, q, k) == brute[r, q, k]
            assert batch.allowed_keys(r)[q] == [k for k in range(batch.shape[1]) if brute[r, q, k]]
    np.testing.assert_array_equal(batch.dense_mask(), brute)
    batch.verify()


def test_read_only_and_non_contiguous_token_arrays(binding):
    base = np.array([0, 0, 5, 99, 9, 100, 7, 1, 3], dtype=np.int64)
    strided = base[1::2]  # [0, 99, 100, 1], non-contiguous
    strided.flags.writeable = False
    ex = example("s", strided, binding)
    batch = sp.pad([ex], sp.PadConfig(rows_per_batch=1, max_cells=3), partition=TRAIN, binding=binding).batches[0]
    assert batch.inputs.tolist() == [[0, 99, 100]]
    assert batch.targets.tolist() == [[99, 100, 1]]
    fortran = np.asfortranarray(np.array([[0, 101, 1]], dtype=np.int32))[0]
    assert example("f", fortran, binding).targets.tolist() == [101, 1]


# --- verify() catches each kind of corruption -------------------------------------------


@pytest.mark.parametrize(
    "field, index, value, message",
    [
        ("positions", (1, 2), 3, "row 1, column 2: local position 3 does not step by one"),
        ("positions", (1, 0), 1, "row 1, column 0: local position 1"),
        ("segments", (1, 3), -1, "row 1, column 3: a valid cell has no segment"),
        ("segments", (1, 3), 7, "row 1, column 3: local position 3 does not step by one from 0 inside segment 7"),
        ("token_valid", (0, 2), True, "row 0, column 2: \\(input exists"),
        ("target_valid", (1, 1), False, "row 1, column 1: \\(input exists, target exists, supervised\\) = \\(True, False, True\\)"),
        ("inputs", (0, 3), 5, "row 0, column 3: padding must hold input/target PAD_CELL"),
        ("positions", (0, 3), 2, "row 0, column 3: padding must hold"),
        ("inputs", (1, 1), -1, "row 1, column 1: a valid cell holds PAD_CELL"),
        ("segment_starts", (1, 2), 1, "row 1, column 2: segment start 1"),
        ("targets", (1, 2), 103, "occurrence 1 \\(example 'long', row 1\\), column 2: input or target differs"),
        ("valid_lengths", 0, 5, "row 0: valid length 5 is outside \\[0, 4\\]"),
    ],
)
def test_verify_names_the_violation(ch04, corrupted, field, index, value, message):
    with pytest.raises(sp.VerificationError, match=message):
        corrupted(ch04, field, index, value).verify()


def test_verify_names_row_coverage(ch04, corrupted):
    clone = corrupted(ch04, "valid_lengths", 1, 4)
    clone._records = ch04._records[1:]  # row 0's occurrence record is lost
    with pytest.raises(sp.VerificationError, match="row 0: its occurrences do not cover exactly its valid prefix of 2 cells") as caught:
        clone.verify()
    assert caught.value.row == 0


def test_verify_names_record_length(ch04, corrupted):
    clone = corrupted(ch04, "valid_lengths", 1, 4)
    records = ch04._records.copy()
    records["stop"][0] = 1
    clone._records = records
    with pytest.raises(sp.VerificationError, match="occurrence 0: columns \\[0, 1\\) differ from its example's 2 predictions"):
        clone.verify()


@pytest.mark.parametrize("texts, rows", [(["ab"], 1), (["abc", "hello", "x" * 20], 1), (["ab"] * 10, 2)])
def test_a_small_padded_epoch_holds_no_more_than_its_memory_peak(binding, texts, rows):
    # pad counted no fixed allowance: one example held 6597 bytes against a memory_peak of 3281 (review).
    import tracemalloc

    table = sp.ExampleTable.from_texts(texts, binding, capacity=64)
    config = sp.PadConfig(rows_per_batch=rows)
    sp.pad(table, config, partition=TRAIN, binding=binding)  # warm-up
    tracemalloc.start()
    epoch = sp.pad(table, config, partition=TRAIN, binding=binding)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak <= epoch.memory_peak
