"""Corpus readers: every input kind gives the same documents, and every error names its place."""

import json
import re
import sys

import numpy as np
import pytest

import seqpack as sp
from seqpack import io
from seqpack.io.readers import MEGATRON_DTYPES, MEGATRON_HEADER, MEGATRON_MAGIC

TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="tests")
CONFIG = sp.PackConfig(32, 2)
TEXTS = ["the quick brown fox", "jumps", "over the lazy dog " * 3, "é ü ñ"]


def content_ids(text):
    return (np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64) + 2).tolist()


def pack(tmp_path, reader, name="out", **options):
    options.setdefault("long", "cut")
    io.pack_corpus([reader], tmp_path / name, binding=BINDING, tokenizer=TOKENIZER, config=CONFIG, **options)
    return io.open_dataset(tmp_path / name)


def documents_of(dataset):
    """Every document's framed tokens, rebuilt from the dataset (in ordinal order)."""
    seen, result = set(), []
    for ordinal in range(dataset.occurrence_count):
        example = dataset.example(ordinal)
        if example.document.source_id not in seen:
            seen.add(example.document.source_id)
            result.append(example.document.token_ids.tolist())
    return result


def expected_documents(texts):
    return [[0] + content_ids(t) + [1] for t in texts]


def write_megatron(prefix, documents, dtype=np.uint16):
    """A Megatron indexed dataset ``PREFIX.idx/.bin`` (the layout of ECOSYSTEM.md)."""
    dtype = np.dtype(dtype)
    code = {np.dtype(v): k for k, v in MEGATRON_DTYPES.items()}[dtype]
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize)))
    with open(f"{prefix}.bin", "wb") as handle:
        for document in documents:
            handle.write(np.asarray(document, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as handle:
        handle.write(MEGATRON_MAGIC + (1).to_bytes(8, "little") + bytes([code]))
        handle.write(len(documents).to_bytes(8, "little") + (len(documents) + 1).to_bytes(8, "little"))
        handle.write(lengths.tobytes() + pointers.astype(np.int64).tobytes()
                     + np.arange(len(documents) + 1, dtype=np.int64).tobytes())


def test_text_jsonl_and_ids_give_the_same_documents(tmp_path):
    directory = tmp_path / "texts"
    directory.mkdir()
    for index, text in enumerate(TEXTS):
        (directory / f"{index}.txt").write_text(text)
    (directory / ".hidden").write_text("never read")
    (directory / "empty.txt").write_text("")
    lines = tmp_path / "docs.jsonl"
    lines.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)) + "\n\n")
    ids = tmp_path / "ids.jsonl"
    ids.write_text("\n".join(json.dumps({"input_ids": content_ids(t)}) for t in TEXTS))
    framed = tmp_path / "framed.jsonl"
    framed.write_text("\n".join(json.dumps({"ids": [0] + content_ids(t) + [1]}) for t in TEXTS))
    expected = expected_documents(TEXTS)
    assert documents_of(pack(tmp_path, io.TextFiles([directory]), "a")) == expected
    assert io.TextFiles(directory).paths == io.TextFiles([directory]).paths == io.TextFiles(str(directory)).paths
    assert documents_of(pack(tmp_path, io.JsonLines(lines), "b")) == expected
    assert documents_of(pack(tmp_path, io.JsonLines(ids, ids_field="input_ids"), "c")) == expected
    assert documents_of(pack(tmp_path, io.JsonLines(framed, ids_field="ids"), "d", framed=True)) == expected


def test_arrow_inputs(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="the corpus extra reads Parquet and Arrow")
    import pyarrow.parquet as pq

    table = pa.table({"text": TEXTS, "input_ids": [content_ids(t) for t in TEXTS]})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=2)
    with pa.ipc.new_file(str(tmp_path / "docs.arrow"), table.schema) as writer:
        writer.write_table(table)
    expected = expected_documents(TEXTS)
    assert documents_of(pack(tmp_path, io.reader_for(tmp_path / "docs.parquet"), "a")) == expected
    assert documents_of(pack(tmp_path, io.reader_for(tmp_path / "docs.parquet", ids_field="input_ids"), "b")) == expected
    assert documents_of(pack(tmp_path, io.reader_for(tmp_path / "docs.arrow"), "c")) == expected
    assert documents_of(pack(tmp_path, io.ArrowBatches(table.slice(1), ids_field="input_ids"), "d")) == expected[1:]
    large = pa.table({"input_ids": pa.array([content_ids(t) for t in TEXTS], pa.large_list(pa.int64()))})
    assert documents_of(pack(tmp_path, io.ArrowBatches(large), "e")) == expected


@pytest.mark.slow
def test_a_datasets_dataset(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is a bench extra")
    dataset = datasets.Dataset.from_dict({"input_ids": [content_ids(t) for t in TEXTS]})
    packed = pack(tmp_path, io.ArrowBatches(dataset.select([3, 2, 1, 0])), "a")
    assert documents_of(packed) == expected_documents(TEXTS[::-1])


def test_megatron(tmp_path):
    documents = [content_ids(t) for t in TEXTS]
    write_megatron(tmp_path / "corpus_text_document", documents)
    packed = pack(tmp_path, io.reader_for(tmp_path / "corpus_text_document.idx"))
    assert documents_of(packed) == expected_documents(TEXTS)
    assert packed.example_id(1).endswith("corpus_text_document.bin sequence 1")


@pytest.mark.parametrize("content, field, message", [
    ('{"text": "a"}\nnot json\n', None, r"bad\.jsonl:2: not valid JSON"),
    ('{"text": "a"}\n\n{"txt": "b"}\n', None, r"bad\.jsonl:3: no field 'text'"),
    ('{"text": 5}\n', None, r"bad\.jsonl:1: field 'text' is not a string"),
    ('{"ids": [5, "x"]}\n', "ids", r"bad\.jsonl:1: field 'ids' is not a list of ints"),
    ('{"ids": [5, 6]}\n{"ids": [300]}\n', "ids", r"bad\.jsonl:2: token 300 at position 1 is out of vocabulary \(vocabulary size 258\) "
     r"\(positions count the BOS seqpack put before the IDs: the IDs' own index is one less\)$"),
    ('{"ids": [5, 1, 6]}\n', "ids", r"bad\.jsonl:1: control token 1 \(EOS\) at position 2 is inside the content "
     r"\(positions count the BOS"),
    ('{"ids": [5]}\n{"ids": [99999999999]}\n', "ids", r"bad\.jsonl:2: token ID 99999999999 does not fit int32"),
    ('{"ids": [5]}\n{"ids": [3, 18446744073709551616]}\n', "ids",
     r"bad\.jsonl:2: token ID 18446744073709551616 does not fit int64"),
    ('{"text": "é"}\n{"text": "a\\ud800b"}\n', None,
     r"bad\.jsonl:2: field 'text' holds '\\ud800' \(a lone surrogate\) at character 1"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, content, field, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(sp.InvalidInputError, match=message):
        pack(tmp_path, io.JsonLines(path, ids_field=field))
    assert not (tmp_path / "out").exists()


def test_framed_ids_are_named_by_their_own_positions(tmp_path):
    """Documents framed by the user carry their own BOS: no note about seqpack's."""
    path = tmp_path / "framed.jsonl"
    path.write_text('{"ids": [0, 5, 300, 1]}\n')
    with pytest.raises(sp.InvalidInputError, match=r"framed\.jsonl:1: token 300 at position 2 is out of vocabulary \(vocabulary size 258\)$"):
        pack(tmp_path, io.JsonLines(path, ids_field="ids"), framed=True)


def chunk_documents(reader):
    """``(line, text)`` of every document a reader yields."""
    return [(line, text) for chunk in reader.chunks(0) for line, text in zip(chunk.locations.tolist(), chunk.texts)]


def test_jsonl_line_ranges_read_the_file_in_pieces_with_its_line_numbers(tmp_path, monkeypatch):
    monkeypatch.setattr(io.JsonLines, "SCAN_BYTES", 5)  # count lines over many small blocks
    path = tmp_path / "lines.jsonl"
    lines = [json.dumps({"text": "x" * (i % 9)}) + "\n" if i % 7 else "\n" for i in range(60)]
    path.write_text("".join(lines) + json.dumps({"text": "last, no newline"}))
    starts = np.cumsum([0] + [len(line) for line in lines]).tolist()  # line i + 1 starts at starts[i]
    whole = chunk_documents(io.JsonLines(path))
    assert len(whole) == 52 and whole[-1] == (61, "last, no newline")
    # A cut inside a line moves to the next line start; on a line start it stays; repeated,
    # inside the last line (no newline), past the end or at the start it adds nothing.
    cuts = [0, starts[10] + 3, starts[10] + 4, starts[20], starts[45] - 1, starts[59] + 2, starts[60] + 2, 10**9]
    pieces = io.JsonLines(path).split(cuts)
    assert [(p.start, p.stop, p.first_line) for p in pieces] == [
        (0, starts[11], 1), (starts[11], starts[20], 12), (starts[20], starts[45], 21), (starts[45], starts[60], 46),
        (starts[60], path.stat().st_size, 61)]
    assert [document for piece in pieces for document in chunk_documents(piece)] == whole
    assert chunk_documents(pieces[1])[0] == (12, "xx")
    again = pieces[2].split([starts[30] + 1])  # a piece splits within its own range
    assert [(p.start, p.stop, p.first_line) for p in again] == [(starts[20], starts[31], 21),
                                                                 (starts[31], starts[45], 32)]


def test_a_bad_line_in_a_line_range_names_its_line_in_the_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + "\n" * 5 + json.dumps({"text": "b"}) + "\n" + "{oops\n")
    first, second = io.JsonLines(path).split([15])
    assert chunk_documents(first) == [(1, "a")] and second.first_line == 3
    with pytest.raises(sp.InvalidInputError, match=r"bad\.jsonl:8: not valid JSON"):
        chunk_documents(second)
    for options, message in (({"start": -1}, "start must be at least 0"), ({"start": 5, "stop": 4}, "stop must be"),
                             ({"first_line": 0}, "first_line must be at least 1"), ({"start": True}, "start must be")):
        with pytest.raises(sp.InvalidInputError, match=message):
            io.JsonLines(path, **options)
    assert chunk_documents(io.JsonLines(path, start=15, stop=15, first_line=3)) == []  # an empty range is allowed


def test_long_documents_error_names_the_line_unless_cut(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": "b" * 40}) + "\n")
    with pytest.raises(sp.CapacityError, match=r"long\.jsonl:2: the document has 41 predictions; capacity is 32"):
        pack(tmp_path, io.JsonLines(path), long="error")
    packed = pack(tmp_path, io.JsonLines(path), long="cut")
    assert packed.occurrence_count == 3 and int(packed.report().valid_targets) == 2 + 41
    assert packed.example_id(2) == f"{path}:2[32:42]"


def test_empty_documents_are_skipped_and_counted(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["", "ab", "", "c"]))
    packed = pack(tmp_path, io.JsonLines(path))
    assert packed.manifest["counts"]["skipped_empty_documents"] == 2
    assert documents_of(packed) == expected_documents(["ab", "c"])
    assert packed.example_id(1) == f"{path}:4"


def test_arrow_errors_name_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="the corpus extra reads Parquet and Arrow")
    with pytest.raises(sp.InvalidInputError, match=r"Table row 2: the document is null"):
        pack(tmp_path, io.ArrowBatches(pa.table({"text": ["a", "b", None]})))
    with pytest.raises(sp.InvalidInputError, match=r"Table row 1: token 400 at position 2"):
        pack(tmp_path, io.ArrowBatches(pa.table({"input_ids": [[5, 6], [7, 400]]})))
    for rows, message in (([[3, 4], [None], [5]], "Table row 1"), ([[3], [4, 5], [6, None]], "Table row 2")):
        with pytest.raises(sp.InvalidInputError, match=f"{message}: a token ID is null"):
            pack(tmp_path, io.ArrowBatches(pa.table({"input_ids": rows})))
    with pytest.raises(sp.InvalidInputError, match=r"no 'text' or 'input_ids' column"):
        pack(tmp_path, io.ArrowBatches(pa.table({"body": ["a"]})))
    with pytest.raises(sp.InvalidInputError, match=r"no column 'body'"):
        pack(tmp_path, io.ArrowBatches(pa.table({"text": ["a"]}), text_field="body"))
    stream = tmp_path / "cut.arrow"  # an Arrow IPC stream cut off inside its second batch
    table = pa.table({"text": [f"row {i}" for i in range(3000)]})
    with pa.ipc.new_stream(str(stream), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=1000):
            writer.write_batch(batch)
    data = stream.read_bytes()
    stream.write_bytes(data[: len(data) * 3 // 5])
    with pytest.raises(sp.InvalidInputError, match=r"cut\.arrow row \d+: cannot read as arrow"):
        pack(tmp_path, io.ArrowBatches(stream))


def test_megatron_errors(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"NOTMEGATRON" + bytes(40))
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(sp.InvalidInputError, match=r"x\.idx: not a Megatron index"):
        io.Megatron(tmp_path / "x")
    with pytest.raises(sp.InvalidInputError, match=r"y\.idx: no such file"):
        io.Megatron(tmp_path / "y")
    write_megatron(tmp_path / "z", [[5, 6], [7]])
    (tmp_path / "z.bin").write_bytes(b"\x05\x00")  # shorter than the index says
    with pytest.raises(sp.InvalidInputError, match=r"z\.bin sequence 0: lies outside"):
        pack(tmp_path, io.Megatron(tmp_path / "z.bin"))


def patch_megatron_index(prefix, sequence, *, length=None, pointer=None):
    """Overwrite one sequence's length or byte pointer in ``PREFIX.idx``."""
    path = f"{prefix}.idx"
    data = bytearray(open(path, "rb").read())
    count = int.from_bytes(data[18:26], "little")
    if length is not None:
        data[34 + 4 * sequence: 38 + 4 * sequence] = np.int32(length).tobytes()
    if pointer is not None:
        start = 34 + 4 * count + 8 * sequence
        data[start: start + 8] = np.int64(pointer).tobytes()
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("patch, message", [
    ({"length": -1}, r"m\.bin sequence 1: negative length -1"),
    ({"pointer": 3}, r"m\.bin sequence 1: byte pointer 3 is not a multiple of the uint16 token size"),
    ({"pointer": 2**63 - 2}, r"m\.bin sequence 1: lies outside"),  # pointer + length wraps past int64
    ({"pointer": -2}, r"m\.bin sequence 1: lies outside"),
])
def test_megatron_bad_sequences_are_named(tmp_path, patch, message):
    write_megatron(tmp_path / "m", [[5, 6], [7, 8], [9]])
    patch_megatron_index(tmp_path / "m", 1, **patch)
    with pytest.raises(sp.InvalidInputError, match=message):
        pack(tmp_path, io.Megatron(tmp_path / "m"))



def patch_megatron_header(prefix, field, value):
    """Overwrite one field of ``PREFIX.idx``'s header (by its name in ``MEGATRON_HEADER``)."""
    path = f"{prefix}.idx"
    data = bytearray(open(path, "rb").read())
    first, width = next((first, width) for name, first, width in MEGATRON_HEADER if name == field)
    data[first: first + width] = value.to_bytes(width, "little")
    open(path, "wb").write(bytes(data))


# A correct MMIDIDX magic with garbage after it was "no MMIDIDX header".
@pytest.mark.parametrize("field, value, message", [
    ("version", 2, r"Megatron index version 2 is not supported \(seqpack reads version 1\)"),
    ("version", 0x0706050403020100, r"Megatron index version 506097522914230528 is not supported"),
    ("dtype code", 0, r"unknown Megatron dtype code 0 \(the codes are 1 to 8\)"),
    ("dtype code", 255, r"unknown Megatron dtype code 255 "),
    ("dtype code", 6, r"dtype code 6 is float64, not an integer token type"),
    ("dtype code", 7, r"dtype code 7 is float32, not an integer token type"),
    ("sequence count", 2**64 - 1, rf"sequence count {2**64 - 1} needs {34 + 12 * (2**64 - 1)} bytes of index \(the "
                                  r"header and 12 per sequence\); the file has 102"),
    ("sequence count", 5, r"document count 4 needs 126 bytes of index \(the header, 5 sequences and 8 per document\); "
                          r"the file has 102"),
    ("document count", 2**40, rf"document count {2**40} needs {70 + 8 * 2**40} bytes of index"),
    ("document count", 3, r"102 bytes, but sequence count 3 and document count 3 account for 94 \(97 with a mode per "
                          r"sequence\): the counts are wrong or bytes follow the index"),
    ("sequence count", 2, r"102 bytes, but sequence count 2 and document count 4 account for 90 "),
])
def test_megatron_header_fields_are_named(tmp_path, field, value, message):
    write_megatron(tmp_path / "m", [[5, 6], [7, 8], [9]])  # 102 bytes of index
    patch_megatron_header(tmp_path / "m", field, value)
    with pytest.raises(sp.InvalidInputError, match=rf"m\.idx: {message}"):
        io.Megatron(tmp_path / "m")


@pytest.mark.parametrize("size, field", [(9, "version"), (16, "version"), (17, "dtype code"), (18, "sequence count"),
                                         (25, "sequence count"), (26, "document count"), (33, "document count")])
def test_a_truncated_megatron_header_names_the_field_it_ends_in(tmp_path, size, field):
    write_megatron(tmp_path / "m", [[5, 6], [7]])
    (tmp_path / "m.idx").write_bytes((tmp_path / "m.idx").read_bytes()[:size])
    with pytest.raises(sp.InvalidInputError, match=rf"m\.idx: a truncated Megatron index: its {size} bytes end inside "
                                                   rf"the header's {field} \(the header is 34 bytes\)"):
        io.Megatron(tmp_path / "m")


def test_megatron_index_bytes_after_the_document_index(tmp_path):
    write_megatron(tmp_path / "m", [[5, 6], [7, 8], [9]])
    index = (tmp_path / "m.idx").read_bytes()
    (tmp_path / "m.idx").write_bytes(index + bytes(3))  # Megatron's multimodal modes: one int8 per sequence
    assert io.Megatron(tmp_path / "m").lengths.tolist() == [2, 2, 1]
    (tmp_path / "m.idx").write_bytes(index + b"garbage")
    with pytest.raises(sp.InvalidInputError, match=r"m\.idx: 109 bytes, but sequence count 3 and document count 4 "
                                                   r"account for 102 \(105 with a mode per sequence\)"):
        io.Megatron(tmp_path / "m")
    (tmp_path / "m.idx").write_bytes(MEGATRON_MAGIC + bytes(range(100)))  # garbage after the magic
    with pytest.raises(sp.InvalidInputError, match=r"m\.idx: Megatron index version 506097522914230528 is not "):
        io.Megatron(tmp_path / "m")

def test_megatron_data_of_part_tokens_is_an_error(tmp_path):
    write_megatron(tmp_path / "m", [[5, 6], [7]])
    with open(tmp_path / "m.bin", "ab") as handle:
        handle.write(b"\x00")  # 7 bytes: three uint16 tokens and a half
    with pytest.raises(sp.InvalidInputError, match=r"m\.bin: 7 bytes is not a whole number of uint16 tokens"):
        pack(tmp_path, io.Megatron(tmp_path / "m"))
    (tmp_path / "e.idx").write_bytes(b"")
    (tmp_path / "e.bin").write_bytes(b"")
    with pytest.raises(sp.InvalidInputError, match=r"e\.idx: not a Megatron index"):
        io.Megatron(tmp_path / "e")


def test_suffixes_match_in_any_case_and_a_lone_megatron_file_is_an_error(tmp_path):
    (tmp_path / "A.JSONL").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    assert documents_of(pack(tmp_path, io.reader_for(tmp_path / "A.JSONL"), "a")) == expected_documents(TEXTS)
    write_megatron(tmp_path / "UP", [content_ids(t) for t in TEXTS])
    (tmp_path / "UP.idx").rename(tmp_path / "UP.IDX")
    (tmp_path / "UP.bin").rename(tmp_path / "UP.BIN")
    for name in ("UP.IDX", "UP.BIN"):
        assert documents_of(pack(tmp_path, io.reader_for(tmp_path / name), f"out-{name}")) == expected_documents(TEXTS)
    (tmp_path / "lone.idx").write_bytes(b"MMIDIDX")
    (tmp_path / "alone.bin").write_bytes(b"\x05\x00")
    with pytest.raises(sp.InvalidInputError, match=r"lone\.bin: no such file"):
        io.reader_for(tmp_path / "lone.idx")
    with pytest.raises(sp.InvalidInputError, match=r"alone\.idx: no such file"):
        io.reader_for(tmp_path / "alone.bin")


def test_empty_text_files_are_documents_skipped_and_counted(tmp_path):
    directory = tmp_path / "texts"
    directory.mkdir()
    for name, text in (("0.txt", ""), ("1.txt", "ab"), ("2.txt", ""), ("3.txt", "c")):
        (directory / name).write_text(text)
    packed = pack(tmp_path, io.TextFiles(directory))
    assert packed.manifest["counts"]["skipped_empty_documents"] == 2
    assert documents_of(packed) == expected_documents(["ab", "c"])


def test_a_dangling_link_in_a_directory_is_named(tmp_path):
    directory = tmp_path / "texts"
    directory.mkdir()
    (directory / "a.txt").write_text("a")
    (directory / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(sp.InvalidInputError, match=r"gone\.txt: not a regular file \(a dangling link"):
        io.TextFiles(directory)
    assert io.TextFiles(directory, "a*").paths == [directory / "a.txt"]



LOOP = r"a symbolic link that loops \(it points, directly or through others, back to itself\)"


@pytest.mark.parametrize("name", ["loop", "loop.jsonl", "loop.parquet", "loop.arrow", "loop.idx", "loop.bin"])
def test_an_input_link_that_loops_is_named(tmp_path, name):
    # An input linked to itself was "no such file or directory".
    (tmp_path / name).symlink_to(name)
    with pytest.raises(sp.InvalidInputError, match=rf"{re.escape(name)}: {LOOP}$"):
        io.reader_for(tmp_path / name)


def test_links_that_loop_through_others_are_named_by_every_reader(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    for make in (io.reader_for, io.JsonLines, io.ArrowBatches, lambda path: io.TextFiles([path])):
        with pytest.raises(sp.InvalidInputError, match=rf"/a: {LOOP}$"):
            make(tmp_path / "a")
    with pytest.raises(sp.InvalidInputError, match=rf"a/x\.txt: its path goes through {LOOP}$"):
        io.reader_for(tmp_path / "a" / "x.txt")
    write_megatron(tmp_path / "m", [[5, 6]])
    (tmp_path / "m.bin").unlink()
    (tmp_path / "m.bin").symlink_to("m.bin")
    with pytest.raises(sp.InvalidInputError, match=rf"m\.bin: {LOOP}$"):
        io.reader_for(tmp_path / "m.idx")


def test_a_link_that_loops_in_a_directory_is_named_unless_left_out(tmp_path):
    # As a dangling link: an error when its name would be read, skipped when hidden or not matched.
    directory = tmp_path / "texts"
    directory.mkdir()
    (directory / "a.txt").write_text("a")
    (directory / "self.txt").symlink_to("self.txt")
    with pytest.raises(sp.InvalidInputError, match=rf"texts/self\.txt: {LOOP}; remove it or leave it out with --glob"):
        io.TextFiles(directory)
    assert io.TextFiles(directory, "a*").paths == [directory / "a.txt"]
    (directory / "self.txt").rename(directory / ".self.txt")
    assert io.TextFiles(directory).paths == [directory / "a.txt"]

def test_linked_directories_are_followed_and_a_cycle_is_named(tmp_path):
    outside, directory = tmp_path / "outside", tmp_path / "texts"
    (outside / "deeper").mkdir(parents=True)
    directory.mkdir()
    (outside / "deeper" / "b.txt").write_text("b")
    (directory / "a.txt").write_text("a")
    (directory / "linked").symlink_to(outside, target_is_directory=True)
    assert io.TextFiles(directory).paths == [directory / "a.txt", directory / "linked" / "deeper" / "b.txt"]
    (outside / "deeper" / "loop").symlink_to(outside, target_is_directory=True)
    with pytest.raises(sp.InvalidInputError, match=r"linked/deeper/loop: a directory link cycle \(it leads back to "):
        io.TextFiles(directory)


@pytest.mark.parametrize("make", [io.JsonLines, io.Megatron, io.reader_for, io.open_dataset,
                                  lambda value: io.TextFiles([value])])
@pytest.mark.parametrize("value", [["a.jsonl", "b.jsonl"], 7, None])
def test_a_path_argument_of_another_type_is_named(make, value):
    with pytest.raises(sp.InvalidInputError, match=f"expected a path \\(str or os.PathLike\\), got {type(value).__name__}"):
        make(value)


def test_missing_inputs(tmp_path):
    with pytest.raises(sp.InvalidInputError, match="nowhere: no such file or directory"):
        io.TextFiles([tmp_path / "nowhere"])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(sp.InvalidInputError, match="no document with content"):
        pack(tmp_path, io.JsonLines(tmp_path / "empty.jsonl"))


def test_the_byte_path_needs_neither_pyarrow_nor_tqdm_nor_tokenizers(tmp_path, monkeypatch):
    """Without the extras, text and JSONL pack with the byte tokenizer; the others name their extra."""
    for name in ("pyarrow", "tqdm", "tokenizers"):
        monkeypatch.setitem(sys.modules, name, None)  # import now raises ImportError
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    assert documents_of(pack(tmp_path, io.JsonLines(path))) == expected_documents(TEXTS)
    with pytest.raises(sp.InvalidInputError, match=r"pip install 'seqpack\[corpus\]'"):
        pack(tmp_path, io.ArrowBatches(tmp_path / "docs.jsonl"), "other")
    with pytest.raises(sp.InvalidInputError, match=r"pip install 'seqpack\[hf\]'"):
        io.TokenizerFile(tmp_path / "tokenizer.json", bos=0, eos=1)
