"""Corpus readers: every input kind gives the same documents, and every error names its place."""

import json
import re
import sys

import numpy as np
import pytest

import seqpack as sp
from seqpack import io
from seqpack.io.readers import MEGATRON_DTYPES, MEGATRON_HEADER, MEGATRON_MAGIC
import os
import time
import warnings

from helpers import one_error_line, pyarrow, run, write_megatron

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


@pytest.mark.parametrize("start", [b"", b"\xef\xbb\xbf", b"\xef\xbb\xbf\r\n", b"\r\n \t\r\n", b"\xef\xbb\xbf  \n"])
def test_a_byte_order_mark_and_blank_lines_before_the_first_record_are_skipped(tmp_path, start):
    # A byte order mark on a blank first line was a JSON error; on a record's line json reads past it.
    lines = tmp_path / "docs.jsonl"
    lines.write_bytes(start + b"\r\n".join(json.dumps({"text": t}).encode() for t in TEXTS) + b"\r\n")
    assert documents_of(pack(tmp_path, io.JsonLines(lines))) == expected_documents(TEXTS)


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


def test_dictionary_encoded_and_view_string_columns_are_read_as_strings(tmp_path):
    # A pandas Categorical's Parquet file, or a string_view column, was "not a string column" (review).
    pa = pytest.importorskip("pyarrow", reason="the corpus extra reads Parquet and Arrow")
    import pyarrow.parquet as pq

    texts = [TEXTS[0], TEXTS[3], TEXTS[0]]
    pairs = {"prompt": pa.array(texts).dictionary_encode(), "completion": pa.array(texts, pa.string_view())}
    for index, column in enumerate([pa.array(texts).dictionary_encode(), pa.array(texts, pa.string_view()),
                                    pa.array([t.encode() for t in texts], pa.binary_view())]):
        pq.write_table(pa.table({"text": column}), tmp_path / f"{index}.parquet")
        assert pq.read_schema(tmp_path / f"{index}.parquet").field("text").type == column.type
        dataset = pack(tmp_path, io.reader_for(tmp_path / f"{index}.parquet"), f"out{index}")
        assert documents_of(dataset) == expected_documents(texts)
    (chunk,) = io.ArrowBatches(pa.table(pairs)).chunks(0)
    assert (list(chunk.prompts), list(chunk.completions)) == (texts, texts)
    # Inside messages too: a string_view role was "not a list of messages" (review).
    messages = [[{"role": "user", "content": text}, {"role": "assistant", "content": None}] for text in texts]
    viewed = pa.array(messages, pa.list_(pa.struct([("role", pa.string_view()), ("content", pa.string_view())])))
    (chunk,) = io.ArrowBatches(pa.table({"messages": viewed})).chunks(0)
    assert list(chunk.conversations) == messages


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
    with pytest.raises(sp.InvalidInputError, match=message) as raised:
        pack(tmp_path, io.JsonLines(path, ids_field=field))
    assert not (tmp_path / "out").exists()
    # ... in the error's fields too, which callers read (they were None; review)
    assert (raised.value.path, raised.value.line) == (str(path), int(re.search(r"jsonl:(\d+)", message)[1]))


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
    long = r"long\.jsonl:2: the document has 41 predictions; capacity is 32"
    with pytest.raises(sp.CapacityError, match=long) as raised:
        pack(tmp_path, io.JsonLines(path), long="error")
    assert (raised.value.path, raised.value.line) == (str(path), 2)
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
    with pytest.raises(sp.InvalidInputError, match=r"Table row 2: the document is null") as raised:
        pack(tmp_path, io.ArrowBatches(pa.table({"text": ["a", "b", None]})))
    assert raised.value.path.startswith("Table") and raised.value.line == 2
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
    with pytest.raises(sp.InvalidInputError, match=r"cut\.arrow: an Arrow stream without its end-of-stream marker"):
        pack(tmp_path, io.ArrowBatches(stream))
    # Other data named .arrow was said to be a stream cut short (review).
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "parquet.arrow")
    (tmp_path / "lines.arrow").write_text('{"text": "a"}\n')
    (tmp_path / "packed.arrow").write_bytes(b"\x1f\x8b" + bytes(20))
    with pa.ipc.new_file(str(tmp_path / "file.arrow"), table.schema) as writer:
        writer.write_table(table)
    (tmp_path / "file.arrow").write_bytes((tmp_path / "file.arrow").read_bytes()[:-40])
    for name, message in [("parquet", "a Parquet file, not an Arrow file or stream: name it by its own extension"),
                          ("lines", "not an Arrow file or stream \\(it begins with neither 'ARROW1' nor a stream's"),
                          ("packed", "gzip-compressed; decompress it first"),
                          ("file", r"an Arrow file pyarrow cannot read: cut short \(no footer")]:
        with pytest.raises(sp.InvalidInputError, match=f"{name}\\.arrow: {message}"):
            pack(tmp_path, io.ArrowBatches(tmp_path / f"{name}.arrow"))


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


def directory_of(directory, files):
    """A new directory holding the named text files."""
    directory.mkdir()
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


def test_a_link_that_loops_in_a_directory_is_named_unless_left_out(tmp_path):
    # As a dangling link: an error when its name would be read, skipped when hidden or not matched.
    directory = directory_of(tmp_path / "texts", {"a.txt": "a"})
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


def pack_readers(readers, out):
    return io.pack_corpus(readers, out, config=sp.PackConfig(64, 2), tokenizer=TOKENIZER, binding=BINDING)


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
        pack_readers([io.TextFiles([directory])], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    stream = tmp_path / "s.arrows"  # the stream's own suffix reads as Arrow
    stream.write_bytes((directory / "data-00000-of-00001.arrow").read_bytes())
    assert isinstance(io.reader_for(stream), io.ArrowBatches)
    assert pack_readers([io.reader_for(stream)], tmp_path / "out")["counts"]["documents"] == 2


def test_a_jsonl_file_in_a_directory_is_not_read_as_text(tmp_path):
    directory = directory_of(tmp_path / "records", {"a.jsonl": '{"text": "hello"}\n', "b.txt": "plain"})
    with pytest.raises(sp.InvalidInputError, match=r"a.jsonl: a JSONL file, not text: give it as an input"):
        pack_readers([io.TextFiles([directory])], tmp_path / "out")
    assert pack_readers([io.TextFiles([directory], "*.txt")], tmp_path / "out")["counts"]["documents"] == 1
    ndjson = tmp_path / "x.ndjson"
    ndjson.write_text('{"text": "a"}\n')
    assert isinstance(io.reader_for(ndjson), io.JsonLines)


def test_text_that_begins_like_a_binary_format_is_text(tmp_path):
    """A text beginning with PAR1 or ARROW1 was refused as Parquet or Arrow; real files
    also end with their magic, which tells them apart."""
    for head in (b"PAR1 of the contract", b"ARROW1 is a name", b"FEA1 too"):
        path = tmp_path / "note.txt"
        path.write_bytes(head)
        assert pack_readers([io.TextFiles([path])], tmp_path / "out")["counts"]["documents"] == 1
        (tmp_path / "out").rename(tmp_path / f"done-{head[:3].decode()}")
    path.write_bytes(b"PAR1 and nothing else PAR1")
    with pytest.raises(sp.InvalidInputError, match="a Parquet file, not text"):
        pack_readers([io.TextFiles([path])], tmp_path / "out")


def test_damage_in_a_sharded_parquet_file_is_one_error(tmp_path):
    pa = pyarrow()
    import pyarrow.parquet as pq

    from seqpack.io import pack_corpus

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
        pack_corpus([io.reader_for(path)], tmp_path / "out", binding=BINDING, tokenizer=TOKENIZER,
                     config=sp.PackConfig(2048, 2), shards=2, long="cut")
    assert not (tmp_path / "out").exists()


def test_duplicate_columns_and_deep_json_are_one_line_errors(tmp_path):
    pa = pyarrow()
    import pyarrow.parquet as pq

    path = tmp_path / "dup.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"]), path)
    with pytest.raises(sp.InvalidInputError, match="dup.parquet: 2 columns are named 'text'"):
        pack_readers([io.reader_for(path)], tmp_path / "out")
    deep = tmp_path / "deep.jsonl"
    deep.write_bytes(b'{"text": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    with pytest.raises(sp.InvalidInputError, match=r"deep.jsonl:1: JSON nested too deeply to read"):
        pack_readers([io.reader_for(deep)], tmp_path / "out")
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps({"text": "a"}, indent=2))
    with pytest.raises(sp.InvalidInputError, match=r"pretty.json:1: not valid JSON: .*read as JSON lines"):
        pack_readers([io.reader_for(pretty)], tmp_path / "out")


def test_datasets_that_are_not_one_table_are_named():
    datasets = pytest.importorskip("datasets", reason="needs the datasets library")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})})
    with pytest.raises(sp.InvalidInputError, match=r"DatasetDict of splits \['train'\]: give one split"):
        list(io.ArrowBatches(splits).chunks(0))
    unknown = datasets.IterableDataset.from_generator(lambda: iter([{"text": "a"}]))
    if unknown.column_names is None:
        with pytest.raises(sp.InvalidInputError, match="with unknown columns"):
            list(io.ArrowBatches(unknown).chunks(0))
    # With its features known, a stream of rows raised AttributeError (review).
    streamed = datasets.Dataset.from_dict({"text": ["a"]}).to_iterable_dataset()
    with pytest.raises(sp.InvalidInputError, match=r"IterableDataset: give a datasets.Dataset \(a table\), not a "
                                                   r"stream of rows$"):
        list(io.ArrowBatches(streamed).chunks(0))


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


def write_megatron_with_starts(prefix, documents, starts):
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
        write_megatron_with_starts(tmp_path / "m", documents, starts)
        with pytest.raises(sp.InvalidInputError, match=r"m.idx: a broken document index"):
            io.Megatron(tmp_path / "m")
    for starts in ([0, 4], [0, 1, 2, 3, 4], [0, 2, 2, 4], []):  # sentences of documents, or no index
        write_megatron_with_starts(tmp_path / "m", documents, starts)
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


def test_a_file_reached_twice_in_a_directory_is_refused_naming_the_link(tmp_path):
    # A linked file was read twice through the API; the command blamed the directory (review).
    directory = tmp_path / "d"
    directory.mkdir()
    (directory / "a.txt").write_text("alpha")
    (directory / "copy_of_a.txt").symlink_to("a.txt")
    with pytest.raises(sp.InvalidInputError, match=r"d/copy_of_a.txt: the file .*d/a.txt again, through a link: it "
                                                   r"would be an input twice"):
        list(io.TextFiles([directory]).chunks(0))
    (directory / "copy_of_a.txt").unlink()
    os.link(directory / "a.txt", directory / "hard.txt")
    with pytest.raises(sp.InvalidInputError, match=r"d/hard.txt: the file .*d/a.txt again, through a link"):
        list(io.TextFiles([directory]).chunks(0))
    # Given as inputs, a hard link and its file were packed twice (review).
    (directory / "hard.txt").unlink()
    os.link(directory / "a.txt", tmp_path / "hard.txt")
    for inputs, message in [([directory / "a.txt", tmp_path / "hard.txt"], r"hard.txt is an input twice \(also as "),
                            ([tmp_path / "hard.txt", directory], r"a.txt \(inside .*d\) is an input twice \(also as ")]:
        with pytest.raises(sp.InvalidInputError, match=message):
            pack(tmp_path, io.TextFiles(inputs))
    assert not (tmp_path / "out").exists()


def test_megatron_halves_in_a_directory_are_refused_by_name_and_json_is_text(tmp_path):
    """Megatron token data has no magic bytes: a lone .bin in a directory was packed as a
    text document of its tokens. A .json file there stays text (only a given one is JSONL)."""
    directory = tmp_path / "mixed"
    directory.mkdir()
    (directory / "a.txt").write_text("plain")
    (directory / "tokens.BIN").write_bytes(np.arange(40, dtype=np.uint16).tobytes())
    with pytest.raises(sp.InvalidInputError, match=r"tokens.BIN: a .bin file \(half of a Megatron dataset, by its "
                                                   r"name\), not text: give it as an input of its own"):
        pack_readers([io.TextFiles([directory])], tmp_path / "out")
    (directory / "tokens.BIN").rename(directory / "tokens.idx")
    with pytest.raises(sp.InvalidInputError, match=r"tokens.idx: a .idx file"):
        pack_readers([io.TextFiles([directory])], tmp_path / "out")
    (directory / "tokens.idx").rename(directory / "000_00000.ds.index")  # datatrove's: read as bytes (review)
    with pytest.raises(sp.InvalidInputError, match=r"000_00000.ds.index: a datatrove tokenized shard's file \(by "
                                                   r"its name\), not text; seqpack does not read datatrove shards"):
        pack_readers([io.TextFiles([directory])], tmp_path / "out")
    (directory / "000_00000.ds.index").rename(directory / "config.json")
    (directory / "config.json").write_text('{"text": "kept as written"}\n')
    report = pack_readers([io.TextFiles([directory])], tmp_path / "out")
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
        outputs[version] = pack_readers([io.reader_for(path)], tmp_path / f"out{version}")
        assert outputs[version]["counts"]["documents"] == 2
    assert ((tmp_path / "out1" / "part-00000" / "tokens.bin").read_bytes()
            == (tmp_path / "out2" / "part-00000" / "tokens.bin").read_bytes())
    broken = tmp_path / "broken.feather"
    broken.write_bytes((tmp_path / "v1.feather").read_bytes()[:40])
    with pytest.raises(sp.InvalidInputError, match=r"broken.feather: cannot read as arrow"):
        pack_readers([io.reader_for(broken)], tmp_path / "out3")


def test_megatron_suffixes_match_in_any_case_from_the_prefix_too(tmp_path):
    """The README: a Megatron dataset is given as PREFIX or either file, suffixes in any
    case; a prefix found only lower-case files, and a mixed-case partner was 'no such file'."""
    documents = [np.array([5, 6]), np.array([7]), np.array([8, 9, 10])]
    write_megatron_with_starts(tmp_path / "m", documents, [0, 1, 2, 3])
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

    monkeypatch.setattr(readers.megatron, "CHUNK_BYTES", 64)  # 32 uint16 tokens
    documents = [np.arange(n, dtype=np.int64) + 2 for n in (10, 10, 10, 40, 1, 0, 31, 32, 33, 5)]
    write_megatron_with_starts(tmp_path / "m", documents, [])
    chunks = list(io.Megatron(tmp_path / "m").chunks(0))
    assert [chunk.locations.tolist() for chunk in chunks] == [[0, 1, 2], [3], [4, 5, 6], [7], [8], [9]]
    flat = np.concatenate([chunk.ids[0] for chunk in chunks])
    assert flat.tolist() == np.concatenate(documents).tolist()


# --- inputs the readers used to misread: non-objects, both fields, compressed or binary files,
# datasets in a directory walk ---------------------------------------------------------------

import bz2
import gzip
import io as io_module
import lzma
import zipfile


# Regression: a JSONL line that is not an object was a foreign error.
@pytest.mark.parametrize("line, kind", [('["text"]', "array"), ('"text"', "string"), ("5", "number"),
                                        ("null", "null"), ("true", "boolean")])
def test_a_jsonl_value_that_is_not_an_object_is_named(tmp_path, line, kind):
    lines = tmp_path / "docs.jsonl"
    lines.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    with pytest.raises(sp.InvalidInputError, match=rf"docs.jsonl:2: a JSON {kind}, not an object with field 'text'"):
        pack_readers([io.JsonLines(lines)], tmp_path / "out")


# Regression: a text field and an IDs field were accepted together.
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
    assert io.JsonLines(lines).record_fields.fields == ("text",)
    assert io.JsonLines(lines, ids_field="ids").record_fields.fields == ("ids",)


# Regression: a BOS or EOS ID that names no token (a gap in the vocabulary) was accepted.
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


def _zip_bytes(data):
    buffer = io_module.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("docs.jsonl", data)
    return buffer.getvalue()


COMPRESSORS = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress, "zip": _zip_bytes,
               "zstd": lambda data: b"\x28\xb5\x2f\xfd" + data}  # a zstd frame's magic (no zstd module needed)


# Regression: compressed inputs were packed as one text document or failed as not JSON.
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
        pack_readers([io.TextFiles(tmp_path / "docs.txt")], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# From the d863305 fix: a directory's Parquet, Arrow or Megatron file was packed as one text document of its bytes.
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
        pack_readers([io.TextFiles(corpus)], tmp_path / "out")
    for name, what in (("c.arrow", "an Arrow file"), ("d.idx", "a Megatron index")):
        (corpus / "b.parquet").unlink(missing_ok=True)
        (corpus / name).write_bytes((tmp_path / name).read_bytes())
        with pytest.raises(sp.InvalidInputError, match=rf"{re.escape(name)}: {what}, not text: "):
            pack_readers([io.TextFiles(corpus)], tmp_path / "out")
        (corpus / name).unlink()
    with pytest.raises(sp.InvalidInputError, match=r"c\.arrow: an Arrow file, not JSONL: "):
        io.JsonLines(tmp_path / "c.arrow")
    assert not (tmp_path / "out").exists()
    assert pack_readers([io.TextFiles(corpus, pattern="*.txt")], tmp_path / "out")["counts"]["documents"] == 1


# Regression: the passing twin of the compressed-input check: text that starts like a magic number.
@pytest.mark.parametrize("text", ["BZh91AY no", "PK and gz", ""])
def test_text_that_starts_like_a_magic_number_is_text(tmp_path, text):
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": text or "x"}) + "\n")
    assert len(io.TextFiles(tmp_path / "a.txt").inputs) == 1
    assert pack_readers([io.JsonLines(tmp_path / "docs.jsonl")], tmp_path / "out")["counts"]["documents"] == 1


# Regression: a packed dataset met in a directory walk was read back as text documents.
def test_a_packed_dataset_under_a_directory_is_skipped_and_listed(tmp_path, text):
    corpus = tmp_path / "corpus"
    (corpus / "deeper").mkdir(parents=True)
    (corpus / "b.txt").write_text("bee")
    pack_readers([io.TextFiles([text])], corpus / "deeper" / "packed")
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


# Regression: a JSONL line without the field said only "no field 'text'", unlike Parquet.
@pytest.mark.parametrize("records, text_field, hint", [
    ([{"text": "hi"}, {"input_ids": [5, 6]}], None,
     ":2: a token-ID record, but the first record is a text record: every record of an input must be of one kind"),
    ([{"input_ids": [5, 6]}], "text", ":1: no field 'text' (the line has 'input_ids': pass --ids-field input_ids)"),
    ([{"txt": "hi"}], None, ":1: no field 'text'; name one with --text-field or --ids-field"),
])
def test_a_jsonl_line_without_the_field_says_which_flag_names_it(tmp_path, records, text_field, hint):
    """Used to say only "no field 'text'", unlike the Parquet reader."""
    lines = tmp_path / "ids2.jsonl"
    lines.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(sp.InvalidInputError) as raised:
        pack_readers([io.JsonLines(lines, text_field=text_field)], tmp_path / "out")
    assert str(raised.value) == f"{lines}{hint}"


def test_jsonl_records_of_input_ids_alone_are_read_as_ids_as_in_parquet(tmp_path):
    # TRL's pre-tokenized JSONL ({"input_ids", "completion_mask"}) is read as IDs without --ids-field.
    lines = tmp_path / "ids.jsonl"
    lines.write_text(json.dumps({"input_ids": [5, 6], "completion_mask": [0, 1]}) + "\n"
                     + json.dumps({"input_ids": [7], "completion_mask": [1]}) + "\n")
    reader = io.JsonLines(lines)
    assert reader.record_fields == io.JsonLines(lines, ids_field="input_ids").record_fields
    assert (reader.record_fields.kind, reader.record_fields.masks) == ("ids", ("completion_mask",))
    (chunk,) = reader.chunks(0)
    (expected,) = io.JsonLines(lines, ids_field="input_ids").chunks(0)
    assert [values.tolist() for values in chunk.ids] == [values.tolist() for values in expected.ids] \
        == [[5, 6, 7], [0, 2, 3]]
    assert chunk.masks["completion_mask"].tolist() == [0, 1, 1]


# Regression: reader_for did not take a Megatron PREFIX (the path without .idx/.bin).
def test_reader_for_takes_a_megatron_prefix(tmp_path):
    write_megatron(tmp_path / "meg", [[5, 6, 7], [8, 9]])
    reader = io.reader_for(tmp_path / "meg")
    assert isinstance(reader, io.Megatron) and reader.index_path == tmp_path / "meg.idx"
    with pytest.raises(sp.InvalidInputError, match="nothing: no such file or directory"):
        io.reader_for(tmp_path / "nothing")


def test_a_file_pyarrow_cannot_read_as_parquet_is_named(tmp_path):
    pyarrow()
    from seqpack.io.readers import open_parquet

    fake = tmp_path / "fake.parquet"
    fake.write_bytes(b"not parquet at all")
    message = rf"^{re.escape(str(fake))}: cannot read as parquet: "
    with pytest.raises(sp.InvalidInputError, match=message) as caught:
        open_parquet(str(fake))
    assert caught.value.path == str(fake)
    with pytest.raises(sp.InvalidInputError, match=message):
        list(io.ArrowBatches(fake).chunks(0))
