"""Audit of the corpus layer: arguments and inputs that used to be misread or crash unnamed."""

import bz2
import gzip
import io as io_module
import json
import lzma
import os
import re
import sys
import zipfile

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


def _zip_bytes(data):
    buffer = io_module.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("docs.jsonl", data)
    return buffer.getvalue()


COMPRESSORS = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress, "zip": _zip_bytes,
               "zstd": lambda data: b"\x28\xb5\x2f\xfd" + data}  # a zstd frame's magic (no zstd module needed)


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_compressed_inputs_are_refused_by_their_first_bytes(tmp_path, kind):
    """Used to pack the compressed bytes as one text document, or fail as 'not valid JSON'."""
    data = COMPRESSORS[kind](json.dumps({"text": "hello"}).encode() + b"\n")
    for name in ("docs.jsonl", "docs.txt"):
        (tmp_path / name).write_bytes(data)
    message = f"docs.jsonl: {kind}-compressed; decompress it first"
    with pytest.raises(sp.InvalidInputError, match=message):
        io.JsonLines(tmp_path / "docs.jsonl")
    with pytest.raises(sp.InvalidInputError, match=message.replace("jsonl", "txt")):
        pack([io.TextFiles(tmp_path / "docs.txt")], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_binary_corpus_files_in_a_directory_are_refused_not_read_as_text(tmp_path):
    """A directory's Parquet file was packed as one 'text' document of its bytes."""
    pa = pytest.importorskip("pyarrow", reason="writing Parquet and Arrow files needs the corpus extra")
    import pyarrow.parquet as pq

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("plain text")
    table = pa.table({"text": ["a", "b"]})
    pq.write_table(table, corpus / "b.parquet")
    with pa.ipc.new_file(str(tmp_path / "c.arrow"), table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "d.idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(30))
    hint = "give it as an input of its own, named by its extension"
    with pytest.raises(sp.InvalidInputError, match=rf"b\.parquet: a Parquet file, not text: {hint}"):
        pack([io.TextFiles(corpus)], tmp_path / "out")
    for name, what in (("c.arrow", "an Arrow file"), ("d.idx", "a Megatron index")):
        (corpus / "b.parquet").unlink(missing_ok=True)
        (corpus / name).write_bytes((tmp_path / name).read_bytes())
        with pytest.raises(sp.InvalidInputError, match=rf"{re.escape(name)}: {what}, not text: "):
            pack([io.TextFiles(corpus)], tmp_path / "out")
        (corpus / name).unlink()
    with pytest.raises(sp.InvalidInputError, match=r"c\.arrow: an Arrow file, not JSONL: "):
        io.JsonLines(tmp_path / "c.arrow")
    assert not (tmp_path / "out").exists()
    assert pack([io.TextFiles(corpus, pattern="*.txt")], tmp_path / "out")["counts"]["documents"] == 1


@pytest.mark.parametrize("text", ["BZh91AY no", "PK and gz", ""])
def test_text_that_starts_like_a_magic_number_is_text(tmp_path, text):
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": text or "x"}) + "\n")
    assert len(io.TextFiles(tmp_path / "a.txt").inputs) == 1
    assert pack([io.JsonLines(tmp_path / "docs.jsonl")], tmp_path / "out")["counts"]["documents"] == 1


def test_a_packed_dataset_under_a_directory_is_skipped_and_listed(tmp_path, text):
    corpus = tmp_path / "corpus"
    (corpus / "deeper").mkdir(parents=True)
    (corpus / "b.txt").write_text("bee")
    pack([io.TextFiles([text])], corpus / "deeper" / "packed")
    (corpus / "deeper" / ".packed.seqpack-partial-0123456789ab").mkdir()   # a staging sibling: hidden
    (corpus / "deeper" / ".packed.seqpack-partial-0123456789ab" / "tokens.bin").write_bytes(b"\x00\x01")
    (corpus / "web").mkdir()
    (corpus / "web" / "manifest.json").write_text('{"name": "an extension"}')  # not seqpack's: text
    reader = io.TextFiles(corpus)
    assert reader.paths == [corpus / "b.txt", corpus / "web" / "manifest.json"]
    assert reader.skipped == [corpus / "deeper" / "packed"]
    assert [item.within for item in reader.inputs] == [str(corpus)] * 2
    with pytest.raises(sp.InvalidInputError, match=r"packed: a packed dataset, not text files"):
        io.TextFiles(corpus / "deeper" / "packed")


def test_pack_corpus_refuses_an_output_inside_an_input_directory(tmp_path, text):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "b.txt").write_text("bee")
    with pytest.raises(sp.InvalidInputError, match=f"the output {corpus / 'out'} lies inside the input directory "
                                                   f"{corpus}: write it outside the inputs"):
        pack([io.TextFiles([text]), io.TextFiles([corpus])], corpus / "out")
    assert sorted(p.name for p in corpus.iterdir()) == ["b.txt"]
    pack([io.TextFiles([corpus / "b.txt"])], corpus / "out")  # a file given alone is no directory input


@pytest.mark.parametrize("record, hint", [
    ({"input_ids": [5, 6]}, " (the line has 'input_ids': pass --ids-field input_ids)"),
    ({"txt": "hi"}, "; name one with --text-field or --ids-field"),
])
def test_a_jsonl_line_without_the_field_says_which_flag_names_it(tmp_path, record, hint):
    """Used to say only "no field 'text'", unlike the Parquet reader."""
    lines = tmp_path / "ids2.jsonl"
    lines.write_text(json.dumps(record) + "\n")
    with pytest.raises(sp.InvalidInputError) as raised:
        pack([io.JsonLines(lines)], tmp_path / "out")
    assert str(raised.value) == f"{lines}:1: no field 'text'{hint}"


def test_reader_for_takes_a_megatron_prefix(tmp_path):
    from test_io_readers import write_megatron

    write_megatron(tmp_path / "meg", [[5, 6, 7], [8, 9]])
    reader = io.reader_for(tmp_path / "meg")
    assert isinstance(reader, io.Megatron) and reader.index_path == tmp_path / "meg.idx"
    with pytest.raises(sp.InvalidInputError, match="nothing: no such file or directory"):
        io.reader_for(tmp_path / "nothing")


def test_the_bytes_bar_counts_in_the_units_it_shows(monkeypatch):
    """tqdm printed 1024-based counts labelled MB (1.91M/2.86M here)."""
    pytest.importorskip("tqdm", reason="progress bars need the corpus extra (tqdm)")
    from tqdm import tqdm

    from seqpack.io.progress import Progress

    monkeypatch.setattr(sys, "stderr", io_module.StringIO())
    progress = Progress(enabled=False)
    progress._tqdm = tqdm
    progress.phase("writing", 3_000_000, "B")
    progress.advance(2_000_000)
    progress.close()
    assert "2.00M/3.00M" in sys.stderr.getvalue()


@pytest.mark.parametrize("step", ["rename out aside", "rename staging in", "write the manifest", "after the manifest"])
@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_publish_stopped_at_any_step_puts_the_old_dataset_back(tmp_path, text, monkeypatch, step, failure):
    """A full disk or Ctrl-C while publishing left the old dataset under a hidden name and
    the output without a manifest (or gone)."""
    from seqpack.io import format as fmt

    out = tmp_path / "out"
    (tmp_path / "b.txt").write_text("a second document")
    pack([io.TextFiles([text])], out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    renames, real_rename = [], os.rename
    stops = {"rename out aside": ("rename", 1), "rename staging in": ("rename", 2),
             "write the manifest": ("manifest", None), "after the manifest": ("rename", 3)}
    kind, number = stops[step]

    def rename(source, target):
        renames.append(target)
        if kind == "rename" and len(renames) == number:
            real_rename(source, target) if step == "after the manifest" else None
            raise failure
        real_rename(source, target)

    def dump(*args, **kwargs):
        raise failure

    monkeypatch.setattr(fmt.os, "rename", rename)
    if kind == "manifest":
        monkeypatch.setattr(fmt.json, "dump", dump)
    with pytest.raises(type(failure)):
        pack([io.TextFiles([text, text.parent / "b.txt"])], out, force=True)
    monkeypatch.undo()
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before, step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "out"], step
    io.verify_dataset(out)


@pytest.mark.parametrize("make, stranger", [
    (lambda d: (d / "part-1").mkdir(), "'part-1'"),
    (lambda d: (d / "part-00007").write_text("mine"), "'part-00007'"),
    (lambda d: (d / "part-00000" / "notes.txt").write_text("mine"), "'part-00000/notes.txt'"),
    (lambda d: (d / "manifest.json").write_text('{"name": "mine"}'), "manifest.json, which is not a seqpack manifest"),
])
def test_force_refuses_a_directory_that_only_looks_like_a_dataset(tmp_path, text, make, stranger):
    """--force deleted any entry named part-<digits> (a user's file or directory, whatever it
    held) and replaced a directory whose manifest.json was not seqpack's."""
    out = tmp_path / "out"
    pack([io.TextFiles([text])], out)
    make(out)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(sp.InvalidInputError, match=rf"is not a packed dataset \(it holds {re.escape(stranger)}\)"):
        pack([io.TextFiles([text])], out, force=True)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
