"""A real corpus: the Python standard library's .py files, byte-tokenized and packed by each policy."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack.data import window_ranges
from seqpack.data.corpus import stdlib_sources, stdlib_table
from seqpack.packing.placement import POLICIES

pytestmark = pytest.mark.kernel

CAPACITY = 2048


@pytest.fixture(scope="module")
def corpus(binding):
    return stdlib_table(binding, capacity=CAPACITY)


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_stdlib_packs_verified_and_conserved(binding, corpus, policy):
    """Every model call verifies and the valid targets are exactly the table's predictions."""
    config = sp.PackConfig(CAPACITY, 8, 8 * CAPACITY, 1 << 34)
    plan = sp.plan(corpus, config, partition=sp.Partition.TRAIN, binding=binding, policy=policy)
    targets, occurrences = 0, 0
    for batch in plan:
        batch.verify()
        targets += batch.target_count
        occurrences += len(batch.occurrences)
    total = int(corpus.lengths.sum())
    assert targets == total and occurrences == len(corpus)
    report = plan.report()
    assert report.valid_targets == total and sum(report.batch_targets) == total
    assert report.rows >= sp.packing.lower_bound_rows(corpus.lengths, CAPACITY)
    print(f"\nstdlib corpus, {corpus.document_count} files, {len(corpus)} examples, capacity {CAPACITY}:")
    print(json.dumps(report.as_dict()))


def test_stdlib_corpus_is_the_stdlib(binding, corpus):
    """Each document decodes to its file's bytes; long files are cut into ranges, never truncated."""
    paths = stdlib_sources()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert corpus.document_count == len(paths) > 100
    assert all("site-packages" not in p.parts for p in paths)
    assert len(corpus) > corpus.document_count  # some files exceed one row
    assert int(corpus.lengths.max()) == CAPACITY and int(corpus.lengths.min()) >= 1
    for ordinal in (0, len(corpus) // 2, len(corpus) - 1):
        example = corpus.example(ordinal)
        name, _, span = corpus.example_id(ordinal).rpartition("[")
        start, stop = (int(v) for v in span.rstrip("]").split(":"))
        assert (example.source_range.start, example.source_range.stop) == (start, stop)
        assert binding.decode_document(example.document.token_ids) == (root / name).read_bytes()


def test_limit_keeps_the_first_files(binding):
    small = stdlib_table(binding, capacity=64, limit=3)
    assert small.document_count == 3 and int(small.lengths.max()) <= 64
    config = sp.PackConfig(64, 4, 256, 1 << 30)
    for batch in sp.plan(small, config, partition=sp.Partition.TRAIN, binding=binding, policy="best-fit-decreasing"):
        batch.verify()


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.lists(st.integers(3, 40), min_size=1, max_size=8), st.integers(1, 12))
def test_window_ranges_cover_every_prediction_once(lengths, capacity):
    """Reference: predictions ``1..n-1`` of each document, each in exactly one range of at most capacity."""
    documents, ranges = window_ranges(np.array(lengths, dtype=np.int64), capacity)
    covered = {d: [] for d in range(len(lengths))}
    for d, (start, stop) in zip(documents.tolist(), ranges.tolist()):
        assert 2 <= stop - start <= capacity + 1 and 0 <= start and stop <= lengths[d]
        covered[d].extend(range(start + 1, stop))  # the targets this range predicts
    assert documents.tolist() == sorted(documents.tolist())
    for d, n in enumerate(lengths):
        assert covered[d] == list(range(1, n))
