"""Shards packed serially (seqpack.io.shards, run by seqpack.io.job), which the Ray engine must
equal byte for byte: shard plans, one part per shard, global ordinals, errors naming shard,
file and line."""

import io as io_module
import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import seqpack as sp
from seqpack import io
from seqpack.errors import InvalidInputError, SeqpackError
from seqpack.io import format as fmt
from seqpack.io.job import PackJob, SerialRunner
from seqpack.io.shards import ShardProgress, Unit, pack_shard, plan_shards

from helpers import write_jsonl

FIELDS = ("inputs", "targets", "positions", "segments", "token_valid", "target_valid", "loss_mask", "valid_lengths")
TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="tests")
CONFIG = sp.PackConfig(64, 4)


def jsonl_corpus(directory, files=6, per_file=25, seed=0):
    """``files`` JSONL files of lognormal-length texts (some longer than a row of 64)."""
    rng = np.random.default_rng(seed)
    directory.mkdir()
    paths = []
    for number in range(files):
        sizes = np.clip(rng.lognormal(np.log(30), 1.0, per_file).astype(int), 1, 200)
        texts = ["".join(map(chr, rng.integers(97, 123, size=n))) for n in sizes]
        paths.append(write_jsonl(directory / f"part{number}.jsonl", [{"text": t} for t in texts]))
    return paths


def readers(paths):
    return [io.JsonLines(path) for path in paths]


def sharded(paths, out, shards, policy="best-fit-decreasing", run=None):
    job = PackJob.of(readers(paths), out, binding=BINDING, tokenizer=TOKENIZER, config=CONFIG, shards=shards,
                     policy=policy, long="cut")
    return io.job.run_job(job, run)


def examples(dataset):
    """Every example's place in its input and source tokens, by global ordinal."""
    return [(dataset.example_id(i), dataset.example(i).source_tokens.tolist()) for i in range(dataset.occurrence_count)]


def test_plan_is_contiguous_balanced_and_drops_empty_shards(tmp_path):
    paths = jsonl_corpus(tmp_path / "in")
    inputs, shards = plan_shards(readers(paths), 3)
    assert [item.name for item in inputs] == [str(p) for p in paths]
    assert [[unit.first_input for unit in shard.units] for shard in shards] == [[0, 1], [2, 3], [4, 5]]
    assert [(shard.index, shard.count) for shard in shards] == [(0, 3), (1, 3), (2, 3)]
    _, many = plan_shards(readers(paths), 50)  # more shards than files: files cut into line ranges
    ranges = [(unit.first_input, unit.reader.first_line) for shard in many for unit in shard.units]
    assert ranges == sorted(ranges) and len(set(ranges)) == len(ranges) > 6 and 6 < len(many) <= 50
    assert dict(reversed(ranges)) == dict.fromkeys(range(6), 1)  # each file's first range starts at line 1
    _, one = plan_shards(readers(paths), 1)
    assert len(one) == 1 and len(one[0].units) == 6
    _, default = plan_shards(readers(paths), None)  # one per 64 MiB: all of this in one
    assert len(default) == 1
    for bad, message in ((0, "shards must be at least 1, got 0"), (True, "shards must be an int, got bool"),
                         (2.0, "shards must be an int, got float")):
        with pytest.raises(InvalidInputError, match=f"^{message}$"):
            plan_shards(readers(paths), bad)


def test_a_large_unsplittable_input_goes_to_the_shard_of_its_middle_byte(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("x" * 6200)
    small = [write_jsonl(tmp_path / f"s{i}.jsonl", [{"text": "y" * 50}] * 10) for i in range(3)]
    _, shards = plan_shards([io.TextFiles([big]), *readers(small)], 4)
    assert [[unit.first_input for unit in shard.units] for shard in shards] == [[0], [1, 2, 3]]


def test_a_large_jsonl_file_is_cut_into_line_ranges_at_the_shard_boundaries(tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", [{"text": "x" * 50}] * 100)  # 100 lines of 63 bytes
    small = [write_jsonl(tmp_path / f"s{i}.jsonl", [{"text": "y" * 50}] * 10) for i in range(3)]
    _, shards = plan_shards(readers([big, *small]), 4)  # a shard is 8190 / 4 = 2047.5 bytes
    pieces = [[(unit.first_input, unit.reader.start, unit.reader.stop, unit.reader.first_line, unit.weight)
               for unit in shard.units] for shard in shards]
    # Cuts at 2048, 4095 and 6143 move on to the next line start: 2079 (line 34), 4095 (66), 6174 (99).
    assert pieces == [[(0, 0, 2079, 1, 2079)], [(0, 2079, 4095, 34, 2016)], [(0, 4095, 6174, 66, 2079)],
                      [(0, 6174, 6300, 99, 126), (1, 0, None, 1, 630), (2, 0, None, 1, 630), (3, 0, None, 1, 630)]]
    _, alone = plan_shards(readers(small), 3)  # files under a shard's bytes stay whole
    assert [[(unit.first_input, unit.reader.stop) for unit in shard.units] for shard in alone] == \
        [[(0, None)], [(1, None)], [(2, None)]]


@pytest.mark.slow
def test_directory_files_are_units_and_parquet_files_are_split_by_row_groups(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet row groups need the corpus extra (pyarrow)")
    import pyarrow as pa

    texts = [f"document {i} " * (i % 7 + 1) for i in range(40)]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=10)
    text_dir = tmp_path / "texts"
    text_dir.mkdir()
    for i in range(3):
        (text_dir / f"{i}.txt").write_text(texts[i] * 3)
    chosen = [io.TextFiles([text_dir]), io.ArrowBatches(path)]
    inputs, shards = plan_shards(chosen, 8)
    units = [unit for shard in shards for unit in shard.units]
    assert [unit.first_input for unit in units] == [0, 1, 2, 3, 3, 3, 3] and len(inputs) == 4
    manifest = io.pack_corpus(chosen, tmp_path / "out", binding=BINDING, tokenizer=TOKENIZER, config=CONFIG,
                            shards=8, long="cut")
    io.pack_corpus([io.TextFiles([text_dir]), io.ArrowBatches(path)], tmp_path / "whole", binding=BINDING,
                   tokenizer=TOKENIZER, config=CONFIG, long="cut")
    assert len(manifest["parts"]) == len(shards) >= 5
    dataset = io.open_dataset(tmp_path / "out")
    documents = np.concatenate([part.documents for part in dataset.parts])
    # Rows of the Parquet file are numbered across row groups, inputs globally.
    assert documents[3:, 0].tolist() == [3] * 40 and documents[3:, 1].tolist() == list(range(40))
    reference = io.open_dataset(tmp_path / "whole")
    assert examples(reference) == examples(dataset)
    assert io.verify_dataset(tmp_path / "out")["parts"] == len(shards)


def assert_the_concatenation_of_each_shard_alone(chosen, out, count):
    """The dataset of ``chosen`` in ``count`` shards at ``out`` holds, batch by batch, the
    datasets of each shard's units packed alone, with segments counted on; return its manifest."""
    manifest = io.pack_corpus(chosen, out, binding=BINDING, tokenizer=TOKENIZER, config=CONFIG, shards=count,
                            policy="best-fit-decreasing", long="cut")
    _, shards = plan_shards(chosen, count)
    combined = io.open_dataset(out)
    batches, first_example = [], 0
    for shard in shards:
        alone = out.parent / f"{out.name}-alone{shard.index}"
        io.pack_corpus([unit.reader for unit in shard.units], alone, binding=BINDING, tokenizer=TOKENIZER,
                     config=CONFIG, shards=1, policy="best-fit-decreasing", long="cut")
        for batch in io.open_dataset(alone):
            segments = np.where(batch.segments >= 0, batch.segments + first_example, batch.segments)
            batches.append({**{f: getattr(batch, f) for f in FIELDS}, "segments": segments})
        first_example += json.loads((alone / fmt.MANIFEST).read_text())["counts"]["examples"]
    assert len(combined) == len(batches) == manifest["counts"]["batches"]
    assert first_example == manifest["counts"]["examples"]
    for number, (batch, expected) in enumerate(zip(combined, batches)):
        for field in FIELDS:
            assert np.array_equal(getattr(batch, field), expected[field]), (number, field)
    assert [part["first_example"] for part in manifest["parts"]] == \
        list(np.cumsum([0] + [part["examples"] for part in manifest["parts"]])[:-1])
    assert manifest["shards"]["count"] == len(shards) and "placed on its own" in manifest["shards"]["placement"]
    assert io.verify_dataset(out)["parts"] == len(shards)
    return manifest


def test_open_dataset_over_the_parts_is_the_concatenation_of_each_shard_alone(tmp_path):
    paths = jsonl_corpus(tmp_path / "in")
    assert len(assert_the_concatenation_of_each_shard_alone(readers(paths), tmp_path / "all", 3)["parts"]) == 3


@pytest.mark.parametrize("count", [1, 2, 4])
def test_one_jsonl_file_in_shards_is_the_concatenation_with_global_lines(tmp_path, count):
    paths = jsonl_corpus(tmp_path / "in", files=3, per_file=40)
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"".join(path.read_bytes() for path in paths) + b"\n")  # and a blank last line
    manifest = assert_the_concatenation_of_each_shard_alone([io.JsonLines(big)], tmp_path / "all", count)
    assert len(manifest["parts"]) == count
    whole = tmp_path / "whole"
    io.pack_corpus([io.JsonLines(big)], whole, binding=BINDING, tokenizer=TOKENIZER, config=CONFIG, long="cut")
    # Ordinals in line order, every example named by its line in the whole file.
    assert examples(io.open_dataset(tmp_path / "all")) == examples(io.open_dataset(whole))
    dataset = io.open_dataset(tmp_path / "all")
    assert dataset.example_id(dataset.occurrence_count - 1).startswith(f"{big}:120[")  # a cut of the last line


def test_shards_cut_a_jsonl_file_of_pairs_at_record_boundaries_and_never_split_a_pair(tmp_path):
    rng = np.random.default_rng(8)
    records = [{key: rng.integers(2, 258, int(rng.integers(1, 12))).tolist()
                for key in ("prompt_ids", "chosen_ids", "rejected_ids")} for _ in range(90)]
    big = write_jsonl(tmp_path / "dpo.jsonl", records)
    _, shards = plan_shards([io.JsonLines(big)], 4)
    data = big.read_bytes()
    starts = [unit.reader.start for shard in shards for unit in shard.units]
    assert len(starts) == 4 and all(start == 0 or data[start - 1:start] == b"\n" for start in starts)  # line starts
    manifest = assert_the_concatenation_of_each_shard_alone([io.JsonLines(big)], tmp_path / "all", 4)
    assert manifest["format_version"] == 3 and manifest["counts"]["pairs"] == 90
    assert [part["examples"] for part in manifest["parts"]] == [2 * part["pairs"] for part in manifest["parts"]]
    dataset = io.open_dataset(tmp_path / "all")
    for p, record in enumerate(records):  # pair p is line p + 1, its sequences global examples 2p and 2p + 1
        assert dataset.example_id(2 * p) == dataset.example_id(2 * p + 1) == f"{big}:{p + 1}"
        assert dataset.example(2 * p + 1).source_tokens.tolist() == record["prompt_ids"] + record["rejected_ids"]
    for batch in dataset:
        found = batch.occurrence_records
        assert (found["ordinal"][1::2] == found["ordinal"][0::2] + 1).all()
        assert (found["row"][1::2] == found["row"][0::2]).all()


def test_one_shard_holds_the_unsharded_dataset_bytes(tmp_path):
    paths = jsonl_corpus(tmp_path / "in")
    one = sharded(paths, tmp_path / "one", 1, policy="next-fit")
    whole = io.pack_corpus(readers(paths), tmp_path / "whole", binding=BINDING, tokenizer=TOKENIZER, config=CONFIG,
                           long="cut")
    assert one["parts"][0]["files"] == whole["parts"][0]["files"]
    assert one == whole  # a job that names no shard count is one shard


def test_shards_of_only_empty_documents_have_no_part_and_are_counted(tmp_path):
    """A shard whose documents are all empty is no error: it has no part, its empty
    documents are counted, and the dataset holds what the unsharded one holds."""
    lines = ["some text", "more", "x" * 30, "tail", "end"] + [""] * 200
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": line} for line in lines])
    texts = tmp_path / "texts"
    texts.mkdir()
    for number, text in enumerate(["ab", "cd"] + [""] * 6):
        (texts / f"{number}.txt").write_text(text)
    for name, reader, skipped in (("jsonl", io.JsonLines(corpus), 200), ("files", io.TextFiles(texts), 6)):
        manifest = io.pack_corpus([reader], tmp_path / name, binding=BINDING, tokenizer=TOKENIZER, config=CONFIG,
                                shards=3, long="cut")
        whole = io.pack_corpus([reader], tmp_path / f"{name}-whole", binding=BINDING, tokenizer=TOKENIZER,
                               config=CONFIG, long="cut")
        assert manifest["counts"] == whole["counts"] and whole["counts"]["skipped_empty_documents"] == skipped
        assert len(manifest["parts"]) < 3
        assert examples(io.open_dataset(tmp_path / name)) == examples(io.open_dataset(tmp_path / f"{name}-whole"))
        assert io.verify_dataset(tmp_path / name)["files"] == 4 * len(manifest["parts"])
    (texts / "0.txt").write_text("")
    (texts / "1.txt").write_text("")
    with pytest.raises(InvalidInputError, match="the inputs hold no document with content"):
        io.pack_corpus([io.TextFiles(texts)], tmp_path / "none", binding=BINDING, tokenizer=TOKENIZER, config=CONFIG,
                     shards=3)


def test_a_bad_line_names_shard_file_and_line_and_leaves_nothing(tmp_path):
    paths = jsonl_corpus(tmp_path / "in")
    lines = paths[3].read_text().splitlines(keepends=True)
    lines[6] = '{"text": "unterminated\n'
    paths[3].write_text("".join(lines))
    with pytest.raises(InvalidInputError, match=r"^shard 1 of 3 \(.*part2.jsonl \.\.\. .*part3.jsonl\): "
                                                r".*part3.jsonl:7: not valid JSON"):
        sharded(paths, tmp_path / "out", 3)
    assert sorted(os.listdir(tmp_path)) == ["in"]


def test_a_bad_line_in_a_later_line_range_names_its_line_in_the_file(tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", [{"text": f"document {i}"} for i in range(300)])
    lines = big.read_text().splitlines(keepends=True)
    lines[250] = '{"text": "unterminated\n'
    big.write_text("".join(lines))
    _, shards = plan_shards([io.JsonLines(big)], 2)
    assert shards[1].units[0].reader.first_line < 251
    with pytest.raises(InvalidInputError, match=r"^shard 1 of 2 \(.*big.jsonl\): .*big.jsonl:251: not valid JSON"):
        io.pack_corpus([io.JsonLines(big)], tmp_path / "out", binding=BINDING, tokenizer=TOKENIZER, config=CONFIG,
                     shards=2)
    assert sorted(os.listdir(tmp_path)) == ["big.jsonl"]


def test_a_shard_rewrites_what_an_earlier_attempt_left(tmp_path):
    paths = jsonl_corpus(tmp_path / "in", files=2)
    inputs, shards = plan_shards(readers(paths), 2)
    job = PackJob.of(readers(paths), tmp_path / "out", binding=BINDING, tokenizer=TOKENIZER, config=CONFIG,
                     long="cut")
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "part-00001").mkdir()
    (staging / "part-00001" / "tokens.bin").write_bytes(b"left by a killed worker")
    first, _ = pack_shard(job, shards[1], staging)
    again, _ = pack_shard(job, shards[1], staging)
    assert first == again and first["name"] == "part-00001"
    assert sorted(os.listdir(staging)) == ["part-00001"]
    assert (staging / "part-00001" / "tokens.bin").stat().st_size == first["files"]["tokens.bin"]["bytes"]
    assert isinstance(shards[1].units[0], Unit)


@pytest.mark.slow
def test_cli_shards_and_engine_usage(tmp_path):
    paths = jsonl_corpus(tmp_path / "in")
    command = [sys.executable, "-m", "seqpack", "pack", *map(str, paths), "--capacity", "64", "--rows-per-batch", "4", "--cut-long",
               "--quiet", "--json", "--out"]
    done = subprocess.run([*command, str(tmp_path / "out"), "--shards", "2"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    manifest = json.loads(done.stdout)
    assert [part["name"] for part in manifest["parts"]] == ["part-00000", "part-00001"]
    reference = sharded(paths, tmp_path / "api", 2, policy="next-fit")
    assert manifest["parts"] == reference["parts"]
    for arguments, message in ((["--shards", "0"], "--shards must be at least 1"),
                               (["--address", "auto"], "--address goes with --engine ray"),
                               (["--workers", "2"], "--workers goes with --engine ray"),
                               (["--engine", "ray", "--workers", "0"], "--workers must be at least 1")):
        failed = subprocess.run([*command, str(tmp_path / "bad"), *arguments], capture_output=True, text=True,
                                check=False)
        assert failed.returncode == 2 and message in failed.stderr


def test_the_bar_counts_shards_and_tokens(monkeypatch):
    pytest.importorskip("tqdm", reason="progress bars need the corpus extra (tqdm)")

    class Terminal(io_module.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = ShardProgress(3, enabled=True)
    for _ in range(3):
        bar.shard_done({"documents": 5, "tokens": 1_000_000}, 10)
    bar.close()
    drawn = sys.stderr.getvalue()
    assert "packing shards" in drawn and "3/3" in drawn and "3,000,000 tokens" in drawn


def test_the_ray_engine_without_ray_names_the_extra(monkeypatch, tmp_path):
    from seqpack.ray import pack_corpus

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if it were not installed
    with pytest.raises(InvalidInputError, match=r"pip install 'seqpack\[ray\]'"):
        pack_corpus([], tmp_path / "out", config=CONFIG)


@pytest.mark.slow  # importing ray takes about a second
def test_a_cluster_that_cannot_be_joined_is_an_input_error(monkeypatch, tmp_path, capsys):
    ray = pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    from seqpack.cli import main

    def refuse(**options):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    paths = jsonl_corpus(tmp_path / "in", files=1)
    status = main(["pack", str(paths[0]), "--out", str(tmp_path / "out"), "--engine", "ray", "--address", "auto"])
    assert status == 1
    assert "cannot join the Ray cluster at auto: Could not find any running Ray instance." in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in"]


# --- shard plans past int64, and runners that report a shard twice or never --------------


def plan(readers, count):
    return [[(unit.first_input, getattr(unit.reader, "start", None)) for unit in shard.units]
            for shard in plan_shards(readers, count)[1]]


# Regression: a shard count past int64 products wrapped around and merged shards.
def test_a_shard_count_past_int64_products_plans_exactly(tmp_path):
    """Text files of 1 and 3 bytes: with more shards than bytes each file is a shard of its
    own. The int64 product of a middle byte and 2**62 wrapped around and merged them."""
    for name, text in (("a.txt", "x"), ("b.txt", "yyy")):
        (tmp_path / name).write_text(text)
    readers = [io.TextFiles([tmp_path / "a.txt"]), io.TextFiles([tmp_path / "b.txt"])]
    expected = [[(0, None)], [(1, None)]]
    assert plan(readers, 4) == expected
    for count in (2 ** 62, 10 ** 19, 2 ** 200):
        assert plan(readers, count) == expected


# Regression: more shards than bytes was a MemoryError or a wrapped int64.
def test_a_huge_shard_count_splits_a_jsonl_file_like_one_shard_per_byte(tmp_path):
    """More shards than bytes plan as one shard per byte (every line alone), instead of
    a MemoryError or a wrapped int64."""
    path = write_jsonl(tmp_path / "big.jsonl", [{"text": "x" * 50}] * 40)
    total = path.stat().st_size
    expected = plan([io.JsonLines(path)], total)
    assert len(expected) == 40
    for count in (total + 1, 2 ** 40, 2 ** 62, 10 ** 30):
        assert plan([io.JsonLines(path)], count) == expected


# Regression: a shard reported twice was counted twice in the manifest, a missing one crashed.
def test_a_runner_reporting_a_shard_twice_or_never_is_an_error(tmp_path):
    """A duplicated task's record was counted twice (the manifest's input_bytes doubled);
    a missing one crashed with a TypeError. Nothing is published either way."""
    corpus = jsonl_corpus(tmp_path / "in", files=3)
    expected = sharded(corpus, tmp_path / "serial", 3)

    class Twice(SerialRunner):
        def __call__(self, *arguments):
            for index, result in super().__call__(*arguments):
                yield index, result
                yield index, result

    class Never(SerialRunner):
        def __call__(self, *arguments):
            for index, result in super().__call__(*arguments):
                if index != 1:
                    yield index, result

    class Stranger(SerialRunner):
        def __call__(self, *arguments):
            yield from super().__call__(*arguments)
            yield -1, (None, 0)

    for name, run, message in (("twice", Twice(), r"reported shard 0 of 3 twice"),
                               ("never", Never(), r"never reported shard 1 of 3 \("),
                               ("stranger", Stranger(), r"reported shard -1 of 3 \(no such shard\)")):
        with pytest.raises(SeqpackError, match=message):
            sharded(corpus, tmp_path / name, 3, run=run)
        assert not (tmp_path / name).exists()
    assert sharded(corpus, tmp_path / "again", 3)["input_bytes"] == expected["input_bytes"] == \
        sum(p.stat().st_size for p in corpus)


# Regression: a sharded pack took one path instead of a list of inputs.
def test_a_sharded_pack_refuses_one_input_instead_of_a_list(tmp_path):
    (tmp_path / "a.txt").write_text("some text")
    binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="one-path")
    with pytest.raises(sp.InvalidInputError, match="inputs must be a list of readers or paths"):
        io.pack_corpus(str(tmp_path / "a.txt"), tmp_path / "out", binding=binding, tokenizer=binding.tokenizer,
                     config=sp.PackConfig(64, 2), shards=2)
    assert not (tmp_path / "out").exists()


# --- the Ray entry point: its inputs, and the address it is given ------------------------


# Regression: ray.pack_corpus iterated a path string character by character ('/data' read '/').
def test_ray_pack_corpus_refuses_one_path_given_as_a_string(tmp_path):
    """A string was iterated character by character: '/data' read the root directory '/'."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    from seqpack.ray import pack_corpus

    (tmp_path / "a.txt").write_text("some text")
    for inputs in (str(tmp_path), tmp_path):
        with pytest.raises(InvalidInputError, match="inputs must be a list of readers or paths"):
            pack_corpus(inputs, tmp_path / "out", config=CONFIG)
    assert not (tmp_path / "out").exists()


def closed_port() -> int:
    """A loopback port that nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


FAILS_FAST = """
import sys, time
import ray
import seqpack as sp
from seqpack.errors import InvalidInputError
from seqpack.ray import pack_corpus

path, out, address = sys.argv[1:]
started = time.monotonic()
try:
    pack_corpus([path], out, config=sp.PackConfig(32, 3), address=address)
except InvalidInputError as error:
    print(f"{time.monotonic() - started:.1f}|{ray.is_initialized()}|{error}")
"""


# From the bb15d34 fix: ray.init retried a closed port for ten minutes, then logged only Ray's GCS timeout.
def test_ray_pack_corpus_fails_fast_on_an_unreachable_address(tmp_path):
    """``ray.init`` retried a closed port for about ten minutes, then logged only Ray's
    "Failed to get cluster ID from GCS server: TimedOut". Each call runs in a fresh
    process, where no Ray is initialized yet (one already running would be used whatever
    the address)."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "some text"}])
    port = closed_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        run = subprocess.run([sys.executable, "-c", FAILS_FAST, str(path), str(tmp_path / "out"), address],
                             capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 0, run.stderr
        seconds, initialized, message = run.stdout.strip().split("|", 2)
        assert re.match(rf"^cannot reach a Ray cluster at {re.escape(address)}: ", message), message
        assert float(seconds) < 10 and initialized == "False" and not (tmp_path / "out").exists()


# From the bb15d34 fix: only an explicit host:port is probed; "auto", None and portless addresses are Ray's.
def test_only_an_explicit_host_and_port_is_probed(monkeypatch):
    """A silent address names the wait; "auto", None and addresses without a port are Ray's."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    from seqpack.ray import pipeline

    calls = []

    def silent(target, timeout):
        calls.append((target, timeout))
        raise TimeoutError("timed out")

    monkeypatch.setattr(pipeline.socket, "create_connection", silent)
    for address in (None, "auto", "local", "head-node", "anyscale://cluster"):
        pipeline.check_reachable(address)
    assert calls == []
    for address, target in (("10.0.0.7:6379", ("10.0.0.7", 6379)), ("ray://head:10001", ("head", 10001)),
                            ("[::1]:6379", ("::1", 6379))):
        with pytest.raises(InvalidInputError, match=rf"^cannot reach a Ray cluster at {re.escape(address)}: "
                                                    r"no answer within 5 s$"):
            pipeline.check_reachable(address)
        assert calls.pop() == (target, pipeline.CONNECT_TIMEOUT)


class LoopbackServer:
    """A one-connection TCP server on a loopback port that ``reply(connection)`` answers."""

    def __init__(self, reply):
        import threading

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, args=(reply,), daemon=True)
        self.thread.start()

    def _serve(self, reply):
        connection, _ = self.listener.accept()
        with connection:
            reply(connection)

    def close(self):
        """Once the connection is served (the kernel accepts a client before ``accept``
        returns, so the probe may finish first), stop listening."""
        self.thread.join(10)
        self.listener.close()


def http1(connection):
    connection.recv(1024)
    connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


def banner(connection):
    connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    connection.recv(1024)


def silent(connection):
    time.sleep(2)


def hang_up(connection):
    """Reads the whole greeting (unread bytes would make the close a reset), then closes."""
    from seqpack.ray.pipeline import HTTP2_GREETING

    received = b""
    while len(received) < len(HTTP2_GREETING):
        received += connection.recv(1024)


# From the 00a23a6 fix: ray.init hung on a port where something other than a Ray cluster listens.
@pytest.mark.parametrize("reply, message", [
    (http1, r"is not a Ray cluster's address: an HTTP/1 server answers there \(the Ray dashboard does, on port 8265 "
            r"by default; a cluster's address is its GCS port, 6379 by default, or ray://host:10001 for Ray Client\)$"),
    (banner, r"is not a Ray cluster's address: the server answered b'SSH-2.0-O'$"),
    (hang_up, r"is not a Ray cluster's address: the server closed the connection without a word$"),
    (silent, r"^cannot reach a Ray cluster at ray://127\.0\.0\.1:\d+: no answer within 0\.5 s$"),
])
def test_an_address_where_something_else_listens_is_refused_in_seconds(monkeypatch, reply, message):
    """``ray.init`` hung inside Ray on such an address; the probe names what answered."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    from seqpack.ray import pipeline

    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    server = LoopbackServer(reply)
    try:
        started = time.monotonic()
        with pytest.raises(InvalidInputError, match=message):
            pipeline.check_reachable(f"ray://{server.address}", timeout=0.5)
        assert time.monotonic() - started < 1.5
    finally:
        server.close()


# From the 00a23a6 fix: a TLS cluster would not answer the plain-text greeting, so with RAY_USE_TLS none is sent.
def test_with_tls_only_the_connection_is_checked(monkeypatch):
    """A TLS cluster would not answer a plain-text greeting; with RAY_USE_TLS set the probe sends none."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra")
    from seqpack.ray import pipeline

    received = []
    server = LoopbackServer(lambda connection: received.append(connection.recv(1024)))
    monkeypatch.setenv("RAY_USE_TLS", "1")
    try:
        pipeline.check_reachable(server.address, timeout=0.5)
    finally:
        server.close()
    assert received == [b""]
