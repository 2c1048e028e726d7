"""Preference records (TRL 1.16's DPO formats) read from JSONL, Parquet, Arrow, tables and
``save_to_disk`` directories and encoded as pairs of documents exactly as TRL's
``DPOTrainer`` prepares them: TRL is the oracle (its trainer's prepared rows, its
``extract_prompt``, its ``DataCollatorForPreference``), on BPEs trained here with a
BOS-adding post-processor (Llama-style) and without (Qwen-style)."""

import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack import io
from seqpack.io import readers
from seqpack.io.chunk_encoder import ChunkEncoder, SupervisionOptions
from seqpack.io.preference_encoders import (
    encode_conversational_preference,
    encode_preference,
    encode_preference_ids,
    extract_prompt,
)
from seqpack.io.tokenizer_file import TokenizerFile

from helpers import (
    CONVERSATIONS,
    TEMPLATES,
    TOOL_CALL,
    TOOLS,
    pyarrow,
    train_chat_bpe,
    trl_rows,
    write_jsonl,
    write_parquet,
    write_saved,
)

ANSWER = [{"role": "assistant", "content": "the lazy fox"}]
#: Zephyr's template, but the prompt alone ends with a thought the joint conversation
#: lacks (as Gemma's does): every pair's cut falls inside its prompt.
THINKING = TEMPLATES["zephyr"].replace("<|assistant|>\n{% endif %}", "<|assistant|>\nthink: {% endif %}")
assert THINKING != TEMPLATES["zephyr"]

#: Each kind's records, each with why it is here, and the chat template that renders them.
KINDS = {
    "standard": ([
        {"prompt": "Question: what is two plus two? Answer:", "chosen": " four.", "rejected": " five."},
        {"prompt": "hello wor", "chosen": "ld", "rejected": "ld peace"},  # the prompt's last token merges away
        {"prompt": "hello ", "chosen": "world", "rejected": " there"},  # it merges into one completion only
        {"prompt": "", "chosen": "the quick fox", "rejected": "the lazy dog"},  # an empty prompt
        {"prompt": "the lazy dog", "chosen": "", "rejected": " ab"},  # an empty chosen: EOS is all of it
        {"prompt": "hello", "chosen": " world<|eos|>", "rejected": " there"},  # EOS already there: none added
        {"prompt": "a<|eos|>b", "chosen": "c<|eos|>d", "rejected": "Ün ïcödé"},  # an EOS inside is content
    ], None),
    "implicit": ([
        {"chosen": "hello world", "rejected": "hello there"},  # the space before the divergence is the completions'
        {"chosen": "ab", "rejected": "ab"},  # equal: the prompt is all but the last character
        {"chosen": "abc", "rejected": "abcd"},  # one begins the other: cut before their last shared character
        {"chosen": "x ", "rejected": "y"},  # TRL's corner: the cut is before chosen's last character
        {"chosen": "Question: two? four.", "rejected": "Question: two? five."},
    ], None),
    "conversational": ([
        {"prompt": c[:-1], "chosen": c[-1:], "rejected": ANSWER, "tools": None} for c in CONVERSATIONS
    ] + [{"prompt": TOOL_CALL[:3], "chosen": TOOL_CALL[3:], "rejected": ANSWER, "tools": json.dumps(TOOLS)}],
        TEMPLATES["tools"]),
    "implicit conversational": ([
        {"chosen": c, "rejected": c[:-1] + ANSWER} for c in CONVERSATIONS
    ] + [{"chosen": CONVERSATIONS[0], "rejected": CONVERSATIONS[0] + CONVERSATIONS[1][1:]}],  # one begins the other
        TEMPLATES["zephyr"]),
    "mismatched conversational": ([{"prompt": c[:-1], "chosen": c[-1:], "rejected": ANSWER} for c in CONVERSATIONS]
                                  + [{"prompt": CONVERSATIONS[1][:2], "chosen": CONVERSATIONS[1][2:],
                                      "rejected": ANSWER}], THINKING),
}
READER_KINDS = {"standard": "preference", "implicit": "implicit-prompt preference",
                "conversational": "conversational preference",
                "implicit conversational": "conversational implicit-prompt preference",
                "mismatched conversational": "conversational preference"}


def trl():
    pytest.importorskip("torch", reason="TRL needs PyTorch: pip install 'seqpack[hf]'")
    return pytest.importorskip("trl", reason="the TRL oracle needs the bench extra: pip install 'seqpack[bench]'")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    pytest.importorskip("tokenizers", reason="the hf extra provides tokenizers: pip install 'seqpack[hf]'")
    pytest.importorskip("transformers", reason="chat templates need the hf extra: pip install 'seqpack[hf]'")
    root = tmp_path_factory.mktemp("bpe")
    return {"llama": train_chat_bpe(root, "llama", True), "qwen": train_chat_bpe(root, "qwen", False)}


@pytest.fixture(scope="module", params=["llama", "qwen"])
def bound(request, paths):
    """A tokenizer whose post-processor adds BOS, and one that adds none."""
    return TokenizerFile(paths[request.param], eos="<|eos|>")


def binding_of(tokenizer):
    return sp.BatchBinding.for_tokenizer(tokenizer.identity, split="tests")


def write_arrow(path, records):
    """An Arrow IPC file of ``records``, two rows a record batch."""
    pa = pyarrow()
    table = pa.Table.from_pylist(records)
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    return path


def readers_of(tmp_path, records):
    """The same records as JSONL, Parquet (row groups of 2), an Arrow file, a ``save_to_disk``
    directory (3 files) and an in-memory table."""
    return {"jsonl": io.reader_for(write_jsonl(tmp_path / "pairs.jsonl", records, blank_lines=True)),
            "parquet": io.reader_for(write_parquet(tmp_path / "pairs.parquet", records, row_group_size=2)),
            "arrow": io.reader_for(write_arrow(tmp_path / "pairs.arrow", records)),
            "saved": io.reader_for(write_saved(tmp_path / "pairs-saved", records)),
            "table": io.ArrowBatches(pyarrow().Table.from_pylist(records))}


def encoded_of(reader, tokenizer, template=None, binding=None) -> list:
    """Every chunk of ``reader`` through ``ChunkEncoder.encode``."""
    encoder = ChunkEncoder(binding or binding_of(tokenizer), tokenizer, reader.inputs,
                           supervision=SupervisionOptions(chat_template=template))
    return [encoder.encode(chunk) for chunk in reader.chunks(0)]


def documents(tokens, offsets, supervised) -> list:
    """``(tokens, supervised)`` lists of each document."""
    cuts = offsets[1:-1]
    return [(t.tolist(), s.tolist()) for t, s in zip(np.split(tokens, cuts), np.split(supervised, cuts))]


def assert_pairs_equal(found: list, rows: list) -> None:
    """Documents 2p and 2p + 1 are TRL's ``prompt_ids + chosen_ids`` and ``prompt_ids +
    rejected_ids``, supervised on the completion (never on a document's first token)."""
    assert len(found) == 2 * len(rows)
    for index, row in enumerate(rows):
        for side, (tokens, supervised) in zip(("chosen", "rejected"), found[2 * index: 2 * index + 2]):
            assert tokens == row["prompt_ids"] + row[f"{side}_ids"], (index, side)
            assert supervised == [False] + [j >= len(row["prompt_ids"]) for j in range(1, len(tokens))], (index, side)


def prompt_lengths(bound, rows, template) -> list:
    """The length of each TRL row's prompt encoded alone (rendered with the generation prompt)."""
    from transformers import PreTrainedTokenizerFast

    if template is None:
        return [len(bound.tokenizer.encode(row["prompt"]).ids) for row in rows]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(bound.path), eos_token="<|eos|>",
                                 bos_token=bound.token_text(bound.bos_id))
    return [len(hf.apply_chat_template(row["prompt"], chat_template=template, add_generation_prompt=True,
                                       tools=json.loads(row["tools"]) if row.get("tools") else None, tokenize=True,
                                       return_dict=True)["input_ids"]) for row in rows]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's DPOConfig
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_pairs_from_every_input_equal_trls_dpo_trainer(bound, tmp_path, monkeypatch, kind):
    monkeypatch.setattr(readers.jsonl, "CHUNK_DOCUMENTS", 3)  # chunks of three records: pairs stay whole
    monkeypatch.setattr(io.ArrowBatches, "BATCH_ROWS", 3)
    records, template = KINDS[kind]
    rows = trl_rows(bound, tmp_path, records, template=template, preference=True)
    mismatched = [2 * index for index, (row, length) in enumerate(zip(rows, prompt_lengths(bound, rows, template)))
                  if len(row["prompt_ids"]) < length]
    if kind == "standard":  # the merges, and the shorter of the two prefixes
        assert {2, 4} <= set(mismatched)
    assert (mismatched == list(range(0, 2 * len(records), 2))) == (kind == "mismatched conversational")
    for name, reader in readers_of(tmp_path, records).items():
        assert reader.record_kind == READER_KINDS[kind], name
        encoded = encoded_of(reader, bound, template)
        assert len(encoded) > 1, name
        assert all(part.paired and part.skipped == 0 and part.supervision == (READER_KINDS[kind].replace(
            "implicit-prompt ", ""),) for part in encoded), name
        found = [document for part in encoded for document in documents(part.tokens, part.offsets, part.supervised)]
        assert_pairs_equal(found, rows)
        starts = np.cumsum([0] + [len(part.locations) for part in encoded])
        assert np.concatenate([part.mismatched + start for part, start in zip(encoded, starts)]).tolist() == mismatched
        places = np.concatenate([part.locations for part in encoded]).tolist()
        first = 1 if name == "jsonl" else 0  # JSONL lines count from 1 (blank lines between), rows from 0
        step = 2 if name == "jsonl" else 1
        assert places == [first + step * index for index in range(len(records)) for _ in range(2)], name
    # The public encoders give the same documents.
    columns = {field: [record.get(field) for record in records] for field in ("prompt", "chosen", "rejected")}
    prompts = columns["prompt"] if "prompt" in records[0] else None
    if template is None:
        direct = encode_preference(bound, prompts, columns["chosen"], columns["rejected"])
    else:
        tools = [json.loads(r["tools"]) if r.get("tools") else None for r in records]
        direct = encode_conversational_preference(bound, prompts, columns["chosen"], columns["rejected"],
                                                  chat_template=template, tools=tools)
    assert_pairs_equal(documents(direct.tokens, direct.offsets, direct.supervised), rows)
    assert direct.mismatched.tolist() == mismatched


def collated(records) -> list:
    """TRL's ``DataCollatorForPreference`` on ``records``: ``(tokens, supervised)`` of its
    rows, chosen and rejected of each record in turn (its first token never supervised)."""
    collator = trl().trainer.dpo_trainer.DataCollatorForPreference(pad_token_id=0)
    batch = collator([dict(record) for record in records])
    rows = []
    for ids, attention, completion in zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"]):
        kept = attention.bool()
        rows.append((ids[kept].tolist(), [False] + completion[kept].bool().tolist()[1:]))
    count = len(records)
    return [rows[index + side * count] for index in range(count) for side in (0, 1)]


#: Pre-tokenized pairs: an empty prompt, one-token completions, and IDs at the edges of a 330-token vocabulary.
PAIR_IDS = [{"prompt_ids": [1, 40, 41], "chosen_ids": [42, 2], "rejected_ids": [43, 44, 2]},
            {"prompt_ids": [], "chosen_ids": [7, 8], "rejected_ids": [9, 10]},
            {"prompt_ids": [5], "chosen_ids": [0], "rejected_ids": [329]}]


@pytest.mark.parametrize("tokenizer", ["file", "bytes"])
def test_pre_tokenized_pairs_from_every_input_equal_trls_collator(tmp_path, paths, tokenizer):
    # Pre-tokenized pairs need no tokenizers file: the byte tokenizer's vocabulary (258) holds these IDs.
    records = PAIR_IDS if tokenizer == "file" else [{k: [i % 258 for i in v] for k, v in r.items()} for r in PAIR_IDS]
    tokenizer = TokenizerFile(paths["llama"], eos="<|eos|>") if tokenizer == "file" else sp.ByteTokenizer()
    binding = sp.BatchBinding.for_tokenizer(tokenizer.identity if isinstance(tokenizer, TokenizerFile) else tokenizer,
                                            split="tests")
    expected = collated(records)
    for name, reader in readers_of(tmp_path, records).items():
        assert reader.record_kind == "preference-ids", name
        encoded = encoded_of(reader, tokenizer, binding=binding)
        assert all(part.paired and part.supervision == ("preference IDs",) and not part.mismatched.size
                   for part in encoded), name
        found = [document for part in encoded for document in documents(part.tokens, part.offsets, part.supervised)]
        assert found == expected, name
    # Every prompt empty: pyarrow and datasets type the column list<null>; it was refused (review).
    unprompted = [{**record, "prompt_ids": []} for record in records
                  if min(len(record["chosen_ids"]), len(record["rejected_ids"])) >= 2] * 2   # (one token: no target)
    (tmp_path / "unprompted").mkdir()
    for name, reader in readers_of(tmp_path / "unprompted", unprompted).items():
        encoded = encoded_of(reader, tokenizer, binding=binding)
        found = [document for part in encoded for document in documents(part.tokens, part.offsets, part.supervised)]
        assert found == collated(unprompted), name


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_trls_prepared_rows_are_read_as_their_ids(tmp_path, paths):
    # TRL's prepared rows keep the texts beside the IDs: the IDs are the record, as TRL's collator has it.
    bound = TokenizerFile(paths["qwen"], eos="<|eos|>")
    records, _ = KINDS["standard"]
    rows = trl_rows(bound, tmp_path, records, preference=True)
    reader = io.reader_for(write_jsonl(tmp_path / "prepared.jsonl", rows))
    assert set(rows[0]) >= {"prompt", "chosen", "rejected", "prompt_ids"} and reader.record_kind == "preference-ids"
    (part,) = encoded_of(reader, bound)
    assert_pairs_equal(documents(part.tokens, part.offsets, part.supervised), rows)


def test_each_record_is_read_by_trls_precedence(tmp_path):
    cases = [
        ({"input_ids": [5], "prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}, "ids"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]},
         "preference-ids"),
        ({"prompt": "p", "completion": "c", "chosen": "c", "rejected": "r"}, "prompt-completion"),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "messages": [{"role": "user"}], "text": "t"}, "preference"),
        ({"chosen": "c", "rejected": "r", "text": "t"}, "implicit-prompt preference"),
        ({"chosen": [{"role": "user", "content": "c"}], "rejected": [{"role": "user", "content": "r"}]},
         "conversational implicit-prompt preference"),
        ({"chosen": "c", "text": "t"}, "text"),  # chosen alone is no pair
    ]
    for index, (record, kind) in enumerate(cases):
        path = write_jsonl(tmp_path / f"{index}.jsonl", [record])
        assert io.JsonLines(path).record_kind == kind, record
        assert io.ArrowBatches(pyarrow().Table.from_pylist([record])).record_kind == kind, record
    (chunk,) = io.JsonLines(write_jsonl(tmp_path / "implicit.jsonl", [{"chosen": "c", "rejected": "r"}])).chunks(0)
    assert chunk.prompts is None and chunk.chosen == ["c"] and chunk.rejected == ["r"] and chunk.preference


@settings(derandomize=True, max_examples=200, deadline=None, database=None)
@given(st.data())
def test_extract_prompt_equals_trls(data):
    trls = trl().data_utils.extract_prompt

    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "assistant", "content": "b "}, {"role": "user", "content": " "}]
    items = st.text(alphabet="ab ", min_size=1, max_size=8) | st.lists(st.sampled_from(messages), min_size=1,
                                                                       max_size=4)
    chosen = data.draw(items)
    rejected = data.draw(st.text(alphabet="ab ", min_size=1, max_size=8) if isinstance(chosen, str)
                         else st.lists(st.sampled_from(messages), min_size=1, max_size=4))
    expected = trls({"chosen": chosen, "rejected": rejected})
    assert extract_prompt(chosen, rejected) == (expected["prompt"], expected["chosen"], expected["rejected"])


def naive_trl_rule(bound, prompt, chosen, rejected) -> list:
    """TRL 1.16's ``tokenize_fn`` for one standard record, written out: ``(tokens, supervised)``
    of its two documents, and whether it is mismatched."""
    common_prefix_length = trl().data_utils.common_prefix_length
    eos = bound.token_text(bound.eos_id)
    prompt_ids = bound.tokenizer.encode(prompt).ids
    joint = [bound.tokenizer.encode(prompt + (text if text.endswith(eos) else text + eos)).ids
             for text in (chosen, rejected)]
    cut = min(common_prefix_length(prompt_ids, ids) for ids in joint)
    return [(ids, [False] + [j >= cut for j in range(1, len(ids))]) for ids in joint], cut < len(prompt_ids)


@settings(derandomize=True, max_examples=120, deadline=None, database=None)
@given(st.lists(st.tuples(*[st.text(alphabet="ab .é", max_size=8)] * 2, st.text(alphabet="ab .é", max_size=8)
                          | st.just("a<|eos|>")), min_size=1, max_size=6))
def test_random_pairs_equal_the_per_record_rule(bound, records):
    result = encode_preference(bound, *zip(*records))
    found = documents(result.tokens, result.offsets, result.supervised)
    mismatched = []
    for index, record in enumerate(records):
        pair, merged = naive_trl_rule(bound, *record)
        assert found[2 * index: 2 * index + 2] == pair
        mismatched += [2 * index] * merged
    assert result.mismatched.tolist() == mismatched


@settings(derandomize=True, max_examples=60, deadline=None, database=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 99), max_size=5), st.lists(st.integers(0, 99), min_size=1,
                                                                                 max_size=5),
                          st.lists(st.integers(0, 99), min_size=1, max_size=5)), min_size=1, max_size=5))
def test_random_pre_tokenized_pairs_equal_trls_collator(records):
    def flat(rows):
        return np.array([i for row in rows for i in row], np.int64), np.cumsum([0] + [len(row) for row in rows])

    result = encode_preference_ids(*(flat(column) for column in zip(*records)))
    expected = collated([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in records])
    assert documents(result.tokens, result.offsets, result.supervised) == expected
    assert result.tokens.dtype == np.int32 and result.offsets.dtype == np.int64


STANDARD = {"prompt": "a", "chosen": "b", "rejected": "c"}
MESSAGES = {"prompt": [{"role": "user", "content": "a"}], "chosen": ANSWER, "rejected": ANSWER}
IDS = {"prompt_ids": [4], "chosen_ids": [5], "rejected_ids": [6]}


@pytest.mark.parametrize("bad, good, message", [
    ([STANDARD, {"chosen": "b", "rejected": "c"}], [STANDARD] * 2,
     r":2: an implicit-prompt preference record, but the first record is a preference record: every record of an "
     r"input must be of one kind$"),
    ([STANDARD, MESSAGES], [STANDARD] * 2, r":2: a conversational preference record, but the first record is a "),
    ([MESSAGES, {"prompt": "a", "completion": "b"}], [MESSAGES] * 2,
     r":2: a prompt-completion record, but the first record is a conversational preference record"),
    ([IDS, STANDARD], [IDS, IDS], r":2: a preference record, but the first record is a token-ID preference record"),
    ([STANDARD, {"prompt": "a", "chosen": "b"}], [STANDARD] * 2,
     r":2: no field 'rejected' \(the first record is a preference record: every record must be one\)$"),
    ([{"chosen_ids": [5], "rejected_ids": [6]}], [IDS], r":1: no field 'prompt_ids'$"),
    ([STANDARD, {**STANDARD, "chosen": 5}], [STANDARD] * 2, r":2: field 'chosen' is not a string$"),
    ([STANDARD, {**STANDARD, "rejected": None}], [STANDARD] * 2, r":2: field 'rejected' is not a string$"),
    ([{**MESSAGES, "rejected": "c"}], [MESSAGES],
     r":1: field 'rejected' is a JSON string, not a non-empty list of messages$"),
    ([{**MESSAGES, "chosen": []}], [MESSAGES], r":1: field 'chosen' is an empty array, not a non-empty list of "),
    ([{"chosen": [{"content": "a"}], "rejected": ANSWER}], [{"chosen": ANSWER, "rejected": ANSWER}],
     r":1: chosen\[0\] has no 'role'$"),
    ([{**IDS, "chosen_ids": [5, "6"]}], [IDS], r":1: field 'chosen_ids' is not a list of ints$"),
    ([IDS, {**IDS, "rejected_ids": [2**64]}], [IDS, {**IDS, "rejected_ids": [2**63 - 1]}],
     r":2: field 'rejected_ids' value 18446744073709551616 does not fit int64$"),
])
def test_jsonl_errors_name_the_line_beside_a_twin_that_reads(tmp_path, bad, good, message):
    path = write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(sp.InvalidInputError, match=re.escape(str(path)) + message):
        list(io.JsonLines(path).chunks(0))
    assert sum(len(chunk) for chunk in io.JsonLines(write_jsonl(tmp_path / "good.jsonl", good)).chunks(0)) == len(good)


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("bad, good, message", [
    (lambda pa: {"prompt": ["a"], "chosen": pa.array([1]), "rejected": ["c"]},
     lambda pa: {"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]},
     r"Table: column 'chosen' of type int64 is not a string column"),
    (lambda pa: {"chosen": ["a", "b"], "rejected": ["c", None]},
     lambda pa: {"chosen": ["a", "b"], "rejected": ["c", "d"]}, r"Table row 1: column 'rejected' is null"),
    (lambda pa: {"chosen": pa.array([["hi"]]), "rejected": pa.array([["hi"]])},
     lambda pa: {"chosen": [HI], "rejected": [HI]},
     r"Table: column 'chosen' of type list<item: string> is not a list of messages \(structs with a string 'role'\)"),
    (lambda pa: {"prompt": [HI, HI], "chosen": [HI, []], "rejected": [HI, HI]},
     lambda pa: {"prompt": [HI, HI], "chosen": [HI, HI], "rejected": [HI, HI]},
     r"Table row 1: field 'chosen' is an empty array, not a non-empty list of messages"),
    (lambda pa: {"prompt_ids": [[1]], "chosen_ids": pa.array([[1.0]]), "rejected_ids": [[2]]},
     lambda pa: {"prompt_ids": [[1]], "chosen_ids": [[1]], "rejected_ids": [[2]]},
     r"Table: column 'chosen_ids' of type list<item: double> is not a list of integers"),
    (lambda pa: {"prompt_ids": [[1], [2]], "chosen_ids": [[1], [2]], "rejected_ids": [[2], [3, None]]},
     lambda pa: {"prompt_ids": [[1], [2]], "chosen_ids": [[1], [2]], "rejected_ids": [[2], [3, 4]]},
     r"Table row 1: a 'rejected_ids' value is null"),
    (lambda pa: {"chosen_ids": [[1]], "rejected_ids": [[2]]},
     lambda pa: {"prompt_ids": pa.array([[]], pa.list_(pa.int64())), "chosen_ids": [[1]], "rejected_ids": [[2]]},
     r"Table: no column 'prompt_ids' \(columns: chosen_ids, rejected_ids\)"),
])
def test_table_errors_name_the_row_and_the_column_beside_a_twin_that_reads(bad, good, message):
    pa = pyarrow()
    with pytest.raises(sp.InvalidInputError, match=f"^{message}$"):
        list(io.ArrowBatches(pa.table(bad(pa))).chunks(0))
    assert len(next(io.ArrowBatches(pa.table(good(pa))).chunks(0))) == len(next(iter(good(pa).values())))


def encode_jsonl(tmp_path, records, tokenizer, template=None, name="pairs.jsonl"):
    path = write_jsonl(tmp_path / name, records)
    binding = sp.BatchBinding.for_tokenizer(tokenizer.identity if isinstance(tokenizer, TokenizerFile) else tokenizer,
                                            split="tests")
    return path, encoded_of(io.JsonLines(path), tokenizer, template, binding)


def test_encoding_errors_name_the_record_beside_a_twin_that_encodes(tmp_path, paths):
    llama, qwen = (TokenizerFile(paths[name], eos="<|eos|>") for name in ("llama", "qwen"))
    vocabulary = llama.vocabulary_size
    cases = [
        # A pair is never skipped: an empty completion is an error, not a skip of half a pair.
        ([IDS, {**IDS, "chosen_ids": []}], [IDS, {**IDS, "chosen_ids": [5]}], llama, None,
         r":2: field 'chosen_ids' is empty: each completion needs a token$"),
        ([{"prompt_ids": [1, 2], "chosen_ids": [5], "rejected_ids": []}], [IDS], llama, None,
         r":1: field 'rejected_ids' is empty: each completion needs a token$"),
        # No BOS, an empty prompt and an empty chosen: a one-token document (its EOS) with no target.
        ([{"prompt": "", "chosen": "", "rejected": "ab"}], [{"prompt": "", "chosen": "a", "rejected": "ab"}], qwen,
         None, r":1: a document of 1 token has no target$"),
        ([{**IDS, "prompt_ids": []}], [{**IDS, "prompt_ids": [], "chosen_ids": [5, 6], "rejected_ids": [6, 7]}],
         llama, None, r":1: a document of 1 token has no target$"),
        ([{"chosen": "", "rejected": "ab"}], [{"chosen": "b", "rejected": "ab"}], llama, None,
         r":1: its chosen is empty: with no prompt given, the prompt is the shared beginning of chosen and rejected$"),
        ([{"chosen": HI + ANSWER, "rejected": [{"role": "user", "content": "ho"}] + ANSWER}],
         [{"chosen": HI + ANSWER, "rejected": HI + HI}], llama, TEMPLATES["zephyr"],
         r":1: its chosen and rejected conversations \(2 and 2 messages\) leave no prompt: TRL's extract_prompt "),
        ([MESSAGES], [MESSAGES], llama, None,
         r":1: conversational preference records \(lists of messages\) need a chat template: --chat-template "
         r"FILE\.jinja$"),
        ([{**IDS, "rejected_ids": [2**31]}], [{**IDS, "rejected_ids": [2**31 - 1]}], llama, None,
         r":1: field 'rejected_ids': token ID 2147483648 does not fit int32$"),
        ([{**IDS, "chosen_ids": [vocabulary]}], [{**IDS, "chosen_ids": [vocabulary - 1]}], llama, None,
         rf":1: token {vocabulary} at position 1 is out of vocabulary \(vocabulary size {vocabulary}\)$"),
        ([STANDARD], [IDS], sp.ByteTokenizer(), None,
         r":1: preference records need a tokenizers file \(--tokenizer FILE\), not the byte tokenizer$"),
    ]
    for bad, good, tokenizer, template, message in cases:
        with pytest.raises(sp.InvalidInputError, match=re.escape(str(tmp_path / "pairs.jsonl")) + message):
            encode_jsonl(tmp_path, bad, tokenizer, template)
        if message.endswith("does not fit int32$"):  # the exact limit passes that check, then fails the vocabulary's
            with pytest.raises(sp.InvalidInputError, match=r":1: token 2147483647 at position 1 is out of vocab"):
                encode_jsonl(tmp_path, good, tokenizer, template)
            continue
        _, encoded = encode_jsonl(tmp_path, good, tokenizer, template or TEMPLATES["zephyr"], name="good.jsonl")
        assert sum(part.offsets.shape[0] - 1 for part in encoded) == 2 * len(good)


def test_public_encoders_refuse_bad_columns_naming_the_record(paths):
    llama = TokenizerFile(paths["llama"], eos="<|eos|>")
    cases = {
        r"^2 prompts, 2 chosen but 1 rejected: one of each per record$": (llama, ["a", "b"], ["c", "d"], ["e"]),
        r"^record 1: the chosen must be a str, not bytes$": (llama, ["a", "b"], ["c", b"d"], ["e", "f"]),
        r"^record 0: the rejected must be a str, not NoneType$": (llama, None, ["c"], [None]),
        r"^chosen must be a sequence of str, one per record, not str$": (llama, None, "cd", ["e", "f"]),
        r"^tokenizer must be a seqpack.io.TokenizerFile, not ByteTokenizer$": (sp.ByteTokenizer(), None, ["a"], ["b"]),
    }
    for message, args in cases.items():
        with pytest.raises(sp.InvalidInputError, match=message):
            encode_preference(*args)
    empty = encode_preference(llama, [], [], [])
    assert (empty.tokens.size, empty.offsets.tolist(), empty.mismatched.size) == (0, [0], 0)
    template = TEMPLATES["zephyr"]
    with pytest.raises(sp.InvalidInputError, match=r"^record 1: its chosen: a conversation is a non-empty list"):
        encode_conversational_preference(llama, None, [HI, []], [HI, HI], chat_template=template)
    with pytest.raises(sp.InvalidInputError, match=r"^tools has 1 entries for 2 records$"):
        encode_conversational_preference(llama, [HI, HI], [ANSWER] * 2, [ANSWER] * 2, chat_template=template,
                                         tools=[None])
    failing = "{% if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}x"
    with pytest.raises(sp.InvalidInputError, match=r"^record 1: its prompt \+ rejected: the chat template failed: "):
        encode_conversational_preference(llama, [HI, HI], [ANSWER] * 2, [ANSWER, ANSWER + HI], chat_template=failing)
    two, one = (np.array([1, 2]), np.array([0, 1, 2])), (np.array([3]), np.array([0, 1]))
    with pytest.raises(sp.InvalidInputError, match=r"^2 prompt_ids, 1 chosen_ids but 1 rejected_ids: one of each "):
        encode_preference_ids(two, one, one)
