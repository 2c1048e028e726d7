"""Audit of the command line and ``seqpack.chapters``: ignored flags, tracebacks, wrong exit codes."""

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
    assert "--threads is 100000000000000000000; the maximum is 65536" in one_error_line(result, 2)


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
