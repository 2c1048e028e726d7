"""Audit of the core API by a user's attacks: each test was a crash, a silent wrong answer
or a traceback from deep inside before its fix."""

import numpy as np
import pytest

import seqpack as sp
from seqpack import _limits
from seqpack.errors import BatchIndexError, InvalidInputError

pytestmark = pytest.mark.kernel

TRAIN = sp.Partition.TRAIN


@pytest.fixture(scope="module")
def binding():
    return sp.BatchBinding.fixture()


@pytest.fixture(scope="module")
def examples(binding):
    documents = [sp.BatchDocument(f"d{i}", [0] + [99 + j for j in range(i % 5 + 1)] + [1]) for i in range(12)]
    return [sp.SequenceExample.from_document(f"e{i}", d, binding) for i, d in enumerate(documents)]


def many_documents(count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` framed two-prediction documents, over the bulk kernels' thread threshold."""
    return np.tile(np.array([0, 99, 100, 1]), count), np.arange(0, 4 * count + 1, 4)


def test_thread_counts_that_would_end_the_process_are_refused(binding):
    """threads=32768 ended the process (libgomp could not start the team) and 65536
    crashed it; the most a caller may ask for is now 1024, which runs."""
    tokens, offsets = many_documents(400_000)
    for call in (lambda t: sp.ExampleTable.from_arrays(tokens, offsets, binding, threads=t),
                 lambda t: sp.pack(table, sp.PackConfig(12), partition=TRAIN, binding=binding, threads=t)):
        table = sp.ExampleTable.from_arrays(tokens, offsets, binding, threads=1)
        for threads in (_limits.MAX_THREADS + 1, 32768, 65536):
            with pytest.raises(InvalidInputError, match=rf"threads is {threads}; the maximum is 1024"):
                call(threads)
    table = sp.ExampleTable.from_arrays(tokens, offsets, binding, threads=1024)
    many = sp.pack(table, sp.PackConfig(12), partition=TRAIN, binding=binding, threads=1024)
    one = sp.pack(table, sp.PackConfig(12), partition=TRAIN, binding=binding, threads=1)
    for name, field in one.fields.items():
        assert np.array_equal(many.fields[name], field), name


def test_permitted_edges_are_exact_past_int64():
    """2**20 segments of 2**22 predictions permit 2**63 + 2**42 edges; the report said
    -9223369837831520256 (and a negative permitted fraction)."""
    lengths = np.full(2**20, 2**22, dtype=np.int64)
    assert _limits.permitted_edges(lengths) == 2**20 * (2**22 * (2**22 + 1) // 2)
    rng = np.random.default_rng(0)
    for count in (0, 1, 1000):
        lengths = rng.integers(0, 2**31, count)
        assert _limits.permitted_edges(lengths) == sum(int(n) * (int(n) + 1) // 2 for n in lengths)
    report = sp.EfficiencyReport.of("next-fit", 2**31 - 1, 4, np.full(4, 2**31 - 1, np.int64), np.ones(4, np.int64))
    assert report.permitted_edges == 4 * ((2**31 - 1) * 2**31 // 2) and 0 < report.permitted_fraction <= 1
    with pytest.raises(InvalidInputError, match="segment lengths"):
        _limits.permitted_edges(np.array([-1]))


def test_example_ids_are_checked_before_they_name_a_bad_range(binding):
    """A bad range was named through ids before ids were checked: a generator, a set, a
    dict or an int raised TypeError or KeyError, and a string named example 'b'."""
    tokens, offsets = np.array([0, 5, 6, 1, 0, 7, 8, 1]), np.array([0, 4, 8])
    bad_ranges = np.array([[0, 4], [0, 9]])
    for ids in ({"a", "b"}, {"a": 1, "b": 2}, 5, "ab", b"ab"):
        with pytest.raises(InvalidInputError, match="ids must be (a|an ordered) sequence of names"):
            sp.ExampleTable.from_arrays(tokens, offsets, binding, ranges=bad_ranges, ids=ids)
    for ids in ((name for name in ("a", "b")), ["a", "b"], np.array(["a", "b"])):
        with pytest.raises(InvalidInputError, match=r"example 'b' \(index 1\): source range \[0, 9\) must lie"):
            sp.ExampleTable.from_arrays(tokens, offsets, binding, ranges=bad_ranges, ids=ids)
    with pytest.raises(InvalidInputError, match="1 ids for 2 examples"):
        sp.ExampleTable.from_arrays(tokens, offsets, binding, ranges=bad_ranges, ids=["a"])
    table = sp.ExampleTable.from_arrays(tokens, offsets, binding, ids=(name for name in ("a", "b")))
    assert [table.example_id(i) for i in range(2)] == ["a", "b"]
    assert len(table.chunk(-1, 5)) == 1
    for bad in (0.5, "1", None):
        with pytest.raises(InvalidInputError, match="start must be an int"):
            table.chunk(bad, 2)


def test_a_constructed_example_with_a_bad_range_is_refused(examples, binding):
    """SequenceExample's constructor only stores: an example of no prediction vanished
    from the packed row, one past its document's end took 8 cells for 3 predictions, and a
    reversed range raised from len()."""
    document = sp.BatchDocument("d", [0, 99, 100, 1])
    for bad in (range(0, 1), range(0, 9), range(3, 1), range(0, 4, 2), (0, 4)):
        raw = sp.SequenceExample("raw", document, bad, binding)
        for call in (lambda: sp.pack([examples[0], raw], sp.PackConfig(12), partition=TRAIN, binding=binding),
                     lambda: sp.pad([examples[0], raw], sp.PadConfig(), partition=TRAIN, binding=binding),
                     lambda: sp.plan([examples[0], raw], sp.PackConfig(12), partition=TRAIN, binding=binding)):
            with pytest.raises(InvalidInputError, match=r"example 'raw' \(index 1\): source range .* is not a step-1"):
                call()
    raw = sp.SequenceExample("raw", [0, 99, 1], range(0, 3), binding)
    with pytest.raises(InvalidInputError, match="holds no BatchDocument"):
        sp.pack([raw], sp.PackConfig(12), partition=TRAIN, binding=binding)
    fine = sp.SequenceExample("fine", document, range(0, 4), binding)
    assert sp.pack([fine], sp.PackConfig(12), partition=TRAIN, binding=binding)[0].target_count == 3


def test_a_batch_number_outside_the_batches_is_one_error_everywhere(examples, binding, tmp_path):
    """Epochs raised a bare IndexError or TypeError where plans raised InvalidInputError;
    every container of batches now raises BatchIndexError, which is both."""
    config = sp.PackConfig(8, 2)
    plan = sp.plan(examples, config, partition=TRAIN, binding=binding)
    epoch = sp.pack(examples, config, partition=TRAIN, binding=binding)
    padded = sp.pad(examples, sp.PadConfig(rows_per_batch=5), partition=TRAIN, binding=binding)
    count = len(plan)
    assert count == len(epoch) == len(epoch.batches) > 2 and len(padded) == 3
    for container, owner, size in ((epoch, "epoch", count), (epoch.batches, "epoch", count), (padded, "epoch", 3),
                                   (plan, "plan", count)):
        assert container[-1].segments.tolist() == container[size - 1].segments.tolist()
        for bad in (size, -size - 1, True, 1.0, "a"):
            with pytest.raises(BatchIndexError, match=rf"this {owner}'s batches \[0, {size}\)") as caught:
                container[bad]
            assert isinstance(caught.value, IndexError) and isinstance(caught.value, InvalidInputError)
    assert [b.segments.tolist() for b in epoch] == [b.segments.tolist() for b in plan]  # iteration unchanged
    assert len(epoch[1:3]) == 2 and len(padded[::2]) == 2


def test_a_decoder_names_a_config_that_is_not_one():
    with pytest.raises(InvalidInputError, match="config must be a DecoderConfig, not NoneType"):
        sp.Decoder(None, 0)
