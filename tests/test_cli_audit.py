"""Audit of the command line and ``seqpack.chapters``: ignored flags, tracebacks, wrong exit codes."""

import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest


def seqpack_command():
    script = shutil.which("seqpack", path=os.path.dirname(sys.executable))
    assert script, "the seqpack console script is not installed beside this Python (pip install the package)"
    return script


def run(*args, stdout=subprocess.PIPE, env=None):
    return subprocess.run([seqpack_command(), *map(str, args)], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=300, env=env)


def one_error_line(result, status):
    assert result.returncode == status, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("seqpack: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("fixture", ["padded", "packed"])
@pytest.mark.parametrize("batch", ["0", "3"])
def test_show_batch_of_a_fixture_is_a_usage_error(fixture, batch):
    result = run("show", fixture, "--batch", batch)
    assert "--batch has no effect here" in one_error_line(result, 2)
    assert result.stdout == ""


@pytest.mark.parametrize("suite", ["attention", "train"])
def test_bench_huge_threads_is_one_line_not_a_traceback(suite):
    result = run("bench", suite, "--threads", 10**20, "--repeats", 1)
    assert "--threads is 100000000000000000000; the maximum is 1024" in one_error_line(result, 2)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [("--help",), ("--version",), ("show", "--help")])
@pytest.mark.parametrize("unbuffered", [True, False])
def test_help_and_version_into_a_full_disk_fail_with_one_line(args, unbuffered):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        result = run(*args, stdout=full, env=env)
    assert "cannot write the output" in one_error_line(result, 1)


def test_help_into_a_closed_pipe_exits_quietly():
    process = subprocess.Popen([seqpack_command(), "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    assert process.wait(timeout=60) == 0
    assert process.stderr.read() == b""


def chapter_batch(kind="packed"):
    from seqpack.chapters import chapter_batch
    from seqpack.data import BatchBinding

    return chapter_batch(kind, BatchBinding.fixture())


def test_loss_probe_refuses_nan_gold_probabilities():
    from seqpack.chapters import loss_probe
    from seqpack.errors import InvalidInputError

    batch = chapter_batch()
    with pytest.raises(InvalidInputError, match="strictly between 0 and 1"):
        loss_probe(batch, np.full(batch.shape, np.nan))


def test_loss_probe_refuses_a_wrong_shape():
    from seqpack.chapters import loss_probe
    from seqpack.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"gold probabilities have shape \(1, 3\); the batch is \(2, 6\)"):
        loss_probe(chapter_batch(), np.full((1, 3), 0.5))


def test_gold_probabilities_of_a_non_chapter_example_is_invalid_input():
    from seqpack.chapters import gold_probabilities
    from seqpack.chapters.fixtures import examples_of, packed_batch
    from seqpack.data import BatchBinding
    from seqpack.errors import InvalidInputError

    binding = BatchBinding.fixture()
    batch = packed_batch(examples_of({"X": [0, 5, 6, 1]}, binding), binding, 6)
    with pytest.raises(InvalidInputError, match="'X' is not a chapter fixture example"):
        gold_probabilities(batch)


@pytest.mark.parametrize("tile", [0, -2])
def test_edge_inventory_refuses_a_tile_below_one(tile):
    from seqpack.chapters.demo import edge_inventory
    from seqpack.errors import InvalidInputError

    batch = chapter_batch()
    assert len(edge_inventory(batch)) == len(edge_inventory(batch, 2)) == 19
    with pytest.raises(InvalidInputError, match="tile_width must be at least 1"):
        edge_inventory(batch, tile)


@pytest.fixture
def textdir(tmp_path):
    directory = tmp_path / "textdir"
    directory.mkdir()
    (directory / "a.txt").write_text("hello")
    (directory / "b.txt").write_text("world")
    return directory


@pytest.mark.parametrize("inside", ["out", "sub/out"])
def test_pack_refuses_an_output_inside_an_input_directory(tmp_path, textdir, inside):
    (textdir / "sub").mkdir()
    result = run("pack", textdir, "--out", textdir / inside, "--quiet")
    line = one_error_line(result, 1)
    assert line.endswith(f"the output {textdir / inside} lies inside the input directory {textdir}: "
                         f"write it outside the inputs")
    assert sorted(p.name for p in textdir.iterdir()) == ["a.txt", "b.txt", "sub"]


def test_a_packed_dataset_inside_an_input_directory_is_skipped_and_reported(tmp_path, textdir):
    """It used to be packed as documents (manifest.json, *.npy, tokens.bin)."""
    assert run("pack", textdir, "--out", tmp_path / "first", "--quiet").returncode == 0
    (tmp_path / "first").rename(textdir / "out")
    result = run("pack", textdir, "--out", tmp_path / "again", "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"seqpack: skipped {textdir / 'out'}: a packed dataset, not text\n"
    manifest = json.loads(result.stdout)
    assert [item["name"] for item in manifest["inputs"]] == [str(textdir / "a.txt"), str(textdir / "b.txt")]
    assert one_error_line(run("pack", textdir / "out", "--out", tmp_path / "x"), 1).endswith(
        f"{textdir / 'out'}: a packed dataset, not text files")


@pytest.mark.parametrize("name", ["good.jsonl.gz", "renamed.jsonl", "renamed.txt"])
def test_pack_refuses_a_gzip_file(tmp_path, name):
    """It used to pack the gzip bytes as one text document (exit 0)."""
    (tmp_path / name).write_bytes(gzip.compress(b'{"text": "hi"}\n'))
    line = one_error_line(run("pack", tmp_path / name, "--out", tmp_path / "out"), 1)
    assert line.endswith(f"{tmp_path / name}: gzip-compressed; decompress it first")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (("--threads", 100000), "--threads is 100000; the maximum is 1024"),
    (("--threads", 0), "--threads must be at least 1"),
    (("--capacity", 0), "--capacity must be at least 1"),
    (("--capacity", 3000000000), "--capacity is 3000000000; the maximum is 2147483647"),
    (("--rows-per-batch", 0), "--rows-per-batch must be at least 1"),
    (("--shards", 0), "--shards must be at least 1"),
    (("--ids-field", "input_ids", "--text-field", "text"), "give --text-field or --ids-field, not both"),
])
@pytest.mark.parametrize("source", ["sample", "jsonl"])
def test_bad_pack_option_values_are_usage_errors(tmp_path, args, message, source):
    """Each used to exit 1 (from the library, some after reading the inputs)."""
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "hi", "input_ids": [5]}) + "\n")
    inputs = ["--sample"] if source == "sample" else [tmp_path / "docs.jsonl"]
    line = one_error_line(run("pack", *inputs, "--out", tmp_path / "out", *args), 2)
    assert line == f"seqpack: error: {message}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--batch", "--row"])
def test_a_negative_show_batch_or_row_is_a_usage_error(flag):
    assert one_error_line(run("show", "packed", flag, -1), 2) == f"seqpack: error: {flag} must be at least 0"


def test_pack_reads_a_megatron_prefix(tmp_path):
    """``pack --help`` says a prefix is an INPUT; it used to fail 'meg: no such file or directory'."""
    from test_io_readers import write_megatron

    write_megatron(tmp_path / "meg", [[5, 6, 7], [8, 9]])
    result = run("pack", tmp_path / "meg", "--out", tmp_path / "out", "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["counts"]["documents"] == 2
    (tmp_path / "half.idx").write_bytes((tmp_path / "meg.idx").read_bytes())
    assert one_error_line(run("pack", tmp_path / "half", "--out", tmp_path / "x"), 1).endswith(
        f"{tmp_path / 'half.bin'}: no such file (a Megatron dataset is PREFIX.idx + PREFIX.bin)")


@pytest.mark.parametrize("args, status, message", [
    (("pack", "--out", "x"), 2, "give INPUT paths or --sample"),
    (("pack", "textdir", "--sample", "--out", "x"), 2, "give INPUT paths or --sample, not both"),
    (("verify", "textdir/a.txt"), 1, "textdir/a.txt: not a directory"),
    (("stats", "nowhere"), 1, "nowhere: no such directory"),
    (("pack", "textdir", "--out", "nowhere/x"), 1, "nowhere does not exist (the parent of nowhere/x)"),
    (("pack", "textdir", "--out", "textdir/a.txt/x"), 1, "textdir/a.txt is not a directory (the parent of "
                                                         "textdir/a.txt/x)"),
    (("pack", "textdir", "textdir/a.txt", "--out", "x"), 1,
     "textdir/a.txt is an input twice (also inside textdir): give each file once"),
    (("pack", "textdir/a.txt", "textdir", "--out", "x"), 1,
     "textdir/a.txt (inside textdir) is an input twice (also as textdir/a.txt): give each file once"),
    (("pack", "textdir", "--out", "x", "--glob", "*.rs"), 1, "textdir: no file matches --glob '*.rs'"),
])
def test_error_wording(tmp_path, textdir, args, status, message):
    result = subprocess.run([seqpack_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            timeout=300, cwd=tmp_path)
    assert one_error_line(result, status) == f"seqpack: error: {message}"


def test_verify_counts_one_example_and_one_batch_in_the_singular(tmp_path, textdir):
    """It printed '1 batches verified'."""
    assert run("pack", textdir / "a.txt", "--out", tmp_path / "out", "--quiet").returncode == 0
    result = run("verify", tmp_path / "out", "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(", 1 example placed by the rules, 1 batch verified\n")


def big_jsonl(path, documents=60_000):
    rng = np.random.default_rng(0)
    with open(path, "w") as handle:
        for size in rng.integers(10, 400, documents):
            handle.write(json.dumps({"text": "w " * int(size)}) + "\n")
    return path


@pytest.mark.slow
def test_sigterm_mid_pack_cleans_up_like_ctrl_c(tmp_path):
    """SIGTERM (kill, timeout, a scheduler) killed the process with no message and left the
    hidden partial directory behind for good."""
    import signal
    import time

    source = big_jsonl(tmp_path / "big.jsonl")
    process = subprocess.Popen([seqpack_command(), "pack", str(source), "--out", str(tmp_path / "out"), "--cut-long",
                                "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".out.seqpack-partial") for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr) == (143, "seqpack: terminated\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


def test_an_unreadable_file_is_named_not_called_the_output(tmp_path, monkeypatch, capsys):
    """verify, stats and show said 'cannot write the output: Permission denied' for a
    dataset file they could not read (as a user without the right to)."""
    import seqpack.io
    from seqpack import cli

    (tmp_path / "a.txt").write_text("hello")
    assert cli.main(["pack", str(tmp_path / "a.txt"), "--out", str(tmp_path / "ds"), "--quiet"]) == 0
    tokens = tmp_path / "ds" / "part-00000" / "tokens.bin"

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tokens))

    monkeypatch.setattr(seqpack.io, "verify_dataset", refuse)
    capsys.readouterr()
    assert cli.main(["verify", str(tmp_path / "ds"), "--quiet"]) == 1
    assert capsys.readouterr().err == f"seqpack: error: {tokens}: Permission denied\n"


def test_an_allocation_that_fails_is_one_line(tmp_path, monkeypatch, capsys):
    from seqpack import cli

    def huge(argv):
        raise MemoryError("Unable to allocate 32.0 GiB for an array with shape (1, 2147483647)")

    monkeypatch.setattr(cli, "_run", huge)
    assert cli.main(["show", "packed"]) == 1
    assert capsys.readouterr().err == ("seqpack: error: not enough memory: Unable to allocate 32.0 GiB for an array "
                                       "with shape (1, 2147483647)\n")


@pytest.mark.parametrize("out", [".", "..", "sub/.."])
def test_an_output_of_dot_is_refused_before_any_work(tmp_path, out):
    """``--out .`` packed everything, then refused at publish time because of its own
    temporary directory, made inside the output."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("hello")
    result = subprocess.run([seqpack_command(), "pack", "sub/a.txt", "--out", out, "--force"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    line = one_error_line(result, 1)
    assert f"the output '{out}' ends in '.' or '..': name the dataset's own directory" in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.txt", "sub"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
@pytest.mark.parametrize("name", ["fifo.txt", "fifo.jsonl", "fifo.parquet", "fifo.idx"])
def test_a_pipe_is_named_as_such_not_as_missing(tmp_path, name):
    """``/dev/stdin``, ``<(...)`` and named pipes were reported as 'no such file'."""
    pipe = tmp_path / name
    os.mkfifo(pipe)
    if name.endswith(".idx"):
        (tmp_path / "fifo.bin").write_bytes(b"")
    line = one_error_line(run("pack", pipe, "--out", tmp_path / "out"), 1)
    assert line == (f"seqpack: error: {pipe}: not a regular file (a pipe, a device or a socket): write the data to a "
                    f"file first")
    assert not (tmp_path / "out").exists()


def test_a_file_name_with_a_line_break_stays_on_one_line(tmp_path):
    path = tmp_path / "bad\nname.jsonl"
    path.write_text('{"text": 1}\n')
    line = one_error_line(run("pack", path, "--out", tmp_path / "out"), 1)
    assert line == f"seqpack: error: {tmp_path}/bad\\nname.jsonl:1: field 'text' is not a string"


def test_a_document_over_the_token_limit_names_the_flag_that_raises_it(tmp_path):
    """--cut-long did not lift the 1,000,000-token guard, and nothing said what would."""
    book = tmp_path / "book.txt"
    book.write_text("ab " * 400_000)
    line = one_error_line(run("pack", book, "--out", tmp_path / "out", "--cut-long"), 1)
    assert line == (f"seqpack: error: {book}: document has 1200002 tokens; the limit is 1000000 (first token over it "
                    f"at position 1000000) (--max-document-tokens raises the limit)")
    result = run("pack", book, "--out", tmp_path / "out", "--cut-long", "--quiet", "--json",
                 "--max-document-tokens", 1_200_002)
    assert result.returncode == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert manifest["binding"]["limits"] == {"max_tokens": 1_200_002, "max_bytes": 9_600_016}
    assert run("verify", tmp_path / "out", "--quiet").returncode == 0
    assert "--max-document-tokens must be at least 3" in one_error_line(
        run("pack", book, "--out", tmp_path / "other", "--max-document-tokens", 2), 2)


@pytest.mark.parametrize("split", ["", "  "])
def test_an_empty_split_name_is_a_usage_error(tmp_path, split):
    (tmp_path / "a.txt").write_text("hello")
    line = one_error_line(run("pack", tmp_path / "a.txt", "--out", tmp_path / "out", "--split", split), 2)
    assert line == "seqpack: error: --split needs the split's name or a split receipt .json file"
