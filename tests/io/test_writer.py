"""pack_corpus, the library call that writes a packed dataset: its arguments, the progress
bar's units, and the publish that puts the new dataset in place of an old one (or the old
one back)."""

import io as io_module
import json
import os
import re
import sys

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


# Regression: one reader or path given instead of a list of readers was misread.
@pytest.mark.parametrize("given", ["str", "path", "reader"])
def test_pack_corpus_refuses_one_input_instead_of_a_list(tmp_path, text, given):
    readers = {"str": str(text), "path": text, "reader": io.TextFiles([text])}[given]
    with pytest.raises(sp.InvalidInputError, match="inputs must be a list of readers or paths, not one"):
        pack(readers, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# Regression: an item of the inputs that is neither a path nor a reader was a foreign error.
def test_pack_corpus_names_an_item_that_is_not_a_reader(tmp_path, text):
    with pytest.raises(sp.InvalidInputError, match=r"inputs\[1\] is a dict, not a path or a reader"):
        pack([io.TextFiles([text]), {"text": "hello"}], tmp_path / "out")


# Regression: the passing twin of the list check: readers given as a generator.
def test_pack_corpus_reads_readers_given_as_a_generator(tmp_path, text):
    manifest = pack((reader for reader in [io.TextFiles([text])]), tmp_path / "out")
    assert manifest["counts"]["documents"] == 1
    # the manifest returned (and printed by seqpack pack --json) is the one on disk, seal included
    assert manifest == json.loads((tmp_path / "out" / "manifest.json").read_text()) and "seal" in manifest


# Regression: a binding, tokenizer, out or progress of the wrong type was a foreign error.
def test_pack_corpus_checks_binding_tokenizer_and_out(tmp_path, text):
    with pytest.raises(sp.InvalidInputError, match="binding must be a BatchBinding"):
        pack([io.TextFiles([text])], tmp_path / "out", binding="tests")
    with pytest.raises(sp.InvalidInputError, match="tokenizer must be"):
        pack([io.TextFiles([text])], tmp_path / "out", tokenizer="bytes")
    with pytest.raises(sp.InvalidInputError, match="out must be a path"):
        pack([io.TextFiles([text])], None)
    with pytest.raises(sp.InvalidInputError, match="progress must be"):
        pack([io.TextFiles([text])], tmp_path / "out", progress="yes")


# Regression: an equal but distinct ByteTokenizer failed after reading everything.
def test_an_equal_byte_tokenizer_packs_like_the_bindings_own(tmp_path, text):
    """Not the binding's instance but the same identity: used to fail after reading everything."""
    manifest = pack([io.TextFiles([text])], tmp_path / "out", tokenizer=sp.ByteTokenizer())
    assert manifest["binding"]["tokenizer"]["kind"] == "byte"
    io.verify_dataset(tmp_path / "out")


# Regression: force="no" replaced an existing dataset.
def test_a_truthy_non_bool_force_does_not_replace_a_dataset(tmp_path, text):
    pack([io.TextFiles([text])], tmp_path / "out")
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    other = tmp_path / "b.txt"
    other.write_text("something else")
    with pytest.raises(sp.InvalidInputError, match="force must be a bool"):
        pack([io.TextFiles([other])], tmp_path / "out", force="no")
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "out"]


# Regression: framed="no" counted as framed.
def test_a_truthy_non_bool_framed_is_refused(tmp_path):
    lines = tmp_path / "ids.jsonl"
    lines.write_text(json.dumps({"ids": [0, 5, 1]}) + "\n")
    with pytest.raises(sp.InvalidInputError, match="framed must be a bool"):
        pack([io.JsonLines(lines, ids_field="ids")], tmp_path / "out", framed="no")


# Regression: one reader instead of a list, with force=True, must leave the existing dataset as it was.
def test_pack_without_a_list_keeps_an_existing_dataset(tmp_path, text):
    pack([io.TextFiles([text])], tmp_path / "out")
    before = (tmp_path / "out" / "part-00000" / "tokens.bin").read_bytes()
    with pytest.raises(sp.InvalidInputError, match="inputs must be a list of readers or paths, not one"):
        pack(io.TextFiles([text]), tmp_path / "out", force=True)
    assert (tmp_path / "out" / "part-00000" / "tokens.bin").read_bytes() == before
    assert np.array_equal(io.open_dataset(tmp_path / "out").example(0).document.token_ids,
                          [0] + [b + 2 for b in b"hello"] + [1])


# Regression: an output inside an input directory was read back as text documents.
def test_pack_corpus_refuses_an_output_inside_an_input_directory(tmp_path, text):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "b.txt").write_text("bee")
    with pytest.raises(sp.InvalidInputError, match=f"the output {corpus / 'out'} lies inside the input directory "
                                                   f"{corpus}: write it outside the inputs"):
        pack([io.TextFiles([text]), io.TextFiles([corpus])], corpus / "out")
    assert sorted(p.name for p in corpus.iterdir()) == ["b.txt"]
    pack([io.TextFiles([corpus / "b.txt"])], corpus / "out")  # a file given alone is no directory input


# Regression: tqdm printed 1024-based byte counts labelled MB.
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


# From the 38bdb8f fix: a full disk or Ctrl-C mid-publish left the old dataset hidden and no manifest.
@pytest.mark.parametrize("step", ["rename out aside", "rename staging in", "write the manifest", "after the manifest"])
@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_publish_stopped_at_any_step_puts_the_old_dataset_back(tmp_path, text, monkeypatch, step, failure):
    """A full disk or Ctrl-C while publishing left the old dataset under a hidden name and
    the output without a manifest (or gone)."""
    from seqpack.io import publish

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

    monkeypatch.setattr(publish.os, "rename", rename)
    if kind == "manifest":
        monkeypatch.setattr(publish.json, "dump", dump)
    with pytest.raises(type(failure)):
        pack([io.TextFiles([text, text.parent / "b.txt"])], out, force=True)
    monkeypatch.undo()
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before, step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "out"], step
    io.verify_dataset(out)


def test_a_dataset_a_killed_force_left_hidden_comes_back_before_a_plain_pack_checks_out(tmp_path, text):
    # SIGKILL between moving the old dataset aside and the new manifest: a plain pack then said
    # "already exists" for a directory without a manifest (review).
    from seqpack.io import publish

    out = tmp_path / "out"
    pack([io.TextFiles([text])], out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    dead = 2**22 + 12345  # no such process
    while publish._alive(dead):
        dead += 1
    hidden = tmp_path / f".out.seqpack-old-{publish.this_host()}-{dead}-0123456789ab"
    os.rename(out, hidden)
    out.mkdir()  # the killed run's new dataset, its manifest never written
    (out / "part-00000").mkdir()
    with pytest.raises(sp.InvalidInputError, match="already exists"):
        pack([io.TextFiles([text])], out)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out"]
    io.verify_dataset(out)


# From the 38bdb8f fix: force deleted a user's part-* entries and replaced a foreign manifest.json.
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


@pytest.mark.parametrize("merges", [(), ((100, 99),)])  # ("a" "b" with bytes as IDs byte + 2)
def test_a_text_past_the_byte_limit_is_refused_before_it_is_encoded(tmp_path, merges):
    # A 100 MB text file peaked at 1 GB of memory before its token count refused it (review).
    import tracemalloc

    binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(merges), split="s", limits=sp.DecodeLimits(2000, 1000))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"x" * 1000)  # exactly the limit: packed
    (corpus / "b.txt").write_bytes(b"ab" * 1_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(sp.InvalidInputError, match=r"b.txt: the document holds more than 1000 bytes, the "
                                                       r"binding's decode limit: refused before it is encoded$"):
            io.pack_corpus([io.TextFiles([corpus])], tmp_path / "out", binding=binding, config=sp.PackConfig(2048))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000  # the file read (2 MB) and no more than a copy of it
    (corpus / "b.txt").unlink()
    io.pack_corpus([io.TextFiles([corpus])], tmp_path / "out", binding=binding, config=sp.PackConfig(2048))
