"""What ``seqpack show`` and ``seqpack stats`` draw: the batch matrix and its figure
(seqpack.io.render), the stats figure's bins (seqpack.io.stats), and the escapes that keep
names printable."""

import os
import re

import numpy as np
import pytest

import seqpack as sp
from seqpack import io
from seqpack.errors import InvalidInputError
from seqpack.io.render import batch_svg, batch_text
from seqpack.io import pack_corpus
from seqpack.io.stats import dataset_stats, stats_svg

from helpers import write_jsonl

TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="corpus")
CONFIG = sp.PackConfig(32, 3)


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(1)
    directory = tmp_path / "in"
    directory.mkdir()
    return [write_jsonl(directory / f"p{i}.jsonl", [{"text": "a" * int(n)} for n in rng.integers(1, 40, 30)])
            for i in range(3)]


def sharded(paths, out):
    return pack_corpus([io.JsonLines(p) for p in paths], out, binding=BINDING, tokenizer=TOKENIZER, config=CONFIG,
                        shards=3, long="cut")


# Regression: the matrix labelled its queries modulo 10,000 (column 10000 read as 0).
def test_query_labels_of_a_wide_row_are_whole_columns():
    """The matrix labelled its queries modulo 10,000: columns 10000 on read as 0, 1, 2..."""
    bind = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="tests")
    table = sp.ExampleTable.from_texts(["q" * 10007], bind, capacity=10010)
    batch = sp.pack(table, sp.PackConfig(10010, 1), partition=sp.Partition.TRAIN, binding=bind).batches[0]
    lines = batch_text(batch, columns=range(9998, 10003)).splitlines()
    labels = [line.split()[-2] for line in lines[1:7]]
    assert labels == ["keys", "9998", "9999", "10000", "10001", "10002"]
    assert lines[2].split()[-1] == "■····" and lines[5].split()[-1] == "■■■■·"  # keys 9998..10002


# Regression: show drew a stepped column range under the wrong labels, and bool or float rows.
def test_show_refuses_rows_and_columns_it_would_draw_wrongly(corpus, tmp_path):
    """A stepped column range drew the matrix of other columns under its labels; a bool
    row, a float row or no rows at all were drawn, crashed or gave an empty figure."""
    sharded(corpus, tmp_path / "out")
    batch = sp.open_dataset(tmp_path / "out").batch(0)
    for draw in (batch_text, batch_svg):
        with pytest.raises(InvalidInputError, match="columns must be a range of consecutive columns"):
            draw(batch, columns=range(0, 10, 2))
        with pytest.raises(InvalidInputError, match="columns must be a range of consecutive columns"):
            draw(batch, columns=range(5, -1, -1))
        with pytest.raises(InvalidInputError, match="columns must be a range of consecutive columns"):
            draw(batch, columns=[0, 1])
        for row in (True, 0.5):
            with pytest.raises(InvalidInputError, match="a row must be an int"):
                draw(batch, rows=[row])
        with pytest.raises(InvalidInputError, match="rows is empty"):
            draw(batch, rows=[])
    svg = batch_svg(batch, rows=[np.int64(1)], columns=range(3, 9))
    assert svg.count('class="cell"') == 6
    assert re.findall(r'class="cell" data-row="(\d+)" data-column="(\d+)"', svg) == [("1", str(c)) for c in range(3, 9)]


# Regression: the stats figure's bins had rounded edges and an open last bin.
def test_stats_figure_bins_label_exactly_what_they_count(corpus, tmp_path):
    """Every bar's label ``[lo, hi)`` (``[lo, hi]`` for the last) holds exactly its count of
    the values computed from the dataset's files. The last bin, which holds full rows and
    examples of the capacity, was labelled half-open, and its edges were rounded
    (``[0.969, 1)`` for ``[0.96875, 1]``)."""
    manifest = sharded(corpus, tmp_path / "out")
    lengths, fill = [], []
    for part in manifest["parts"]:
        occurrences = np.load(tmp_path / "out" / part["name"] / "occurrences.npy")
        examples = np.load(tmp_path / "out" / part["name"] / "examples.npy")
        predictions = examples[occurrences[:, 0], 2] - examples[occurrences[:, 0], 1] - 1
        lengths += predictions.tolist()
        fill += np.bincount(occurrences[:, 1], weights=predictions).tolist()
    capacity = CONFIG.capacity
    fill = np.array(fill) / capacity
    assert (fill == 1).any() and (np.array(lengths) == capacity).any()
    stats = dataset_stats(sp.open_dataset(tmp_path / "out"))
    assert stats["report"]["rows"] == len(fill) and stats["counts"]["examples"] == len(lengths)
    svg = stats_svg(stats)
    titles = re.findall(r"<title>\[([^,]+), ([^\]\)]+)([\]\)]): (\d+)</title>", svg)
    assert len(titles) == 64
    for values, bins in ((np.array(lengths), titles[:32]), (fill, titles[32:])):
        for number, (low, high, close, count) in enumerate(bins):
            low, high = float(low), float(high)
            assert close == ("]" if number == 31 else ")")
            inside = (values >= low) & ((values <= high) if close == "]" else (values < high))
            assert inside.sum() == int(count), (low, high, close, count)


# printable() escapes only what cannot be shown: a name's ordinary text (NBSP, joiners, marks) stays as it is.
def test_printable_escapes_only_what_cannot_be_shown():
    """Control characters, line separators, undecodable bytes and noncharacters are escaped;
    wide spaces, joiners and marks (a name's ordinary text) are kept."""
    from seqpack.io.render import printable

    assert printable("a\x1bb\n\u2028\ufffe" + os.fsdecode(b"\xff")) == "a\\x1bb\\n\\u2028\\ufffe\\xff"
    kept = "nb\u00a0sp, zw\u200dj, e\u0301, \u3000, \u00ad, é"
    assert printable(kept) == kept
    # Bidirectional controls reordered the rest of the line (a dataset named "\u202e..." printed
    # its "ok" line reversed; review).
    assert printable("a\u202eb\u2066c\u200fd\u061ce") == "a\\u202eb\\u2066c\\u200fd\\u061ce"
