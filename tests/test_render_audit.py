"""Audit of ``seqpack show`` and ``seqpack stats``: names a terminal or XML cannot show,
wide rows, column windows, figures written into a dataset, and the median's half."""

import os
import xml.etree.ElementTree as ElementTree

import pytest

import seqpack as sp
from seqpack.io.render import batch_text

from test_cli import one_error_line, run, textdir  # noqa: F401 (a fixture)


@pytest.fixture
def dataset(tmp_path, textdir):  # noqa: F811
    out = tmp_path / "d"
    assert run("pack", textdir, "--out", out, "--capacity", 16, "--rows-per-batch", 3, "--quiet").returncode == 0
    return out


@pytest.mark.skipif(os.name != "posix", reason="needs file names of arbitrary bytes")
def test_names_with_undecodable_bytes_or_control_characters_are_shown_escaped(tmp_path, dataset):
    """A directory name with a byte that is not UTF-8 made show --svg a traceback (and left
    the figure empty); one with a control character wrote an SVG that is not XML."""
    strict = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # a locale whose stdout refuses surrogates
    for raw, shown in ((b"bad\xffname", "bad\\xffname"), (b"d\x01<&x", "d\\x01<&x")):
        renamed = os.path.join(os.fsencode(tmp_path), raw)
        os.rename(os.fsencode(dataset), renamed)
        figure = tmp_path / "figure.svg"
        result = run("show", os.fsdecode(renamed), "--columns", "0:3", "--svg", figure, env=strict)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        titles = [t.text for t in ElementTree.parse(figure).iter("{http://www.w3.org/2000/svg}text")]
        assert f"{tmp_path}/{shown}: batch 0" in titles
        stats = run("stats", os.fsdecode(renamed), env=strict)
        assert stats.returncode == 0, stats.stderr
        assert stats.stdout.splitlines()[0].endswith(f"/{shown}")
        verify = run("verify", os.fsdecode(renamed), "--quiet", env=strict)
        assert verify.returncode == 0 and verify.stdout.startswith(f"{tmp_path}/{shown}: ok:"), verify.stderr
        os.rename(renamed, os.fsencode(dataset))


def test_query_labels_of_a_wide_row_are_whole_columns():
    """The matrix labelled its queries modulo 10,000: columns 10000 on read as 0, 1, 2..."""
    bind = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="tests")
    table = sp.ExampleTable.from_texts(["q" * 10007], bind, capacity=10010)
    batch = sp.pack(table, sp.PackConfig(10010, 1), partition=sp.Partition.TRAIN, binding=bind).batches[0]
    lines = batch_text(batch, columns=range(9998, 10003)).splitlines()
    labels = [line.split()[-2] for line in lines[1:7]]
    assert labels == ["keys", "9998", "9999", "10000", "10001", "10002"]
    assert lines[2].split()[-1] == "■····" and lines[5].split()[-1] == "■■■■·"  # keys 9998..10002


@pytest.mark.parametrize("window", ["3:3", "5:2"])
def test_an_empty_column_window_is_a_usage_error(dataset, window):
    result = run("show", dataset, "--columns", window)
    assert f"--columns {window} is empty: STOP must be above START" in one_error_line(result, 2)


@pytest.mark.parametrize("command", ["stats", "show"])
def test_a_figure_inside_the_dataset_is_refused(dataset, command):
    """The figure made the dataset fail verify: it holds only its manifest and parts."""
    figure = dataset / "part-00000" / ".." / "figure.svg"
    line = one_error_line(run(command, dataset, "--svg", figure), 1)
    assert f"--svg {figure} is inside the dataset {dataset}, which holds only its manifest and parts" in line
    assert not (dataset / "figure.svg").exists()
    assert run("verify", dataset, "--quiet").returncode == 0


def test_the_median_length_keeps_its_half(tmp_path):
    """Two examples of 2 and 3 predictions printed 'median 2' (round half to even)."""
    corpus = tmp_path / "two"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a")
    (corpus / "b.txt").write_text("bc")
    assert run("pack", corpus, "--out", tmp_path / "o", "--capacity", 8, "--quiet").returncode == 0
    result = run("stats", tmp_path / "o")
    assert "(lengths: median 2.5, mean 2.5, max 3)" in result.stdout


def test_a_figure_that_cannot_be_written_fails_before_anything_is_printed(tmp_path):
    result = run("show", "packed", "--svg", tmp_path / "missing" / "figure.svg")
    assert "figure.svg: cannot write: No such file or directory" in one_error_line(result, 1)
    assert result.stdout == ""


def test_printable_escapes_only_what_cannot_be_shown():
    """Control characters, line separators, undecodable bytes and noncharacters are escaped;
    wide spaces, joiners and marks (a name's ordinary text) are kept."""
    from seqpack.io.render import printable

    assert printable("a\x1bb\n\u2028\ufffe" + os.fsdecode(b"\xff")) == "a\\x1bb\\n\\u2028\\ufffe\\xff"
    kept = "nb\u00a0sp, zw\u200dj, e\u0301, \u3000, \u00ad, é"
    assert printable(kept) == kept
