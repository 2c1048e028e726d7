"""Audit of the corpus readers with odd real-world inputs: each test was a silent misreading,
a traceback or a walk that never ended before its fix."""

import json
import os
import time
import warnings

import numpy as np
import pytest

import seqpack as sp
from seqpack import io
from seqpack.io.readers import MEGATRON_DTYPES, MEGATRON_MAGIC

from test_cli_audit import one_error_line, run

TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="tests")


def pack(readers, out):
    return io.pack_corpus(readers, out, config=sp.PackConfig(64, 2), tokenizer=TOKENIZER, binding=BINDING)


def pyarrow():
    return pytest.importorskip("pyarrow", reason="Parquet and Arrow need the corpus extra: pip install 'seqpack[corpus]'")


def test_an_arrow_stream_in_a_directory_is_not_read_as_text(tmp_path):
    """datasets.save_to_disk writes Arrow streams: such a directory was packed as three
    text documents, its binary shard among them."""
    pa = pyarrow()
    directory = tmp_path / "saved"
    directory.mkdir()
    table = pa.table({"text": ["hello", "world"]})
    with pa.ipc.new_stream(directory / "data-00000-of-00001.arrow", table.schema) as writer:
        writer.write_table(table)
    (directory / "state.json").write_text("{}")
    with pytest.raises(sp.InvalidInputError, match=r"data-00000-of-00001.arrow: an Arrow stream .*, not text"):
        pack([io.TextFiles([directory])], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    stream = tmp_path / "s.arrows"  # the stream's own suffix reads as Arrow
    stream.write_bytes((directory / "data-00000-of-00001.arrow").read_bytes())
    assert isinstance(io.reader_for(stream), io.ArrowBatches)
    assert pack([io.reader_for(stream)], tmp_path / "out")["counts"]["documents"] == 2


def test_a_jsonl_file_in_a_directory_is_not_read_as_text(tmp_path):
    directory = tmp_path / "records"
    directory.mkdir()
    (directory / "a.jsonl").write_text('{"text": "hello"}\n')
    (directory / "b.txt").write_text("plain")
    with pytest.raises(sp.InvalidInputError, match=r"a.jsonl: a JSONL file, not text: give it as an input"):
        pack([io.TextFiles([directory])], tmp_path / "out")
    assert pack([io.TextFiles([directory], "*.txt")], tmp_path / "out")["counts"]["documents"] == 1
    ndjson = tmp_path / "x.ndjson"
    ndjson.write_text('{"text": "a"}\n')
    assert isinstance(io.reader_for(ndjson), io.JsonLines)


def test_text_that_begins_like_a_binary_format_is_text(tmp_path):
    """A text beginning with PAR1 or ARROW1 was refused as Parquet or Arrow; real files
    also end with their magic, which tells them apart."""
    for head in (b"PAR1 of the contract", b"ARROW1 is a name", b"FEA1 too"):
        path = tmp_path / "note.txt"
        path.write_bytes(head)
        assert pack([io.TextFiles([path])], tmp_path / "out")["counts"]["documents"] == 1
        (tmp_path / "out").rename(tmp_path / f"done-{head[:3].decode()}")
    path.write_bytes(b"PAR1 and nothing else PAR1")
    with pytest.raises(sp.InvalidInputError, match="a Parquet file, not text"):
        pack([io.TextFiles([path])], tmp_path / "out")


def test_damage_in_a_sharded_parquet_file_is_one_error(tmp_path):
    pa = pyarrow()
    import pyarrow.parquet as pq

    from seqpack.io.shards import pack_sharded

    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": [f"document number {i} " * 3 for i in range(20000)]}), path,
                   row_group_size=5000)
    group = pq.ParquetFile(path).metadata.row_group(2).column(0)
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(1)
    for _ in range(300):  # damage row group 2's pages until pyarrow notices
        damaged = bytearray(data)
        start = int(rng.integers(group.data_page_offset, group.data_page_offset + group.total_compressed_size))
        damaged[start:start + 16] = rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
        path.write_bytes(bytes(damaged[:len(data)]))
        try:
            for _ in pq.ParquetFile(path).iter_batches(batch_size=4096, row_groups=[2]):
                pass
        except (pa.ArrowInvalid, OSError):
            break
    else:
        pytest.fail("no damage that pyarrow notices")
    with pytest.raises(sp.InvalidInputError, match=rf"{path} row \d+: cannot read as parquet"):
        pack_sharded([io.reader_for(path)], tmp_path / "out", binding=BINDING, tokenizer=TOKENIZER,
                     config=sp.PackConfig(2048, 2), shards=2, long="cut")
    assert not (tmp_path / "out").exists()


def test_duplicate_columns_and_deep_json_are_one_line_errors(tmp_path):
    pa = pyarrow()
    import pyarrow.parquet as pq

    path = tmp_path / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"]), path)
    with pytest.raises(sp.InvalidInputError, match="dup.parquet: 2 columns are named 'text'"):
        pack([io.reader_for(path)], tmp_path / "out")
    deep = tmp_path / "deep.jsonl"
    deep.write_bytes(b'{"text": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    with pytest.raises(sp.InvalidInputError, match=r"deep.jsonl:1: JSON nested too deeply to read"):
        pack([io.reader_for(deep)], tmp_path / "out")
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps({"text": "a"}, indent=2))
    with pytest.raises(sp.InvalidInputError, match=r"pretty.json:1: not valid JSON: .*read as JSON lines"):
        pack([io.reader_for(pretty)], tmp_path / "out")


def test_datasets_that_are_not_one_table_are_named():
    datasets = pytest.importorskip("datasets", reason="needs the datasets library")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})})
    with pytest.raises(sp.InvalidInputError, match=r"DatasetDict of splits \['train'\]: give one split"):
        list(io.ArrowBatches(splits).chunks(0))
    unknown = datasets.IterableDataset.from_generator(lambda: iter([{"text": "a"}]))
    if unknown.column_names is None:
        with pytest.raises(sp.InvalidInputError, match="with unknown columns"):
            list(io.ArrowBatches(unknown).chunks(0))


def test_a_tokenizer_whose_ids_have_gaps_reads_its_highest_ids(tmp_path):
    """The vocabulary size was the token count: ID 10 of a five-token vocabulary was
    'out of vocabulary', and could not be the BOS."""
    pytest.importorskip("tokenizers", reason="tokenizer files need the hf extra: pip install 'seqpack[hf]'")
    path = tmp_path / "gapped.json"
    path.write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 10},
                  "unk_token": "[UNK]"},
    }))
    tokenizer = io.TokenizerFile(path, bos="<s>", eos="</s>")
    assert tokenizer.vocabulary_size == 11 and io.TokenizerFile(path, bos="world", eos=1).bos_id == 10
    lines = tmp_path / "g.jsonl"
    lines.write_text('{"text": "hello world"}\n')
    binding = sp.BatchBinding.for_tokenizer(tokenizer.identity, split="tests")
    io.pack_corpus([io.reader_for(lines)], tmp_path / "out", config=sp.PackConfig(64, 2), tokenizer=tokenizer,
                   binding=binding)
    assert io.open_dataset(tmp_path / "out").example(0).document.token_ids.tolist() == [0, 3, 10, 1]
    with pytest.raises(sp.InvalidInputError, match=r"missing.json: no such tokenizer file"):
        io.TokenizerFile(tmp_path / "missing.json", bos=0, eos=1)


def write_megatron(prefix, documents, starts):
    dtype = np.dtype(np.uint16)
    code = {np.dtype(v): k for k, v in MEGATRON_DTYPES.items()}[dtype]
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1].astype(np.int64) * 2)))
    with open(f"{prefix}.bin", "wb") as handle:
        handle.write(np.concatenate(documents).astype(dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as handle:
        handle.write(MEGATRON_MAGIC + (1).to_bytes(8, "little") + bytes([code]))
        handle.write(len(documents).to_bytes(8, "little") + len(starts).to_bytes(8, "little"))
        handle.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + np.array(starts, np.int64).tobytes())


def test_a_broken_megatron_document_index_is_refused(tmp_path):
    documents = [np.array([5, 6]), np.array([7]), np.array([8, 9, 10]), np.array([11])]
    for starts in ([0, 7, 4], [1, 4], [0, 3, 2, 4], [0, 3]):
        write_megatron(tmp_path / "m", documents, starts)
        with pytest.raises(sp.InvalidInputError, match=r"m.idx: a broken document index"):
            io.Megatron(tmp_path / "m")
    for starts in ([0, 4], [0, 1, 2, 3, 4], [0, 2, 2, 4], []):  # sentences of documents, or no index
        write_megatron(tmp_path / "m", documents, starts)
        assert io.Megatron(tmp_path / "m").lengths.tolist() == [2, 1, 3, 1]


def test_directories_reached_twice_through_links_are_refused_at_once(tmp_path):
    """Each level linking twice to the next doubled the walk (16 levels took 14 s) before
    the inputs were found to repeat."""
    for level in range(40):
        (tmp_path / f"d{level}").mkdir()
    (tmp_path / "d39" / "leaf.txt").write_text("leaf")
    for level in range(39):
        for name in ("a", "b"):
            os.symlink(tmp_path / f"d{level + 1}", tmp_path / f"d{level}" / name)
    began = time.monotonic()
    with pytest.raises(sp.InvalidInputError, match=r"d0/b: the directory .*d0/a again, through a link"):
        io.TextFiles([tmp_path / "d0"])
    assert time.monotonic() - began < 10


def test_glob_takes_a_name_pattern(tmp_path):
    (tmp_path / "p" / "pkg").mkdir(parents=True)
    (tmp_path / "p" / "pkg" / "b.py").write_text("x = 1")
    for pattern in ("**/*.py", "pkg/*.py"):
        with pytest.raises(sp.InvalidInputError, match="must be a file name pattern"):
            io.TextFiles([tmp_path / "p"], pattern)
        result = run("pack", tmp_path / "p", "--glob", pattern, "--out", tmp_path / "out")
        assert "--glob matches file names in every subdirectory, not paths" in one_error_line(result, 2)
    assert len(io.TextFiles([tmp_path / "p"], "*.py").paths) == 1


def test_framed_goes_with_a_default_input_ids_column(tmp_path):
    """--framed was refused as having no effect on a Parquet file whose input_ids column
    is read by default, and without it the documents' own BOS failed."""
    pa = pyarrow()
    import pyarrow.parquet as pq

    path = tmp_path / "framed.parquet"
    pq.write_table(pa.table({"input_ids": [[0, 5, 6, 1], [0, 7, 1]]}), path)
    result = run("pack", path, "--framed", "--out", tmp_path / "out", "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["counts"]["tokens"] == 7
    result = run("pack", tmp_path / "framed.parquet", "--out", tmp_path / "other", "--quiet")
    assert "control token 0 (BOS)" in one_error_line(result, 1)


def test_a_directory_given_twice_is_named_as_a_directory(tmp_path, monkeypatch):
    """``seqpack pack d ./d`` said 'd/a.txt (inside d) is an input twice (also inside d)'."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello")
    monkeypatch.chdir(tmp_path)
    result = run("pack", "d", "./d", "--out", "out")
    assert one_error_line(result, 1) == ("seqpack: error: the directory d is an input twice (its file d/a.txt among "
                                         "others): give each directory once")
    result = run("pack", "d", "d/a.txt", "--out", "out")
    assert "d/a.txt is an input twice (also inside d)" in one_error_line(result, 1)


def test_megatron_halves_in_a_directory_are_refused_by_name_and_json_is_text(tmp_path):
    """Megatron token data has no magic bytes: a lone .bin in a directory was packed as a
    text document of its tokens. A .json file there stays text (only a given one is JSONL)."""
    directory = tmp_path / "mixed"
    directory.mkdir()
    (directory / "a.txt").write_text("plain")
    (directory / "tokens.BIN").write_bytes(np.arange(40, dtype=np.uint16).tobytes())
    with pytest.raises(sp.InvalidInputError, match=r"tokens.BIN: a .bin file \(half of a Megatron dataset, by its "
                                                   r"name\), not text: give it as an input of its own"):
        pack([io.TextFiles([directory])], tmp_path / "out")
    (directory / "tokens.BIN").rename(directory / "tokens.idx")
    with pytest.raises(sp.InvalidInputError, match=r"tokens.idx: a .idx file"):
        pack([io.TextFiles([directory])], tmp_path / "out")
    (directory / "tokens.idx").rename(directory / "config.json")
    (directory / "config.json").write_text('{"text": "kept as written"}\n')
    report = pack([io.TextFiles([directory])], tmp_path / "out")
    assert report["counts"]["documents"] == 2
    assert report["counts"]["document_tokens"] == len("plain") + len('{"text": "kept as written"}\n') + 4


@pytest.mark.filterwarnings("ignore:Feather V1:DeprecationWarning")
def test_a_feather_version_1_file_is_read(tmp_path):
    """A Feather v1 file, which a directory walk sends to be given on its own, failed there
    with pyarrow's 'Expected to read ... metadata bytes'; it now reads like version 2."""
    pa = pyarrow()
    import pyarrow.feather as feather

    table = pa.table({"text": ["hello world", "second doc", ""]})
    outputs = {}
    for version in (1, 2):
        path = tmp_path / f"v{version}.feather"
        with warnings.catch_warnings():  # pyarrow deprecates writing version 1
            warnings.simplefilter("ignore", DeprecationWarning)
            feather.write_feather(table, path, version=version)
        outputs[version] = pack([io.reader_for(path)], tmp_path / f"out{version}")
        assert outputs[version]["counts"]["documents"] == 2
    assert ((tmp_path / "out1" / "part-00000" / "tokens.bin").read_bytes()
            == (tmp_path / "out2" / "part-00000" / "tokens.bin").read_bytes())
    broken = tmp_path / "broken.feather"
    broken.write_bytes((tmp_path / "v1.feather").read_bytes()[:40])
    with pytest.raises(sp.InvalidInputError, match=r"broken.feather: cannot read as arrow"):
        pack([io.reader_for(broken)], tmp_path / "out3")


def test_megatron_suffixes_match_in_any_case_from_the_prefix_too(tmp_path):
    """The README: a Megatron dataset is given as PREFIX or either file, suffixes in any
    case; a prefix found only lower-case files, and a mixed-case partner was 'no such file'."""
    documents = [np.array([5, 6]), np.array([7]), np.array([8, 9, 10])]
    write_megatron(tmp_path / "m", documents, [0, 1, 2, 3])
    for index_name, data_name in (("UP.IDX", "UP.BIN"), ("mix.Idx", "mix.Bin")):
        (tmp_path / "m.idx").rename(tmp_path / index_name)
        (tmp_path / "m.bin").rename(tmp_path / data_name)
        prefix = tmp_path / index_name.split(".")[0]
        for given in (prefix, tmp_path / index_name, tmp_path / data_name):
            reader = io.reader_for(given)
            assert (reader.index_path.name, reader.data_path.name) == (index_name, data_name), given
            assert reader.lengths.tolist() == [2, 1, 3]
        (tmp_path / index_name).rename(tmp_path / "m.idx")
        (tmp_path / data_name).rename(tmp_path / "m.bin")
    (tmp_path / "m.IDX").write_bytes((tmp_path / "m.idx").read_bytes())
    with pytest.raises(sp.InvalidInputError, match=r"m: m.IDX, m.idx each name its .idx file: keep one"):
        io.reader_for(tmp_path / "m")


def test_megatron_chunks_are_bounded_in_bytes_too(tmp_path, monkeypatch):
    """Chunks were 4,096 sequences whatever their lengths: long sequences (or pointers that
    all name the same long run) made one chunk of gigabytes. Now a chunk also stops at
    CHUNK_BYTES of tokens, a longer sequence alone."""
    from seqpack.io import readers

    monkeypatch.setattr(readers, "CHUNK_BYTES", 64)  # 32 uint16 tokens
    documents = [np.arange(n, dtype=np.int64) + 2 for n in (10, 10, 10, 40, 1, 0, 31, 32, 33, 5)]
    write_megatron(tmp_path / "m", documents, [])
    chunks = list(io.Megatron(tmp_path / "m").chunks(0))
    assert [chunk.locations.tolist() for chunk in chunks] == [[0, 1, 2], [3], [4, 5, 6], [7], [8], [9]]
    flat = np.concatenate([chunk.ids[0] for chunk in chunks])
    assert flat.tolist() == np.concatenate(documents).tolist()
