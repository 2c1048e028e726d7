"""Columnar examples: ExampleTable validation (each error beside its passing twin) and table == list packing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack.packing.placement import POLICIES

from helpers import BIG, assert_same_batches, both_paths, corpora, example_list, flat, table_of

pytestmark = pytest.mark.kernel

TRAIN = sp.Partition.TRAIN
DIGEST = sp.SplitReceipt.fixture().digest
MERGED = 258  # the fixture's first merge: two bytes ("e ")


# --- table == list ---------------------------------------------------------------------


@pytest.mark.slow
@settings(derandomize=True, max_examples=100, deadline=None)
@given(corpora(), st.integers(0, 8), st.integers(1, 4))
def test_table_packs_like_the_list(binding, case, extra, max_rows):
    documents, options = case
    table, examples = both_paths(documents, options, binding)
    assert table.lengths.tolist() == [len(e) for e in examples]
    capacity = int(table.lengths.max()) + extra
    config = sp.PackConfig(capacity, max_rows, max_rows * capacity, BIG)
    for policy in POLICIES:
        columnar = sp.pack(table, config, partition=TRAIN, binding=binding, policy=policy)
        listed = sp.pack(examples, config, partition=TRAIN, binding=binding, policy=policy)
        assert (columnar.row_count, columnar.occurrence_count) == (listed.row_count, listed.occurrence_count)
        assert columnar.policy == listed.policy == policy
        assert_same_batches(columnar.batches, listed.batches)
        assert columnar.target_count == int(table.lengths.sum())


def test_table_examples_match_the_list(binding):
    documents = [[0, 5, 6, 7, 1], [0, 8, 9, 1], [0, 10, 11, 12, 13, 1]]
    options = {"ranges": [[1, 4], [0, 3], [2, 6]], "documents": [0, 1, 2], "ids": ["p", "q", "r"]}
    table, examples = both_paths(documents, options, binding)
    assert len(table) == 3 and table.document_count == 3
    for ordinal, expected in enumerate(examples):
        got = table.example(ordinal)
        assert got.id == expected.id == table.example_id(ordinal)
        assert got.source_tokens.tolist() == expected.source_tokens.tolist()
        assert len(got) == len(expected) == table.lengths[ordinal]


def test_table_copies_its_inputs(binding):
    tokens, offsets = flat([[0, 5, 6, 1], [0, 7, 1]])
    table = sp.ExampleTable.from_arrays(tokens, offsets, binding)
    tokens[1] = 1  # a control ID inside the content, after the table was built
    assert table.example(0).source_tokens.tolist() == [0, 5, 6, 1]
    assert table.lengths.tolist() == [3, 2] and not table.lengths.flags.writeable


def test_chunks_keep_ordinals_and_names(binding):
    documents = [[0, 5 + i, 1] for i in range(5)]
    for ids in (None, [f"x{i}" for i in range(5)]):
        table = table_of(documents, binding, ids=ids)
        part = table.chunk(2, 4)
        # A chunk is packed as its own input (ordinals from 0) but keeps its examples' names.
        assert len(part) == 2 and part.first_ordinal == 0
        assert part.lengths.tolist() == [2, 2]
        for ordinal in (2, 3):
            assert part.example_id(ordinal - 2) == table.example_id(ordinal)
            assert part.example(ordinal - 2).source_tokens.tolist() == documents[ordinal]


def test_a_chunk_packs_like_its_examples(binding):
    """Occurrence ``i`` of the supplied input owns segment ``i``, whatever the input's origin."""
    documents = [[0, *range(5, 5 + n), 1] for n in (3, 1, 4, 2, 2)]
    table = table_of(documents, binding)
    config = sp.PackConfig(6, 2, 12, BIG)
    assert_same_batches(sp.pack(table.chunk(1, 5), config, partition=TRAIN, binding=binding).batches,
                        sp.pack(example_list(documents[1:], binding), config, partition=TRAIN, binding=binding).batches)


def test_an_empty_chunk_is_rejected_clearly(binding):
    table = table_of([[0, 5, 1], [0, 6, 1]], binding)
    with pytest.raises(sp.InvalidInputError, match="at least one example"):
        sp.pack(table.chunk(1, 1), sp.PackConfig(4, 1, 4, BIG), partition=TRAIN, binding=binding)


def test_table_too_long_example_is_named(binding):
    table = table_of([[0, 5, 1], [0, 5, 6, 7, 8, 1], [0, 5, 6, 1]], binding, ids=["a", "b", "c"])
    config = sp.PackConfig(4, 1, 4, BIG)
    sp.pack(table.chunk(0, 1), config, partition=TRAIN, binding=binding)
    with pytest.raises(sp.CapacityError, match="example 'b' \\(index 1\\) has 5 predictions; capacity is 4"):
        sp.pack(table, config, partition=TRAIN, binding=binding)
    with pytest.raises(sp.CapacityError, match="example 'b' .*has 5 predictions"):
        sp.pack(table.chunk(1, 3), config, partition=TRAIN, binding=binding)


def test_table_binding_and_partition_must_match(binding):
    table = table_of([[0, 5, 1]], binding)
    config = sp.PackConfig(4, 1, 4, BIG)
    sp.pack(table, config, partition=TRAIN, binding=sp.BatchBinding.fixture())  # equal by value
    other = sp.BatchBinding(sp.ByteTokenizer().identity, DIGEST, sp.DecodeLimits(100, 100), sp.ByteTokenizer())
    with pytest.raises(sp.BindingError, match="different binding"):
        sp.pack(table, config, partition=TRAIN, binding=other)
    with pytest.raises(sp.BindingError, match="partition 'train', not 'test'"):
        sp.pack(table, config, partition=sp.Partition.TEST, binding=binding)
    test_table = table_of([[0, 5, 1]], binding, partition=sp.Partition.TEST)
    assert sp.pack(test_table, config, partition=sp.Partition.TEST, binding=binding).row_count == 1


# --- document faults: each names its example, beside the passing twin --------------------

GOOD = [0, 5, 6, 7, 1]


@pytest.mark.parametrize(
    "bad, twin, error, message, position",
    [
        ([5, 6, 7, 1], [0, 6, 7, 1], sp.TokenizerError, "document must start with BOS 0; position 0 holds 5", 0),
        ([0, 5, 6, 7], [0, 5, 6, 1], sp.TokenizerError, "document must end with EOS 1; position 3 holds 7", 3),
        ([0, 5, 1, 6, 1], [0, 5, 2, 6, 1], sp.TokenizerError, "control token 1 \\(EOS\\) at position 2", 2),
        ([0, 5, 0, 1], [0, 5, 2, 1], sp.TokenizerError, "control token 0 \\(BOS\\) at position 2", 2),
        ([0, 5, 266, 1], [0, 5, 265, 1], sp.TokenizerError, "token 266 at position 2 is out of vocabulary", 2),
        ([0, -1, 5, 1], [0, 2, 5, 1], sp.TokenizerError, "token -1 at position 1 is negative", 1),
        ([0], [0, 5, 1], sp.TokenizerError, "document \\[0\\] has no EOS", 0),
        ([0, 1], [0, 2, 1], sp.InvalidInputError, "has empty content and supplies no example", None),
    ],
)
@pytest.mark.parametrize("named", [False, True])
def test_document_fault_names_the_example(binding, bad, twin, error, message, position, named):
    ids = ["a", "b", "c", "d"] if named else None
    name = "'c'" if named else "'#2'"
    table_of([GOOD, GOOD, twin, GOOD], binding, ids=ids)
    with pytest.raises(error, match=f"example {name} \\(index 2\\), document 2:? {message}") as caught:
        table_of([GOOD, GOOD, bad, GOOD], binding, ids=ids)
    if position is not None:
        assert isinstance(caught.value, sp.TokenizerError) and caught.value.position == position


def test_document_fault_names_the_example_using_it(binding):
    """With ranges mapped to documents, the error names the first example over the bad document."""
    ranges = [[0, 3], [1, 4], [0, 2], [0, 4]]
    options = {"ranges": ranges, "documents": [0, 0, 2, 1], "ids": ["a", "b", "c", "d"]}
    table_of([GOOD, GOOD, GOOD], binding, **options)
    with pytest.raises(sp.TokenizerError, match="example 'd' \\(index 3\\), document 1: .*position 2") as caught:
        table_of([GOOD, [0, 5, 266, 7, 1], GOOD], binding, **options)
    assert caught.value.position == 2


def test_decode_limits_name_the_example(binding):
    limited = sp.BatchBinding(sp.ByteTokenizer.fixture().identity, DIGEST, sp.DecodeLimits(5, 4), sp.ByteTokenizer.fixture())
    ids = ["a", "b", "c"]
    # Token limit counts BOS and EOS: 5 tokens pass, 6 fail.
    table_of([GOOD, [0, 5, 6, 7, 1], GOOD], limited, ids=ids)
    with pytest.raises(sp.DecodeLimitError, match="example 'b' \\(index 1\\), document 1: document has 6 tokens; "
                                                  "the limit is 5") as caught:
        table_of([GOOD, [0, 5, 6, 7, 8, 1], GOOD], limited, ids=ids)
    assert caught.value.position == 5
    # Byte limit counts decoded content: a merged ID decodes to two bytes.
    table_of([GOOD, [0, MERGED, MERGED, 1], GOOD], limited, ids=ids)
    with pytest.raises(sp.DecodeLimitError, match="example 'b' \\(index 1\\), document 1: document decodes to 5 bytes; "
                                                  "the limit is 4") as caught:
        table_of([GOOD, [0, MERGED, MERGED, 5, 1], GOOD], limited, ids=ids)
    assert caught.value.position == 3


def test_external_binding(binding):
    """An external tokenizer: framing, control IDs, ID range and the token limit; never bytes."""
    identity = sp.TokenizerIdentity.external(1000, 7, 7, "ab" * 32)  # BOS == EOS, GPT-2 style
    external = sp.BatchBinding(identity, DIGEST, sp.DecodeLimits(6, 1))
    table = table_of([[7, 999, 998, 997, 7], [7, 0, 1, 7]], external)  # content far over 1 byte: no byte limit
    assert table.lengths.tolist() == [4, 3]
    batch = sp.pack(table, sp.PackConfig(8, 1, 8, BIG), partition=TRAIN, binding=external).batches[0]
    batch.verify()
    with pytest.raises(sp.TokenizerError, match="example '#1' \\(index 1\\), document 1: token 1000 at position 1 "
                                                "is out of vocabulary \\(vocabulary size 1000\\)") as caught:
        table_of([[7, 999, 7], [7, 1000, 7]], external)
    assert caught.value.position == 1
    with pytest.raises(sp.TokenizerError, match="example '#0' .*control token 7 \\(BOS\\) at position 2") as caught:
        table_of([[7, 5, 7, 5, 7]], external)
    assert caught.value.position == 2
    table_of([[7, 1, 2, 3, 4, 7]], external)
    with pytest.raises(sp.DecodeLimitError, match="example '#0' .*document has 7 tokens; the limit is 6"):
        table_of([[7, 1, 2, 3, 4, 5, 7]], external)
    with pytest.raises(sp.BindingError, match="different binding"):
        sp.pack(table, sp.PackConfig(8, 1, 8, BIG), partition=TRAIN, binding=binding)


# --- ranges, offsets, ids, documents: each beside its passing twin ----------------------

DOCS = [[0, 5, 6, 7, 1], [0, 8, 9, 1]]  # 5 and 4 tokens


@pytest.mark.parametrize(
    "ranges, twin, message",
    [
        ([[0, 5], [-1, 3]], [[0, 5], [0, 3]],
         "example 'y' \\(index 1\\): source range \\[-1, 3\\) has a negative bound"),
        ([[0, 5], [0, -2]], [[0, 5], [0, 2]],
         "example 'y' \\(index 1\\): source range \\[0, -2\\) has a negative bound"),
        ([[0, 6], [0, 4]], [[0, 5], [0, 4]],
         "example 'x' \\(index 0\\): source range \\[0, 6\\) must lie inside its document of 5 tokens"),
        ([[0, 5], [3, 2]], [[0, 5], [2, 4]],
         "example 'y' \\(index 1\\): source range \\[3, 2\\) must lie inside its document of 4 tokens"),
        ([[0, 5], [3, 4]], [[0, 5], [2, 4]],
         "example 'y' \\(index 1\\): source range \\[3, 4\\) has 1 tokens; a prediction needs at least 2"),
        ([[4, 4], [0, 4]], [[3, 5], [0, 4]], "example 'x' \\(index 0\\): source range \\[4, 4\\) has 0 tokens"),
    ],
)
def test_range_bounds(binding, ranges, twin, message):
    table_of(DOCS, binding, ranges=twin, ids=["x", "y"])
    with pytest.raises(sp.InvalidInputError, match=message):
        table_of(DOCS, binding, ranges=ranges, ids=["x", "y"])


def test_range_bounds_name_default_ids(binding):
    with pytest.raises(sp.InvalidInputError, match="example '#2' \\(index 2\\): source range \\[0, 5\\) must lie "
                                                   "inside its document of 4 tokens"):
        table_of(DOCS, binding, ranges=[[0, 5], [0, 4], [0, 5]], documents=[0, 1, 1])


def test_documents_index(binding):
    table_of(DOCS, binding, ranges=[[0, 4], [0, 3]], documents=[1, 0])
    for index in (2, -1):
        with pytest.raises(sp.InvalidInputError,
                           match=f"example '#1' \\(index 1\\): document {index} is outside \\[0, 2\\)"):
            table_of(DOCS, binding, ranges=[[0, 4], [0, 3]], documents=[1, index])
    with pytest.raises(sp.InvalidInputError, match="documents has 1 entries for 2 ranges"):
        table_of(DOCS, binding, ranges=[[0, 4], [0, 3]], documents=[1])
    with pytest.raises(sp.InvalidInputError, match="documents selects ranges; give ranges too"):
        table_of(DOCS, binding, documents=[0, 1])
    with pytest.raises(sp.InvalidInputError, match="3 ranges for 2 documents: give documents= to map them"):
        table_of(DOCS, binding, ranges=[[0, 4], [0, 3], [0, 2]])
    with pytest.raises(sp.InvalidInputError, match="ranges must have shape \\[n, 2\\], got \\(2, 3\\)"):
        table_of(DOCS, binding, ranges=[[0, 4, 5], [0, 3, 4]])


@pytest.mark.parametrize(
    "offsets, message",
    [
        ([0], "offsets needs at least two entries"),
        ([1, 5, 9], "offsets must start at 0 and end at the token count 9; got 1 and 9"),
        ([0, 5, 8], "offsets must start at 0 and end at the token count 9; got 0 and 8"),
        ([0, 5, 4, 9], "offsets decrease at document 1"),
        ([[0, 5, 9]], "offsets must be 1-dimensional"),
        ([0.0, 5.0, 9.0], "offsets must hold integers"),
    ],
)
def test_bad_offsets(binding, offsets, message):
    tokens, good = flat(DOCS)
    assert good.tolist() == [0, 5, 9]
    sp.ExampleTable.from_arrays(tokens, good, binding)
    with pytest.raises(sp.InvalidInputError, match=message):
        sp.ExampleTable.from_arrays(tokens, offsets, binding)


def test_zero_length_document_names_its_example(binding):
    tokens, _ = flat(DOCS)
    with pytest.raises(sp.TokenizerError, match="example '#1' \\(index 1\\), document 1: an empty token sequence"):
        sp.ExampleTable.from_arrays(tokens, [0, 5, 5, 9], binding)


def test_token_array_checks(binding):
    tokens, offsets = flat(DOCS)
    sp.ExampleTable.from_arrays(tokens.astype(np.uint16), offsets, binding)
    with pytest.raises(sp.InvalidInputError, match="token_ids holds 2147483648, outside the int32 range"):
        sp.ExampleTable.from_arrays(np.where(tokens == 5, 2**31, tokens), offsets, binding)
    with pytest.raises(sp.InvalidInputError, match="token_ids must hold integers"):
        sp.ExampleTable.from_arrays(tokens.astype(float), offsets, binding)
    with pytest.raises(sp.InvalidInputError, match="token_ids must be 1-dimensional"):
        sp.ExampleTable.from_arrays(tokens.reshape(1, -1), offsets, binding)
    with pytest.raises(sp.InvalidInputError, match="binding must be a BatchBinding"):
        sp.ExampleTable.from_arrays(tokens, offsets, None)
    with pytest.raises(sp.InvalidInputError,
                       match=r"^partition must be a Partition, not 'Validation': pass seqpack.Partition.VALIDATION$"):
        sp.ExampleTable.from_arrays(tokens, offsets, binding, partition="Validation")
    with pytest.raises(sp.InvalidInputError, match=r"^partition must be a Partition, not 'dev'$"):
        sp.ExampleTable.from_arrays(tokens, offsets, binding, partition="dev")


@pytest.mark.parametrize("make", [
    lambda binding: sp.BatchDocument("doc", [0, 5, 1], partition="test"),
    lambda binding: sp.pack([[0, 5, 1]], sp.PackConfig(capacity=8, rows_per_batch=1), partition="test",
                            binding=binding),
])
def test_partition_name_hint(binding, make):
    with pytest.raises(sp.InvalidInputError, match=r"not 'test': pass seqpack.Partition.TEST$"):
        make(binding)


def test_ids(binding):
    assert table_of(DOCS, binding, ids=["x", "y"]).example_id(1) == "y"
    assert table_of(DOCS, binding, ranges=[[0, 2]], documents=[1], ids=["z"]).example_id(0) == "z"
    with pytest.raises(sp.InvalidInputError, match="3 ids for 2 examples"):
        table_of(DOCS, binding, ids=["x", "y", "z"])
    with pytest.raises(sp.InvalidInputError, match="1 ids for 2 examples"):
        table_of(DOCS, binding, ids=["x"])
    with pytest.raises(sp.InvalidInputError, match="example id at index 1 must be a non-empty string, not ''"):
        table_of(DOCS, binding, ids=["x", ""])
    with pytest.raises(sp.InvalidInputError, match="example id at index 0 must be a non-empty string, not 3"):
        table_of(DOCS, binding, ids=[3, "y"])


def test_at_least_one_example(binding):
    table_of(DOCS, binding, ranges=[[0, 2]], documents=[0])
    with pytest.raises(sp.InvalidInputError, match="at least one example"):
        table_of(DOCS, binding, ranges=np.empty((0, 2), dtype=np.int64), documents=[])


def test_the_table_owns_its_tokens(binding):
    """Writing into the caller's arrays after from_arrays changes nothing in the table."""
    tokens = np.array([0, 99, 100, 1, 0, 101, 1], dtype=np.int32)
    offsets = np.array([0, 4, 7])
    table = sp.ExampleTable.from_arrays(tokens, offsets, binding)
    tokens[1] = 5
    offsets[1] = 3
    assert table.example(0).source_tokens.tolist() == [0, 99, 100, 1]
    assert table.lengths.tolist() == [3, 2]
    packed = sp.pack(table, sp.PackConfig(6, 1, 6, BIG), partition=TRAIN, binding=binding).batches[0]
    assert packed.inputs.tolist() == [[0, 99, 100, 0, 101, -1]]


# Regression: a single string given as ids was read as one id per character.
def test_a_single_string_is_not_a_list_of_ids(binding):
    tokens, offsets = [0, 5, 1, 0, 6, 1], [0, 3, 6]
    assert sp.ExampleTable.from_arrays(tokens, offsets, binding, ids=["a", "b"]).example_id(1) == "b"
    with pytest.raises(sp.InvalidInputError, match="ids must be a sequence of names, not a single str"):
        sp.ExampleTable.from_arrays(tokens, offsets, binding, ids="ab")
    with pytest.raises(sp.InvalidInputError, match="not a single str"):
        sp.ExampleTable.from_texts(["x", "y"], binding, capacity=4, ids="ab")


def test_cut_texts_name_their_windows_by_the_text_they_come_from(binding):
    # Without ids the windows were numbered as examples: '#1' was text 0's second window
    # and text 1 became '#3'; a text left whole was named with its range (review).
    texts = ["a" * 20, "b"]   # 22 tokens in 3 windows at capacity 8, then 3 tokens
    for ids, names in [(None, ["#0", "#1"]), (["long", "short"], ["long", "short"])]:
        table = sp.ExampleTable.from_texts(texts, binding, capacity=8, long="cut", ids=ids)
        long, short = names
        assert [table.example_id(i) for i in range(len(table))] == [
            f"{long}[0:9]", f"{long}[8:17]", f"{long}[16:22]", short]
        assert table.example(3).document.token_ids.tolist() == [0, 100, 1]


def test_from_texts_names_the_text_the_tokenizer_refuses(binding):
    # The tokenizer's error named no text (review).
    with pytest.raises(sp.TokenizerError, match=r"^text 'c' \(index 2\): text holds '\\ud800' \(a lone surrogate\)"):
        sp.ExampleTable.from_texts(["a", "b", "x\ud800"], binding, capacity=8, ids=["a", "b", "c"])
    with pytest.raises(sp.InvalidInputError, match=r"^text '#1' \(index 1\): encode_document takes str or bytes"):
        sp.ExampleTable.from_texts(["a", 5], binding, capacity=8)


def test_from_texts_refuses_a_text_past_the_byte_limit_before_encoding_it():
    # A 20 MB text was encoded whole (260 MB held) before the limit refused it (review).
    import tracemalloc

    binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="s", limits=sp.DecodeLimits(2000, 1000))
    texts = ["fine", "x" * 2_000_000, "é" * 400]
    tracemalloc.start()
    try:
        with pytest.raises(sp.DecodeLimitError, match=r"^text '#1' \(index 1\) holds more than 1000 bytes, the "
                                                      r"binding's decode limit: refused before it is encoded$"):
            sp.ExampleTable.from_texts(texts, binding, capacity=4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    with pytest.raises(sp.DecodeLimitError, match=r"^text '#0' \(index 0\) holds more than 1000 bytes"):
        sp.ExampleTable.from_texts(["é" * 501], binding, capacity=4096)  # 1002 bytes in 501 characters
    assert len(sp.ExampleTable.from_texts(["é" * 500, "x" * 1000], binding, capacity=4096)) == 2  # exactly the limit
    # bytes-like texts too: a bytearray or memoryview was encoded whole first (review)
    for kind in (bytes, bytearray, lambda data: memoryview(bytearray(data))):
        with pytest.raises(sp.DecodeLimitError, match=r"^text '#1' \(index 1\) holds more than 1000 bytes.*refused"):
            sp.ExampleTable.from_texts([kind(b"ok"), kind(b"x" * 1001)], binding, capacity=4096)
        assert len(sp.ExampleTable.from_texts([kind(b"x" * 1000)], binding, capacity=4096)) == 1
