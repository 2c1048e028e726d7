"""Audit of the corpus layer: arguments and inputs that used to be misread or crash unnamed."""

import json

import numpy as np
import pytest

import seqpack as sp
from seqpack import io

TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="tests")
CONFIG = sp.PackConfig(32, 2)


def pack(readers, out, **options):
    options.setdefault("tokenizer", TOKENIZER)
    options.setdefault("binding", BINDING)
    return io.pack_corpus(readers, out, config=CONFIG, **options)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello")
    return path


@pytest.mark.parametrize("given", ["str", "path", "reader"])
def test_pack_corpus_refuses_one_input_instead_of_a_list(tmp_path, text, given):
    readers = {"str": str(text), "path": text, "reader": io.TextFiles([text])}[given]
    with pytest.raises(sp.InvalidInputError, match="readers must be a list of readers, not one"):
        pack(readers, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_pack_corpus_names_an_item_that_is_not_a_reader(tmp_path, text):
    with pytest.raises(sp.InvalidInputError, match=r"readers\[1\] is a PosixPath, not a reader"):
        pack([io.TextFiles([text]), text], tmp_path / "out")


def test_pack_corpus_reads_readers_given_as_a_generator(tmp_path, text):
    manifest = pack((reader for reader in [io.TextFiles([text])]), tmp_path / "out")
    assert manifest["counts"]["documents"] == 1


def test_pack_corpus_checks_binding_tokenizer_and_out(tmp_path, text):
    with pytest.raises(sp.InvalidInputError, match="binding must be a BatchBinding"):
        pack([io.TextFiles([text])], tmp_path / "out", binding=None)
    with pytest.raises(sp.InvalidInputError, match="tokenizer must be"):
        pack([io.TextFiles([text])], tmp_path / "out", tokenizer=None)
    with pytest.raises(sp.InvalidInputError, match="out must be a path"):
        pack([io.TextFiles([text])], None)
    with pytest.raises(sp.InvalidInputError, match="progress must be"):
        pack([io.TextFiles([text])], tmp_path / "out", progress="yes")


def test_an_equal_byte_tokenizer_packs_like_the_bindings_own(tmp_path, text):
    """Not the binding's instance but the same identity: used to fail after reading everything."""
    manifest = pack([io.TextFiles([text])], tmp_path / "out", tokenizer=sp.ByteTokenizer())
    assert manifest["binding"]["tokenizer"]["kind"] == "byte"
    io.verify_dataset(tmp_path / "out")


def test_a_truthy_non_bool_force_does_not_replace_a_dataset(tmp_path, text):
    pack([io.TextFiles([text])], tmp_path / "out")
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    other = tmp_path / "b.txt"
    other.write_text("something else")
    with pytest.raises(sp.InvalidInputError, match="force must be a bool"):
        pack([io.TextFiles([other])], tmp_path / "out", force="no")
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "out"]


def test_a_truthy_non_bool_framed_is_refused(tmp_path):
    lines = tmp_path / "ids.jsonl"
    lines.write_text(json.dumps({"ids": [0, 5, 1]}) + "\n")
    with pytest.raises(sp.InvalidInputError, match="framed must be a bool"):
        pack([io.JsonLines(lines, ids_field="ids")], tmp_path / "out", framed="no")


@pytest.mark.parametrize("line, kind", [('["text"]', "array"), ('"text"', "string"), ("5", "number"),
                                        ("null", "null"), ("true", "boolean")])
def test_a_jsonl_value_that_is_not_an_object_is_named(tmp_path, line, kind):
    lines = tmp_path / "docs.jsonl"
    lines.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    with pytest.raises(sp.InvalidInputError, match=rf"docs.jsonl:2: a JSON {kind}, not an object with field 'text'"):
        pack([io.JsonLines(lines)], tmp_path / "out")


def test_a_text_field_and_an_ids_field_together_are_refused(tmp_path):
    lines = tmp_path / "docs.jsonl"
    lines.write_text(json.dumps({"text": "hi", "ids": [5]}) + "\n")
    with pytest.raises(sp.InvalidInputError, match="not both"):
        io.JsonLines(lines, text_field="text", ids_field="ids")
    with pytest.raises(sp.InvalidInputError, match="not both"):
        io.reader_for(lines, text_field="text", ids_field="ids")
    pa = pytest.importorskip("pyarrow", reason="Arrow input needs the corpus extra: pip install 'seqpack[corpus]'")
    with pytest.raises(sp.InvalidInputError, match="not both"):
        io.ArrowBatches(pa.table({"text": ["hi"], "ids": [[5]]}), text_field="text", ids_field="ids")
    # Either one alone still reads.
    assert io.JsonLines(lines).field == "text" and io.JsonLines(lines, ids_field="ids").field == "ids"


def test_a_bos_or_eos_id_that_names_no_token_is_refused(tmp_path):
    pytest.importorskip("tokenizers", reason="tokenizer files need the hf extra: pip install 'seqpack[hf]'")
    path = tmp_path / "gapped.json"
    path.write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1, "c": 3, "d": 5}, "unk_token": "[UNK]"},
    }))
    assert io.TokenizerFile(path, bos=0, eos=3).bos_id == 0      # IDs of tokens are fine
    with pytest.raises(sp.InvalidInputError, match="--bos 2 is not the ID of any token"):
        io.TokenizerFile(path, bos=2, eos=3)
    with pytest.raises(sp.InvalidInputError, match="--eos 2 is not the ID of any token"):
        io.TokenizerFile(path, bos=0, eos="2")


def test_pack_without_a_list_keeps_an_existing_dataset(tmp_path, text):
    pack([io.TextFiles([text])], tmp_path / "out")
    before = (tmp_path / "out" / "part-00000" / "tokens.bin").read_bytes()
    with pytest.raises(sp.InvalidInputError, match="readers must be a list of readers, not one"):
        pack(io.TextFiles([text]), tmp_path / "out", force=True)
    assert (tmp_path / "out" / "part-00000" / "tokens.bin").read_bytes() == before
    assert np.array_equal(io.open_dataset(tmp_path / "out").example(0).document.token_ids,
                          [0] + [b + 2 for b in b"hello"] + [1])


def test_pack_sharded_refuses_one_input_instead_of_a_list(tmp_path):
    from seqpack.io.shards import pack_sharded

    (tmp_path / "a.txt").write_text("some text")
    binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="audit")
    with pytest.raises(sp.InvalidInputError, match="readers must be a list of readers"):
        pack_sharded(str(tmp_path / "a.txt"), tmp_path / "out", binding=binding, tokenizer=binding.tokenizer,
                     config=sp.PackConfig(64, 2), shards=2)
    assert not (tmp_path / "out").exists()
