"""One job, one driver: seqpack.io.pack_corpus, seqpack.ray.pack_corpus and ``seqpack pack``
describe a pack with one PackJob, checked once, and run it with one driver."""

import inspect
import json

import pytest

import seqpack as sp
from seqpack import io
from seqpack.cli import build_parser
from seqpack.io.job import REFUSED_INPUTS, PackJob, SerialRunner, run_job

CONFIG = sp.PackConfig(32, 2)


def test_both_engines_take_the_same_arguments():
    from seqpack.ray import pack_corpus as pack_on_ray  # Ray itself is imported only when a pack runs

    serial = list(inspect.signature(io.pack_corpus).parameters.values())
    on_ray = list(inspect.signature(pack_on_ray).parameters.values())
    assert serial == list(inspect.signature(PackJob.of).parameters.values())
    assert on_ray[:len(serial)] == serial  # names, kinds, defaults and annotations
    assert [parameter.name for parameter in on_ray[len(serial):]] == ["address", "workers", "max_retries"]
    assert [parameter.name for parameter in serial[:2]] == ["inputs", "out"]


def test_an_argument_neither_engine_takes_is_a_type_error(tmp_path, text):
    from seqpack.ray import pack_corpus as pack_on_ray

    for pack in (io.pack_corpus, pack_on_ray):
        with pytest.raises(TypeError, match="readers"):
            pack([text], tmp_path / "out", config=CONFIG, readers=[text])
    assert not (tmp_path / "out").exists()


def test_paths_and_readers_pack_alike(tmp_path, text):
    by_path = io.pack_corpus([text], tmp_path / "by-path", config=CONFIG)
    by_reader = io.pack_corpus([io.reader_for(text)], tmp_path / "by-reader", config=CONFIG)
    assert by_path["parts"] == by_reader["parts"]
    assert by_path["shards"] == {"count": 1, "placement": by_path["shards"]["placement"]}
    for name in ("tokens.bin", "occurrences.npy", "examples.npy", "documents.npy"):
        assert (tmp_path / "by-path" / "part-00000" / name).read_bytes() == \
            (tmp_path / "by-reader" / "part-00000" / name).read_bytes()


def test_a_job_is_checked_where_it_is_built(tmp_path, text):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("keep")
    refusals = {
        "out must be a path": dict(out=3),
        "inputs must be a list of readers or paths, not one": dict(inputs=text),
        r"inputs\[1\] is a int, not a path or a reader": dict(inputs=[text, 3]),
        "already exists": dict(out=tmp_path / "taken"),
        "shards must be an int": dict(shards=1.5),
        "threads must be at least 1": dict(threads=0),
        "progress must be a bool": dict(progress="yes"),
        "force must be a bool": dict(force="no"),
        "framed must be a bool": dict(framed=1),
        "long must be one of": dict(long="truncate"),
        "config must be a PackConfig": dict(config=(32, 2)),
        "tokenizer must be a seqpack.ByteTokenizer": dict(tokenizer="bytes"),
        "binding must be a BatchBinding": dict(binding="corpus"),
    }
    for message, change in refusals.items():
        arguments = {"inputs": [text], "out": tmp_path / "out", "config": CONFIG, **change}
        with pytest.raises(sp.InvalidInputError, match=message):
            PackJob.of(arguments.pop("inputs"), arguments.pop("out"), **arguments)
    assert (tmp_path / "taken" / "notes.txt").read_text() == "keep"
    assert not (tmp_path / "out").exists()


def test_the_default_binding_is_the_tokenizers_for_the_corpus_split(tmp_path, text):
    job = PackJob.of([text], tmp_path / "out", config=CONFIG)
    assert job.binding == sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="corpus")
    assert job.for_workers().readers == () and job.for_workers().inputs == job.inputs
    manifest = run_job(job, SerialRunner())
    assert sp.open_dataset(tmp_path / "out").binding == job.binding
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"] == manifest["counts"]


def test_a_byte_tokenizer_bound_by_its_bare_identity_keeps_the_byte_limit(tmp_path):
    # The binding of the identity alone counted no bytes: a dataset its own binding refuses was written
    # and verified (review).
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"text": "é" * 8}) + "\n")   # 16 bytes
    limits = sp.DecodeLimits(max_tokens=100, max_bytes=10)
    for binding in (sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="s", limits=limits),
                    sp.BatchBinding.for_tokenizer(sp.ByteTokenizer().identity, split="s", limits=limits)):
        with pytest.raises(sp.DecodeLimitError, match=r"in\.jsonl:1: document decodes to 16 bytes; the limit is 10"):
            io.pack_corpus([io.JsonLines(source)], tmp_path / "out", binding=binding, tokenizer=sp.ByteTokenizer(),
                           config=CONFIG)
    assert not (tmp_path / "out").exists()


def test_help_and_docstring_show_the_one_table_of_refused_inputs():
    pack = next(action for action in build_parser()._subparsers._group_actions[0].choices.items()
                if action[0] == "pack")[1]
    shown = " ".join(pack.format_help().split())
    documented = " ".join(io.pack_corpus.__doc__.split())
    for refusal in REFUSED_INPUTS:
        assert " ".join(refusal.split()) in shown
        assert " ".join(refusal.split()) in documented
