"""Supervised fine-tuning inputs (TRL 1.16's formats): prompt-completion records,
conversations and token IDs with their masks read alike from JSONL, Parquet and a
``datasets.save_to_disk`` directory; every error names its place."""

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack import io
from seqpack.io import readers
from seqpack.io.readers import SavedDataset

from helpers import datasets_library, pyarrow, write_jsonl, write_parquet, write_saved


#: The same records of each kind, every format; each kind with its corners.
RECORDS = {
    "text": [{"text": t} for t in ["the quick brown fox", "", "é ü ñ\nsecond line", "x"]],
    "prompt-completion": [
        {"prompt": "Question: two plus two?", "completion": " four."},
        {"prompt": "", "completion": "all completion"},  # empty prompt
        {"prompt": "the lazy dog", "completion": ""},  # empty completion
        {"prompt": "Ün\nï", "completion": "cödé \"quoted\""},
        {"prompt": "p5", "completion": "c5"},
    ],
    "conversation": [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": ""}]},  # one message, empty content
        {"messages": [{"role": "user", "content": "ünï"}, {"role": "assistant", "content": "cödé"}]},
    ],
    "ids": [
        {"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1], "assistant_masks": [0, 0, 1], "labels": [-100, 6, 7]},
        {"input_ids": [], "completion_mask": [], "assistant_masks": [], "labels": []},  # an empty record
        {"input_ids": [9], "completion_mask": [1], "assistant_masks": [1], "labels": [9]},
        {"input_ids": [3, 4, 2**40], "completion_mask": [1, 0, 1], "assistant_masks": [1, 1, 0],
         "labels": [3, -100, 2**40]},
    ],
}


def one_kind(chunk):
    """The one content field a chunk sets (its texts, IDs, prompts or conversations)."""
    present = [name for name in ("texts", "text_buffer", "ids", "prompts", "conversations")
            if getattr(chunk, name) is not None]
    assert len(present) == 1, present
    assert (chunk.prompts is None) == (chunk.completions is None)
    assert chunk.masks is None or chunk.ids is not None
    return present[0]


def records_of(reader):
    """``(location, record)`` of every record a reader yields, the record as plain Python values."""
    found = []
    for chunk in reader.chunks(0):
        kind = one_kind(chunk)
        if kind == "prompts":
            assert len(chunk.prompts) == len(chunk.completions) == len(chunk)
            items = [{"prompt": p, "completion": c} for p, c in zip(chunk.prompts, chunk.completions)]
        elif kind == "conversations":
            items = [{"messages": messages} for messages in chunk.conversations]
        elif kind == "ids":
            flat, offsets = chunk.ids
            masks = chunk.masks or {}
            assert offsets.dtype == np.int64 and offsets[0] == 0 and offsets[-1] == flat.shape[0]
            for values in masks.values():
                assert values.dtype.kind == "i" and values.shape == flat.shape
            bounds = offsets.tolist()
            items = [{"input_ids": flat[a:b].tolist(), **{name: values[a:b].tolist() for name, values in masks.items()}}
                     for a, b in zip(bounds[:-1], bounds[1:])]
        else:
            items = [{"text": t.decode() if isinstance(t, bytes) else t} for t in chunk.text_list()]
        assert len(items) == len(chunk) == chunk.inputs.shape[0]
        found.extend(zip(chunk.locations.tolist(), items))
    return found


def readers_of(tmp_path, kind, records):
    """The JSONL, Parquet and save_to_disk readers of the same records (each finds the kind by name)."""
    jsonl = write_jsonl(tmp_path / f"{kind}.jsonl", records, blank_lines=True)
    parquet = write_parquet(tmp_path / f"{kind}.parquet", records, row_group_size=2)
    saved = write_saved(tmp_path / f"{kind}-saved", records)
    return {"jsonl": io.reader_for(jsonl), "parquet": io.reader_for(parquet),
            "saved": io.reader_for(saved)}


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_each_kind_reads_the_same_from_jsonl_parquet_and_a_saved_dataset(tmp_path, kind):
    records = RECORDS[kind]
    found = readers_of(tmp_path, kind, records)
    assert isinstance(found["saved"], SavedDataset) and len(found["saved"].files) == 3
    for name, reader in found.items():
        assert reader.record_kind == kind, name
        read = records_of(reader)
        assert [record for _, record in read] == records, name
    # JSONL lines count from 1 (blank lines between records); rows from 0, across a saved dataset's files.
    assert [line for line, _ in records_of(found["jsonl"])] == [1 + 2 * i for i in range(len(records))]
    for name in ("parquet", "saved"):
        assert [row for row, _ in records_of(found[name])] == list(range(len(records)))


def test_each_record_is_read_by_trls_precedence_ids_then_prompts_then_messages_then_text(tmp_path):
    # Text does not win over the other fields: TRL's .map(tokenize) keeps the text column beside the IDs.
    both = tmp_path / "both.jsonl"
    write_jsonl(both, [{"text": "t", "prompt": "p", "completion": "c", "messages": []}])
    assert io.JsonLines(both).record_kind == "prompt-completion"
    assert records_of(io.JsonLines(both)) == [(1, {"prompt": "p", "completion": "c"})]
    tokenized = tmp_path / "tokenized.jsonl"
    write_jsonl(tokenized, [{"text": "t", "input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]},
                            {"text": "u", "messages": [{"role": "user", "content": "x"}], "input_ids": [8, 9]}])
    assert io.JsonLines(tokenized).record_kind == "ids"
    assert [record for _, record in records_of(io.JsonLines(tokenized))] == [
        {"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}, {"input_ids": [8, 9], "completion_mask": [1, 1]}]
    chat = tmp_path / "chat.jsonl"
    write_jsonl(chat, [{"text": "t", "messages": [{"role": "user", "content": "x"}]}])
    assert io.JsonLines(chat).record_kind == "conversation"
    pa = pyarrow()
    assert io.ArrowBatches(pa.table({"messages": [[{"role": "u", "content": "x"}]], "prompt": ["p"],
                                     "completion": ["c"], "text": ["t"]})).record_kind == "prompt-completion"
    assert io.ArrowBatches(pa.table({"text": ["t"], "input_ids": [[5, 6]]})).record_kind == "ids"
    lone = tmp_path / "lone.jsonl"  # a prompt alone is no prompt-completion record
    write_jsonl(lone, [{"prompt": "p"}])
    assert io.JsonLines(lone).record_kind == "text"
    named = tmp_path / "named.jsonl"  # a field named by the user is read as text, whatever else is there
    write_jsonl(named, [{"prompt": "p", "completion": "c", "input_ids": [1]}])
    assert records_of(io.JsonLines(named, text_field="prompt")) == [(1, {"text": "p"})]


def test_masks_are_carried_exactly_and_per_record(tmp_path):
    pa = pyarrow()
    records = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [2], "labels": [-100]}]
    path = write_jsonl(tmp_path / "labels.jsonl", records)
    for reader in (io.JsonLines(path, ids_field="input_ids"), io.ArrowBatches(pa.Table.from_pylist(records))):
        (chunk,) = reader.chunks(0)
        assert list(chunk.masks) == ["labels"] and chunk.masked.tolist() == [True, True]
        assert chunk.masks["labels"].tolist() == [-100, -100, 7, 8, -100]
        assert chunk.ids[1].tolist() == [0, 4, 5]
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"input_ids": [5, 6]}])
    (chunk,) = io.JsonLines(bare, ids_field="input_ids").chunks(0)
    assert chunk.masks is None and chunk.masked is None
    # Each record's masks are its own, not decided by the first record: a record without a
    # mask holds 1s there, which change nothing, and one without labels NO_LABEL (-101): its
    # masks decide (TRL uses a record's labels, when it has them, and no mask).
    later = write_jsonl(tmp_path / "later.jsonl", [{"input_ids": [10, 11, 12]},
                                                   {"input_ids": [20, 21, 22, 23], "completion_mask": [0, 0, 0, 1]},
                                                   {"input_ids": [6, 7], "labels": [-100, 7]}])
    (chunk,) = io.JsonLines(later).chunks(0)
    assert chunk.masked.tolist() == [False, True, True]
    assert chunk.masks["completion_mask"].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert chunk.masks["labels"].tolist() == [-101] * 7 + [-100, 7]
    # Boolean masks are 0/1 masks, as TRL reads them (they were refused; review).
    flags = write_jsonl(tmp_path / "flags.jsonl", [{"input_ids": [5, 6, 7], "completion_mask": [False, True, True]}])
    (chunk,) = io.JsonLines(flags).chunks(0)
    assert chunk.masks["completion_mask"].tolist() == [0, 1, 1]
    table = pa.table({"input_ids": [[5, 6], [7, 8, 9]], "assistant_masks": [[False, True], [True, False, True]]})
    (chunk,) = io.ArrowBatches(table).chunks(0)
    assert chunk.masks["assistant_masks"].tolist() == [0, 1, 1, 0, 1]
    with pytest.raises(sp.InvalidInputError, match=r"column 'labels' of type list<item: bool> is not a list of integers"):
        list(io.ArrowBatches(pa.table({"input_ids": [[5, 6]], "labels": [[True, False]]})).chunks(0))
    # Narrow Arrow types stay as they are (a flat view, no Python object per value).
    table = pa.table({"input_ids": pa.array([[5, 6]], pa.list_(pa.int32())),
                      "assistant_masks": pa.array([[0, 1]], pa.list_(pa.int8()))})
    (chunk,) = io.ArrowBatches(table).chunks(0)
    assert chunk.masks["assistant_masks"].dtype == np.int8 and chunk.masks["assistant_masks"].tolist() == [0, 1]


TOOL_CALL = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny", "name": "get_weather"},
             {"role": "assistant", "content": "It is sunny."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_messages_keep_every_key_and_records_their_tools(tmp_path):
    # Keys other than role and content are kept, and so is TRL's tools column.
    records = [{"messages": TOOL_CALL, "tools": json.dumps(TOOLS), "chat_template_kwargs": {"style": "brief"}},
               {"messages": TOOL_CALL[:1], "tools": None}]
    path = write_jsonl(tmp_path / "tools.jsonl", records)
    (chunk,) = io.JsonLines(path).chunks(0)
    assert chunk.conversations == [TOOL_CALL, TOOL_CALL[:1]]
    assert chunk.tools == [TOOLS, None] and chunk.template_kwargs == [{"style": "brief"}, {}]
    (chunk,) = io.reader_for(write_parquet(tmp_path / "tools.parquet", records)).chunks(0)
    # Arrow gives every message the keys of the column's struct (None where a message has none).
    keys = {key for message in TOOL_CALL for key in message}
    assert chunk.conversations[0] == [{key: message.get(key) for key in keys} for message in TOOL_CALL]
    assert chunk.tools == [TOOLS, None] and chunk.template_kwargs[0] == {"style": "brief"}
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"messages": TOOL_CALL[:1]}])
    (chunk,) = io.JsonLines(plain).chunks(0)
    assert chunk.tools is None and chunk.template_kwargs is None


def test_conversational_prompt_completion_records_keep_their_messages(tmp_path):
    records = [{"prompt": TOOL_CALL[:1], "completion": TOOL_CALL[1:2]},
               {"prompt": TOOL_CALL[:3], "completion": TOOL_CALL[3:]}]
    reader = io.JsonLines(write_jsonl(tmp_path / "cpc.jsonl", records))
    assert reader.record_kind == "conversational prompt-completion"
    (chunk,) = reader.chunks(0)
    assert chunk.conversational and chunk.prompts == [r["prompt"] for r in records]
    assert chunk.completions == [r["completion"] for r in records]
    plain = [{"prompt": TOOL_CALL[:1], "completion": TOOL_CALL[3:]}]
    table = io.ArrowBatches(pyarrow().Table.from_pylist(plain))
    assert table.record_kind == "conversational prompt-completion"
    (chunk,) = table.chunks(0)
    assert chunk.conversational and chunk.prompts == [TOOL_CALL[:1]] and chunk.completions == [TOOL_CALL[3:]]


PROMPT_COMPLETION = '{"prompt": "a", "completion": "b"}\n'
CONVERSATION = '{"messages": [{"role": "user", "content": "hi"}]}\n'
IDS = '{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}\n'


@pytest.mark.parametrize("content, ids_field, message", [
    (PROMPT_COMPLETION + '{"prompt": "a", "completion": 5}\n', None, r":2: field 'completion' is not a string$"),
    (PROMPT_COMPLETION + '{"prompt": ["a"], "completion": "b"}\n', None,
     r":2: a conversational prompt-completion record, but the first record is a prompt-completion record: every "),
    (PROMPT_COMPLETION + '{"prompt": "a", "completion": ["b"]}\n', None, r":2: field 'completion' is not a string$"),
    (PROMPT_COMPLETION * 2 + '\n{"prompt": "a"}\n', None,
     r":4: no field 'completion' \(the first record is a prompt-completion record: every record must be one\)$"),
    (PROMPT_COMPLETION + '{"text": "a"}\n', None,
     r":2: a text record, but the first record is a prompt-completion record: every record of an input must be of "),
    (PROMPT_COMPLETION + CONVERSATION, None, r":2: a conversation record, but the first record is a prompt-completion "),
    (CONVERSATION + PROMPT_COMPLETION, None, r":2: a prompt-completion record, but the first record is a conversation "),
    ('{"text": "a"}\n' + CONVERSATION, None,
     r":2: a conversation record, but the first record is a text record: every record of an input must be of one "
     r"kind$"),
    ('{"text": "a"}\n' + IDS, None, r":2: a token-ID record, but the first record is a text record: every record "),
    ('{"text": "a"}\n{"body": "b"}\n', None, r":2: no field 'text'; name one with --text-field or --ids-field$"),
    (PROMPT_COMPLETION + '["a", "b"]\n', None,
     r":2: a JSON array, not an object with fields 'prompt' and 'completion'$"),
    (PROMPT_COMPLETION + '{"prompt": "a\\ud800", "completion": "b"}\n', None,
     r":2: field 'prompt' holds '\\ud800' \(a lone surrogate\) at character 1: it has no UTF-8 encoding$"),
    (CONVERSATION + '{"messages": []}\n', None, r":2: field 'messages' is an empty array, not a non-empty list of "),
    (CONVERSATION + '{"messages": "hi"}\n', None, r":2: field 'messages' is a JSON string, not a non-empty list "),
    (CONVERSATION + '{"messages": [{"role": "user", "content": "a"}, ["x"]]}\n', None,
     r":2: messages\[1\] is a JSON array, not an object with a 'role'$"),
    (CONVERSATION + '{"messages": [{"content": "a"}]}\n', None, r":2: messages\[0\] has no 'role'$"),
    (CONVERSATION + '{"messages": [{"role": 1, "content": "a"}]}\n', None,
     r":2: messages\[0\] has a 'role' that is not a string$"),
    (CONVERSATION + '{"messages": [{"role": "user"}], "tools": "[not json"}\n', None,
     r":2: field 'tools' is a string but not JSON: "),
    (CONVERSATION + '{"messages": [{"role": "user"}], "tools": {"name": "f"}}\n', None,
     r":2: field 'tools' is a JSON object, not a list of tools$"),
    (CONVERSATION + '{"messages": [{"role": "user"}], "chat_template_kwargs": [1]}\n', None,
     r":2: field 'chat_template_kwargs' is a JSON array, not an object$"),
    (CONVERSATION + '{"messages": [{"role": "user", "content": "é"}, '
                    '{"role": "assistant", "content": "ok\\udc00"}]}\n', None,
     r":2: messages\[1\]\['content'\] holds '\\udc00' \(a lone surrogate\) at character 2"),
    (IDS + '{"input_ids": [5, 6, 7], "completion_mask": [0, 1]}\n', "input_ids",
     r":2: field 'completion_mask' has 2 values; field 'input_ids' has 3 IDs$"),
    (IDS + '{"input_ids": [5], "completion_mask": [1.0]}\n', "input_ids",
     r":2: field 'completion_mask' is not a list of ints$"),
    (IDS + '{"input_ids": [5, 6], "labels": [true, 6]}\n', "input_ids",   # a mask may be booleans, labels not
     r":2: field 'labels' is not a list of ints$"),
    ('{"input_ids": [5], "labels": [-100]}\n{"input_ids": [5], "labels": [-18446744073709551616]}\n', "input_ids",
     r":2: field 'labels' value -18446744073709551616 does not fit int64$"),
    # A repeated key kept only its last value (review).
    (IDS + '{"input_ids": [5, 6, 7], "input_ids": [8, 9]}\n', "input_ids",
     r":2: field 'input_ids' appears twice in one object \(JSON readers keep only the last; Parquet and pyarrow "),
    (CONVERSATION + '{"messages": [{"role": "user", "content": "a", "content": "b"}]}\n', None,
     r":2: field 'content' appears twice in one object"),
    # A record's own -101 is no "record without labels" mark (review: it became a supervised target).
    (IDS + '{"input_ids": [5, 6, 7], "labels": [-101, -100, -101]}\n', "input_ids",
     r":2: labels\[2\] is -101, neither -100 nor its input_ids token 7: a packed document's targets are its own "),
    # Fields seqpack would misread are refused, not ignored (review).
    (IDS + '{"input_ids": [5, 6], "seq_lengths": [1, 1]}\n', "input_ids",
     r":2: field 'seq_lengths': the records are rows that TRL's pack_dataset already packed "),
    (PROMPT_COMPLETION + '{"prompt": "a", "completion": "b", "images": []}\n', None,
     r":2: field 'images': a vision-language record \(TRL reads it with a processor\)"),
])
def test_jsonl_record_errors_name_the_line_and_the_field(tmp_path, content, ids_field, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(sp.InvalidInputError, match=re.escape(str(path)) + message):
        list(io.JsonLines(path, ids_field=ids_field).chunks(0))
    good = tmp_path / "good.jsonl"  # the first line alone, the exact twin, reads
    good.write_text(content.splitlines()[0] + "\n")
    assert len(records_of(io.JsonLines(good, ids_field=ids_field))) == 1


def messages(pa, rows):
    return pa.array(rows, pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("columns, message", [
    (lambda pa: {"prompt": ["a", "b"], "completion": pa.array([1, 2])},
     r"Table: column 'completion' of type int64 is not a string column"),
    (lambda pa: {"prompt": ["a", None, "c"], "completion": ["x", "y", "z"]}, r"Table row 1: column 'prompt' is null"),
    (lambda pa: {"prompt": pa.array([b"a"], pa.binary()), "completion": ["x"]},
     r"Table: column 'prompt' of type binary is not a string column"),
    (lambda pa: {"messages": messages(pa, [HI, HI, []])},
     r"Table row 2: field 'messages' is an empty array, not a non-empty list of messages"),
    (lambda pa: {"messages": messages(pa, [HI, None])}, r"Table row 1: column 'messages' is null"),
    (lambda pa: {"messages": messages(pa, [HI, HI + [{"role": None, "content": "x"}]])},
     r"Table row 1: messages\[1\] has no 'role'"),
    (lambda pa: {"messages": messages(pa, [HI, [None]])},
     r"Table row 1: messages\[0\] is a JSON null, not an object with a 'role'"),
    (lambda pa: {"messages": pa.array([["hi"]])},
     r"Table: column 'messages' of type list<item: string> is not a list of messages \(structs with a string 'role'\)"),
    (lambda pa: {"input_ids": [[5, 6], [7, 8]], "labels": [[-100, 6], [8]]},
     r"Table row 1: column 'labels' has 1 values; column 'input_ids' has 2 IDs"),
    (lambda pa: {"input_ids": [[5, 6], [7]], "completion_mask": [None, [1]]},
     r"Table row 0: column 'completion_mask' is null"),
    (lambda pa: {"input_ids": [[5], [6, 7]], "labels": [[5], [-100, None]]}, r"Table row 1: a 'labels' value is null"),
    (lambda pa: {"input_ids": [[5]], "assistant_masks": [[1.0]]},
     r"Table: column 'assistant_masks' of type list<item: double> is not a list of integers"),
    (lambda pa: {"input_ids": [[5, 6], [7, 8, 9]], "labels": [[-101, 6], [-100, -100, -101]]},
     r"Table row 1: labels\[2\] is -101, neither -100 nor its input_ids token 9: a packed document's targets are "
     r"its own tokens"),
    (lambda pa: {"input_ids": [[5, 6]], "seq_lengths": [[1, 1]]},
     r"Table: field 'seq_lengths': the records are rows that TRL's pack_dataset already packed .*"),
    (lambda pa: {"text": ["a"], "image": ["cat.png"]}, r"Table: field 'image': a vision-language record .*"),
])
def test_arrow_record_errors_name_the_row_and_the_column(columns, message):
    pa = pyarrow()
    with pytest.raises(sp.InvalidInputError, match=f"^{message}$"):
        list(io.ArrowBatches(pa.table(columns(pa))).chunks(0))


def test_parquet_and_saved_dataset_errors_name_the_file_or_directory_and_the_row(tmp_path):
    records = [{"input_ids": [5, 6], "labels": [5, 6]} for _ in range(6)]
    records[4] = {"input_ids": [5, 6], "labels": [5]}
    parquet = write_parquet(tmp_path / "bad.parquet", records, row_group_size=2)
    with pytest.raises(sp.InvalidInputError, match=rf"^{re.escape(str(parquet))} row 4: column 'labels' has 1 values"):
        list(io.reader_for(parquet).chunks(0))
    saved = write_saved(tmp_path / "bad-saved", records)  # rows 0-1, 2-3, 4-5: row 4 is the third file's first
    with pytest.raises(sp.InvalidInputError, match=rf"^{re.escape(str(saved))} row 4: column 'labels' has 1 values"):
        list(io.reader_for(saved).chunks(0))
    prompts = write_saved(tmp_path / "null-saved", [{"prompt": p, "completion": "c"} for p in ["a", "b", "c", None]],
                          num_shards=2)
    with pytest.raises(sp.InvalidInputError, match=rf"^{re.escape(str(prompts))} row 3: column 'prompt' is null$"):
        list(io.reader_for(prompts).chunks(0))


def test_a_saved_dataset_reads_its_files_in_the_order_state_json_lists_them(tmp_path):
    records = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(6)]
    saved = write_saved(tmp_path / "saved", records)
    state = json.loads((saved / "state.json").read_text())
    state["_data_files"].reverse()
    (saved / "state.json").write_text(json.dumps(state))
    assert [record["prompt"] for _, record in records_of(io.reader_for(saved))] == ["p4", "p5", "p2", "p3", "p0", "p1"]
    assert [row for row, _ in records_of(io.reader_for(saved))] == list(range(6))
    state["_data_files"].append({"filename": "data-00009-of-00003.arrow"})
    (saved / "state.json").write_text(json.dumps(state))
    with pytest.raises(sp.InvalidInputError, match=r"data-00009-of-00003\.arrow: no such file \(listed in .*state"):
        io.reader_for(saved)
    state["_data_files"][-1] = {"filename": "../elsewhere.arrow"}
    (saved / "state.json").write_text(json.dumps(state))
    with pytest.raises(sp.InvalidInputError, match=r"state\.json: data file '\.\./elsewhere\.arrow' is not a file "):
        io.reader_for(saved)
    (saved / "state.json").write_text("{}")
    with pytest.raises(sp.InvalidInputError, match=r"state\.json: no '_data_files' list"):
        io.reader_for(saved)


def test_a_saved_dataset_dict_is_refused_naming_its_splits(tmp_path):
    datasets = datasets_library()
    split = datasets.Dataset.from_dict({"prompt": ["p"], "completion": ["c"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    message = (rf"^{re.escape(str(tmp_path / 'dd'))}: a datasets.DatasetDict of splits 'train', 'test': give one "
               rf"split's directory, such as {re.escape(str(tmp_path / 'dd' / 'train'))}$")
    for make in (io.reader_for, SavedDataset):
        with pytest.raises(sp.InvalidInputError, match=message):
            make(tmp_path / "dd")
    assert records_of(io.reader_for(tmp_path / "dd" / "test")) == [(0, {"prompt": "p", "completion": "c"})]


def test_a_saved_dataset_is_named_in_a_pack_error(tmp_path):
    """A packing error names the directory and the row, as for any table."""
    saved = write_saved(tmp_path / "saved", [{"input_ids": [5, 6]}, {"input_ids": [7, 400]}], num_shards=2)
    with pytest.raises(sp.InvalidInputError, match=rf"{re.escape(str(saved))} row 1: token 400 at position 2"):
        io.pack_corpus([io.reader_for(saved)], tmp_path / "out", config=sp.PackConfig(32, 2),
                       tokenizer=sp.ByteTokenizer(), binding=sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(),
                                                                                           split="tests"))


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_chunks_end_at_chunk_documents_with_records_whole(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(readers.jsonl, "CHUNK_DOCUMENTS", 3)
    records = (RECORDS[kind] * 3)[:7]
    path = write_jsonl(tmp_path / "docs.jsonl", records)
    reader = io.JsonLines(path, ids_field="input_ids" if kind == "ids" else None)
    assert [len(chunk) for chunk in reader.chunks(0)] == [3, 3, 1]
    assert [record for _, record in records_of(reader)] == records
    monkeypatch.setattr(readers.jsonl, "CHUNK_BYTES", 1)  # every record alone
    assert [len(chunk) for chunk in reader.chunks(0)] == [1] * 7
    monkeypatch.setattr(io.ArrowBatches, "BATCH_ROWS", 3)
    parquet = io.reader_for(write_parquet(tmp_path / "docs.parquet", records))
    assert [len(chunk) for chunk in parquet.chunks(0)] == [3, 3, 1]
    assert [record for _, record in records_of(parquet)] == records


def test_split_pieces_give_the_whole_files_prompt_completion_records(tmp_path, monkeypatch):
    monkeypatch.setattr(readers.jsonl, "CHUNK_DOCUMENTS", 4)
    records = [{"prompt": "p" * (i % 5), "completion": f"c{i}"} for i in range(40)]
    path = write_jsonl(tmp_path / "pc.jsonl", records, blank_lines=True)
    whole = records_of(io.JsonLines(path))
    size = path.stat().st_size
    pieces = io.JsonLines(path).split([size // 5, size // 2, size // 2 + 1, size * 4 // 5])
    assert len(pieces) >= 3 and pieces[1].first_line > 1
    assert all(piece.record_kind == "prompt-completion" for piece in pieces)  # by the file's first record
    assert [record for piece in pieces for record in records_of(piece)] == whole
    assert [record for _, record in whole] == records
    # A piece beginning with a text record is still a piece of a prompt-completion file.
    lines = path.read_text().splitlines(keepends=True)
    lines[60] = json.dumps({"text": "not a pair"}) + "\n"
    path.write_text("".join(lines))
    later = next(piece for piece in io.JsonLines(path).split([sum(map(len, lines[:60]))]) if piece.first_line == 61)
    with pytest.raises(sp.InvalidInputError, match=r"pc\.jsonl:61: a text record, but the first record is a "
                                                   r"prompt-completion record"):
        records_of(later)


def test_row_groups_read_every_column_of_the_records(tmp_path):
    """Shards of a Parquet file read its row groups with every column the records need."""
    from seqpack.io.shards import units_of

    path = write_parquet(tmp_path / "pc.parquet", RECORDS["prompt-completion"], row_group_size=2)
    units = units_of(io.reader_for(path), 0)
    assert len(units) > 1
    whole = list(io.reader_for(path).chunks(0))
    pieces = [chunk for unit in units for chunk in unit.chunks(0)]
    for field in ("prompts", "completions"):
        assert sum((getattr(c, field) for c in pieces), []) == sum((getattr(c, field) for c in whole), [])
    assert np.concatenate([c.locations for c in pieces]).tolist() == np.concatenate([c.locations for c in whole]).tolist()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    pyarrow()
    return tmp_path_factory.mktemp("round-trip")


@settings(derandomize=True, max_examples=60, deadline=None, database=None)
@given(st.lists(st.tuples(st.text(max_size=12), st.text(max_size=12)), min_size=1, max_size=8))
def test_prompt_completion_strings_round_trip_through_jsonl_and_parquet(scratch, pairs):
    records = [{"prompt": prompt, "completion": completion} for prompt, completion in pairs]
    read = [records_of(io.JsonLines(write_jsonl(scratch / "pc.jsonl", records))),
            records_of(io.ArrowBatches(write_parquet(scratch / "pc.parquet", records)))]
    for found in read:
        assert [record for _, record in found] == records


def test_a_named_field_reads_beside_images_but_packed_rows_are_refused(tmp_path):
    path = tmp_path / "vision.jsonl"
    path.write_text('{"text": "a cat", "images": ["cat.png"]}\n')
    assert [record for _, record in records_of(io.JsonLines(path, text_field="text"))] == [{"text": "a cat"}]
    path.write_text('{"input_ids": [5, 6], "seq_lengths": [1, 1]}\n')
    with pytest.raises(sp.InvalidInputError, match=r":1: field 'seq_lengths': "):
        records_of(io.JsonLines(path, ids_field="input_ids"))


def test_an_arrow_stream_cut_between_record_batches_is_refused(tmp_path):
    # Its reader took the end of the file for the end of the stream: a save_to_disk shard cut
    # at a batch boundary packed 1000 of its 3000 rows, exit 0 (review).
    pa = pyarrow()
    records = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(6)]
    saved = write_saved(tmp_path / "saved", records, num_shards=2)
    shard = sorted(saved.glob("*.arrow"))[1]
    whole = shard.read_bytes()
    assert whole.endswith(b"\xff\xff\xff\xff\x00\x00\x00\x00")
    assert len(records_of(io.reader_for(saved))) == 6
    shard.write_bytes(whole[:-8])  # every record batch intact, the end-of-stream marker gone
    with pytest.raises(sp.InvalidInputError, match=rf"^{re.escape(str(shard))}: an Arrow stream without its "
                                                   rf"end-of-stream marker: cut short"):
        records_of(io.reader_for(saved))
    stream = tmp_path / "records.arrows"
    table = pa.table({"text": [f"t{i}" for i in range(4)]})
    with pa.ipc.new_stream(stream, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    assert len(records_of(io.reader_for(stream))) == 4
    stream.write_bytes(stream.read_bytes()[:-8])
    with pytest.raises(sp.InvalidInputError, match="an Arrow stream without its end-of-stream marker"):
        records_of(io.reader_for(stream))
