"""SequenceExample: pairs formed inside the selected range, and every rule of ch04."""

import numpy as np
import pytest

import seqpack as sp


@pytest.fixture(scope="module")
def long_document():
    return sp.BatchDocument("long", [0, 100, 101, 102, 1], sp.Partition.VALIDATION)


def test_full_document_pair(binding, long_document):
    ex = sp.SequenceExample.from_document("L", long_document, binding)
    assert ex.inputs.tolist() == [0, 100, 101, 102]
    assert ex.targets.tolist() == [100, 101, 102, 1]
    assert len(ex) == 4
    assert ex.inputs.dtype == np.int32 and ex.targets.dtype == np.int32
    assert ex.partition is sp.Partition.VALIDATION
    assert ex.source_range == range(0, 5)
    assert ex.binding == binding and ex.document is long_document and ex.id == "L"


@pytest.mark.parametrize("source_range", [range(1, 4), (1, 4)])
def test_interior_range_adds_no_frame(binding, long_document, source_range):
    ex = sp.SequenceExample.from_range("mid", long_document, source_range, binding)
    assert ex.inputs.tolist() == [100, 101]
    assert ex.targets.tolist() == [101, 102]
    assert ex.source_range == range(1, 4)


def test_two_token_range_is_the_minimum(binding, long_document):
    assert len(sp.SequenceExample.from_range("two", long_document, (3, 5), binding)) == 1
    with pytest.raises(sp.InvalidInputError, match="has 1 tokens; a prediction needs at least 2"):
        sp.SequenceExample.from_range("one", long_document, (3, 4), binding)


@pytest.mark.parametrize(
    "source_range, message",
    [((0, 6), "must lie inside its document of 5 tokens"), ((3, 2), "must lie inside"),
     ((-1, 3), "negative bound"), (range(0, 5, 2), "step 1"), ([0, 3], "range or a \\(start, stop\\) pair"),
     ((0.0, 3), "integers")],
)
def test_range_errors(binding, long_document, source_range, message):
    with pytest.raises(sp.InvalidInputError, match=message):
        sp.SequenceExample.from_range("r", long_document, source_range, binding)
    sp.SequenceExample.from_range("r", long_document, (0, 5), binding)


def test_empty_id(binding, long_document):
    with pytest.raises(sp.InvalidInputError, match="non-empty"):
        sp.SequenceExample.from_document("", long_document, binding)
    sp.SequenceExample.from_document("x", long_document, binding)


def test_empty_content_document(binding):
    with pytest.raises(sp.InvalidInputError, match="document 'empty' has empty content"):
        sp.SequenceExample.from_document("e", sp.BatchDocument("empty", [0, 1]), binding)
    sp.SequenceExample.from_document("e", sp.BatchDocument("one", [0, 99, 1]), binding)


@pytest.mark.parametrize(
    "tokens, position",
    [([0, 99, 0, 1], 2), ([99, 100, 1], 0), ([0, 99, 100], 2), ([0, 266, 1], 1), ([0, -5, 1], 1)],
)
def test_whole_document_is_validated(binding, tokens, position):
    """Even a range that avoids the fault fails: the whole document is checked."""
    with pytest.raises(sp.TokenizerError) as caught:
        sp.SequenceExample.from_range("bad", sp.BatchDocument("bad", tokens), (0, 2), binding)
    assert caught.value.position == position


def test_a_stored_example_with_tokens_outside_the_vocabulary_is_refused_by_pad_and_pack(binding):
    # The bare constructor only stores: PAD_CELL and 99999 reached valid cells (review).
    example = sp.SequenceExample("e", sp.BatchDocument("d", [0, -1, 99999, 1]), range(0, 4), binding)
    message = r"example 'e' \(index 0\): token -1 at position 1 of its document lies outside the vocabulary"
    with pytest.raises(sp.InvalidInputError, match=message):
        sp.pad([example], partition=sp.Partition.TRAIN, binding=binding)
    with pytest.raises(sp.InvalidInputError, match=message):
        sp.pack([example], sp.PackConfig(capacity=4), partition=sp.Partition.TRAIN, binding=binding)


def test_decode_limits_apply(long_document):
    fixture = sp.BatchBinding.fixture()
    tight = sp.BatchBinding(sp.ByteTokenizer.fixture().identity, fixture.split_receipt_digest, sp.DecodeLimits(5, 3), sp.ByteTokenizer.fixture())
    sp.SequenceExample.from_document("ok", long_document, tight)
    tighter = sp.BatchBinding(sp.ByteTokenizer.fixture().identity, fixture.split_receipt_digest, sp.DecodeLimits(4, 3), sp.ByteTokenizer.fixture())
    with pytest.raises(sp.DecodeLimitError, match="document has 5 tokens; the limit is 4") as caught:
        sp.SequenceExample.from_document("no", long_document, tighter)
    assert caught.value.position == 4
