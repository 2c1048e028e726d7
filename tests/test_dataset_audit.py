"""Audit of the packed dataset on disk and the corpus helpers: no silent wrong answer."""

import pickle
import shutil

import numpy as np
import pytest

import seqpack as sp
from seqpack import io
from seqpack.data.corpus import stdlib_table

TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="tests")


def packed(root, texts, capacity=16, rows_per_batch=2, policy="next-fit"):
    docs = root / "docs"
    docs.mkdir(parents=True)
    for index, text in enumerate(texts):
        (docs / f"doc{index:04d}.txt").write_bytes(text)
    io.pack_corpus([io.TextFiles([docs])], root / "packed", binding=BINDING, tokenizer=TOKENIZER,
                   config=sp.PackConfig(capacity, rows_per_batch), policy=policy, long="cut")
    return root / "packed"


def swapped(tmp_path, name):
    """Dataset A (b"hi", b"world") with one file of dataset B (the same texts reversed):
    every file keeps its size, so only the contents disagree."""
    a = packed(tmp_path / "a", [b"hi", b"world"])
    b = packed(tmp_path / "b", [b"world", b"hi"])
    shutil.copy(b / "part-00000" / name, a / "part-00000" / name)
    return a


def test_numpy_negative_batch_index_counts_from_the_end_without_overflow(tmp_path):
    dataset = io.open_dataset(packed(tmp_path, [b"x" * 14] * 130, rows_per_batch=1))
    assert len(dataset) == 130
    expected = dataset.batch(129).occurrences
    for index in (np.int8(-1), np.int16(-1), -1):
        assert dataset[index].occurrences == expected  # np.int8(-1) + 130 overflowed before
    assert dataset[np.int8(-128)].occurrences == dataset.batch(2).occurrences
    for bad in (np.int16(-131), -131, 130, np.uint64(2**64 - 1), True, np.bool_(False), 1.0):
        with pytest.raises(sp.InvalidInputError, match=r"outside (this dataset.s|the) batches \[0, 130\)"):
            dataset[bad]


def test_indices_are_refused_not_wrapped(tmp_path):
    dataset = io.open_dataset(packed(tmp_path, [b"hello world", b"abc", b"x" * 40]))
    last = dataset.occurrence_count - 1
    assert dataset.example_id(np.int64(last)) == dataset.example_id(last)
    for bad in (-1, np.int64(-1), True, np.bool_(True), 1.0, np.float64(0), 2**70):
        for call in (dataset.example, dataset.example_id, dataset.batch, dataset.batch_rows):
            with pytest.raises(sp.InvalidInputError, match="outside this dataset"):
                call(bad)
    for call, end in ((dataset.example, last + 1), (dataset.example_id, last + 1), (dataset.batch, len(dataset)),
                      (dataset.batch_rows, len(dataset))):
        with pytest.raises(sp.InvalidInputError, match="outside this dataset"):
            call(end)


@pytest.mark.parametrize("name", ["occurrences.npy", "examples.npy"])
def test_open_refuses_placements_that_leave_a_gap_or_overlap(tmp_path, name):
    # Before: the batch was filled with a gap (or an overlap) inside the row's valid prefix.
    with pytest.raises(sp.InvalidInputError, match=r"occurrences\.npy: placement 1 leaves a gap or overlaps in row 0"):
        io.open_dataset(swapped(tmp_path, name))


def test_open_refuses_examples_that_are_not_the_documents_ranges(tmp_path):
    # Before: example_id named doc0000.txt[0:4] and example(1) raised a TokenizerError.
    with pytest.raises(sp.InvalidInputError, match=r"examples\.npy: the examples are not the documents' ranges"):
        io.open_dataset(swapped(tmp_path, "documents.npy"))


def test_open_refuses_an_example_placed_twice(tmp_path):
    path = packed(tmp_path, [b"ab", b"cd"])
    occurrences = np.load(path / "part-00000" / "occurrences.npy")
    occurrences[1, 0] = occurrences[0, 0]  # same size, so rows and tokens still add up
    np.save(path / "part-00000" / "occurrences.npy", occurrences)
    # Before: it opened and example(1) read an uninitialized placement index.
    with pytest.raises(sp.InvalidInputError, match="do not name every example exactly once"):
        io.open_dataset(path)


def test_a_pickled_dataset_refuses_to_reopen_a_replaced_directory(tmp_path):
    path = packed(tmp_path / "a", [b"hello", b"world", b"x" * 30])
    dataset = io.open_dataset(path)
    state = pickle.dumps(dataset)
    assert pickle.loads(state).batch_targets().tolist() == dataset.batch_targets().tolist()
    other = packed(tmp_path / "b", [b"x" * 30, b"world", b"hello"])
    shutil.rmtree(path)
    shutil.copytree(other, path)
    # Before: the clone silently served the other dataset's batches.
    with pytest.raises(sp.InvalidInputError, match="replaced after it was pickled"):
        pickle.loads(state)


@pytest.mark.parametrize("limit", [-1, 0, True, 1.0])
def test_stdlib_table_refuses_a_limit_that_is_not_a_positive_int(limit):
    # Before: -1 kept every file but the last, True kept one file, 1.0 raised a TypeError.
    with pytest.raises(sp.InvalidInputError, match="limit must be"):
        stdlib_table(sp.BatchBinding.fixture(), capacity=64, limit=limit)


def test_a_batch_over_the_memory_budget_is_refused_before_it_is_built(tmp_path):
    """The dataset computed its peak and never compared it with max_memory_bytes: a batch
    of a 2**24-cell row was built under a 1 MiB budget (a plan of the same config refuses)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("hello")
    config = sp.PackConfig(2**24, 8, max_memory_bytes=2**20)
    io.pack_corpus([io.TextFiles([docs])], tmp_path / "big", binding=BINDING, tokenizer=TOKENIZER, config=config)
    dataset = io.open_dataset(tmp_path / "big")
    assert dataset.report().valid_targets == 6  # what needs no batch still works
    for build in (lambda: dataset[0], lambda: next(dataset.batches(reuse_buffers=True)),
                  lambda: next(iter(dataset))):
        with pytest.raises(sp.MemoryBudgetError, match=r"big: one batch needs \d+ bytes; "
                                                        r"max_memory_bytes is 1048576"):
            build()


def test_a_dataset_batch_takes_no_caller_buffers(tmp_path):
    """batch(number, buffers) filled buffers of any shape: (8, 1024) for a batch of 2 x 16
    segfaulted, (2, 4096) returned a batch of the wrong shape. Like a plan's, the public
    batch takes a number only; reused buffers come from batches(reuse_buffers=True)."""
    dataset = io.open_dataset(packed(tmp_path, [b"hello", b"world"]))
    with pytest.raises(TypeError):
        dataset.batch(0, sp.layout.fields.FieldArrays.allocate(8, 1024))
    assert [b.shape for b in dataset.batches(reuse_buffers=True)] == [dataset[0].shape]


def test_the_budget_caps_a_batch_not_the_memory_mapped_index(tmp_path):
    """A budget that one batch fits in opens and reads every batch, however large the index
    (it is memory-mapped); counting the index refused every batch of a large corpus."""
    texts = [b"x" * 5] * 3000
    docs = tmp_path / "docs"
    docs.mkdir()
    for index, text in enumerate(texts):
        (docs / f"doc{index:04d}.txt").write_bytes(text)
    config = sp.PackConfig(16, 2, max_memory_bytes=64 * 1024)
    io.pack_corpus([io.TextFiles([docs])], tmp_path / "out", binding=BINDING, tokenizer=TOKENIZER, config=config)
    dataset = io.open_dataset(tmp_path / "out")
    assert dataset.memory_peak > 64 * 1024 > dataset.batch_peak
    assert sum(batch.target_count for batch in dataset.batches(reuse_buffers=True)) == 3000 * 6
    assert io.verify_dataset(tmp_path / "out")["batches_verified"] == len(dataset)
