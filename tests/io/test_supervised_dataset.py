"""Supervision on disk (format version 2): from prompt-completion records to batches.

The oracle is the in-memory path: the records encoded by
``seqpack.io.record_encoders.encode_prompt_completion`` (itself checked against TRL in
``tests/io/test_record_encoders.py``) as an ``ExampleTable`` with ``supervised=``, packed by
``seqpack.pack`` under the same policy. The dataset on disk must give the same batches,
loss masks included, and its counts must be the supervised ones.
"""

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack import InvalidInputError
from seqpack.data import window_ranges
from seqpack.io import format as fmt
from seqpack.io.readers import DocumentChunk, Input
from helpers import reseal, train_bpe, trl_rows

pytest.importorskip("tokenizers", reason="a tokenizers file needs the hf extra: pip install 'seqpack[hf]'")
from seqpack.io import TokenizerFile, open_dataset, pack_corpus, verify_dataset  # noqa: E402
from seqpack.io.record_encoders import TemplateLimits, encode_prompt_completion  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "question", "answer", "the", "of", "is", "what", "why"]
POLICIES = ["next-fit", "first-fit-decreasing", "best-fit-decreasing"]
FIELDS = ("inputs", "targets", "positions", "segments", "token_valid", "target_valid", "loss_mask", "valid_lengths")


class Records:
    """Prompt-completion records as a reader (``JsonLines`` reads them from a file the same way)."""

    def __init__(self, records, chunk: int = 7, name: str = "records.jsonl"):
        self.records, self.chunk = records, chunk
        self.inputs = [Input(name, "jsonl", "line")]

    def chunks(self, first_input):
        for start in range(0, len(self.records), self.chunk):
            part = self.records[start : start + self.chunk]
            yield DocumentChunk(np.full(len(part), first_input, np.int64),
                                np.arange(start + 1, start + 1 + len(part), dtype=np.int64), 1,
                                prompts=[p for p, _ in part], completions=[c for _, c in part])


class Texts(Records):
    """The prompts alone, as text records: no supervision."""

    def chunks(self, first_input):
        for chunk in super().chunks(first_input):
            chunk.texts, chunk.prompts, chunk.completions = chunk.prompts, None, None
            yield chunk


def random_records(seed: int, count: int = 60):
    rng = np.random.default_rng(seed)
    words = lambda low, high: " ".join(rng.choice(WORDS, int(rng.integers(low, high))))  # noqa: E731
    # Some prompts end mid-word ("...gam"), so that tokens merge across the boundary.
    return [(words(1, 15) + (" gam" if rng.random() < 0.2 else "?"), " " + words(1, 25)) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    rng = np.random.default_rng(1)
    path = train_bpe(tmp_path_factory.mktemp("bpe"), [" ".join(rng.choice(WORDS, 12)) for _ in range(300)])
    return TokenizerFile(path, bos="<|bos|>", eos="<|eos|>")


@pytest.fixture(scope="module")
def binding(tokenizer):
    return sp.BatchBinding.for_tokenizer(tokenizer.identity, split="corpus")


def oracle_table(tokenizer, binding, records, capacity, long):
    """The records as an in-memory table: whole documents, or their windows less those
    with no supervised target."""
    encoded = encode_prompt_completion(tokenizer, [p for p, _ in records], [c for _, c in records])
    if long == "error":
        return sp.ExampleTable.from_arrays(encoded.tokens, encoded.offsets, binding, supervised=encoded.supervised, as_given=True)
    documents, ranges = window_ranges(np.diff(encoded.offsets), capacity)
    starts = encoded.offsets[documents]
    keep = [encoded.supervised[a + s + 1 : b + s].any() for (a, b), s in zip(ranges.tolist(), starts.tolist())]
    return sp.ExampleTable.from_arrays(encoded.tokens, encoded.offsets, binding, supervised=encoded.supervised, as_given=True,
                                       ranges=ranges[keep], documents=documents[keep]), int(len(keep) - sum(keep))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("long", ["error", "cut"])
def test_the_dataset_gives_the_batches_of_the_in_memory_pack(tmp_path, tokenizer, binding, policy, long):
    records = random_records(3)
    capacity = 96 if long == "error" else 12
    config = sp.PackConfig(capacity, 3)
    manifest = pack_corpus([Records(records)], tmp_path / "out", binding=binding, tokenizer=tokenizer, config=config,
                           policy=policy, long=long)
    expected = oracle_table(tokenizer, binding, records, capacity, long)
    skipped = 0
    if long == "cut":
        expected, skipped = expected
        assert skipped > 0  # the prompts are long enough for windows of prompt only
    assert manifest["format_version"] == 2
    assert manifest["counts"]["skipped_unsupervised_windows"] == skipped
    assert manifest["supervision"]["applied"] == ["prompt-completion"]
    assert manifest["supervision"]["completion_only_loss"] is True
    assert manifest["supervision"]["assistant_only_loss"] is None is manifest["supervision"]["chat_template_sha256"]
    dataset = open_dataset(tmp_path / "out")
    packed = sp.pack(expected, config, partition=sp.Partition.TRAIN, binding=binding, policy=policy)
    assert len(dataset) == len(packed)
    for mine, theirs in zip(dataset, packed):
        for field in FIELDS:
            np.testing.assert_array_equal(getattr(mine, field), getattr(theirs, field), err_msg=field)
        mine.verify()
    supervised = int(expected.target_counts.sum())
    assert manifest["counts"]["supervised_targets"] == supervised == int(dataset.batch_targets().sum())
    assert manifest["report"]["supervised_targets"] == supervised < manifest["counts"]["valid_targets"]
    assert dataset.report().as_dict() == manifest["report"]
    verify_dataset(tmp_path / "out")
    # Every example rebuilds with its supervision (a document with a window left out cannot).
    for ordinal in range(0, dataset.occurrence_count, 7):
        try:
            example = dataset.example(ordinal)
        except InvalidInputError as error:
            assert long == "cut" and "was left out" in str(error)
            continue
        first = int(np.searchsorted(expected._doc_offsets, expected._begins[ordinal], side="right")) - 1
        assert example.loss_mask.tolist() == expected.example(ordinal).loss_mask.tolist(), first


def test_without_supervision_the_dataset_is_version_1(tmp_path, tokenizer, binding):
    manifest = pack_corpus([Texts(random_records(4))], tmp_path / "out", binding=binding, tokenizer=tokenizer,
                           config=sp.PackConfig(96, 3))
    assert manifest["format_version"] == 1 and "supervision" not in manifest
    assert "supervised_targets" not in manifest["counts"] and "supervised_targets" not in manifest["report"]
    assert sorted(p.name for p in (tmp_path / "out" / "part-00000").iterdir()) == sorted(fmt.PART_FILES)


def test_completion_only_loss_false_supervises_the_prompts(tmp_path, tokenizer, binding):
    manifest = pack_corpus([Records(random_records(5))], tmp_path / "out", binding=binding, tokenizer=tokenizer,
                           config=sp.PackConfig(96, 3), completion_only_loss=False)
    assert manifest["format_version"] == 2 and manifest["supervision"]["completion_only_loss"] is False
    assert manifest["counts"]["supervised_targets"] == manifest["counts"]["valid_targets"]
    assert "supervised_targets" not in manifest["report"]  # as the report of an unmasked pack reads
    flips = np.load(tmp_path / "out" / "part-00000" / fmt.SUPERVISION_FILE)
    assert flips.dtype == np.uint32 and flips.size == 0  # every target supervised: no flip


def test_sharded_parts_carry_the_supervision_of_a_serial_pack(tmp_path, tokenizer, binding):
    from seqpack.io import pack_corpus

    records = random_records(6, 90)
    config = sp.PackConfig(96, 2)

    serial = pack_corpus([Records(records)], tmp_path / "serial", binding=binding, tokenizer=tokenizer, config=config)
    readers = [Records(records[i : i + 30], name=f"records-{i}.jsonl") for i in range(0, 90, 30)]
    sharded = pack_corpus(readers, tmp_path / "sharded", binding=binding, tokenizer=tokenizer, config=config,
                           shards=3)
    assert sharded["format_version"] == 2 and len(sharded["parts"]) == 3
    assert sharded["counts"]["supervised_targets"] == serial["counts"]["supervised_targets"]
    one, many = open_dataset(tmp_path / "serial"), open_dataset(tmp_path / "sharded")
    for ordinal in range(one.occurrence_count):
        assert one.example(ordinal).loss_mask.tolist() == many.example(ordinal).loss_mask.tolist()
    verify_dataset(tmp_path / "sharded")


def test_a_text_shard_beside_supervised_ones_gets_an_empty_supervision_file(tmp_path, tokenizer, binding):
    from seqpack.io import pack_corpus

    readers = [Texts(random_records(7, 20), name="texts.jsonl"), Records(random_records(8, 20))]
    manifest = pack_corpus(readers, tmp_path / "out", binding=binding, tokenizer=tokenizer,
                            config=sp.PackConfig(96, 2), shards=2)
    assert manifest["format_version"] == 2 and len(manifest["parts"]) == 2
    assert manifest["parts"][0]["supervised_targets"] == manifest["parts"][0]["valid_targets"]
    assert np.load(tmp_path / "out" / "part-00000" / fmt.SUPERVISION_FILE).size == 0
    verify_dataset(tmp_path / "out")


def edited(tmp_path, tokenizer, binding, change):
    """A packed dataset whose supervision file is replaced by ``change(flips, part)``, resealed."""
    out = tmp_path / "out"
    manifest = pack_corpus([Records(random_records(9))], out, binding=binding, tokenizer=tokenizer,
                           config=sp.PackConfig(96, 3))
    part = out / "part-00000"
    flips = np.load(part / fmt.SUPERVISION_FILE)
    changed = change(flips.astype(np.int64), open_dataset(out).parts[0]).astype(np.uint32)
    np.save(part / fmt.SUPERVISION_FILE, changed)
    record = manifest["parts"][0]["files"][fmt.SUPERVISION_FILE]
    record["bytes"] = (part / fmt.SUPERVISION_FILE).stat().st_size
    manifest.pop(fmt.SEAL, None)
    reseal(out, manifest)
    return out


def test_opening_refuses_supervision_that_the_files_contradict(tmp_path, tokenizer, binding):
    cases = {
        "falls on an example's first token": lambda flips, part: np.sort(np.append(flips, part.token_offsets[1])),
        "do not rise": lambda flips, part: np.append(flips, flips[-1]),
        "has no supervised target": lambda flips, part: np.append(flips[flips < part.token_offsets[1]],
                                                                  [part.token_offsets[1] + 1]),
        "records supervised_targets": lambda flips, part: flips + (np.arange(flips.size) == 1),  # a prompt longer
    }
    for index, (message, change) in enumerate(cases.items()):
        directory = tmp_path / str(index)
        directory.mkdir()
        out = edited(directory, tokenizer, binding, change)
        with pytest.raises(InvalidInputError, match=message):
            open_dataset(out)


def test_a_version_1_reader_rule_stays_and_unknown_versions_are_refused(tmp_path, tokenizer, binding):
    out = tmp_path / "out"
    manifest = pack_corpus([Records(random_records(10))], out, binding=binding, tokenizer=tokenizer,
                           config=sp.PackConfig(96, 3))
    for version in (4, True, "2"):
        manifest = dict(manifest, format_version=version)
        manifest.pop(fmt.SEAL, None)
        reseal(out, manifest)
        with pytest.raises(InvalidInputError, match="this seqpack reads 1, 2 and 3"):
            open_dataset(out)


def test_a_document_with_no_supervised_target_is_named(tmp_path, tokenizer, binding):
    class Masked(Records):
        def chunks(self, first_input):
            ids = np.array([5, 6, 7, 8, 9, 10], np.int64)
            mask = np.array([1, 1, 1, 0, 0, 0])  # the second record: no supervised token
            yield DocumentChunk(np.zeros(2, np.int64), np.array([1, 2]), 1, ids=(ids, np.array([0, 3, 6])),
                                masks={"completion_mask": mask})

    with pytest.raises(InvalidInputError, match=r"records.jsonl:2: none of the document's 2 targets is supervised "
                                                 r"\(completion_mask\)"):
        pack_corpus([Masked([])], tmp_path / "out", binding=binding, tokenizer=tokenizer, config=sp.PackConfig(96, 3))
    assert not (tmp_path / "out").exists()


def test_mask_columns_follow_trls_rule(tmp_path, tokenizer, binding):
    ids = np.array([5, 6, 7, 8, 9, 10, 11], np.int64)
    offsets = np.array([0, 3, 7])
    columns = {"completion_mask": np.array([0, 1, 1, 0, 1, 1, 1]), "assistant_masks": np.array([1, 1, 1, 0, 0, 1, 1]),
               "labels": np.array([5, -100, 7, 8, 9, 10, -100])}

    class Masked(Records):
        def __init__(self, masks):
            super().__init__([])
            self.masks = masks

        def chunks(self, first_input):
            yield DocumentChunk(np.zeros(2, np.int64), np.array([1, 2]), 1, ids=(ids, offsets), masks=self.masks)

    out = tmp_path / "out"
    manifest = pack_corpus([Masked(columns)], out, binding=binding, tokenizer=tokenizer, config=sp.PackConfig(16, 1),
                           force=True)
    # Given labels, TRL uses them as they are (it builds labels from the masks only without them).
    assert manifest["supervision"]["applied"] == ["labels"]
    batch = open_dataset(out)[0]
    # Taken as given (TRL's prepared records): the targets are each record's IDs after its first.
    given = (columns["labels"] != -100).astype(int)
    expected = [*given[1:3], *given[4:7]]
    assert batch.loss_mask[0, : len(expected)].astype(int).tolist() == expected
    masks = {name: column for name, column in columns.items() if name != "labels"}
    manifest = pack_corpus([Masked(masks)], out, binding=binding, tokenizer=tokenizer, config=sp.PackConfig(16, 1),
                           force=True)
    assert manifest["supervision"]["applied"] == ["assistant_masks", "completion_mask"]
    every = columns["completion_mask"] * columns["assistant_masks"]
    expected = [*every[1:3], *every[4:7]]
    assert open_dataset(out)[0].loss_mask[0, : len(expected)].astype(int).tolist() == expected
    manifest = pack_corpus([Masked(masks)], out, binding=binding, tokenizer=tokenizer, config=sp.PackConfig(16, 1),
                           force=True, completion_only_loss=False)
    assert manifest["supervision"]["applied"] == ["assistant_masks"]
    # No mask applied at all: the records are still TRL's, taken as given, and the manifest says so.
    only = {"completion_mask": columns["completion_mask"]}
    manifest = pack_corpus([Masked(only)], out, binding=binding, tokenizer=tokenizer, config=sp.PackConfig(16, 1),
                           force=True, completion_only_loss=False)
    assert manifest["format_version"] == 2 and manifest["supervision"]["applied"] == []
    assert manifest["supervision"]["as_given_documents"] == 2
    assert manifest["counts"]["supervised_targets"] == manifest["counts"]["valid_targets"] == 5
    verify_dataset(out)
    for name, value, message in (("labels", 99, r"labels\[1\] is 99, neither -100 nor its input_ids token 6"),
                                 ("completion_mask", 2, r"completion_mask\[1\] is 2; a mask holds 0 and 1")):
        bad = {key: column.copy() for key, column in columns.items()}
        bad[name][1] = value
        with pytest.raises(InvalidInputError, match=f"records.jsonl:1: {message}"):
            pack_corpus([Masked(bad)], out, binding=binding, tokenizer=tokenizer, config=sp.PackConfig(16, 1),
                        force=True)


def test_mismatched_prompts_are_counted_and_named(tmp_path, tokenizer, binding):
    records = [("what is the gam", "ma of it"), ("why?", " alpha")]  # "gam" + "ma" merge across the boundary
    manifest = pack_corpus([Records(records)], tmp_path / "out", binding=binding, tokenizer=tokenizer,
                           config=sp.PackConfig(96, 3))
    encoded = encode_prompt_completion(tokenizer, [p for p, _ in records], [c for _, c in records])
    assert manifest["supervision"]["mismatched_prompts"] == len(encoded.mismatched) == 1
    assert manifest["supervision"]["first_mismatched_prompt"] == "records.jsonl:1"
    assert json.loads((tmp_path / "out" / fmt.MANIFEST).read_text())["supervision"]["mismatched_prompts"] == 1


def write_records(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def test_prompt_completion_jsonl_through_the_command_line(tmp_path, tokenizer, binding):
    from seqpack.cli import main

    records = random_records(11, 80)
    source = write_records(tmp_path / "sft.jsonl", [{"prompt": p, "completion": c} for p, c in records])
    common = ["--tokenizer", str(tokenizer.path), "--bos", "<|bos|>", "--eos", "<|eos|>", "--capacity", "96",
              "--rows-per-batch", "3", "--quiet", "--policy", "best-fit-decreasing"]
    assert main(["pack", str(source), "--out", str(tmp_path / "out"), *common]) == 0
    assert main(["verify", str(tmp_path / "out"), "--quiet"]) == 0
    expected = oracle_table(tokenizer, binding, records, 96, "error")
    packed = sp.pack(expected, sp.PackConfig(96, 3), partition=sp.Partition.TRAIN, binding=binding,
                     policy="best-fit-decreasing")
    for mine, theirs in zip(open_dataset(tmp_path / "out"), packed):
        np.testing.assert_array_equal(mine.loss_mask, theirs.loss_mask)
        np.testing.assert_array_equal(mine.inputs, theirs.inputs)
    assert main(["pack", str(source), "--out", str(tmp_path / "all"), *common, "--no-completion-only-loss"]) == 0
    manifest = json.loads((tmp_path / "all" / fmt.MANIFEST).read_text())
    assert manifest["counts"]["supervised_targets"] == manifest["counts"]["valid_targets"]
    text = write_records(tmp_path / "text.jsonl", [{"text": p} for p, _ in records])
    assert main(["pack", str(text), "--out", str(tmp_path / "t"), *common, "--no-completion-only-loss"]) == 2


TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
            "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
            "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}{% endfor %}")


def test_conversations_are_supervised_on_the_assistant_mask(tmp_path, tokenizer, binding):
    transformers = pytest.importorskip("transformers", reason="chat templates need the hf extra: "
                                                              "pip install 'seqpack[hf]'")
    rng = np.random.default_rng(12)
    conversations = [[{"role": "user", "content": " ".join(rng.choice(WORDS, int(rng.integers(1, 8))))},
                      {"role": "assistant", "content": " ".join(rng.choice(WORDS, int(rng.integers(1, 8))))}]
                     for _ in range(30)]
    source = write_records(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    out = tmp_path / "out"
    pack_corpus([sp.io.reader_for(source)], out, binding=binding, tokenizer=tokenizer, config=sp.PackConfig(64, 2),
                chat_template=TEMPLATE, assistant_only_loss=True)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer, bos_token="<|bos|>",
                                              eos_token="<|eos|>")
    dataset = open_dataset(out)
    for ordinal, conversation in enumerate(conversations):
        rendered = hf.apply_chat_template(conversation, chat_template=TEMPLATE, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        example = dataset.example(ordinal)
        assert example.document.token_ids.tolist() == rendered["input_ids"]  # BOS and EOS not doubled
        assert example.loss_mask.astype(int).tolist() == rendered["assistant_masks"][1:]
    for kwargs, message in (
            (dict(chat_template=TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
                  assistant_only_loss=True), "no generation block"),
            (dict(), "need a chat template: --chat-template FILE.jinja")):
        with pytest.raises(InvalidInputError, match=message):
            pack_corpus([sp.io.reader_for(source)], tmp_path / "bad", binding=binding, tokenizer=tokenizer,
                        config=sp.PackConfig(64, 2), **kwargs)
    lonely = write_records(tmp_path / "lonely.jsonl", [{"messages": conversations[0]},
                                                       {"messages": conversations[1][:1]}])
    with pytest.raises(InvalidInputError, match=r"lonely.jsonl:2: no assistant token to supervise"):
        pack_corpus([sp.io.reader_for(lonely)], tmp_path / "bad", binding=binding, tokenizer=tokenizer,
                    config=sp.PackConfig(64, 2), chat_template=TEMPLATE, assistant_only_loss=True)
    # The manifest of a conversation dataset records assistant_only_loss, not completion_only_loss.
    supervision = open_dataset(out).supervision
    assert (supervision["completion_only_loss"], supervision["assistant_only_loss"]) == (None, True)
    assert supervision["applied"] == ["conversation"] and supervision["chat_template_sha256"] is not None
    # A template that renders without end is stopped, naming the line and the flag that bounds it.
    slow = TEMPLATE.replace("{{ bos_token }}", "{% for i in range(100000) %}{% for j in range(100000) %}"
                                               "{% endfor %}{% endfor %}", 1)
    late = write_records(tmp_path / "late.jsonl", [{"messages": conversations[0]}] * 3)
    with pytest.raises(InvalidInputError, match=r"late.jsonl:1: the chat template was still running "
                                                r"after .* the limit is 0.5 s \(raise it with --template-seconds\)"):
        pack_corpus([sp.io.reader_for(late)], tmp_path / "bad", binding=binding, tokenizer=tokenizer,
                    config=sp.PackConfig(64, 2), chat_template=slow, template_limits=TemplateLimits(0.5, 10_000))
    assert not (tmp_path / "bad").exists()


def given_supervision(ids, masks):
    """TRL's pre-tokenized records as seqpack takes them, as given: their IDs and masks,
    the first token of each no target; records of fewer than two tokens (no target) left out."""
    kept = [(row, mask) for row, mask in zip(ids, masks) if len(row) > 1]
    offsets = np.cumsum([0] + [len(row) for row, _ in kept])
    supervised = np.array([bool(bit) and j > 0 for _, mask in kept for j, bit in enumerate(mask)], dtype=bool)
    return np.array([t for row, _ in kept for t in row]), supervised, offsets


def one_supervised_target(masks):
    """Each record's mask with a supervised target (a token after its first)."""
    return [mask if any(mask[1:]) else [*mask[:-1], True] for mask in masks]


@settings(derandomize=True, max_examples=25, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=40), min_size=1, max_size=25).filter(
    lambda masks: any(len(mask) > 1 for mask in masks)),  # a one-token record has no target: skipped
       st.sampled_from(POLICIES), st.booleans(), st.integers(0, 1 << 20))
def test_random_masks_survive_parquet_and_the_disk(tmp_path_factory, masks, policy, cut, seed):
    pa = pytest.importorskip("pyarrow", reason="Parquet needs the corpus extra: pip install 'seqpack[corpus]'")
    import pyarrow.parquet as pq

    masks = one_supervised_target(masks)
    rng = np.random.default_rng(seed)
    ids = [rng.integers(2, 258, len(mask)).tolist() for mask in masks]
    directory = tmp_path_factory.mktemp("masks")
    pq.write_table(pa.table({"input_ids": ids, "completion_mask": [list(map(int, m)) for m in masks]}),
                   directory / "sft.parquet")
    byte_binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="corpus")
    capacity = 8 if cut else 48
    config = sp.PackConfig(capacity, 2)
    pack_corpus([sp.io.reader_for(directory / "sft.parquet")], directory / "out", binding=byte_binding,
                tokenizer=byte_binding.tokenizer, config=config, policy=policy, long="cut" if cut else "error")
    tokens, supervised, offsets = given_supervision(ids, masks)
    if cut:
        documents, ranges = window_ranges(np.diff(offsets), capacity)
        keep = np.array([supervised[offsets[d] + a + 1 : offsets[d] + b].any()
                         for d, (a, b) in zip(documents.tolist(), ranges.tolist())])
        table = sp.ExampleTable.from_arrays(tokens, offsets, byte_binding, supervised=supervised, as_given=True,
                                            ranges=ranges[keep], documents=documents[keep])
    else:
        table = sp.ExampleTable.from_arrays(tokens, offsets, byte_binding, supervised=supervised, as_given=True)
    packed = sp.pack(table, config, partition=sp.Partition.TRAIN, binding=byte_binding, policy=policy)
    dataset = open_dataset(directory / "out")
    assert len(dataset) == len(packed)
    for mine, theirs in zip(dataset, packed):
        for field in FIELDS:
            np.testing.assert_array_equal(getattr(mine, field), getattr(theirs, field), err_msg=field)


def occurrences(directory) -> dict:
    """Each example of the dataset at ``directory``, by ordinal: its placed inputs, targets
    and loss mask, read from the batches."""
    found = {}
    for batch in open_dataset(directory):
        for occurrence in batch.occurrences:
            row, columns = occurrence.row, occurrence.columns
            found[occurrence.ordinal] = tuple(getattr(batch, field)[row, columns].tolist()
                                              for field in ("inputs", "targets", "loss_mask"))
    return found


@settings(derandomize=True, max_examples=15, deadline=None)
@given(st.lists(st.lists(st.lists(st.booleans(), min_size=2, max_size=30), min_size=1, max_size=8),
                min_size=1, max_size=4),
       st.booleans(), st.integers(0, 1 << 20))
def test_random_masks_survive_shards(tmp_path_factory, files, cut, seed):
    # The shards a Ray run packs (run serially here; test_ray_pipeline checks that Ray gives
    # the same bytes): every occurrence's tokens and loss mask are those of one serial pack.
    from seqpack.io import pack_corpus

    rng = np.random.default_rng(seed)
    directory = tmp_path_factory.mktemp("shards")
    paths = []
    for number, masks in enumerate(files):
        masks = one_supervised_target(masks)
        lines = [json.dumps({"input_ids": rng.integers(2, 258, len(mask)).tolist(),
                             "completion_mask": list(map(int, mask))}) + "\n" for mask in masks]
        paths.append(directory / f"sft-{number}.jsonl")
        paths[-1].write_text("".join(lines), encoding="utf-8")
    byte_binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="corpus")
    common = dict(binding=byte_binding, tokenizer=byte_binding.tokenizer, config=sp.PackConfig(8 if cut else 48, 2),
                  long="cut" if cut else "error")
    serial = pack_corpus([sp.io.reader_for(p) for p in paths], directory / "serial", **common)
    sharded = pack_corpus([sp.io.reader_for(p) for p in paths], directory / "sharded", shards=len(paths), **common)
    kept = ("documents", "examples", "tokens", "valid_targets", "supervised_targets", "skipped_unsupervised_windows")
    assert [sharded["counts"][key] for key in kept] == [serial["counts"][key] for key in kept]
    assert sharded["supervision"] == serial["supervision"]
    assert occurrences(directory / "sharded") == occurrences(directory / "serial")
    verify_dataset(directory / "sharded")


def test_a_save_to_disk_directory_is_packed_with_its_masks(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets comes with the bench extra: "
                                                      "pip install 'seqpack[bench]'")
    ids = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    masks = [[0, 0, 1, 1], [1, 0, 1], [0, 1]]
    datasets.Dataset.from_dict({"input_ids": ids, "assistant_masks": masks}).save_to_disk(
        str(tmp_path / "saved"), num_shards=2)
    byte_binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="corpus")
    manifest = pack_corpus([sp.io.reader_for(tmp_path / "saved")], tmp_path / "out", binding=byte_binding,
                           tokenizer=byte_binding.tokenizer, config=sp.PackConfig(16, 1))
    assert manifest["supervision"]["applied"] == ["assistant_masks"]
    tokens, supervised, offsets = given_supervision(ids, masks)
    batch = open_dataset(tmp_path / "out")[0]
    expected = np.concatenate([supervised[a + 1 : b] for a, b in zip(offsets[:-1], offsets[1:])])
    np.testing.assert_array_equal(batch.loss_mask[0, : expected.size], expected)


def test_a_manifest_whose_version_disagrees_with_its_supervision_is_refused(tmp_path, tokenizer, binding):
    out = tmp_path / "out"
    manifest = pack_corpus([Records(random_records(13))], out, binding=binding, tokenizer=tokenizer,
                           config=sp.PackConfig(96, 3))
    assert open_dataset(out).supervision["applied"] == ["prompt-completion"]
    for edit in (lambda m: m.update(format_version=1),            # would read every target as supervised
                 lambda m: m.pop("supervision"),
                 lambda m: m["parts"][0]["files"].pop(fmt.SUPERVISION_FILE)):
        changed = json.loads(json.dumps(manifest))
        changed.pop(fmt.SEAL, None)
        edit(changed)
        reseal(out, changed)
        with pytest.raises(InvalidInputError, match=r"manifest\.json: format version [12], but the manifest (holds|"
                                                     r"lacks) (supervision|parts\[0\]\.files\.supervision\.npy)"):
            open_dataset(out)


def unsealed(out, manifest):
    """Write ``manifest`` into the dataset at ``out`` without a seal, as a hand edit leaves it."""
    (out / fmt.MANIFEST).write_text(json.dumps({key: value for key, value in manifest.items() if key != fmt.SEAL}))


def test_a_version_2_manifest_without_its_seal_is_refused(tmp_path, tokenizer, binding, capsys):
    from seqpack.cli import main

    out = tmp_path / "out"
    manifest = pack_corpus([Records(random_records(14))], out, binding=binding, tokenizer=tokenizer,
                           config=sp.PackConfig(96, 3))
    assert manifest["format_version"] == 2 and verify_dataset(out)["sealed"] is True
    unsealed(out, manifest)  # not "no seal (an older seqpack wrote it)": a version-2 manifest is always sealed
    message = (r"manifest\.json: no seal, but a version-2 manifest is always sealed by the seqpack that writes it, "
               r"so its seal was removed")
    with pytest.raises(InvalidInputError, match=message):
        open_dataset(out)
    with pytest.raises(sp.VerificationError, match=message):
        verify_dataset(out)
    capsys.readouterr()
    assert main(["verify", str(out), "--quiet"]) == 1
    assert re.search(message, capsys.readouterr().err)


def test_a_lowered_version_is_refused_while_the_manifest_holds_what_version_2_writes(tmp_path, tokenizer,
                                                                                      binding):
    out = tmp_path / "out"
    manifest = pack_corpus([Records(random_records(15))], out, binding=binding, tokenizer=tokenizer,
                           config=sp.PackConfig(96, 3))
    # Version 1, and the seal, the supervision record and every supervision.npy gone: still refused.
    lowered = dict(json.loads(json.dumps(manifest)), format_version=1)
    lowered.pop("supervision")
    for part in lowered["parts"]:
        part["files"].pop(fmt.SUPERVISION_FILE)
        (out / part["name"] / fmt.SUPERVISION_FILE).unlink()
    part = lowered["parts"][0]
    traces = [("counts.supervised_targets (and 4 more)", lowered["counts"], fmt.SUPERVISION_COUNTS),
              ("report.supervised_targets (and 2 more)", lowered["report"], ["supervised_targets"]),
              ("parts[0].supervised_targets (and 1 more)", part, ["supervised_targets"]),
              ("parts[0].skipped_unsupervised_windows", part, ["skipped_unsupervised_windows"])]
    assert len(lowered["parts"]) == 1
    for named, holder, keys in traces:
        unsealed(out, lowered)
        message = rf"manifest\.json: format version 1, but the manifest holds {re.escape(named)}, which only version 2"
        with pytest.raises(InvalidInputError, match=message):
            open_dataset(out)
        with pytest.raises(sp.VerificationError, match=message):
            verify_dataset(out)
        for key in keys:
            del holder[key]
    # With every trace gone, the documents still give it away: TRL's records are taken as
    # given (this tokenizer adds no BOS), and no version-1 dataset holds unframed documents.
    unsealed(out, lowered)
    with pytest.raises(sp.VerificationError, match=r"tokens\.bin: BOS or EOS tokens are not exactly at the "):
        verify_dataset(out)


def test_a_mask_only_a_later_jsonl_record_has_is_applied(tmp_path, tokenizer, binding):
    # A completion_mask that only line 2 has, after {"input_ids": [...]} on line 1, is applied: the
    # dataset is version 2, and not every target is supervised.
    source = write_records(tmp_path / "later.jsonl", [
        {"input_ids": [10, 11, 12, 13, 14, 15]},
        {"input_ids": [20, 21, 22, 23], "completion_mask": [0, 0, 0, 1]},
        {"input_ids": [30, 31, 32], "labels": [-100, 31, -100], "text": "ignored: input_ids come first"}])
    manifest = pack_corpus([sp.io.reader_for(source)], tmp_path / "out", binding=binding, tokenizer=tokenizer,
                           config=sp.PackConfig(16, 1), policy="next-fit")
    assert manifest["format_version"] == 2
    assert manifest["supervision"]["applied"] == ["completion_mask", "labels"]
    assert manifest["supervision"]["as_given_documents"] == 2
    batch = open_dataset(tmp_path / "out")[0]
    # The first record is framed [BOS, ids, EOS] (no mask: plain pre-tokenized text); the others as TRL has them.
    row = batch.inputs[0, : int(batch.valid_lengths[0])].tolist()
    assert row == [tokenizer.bos_id, 10, 11, 12, 13, 14, 15, 20, 21, 22, 30, 31]
    assert batch.loss_mask[0, : len(row)].tolist() == [True] * 7 + [False, False, True] + [True, False]
    verify_dataset(tmp_path / "out")


def test_a_record_s_labels_decide_over_its_masks(tmp_path, tokenizer, binding):
    # TRL uses given labels as they are (it builds labels from the masks only without them):
    # the masks of a record with labels were applied too, and left its prompt unsupervised.
    source = write_records(tmp_path / "labelled.jsonl", [
        {"input_ids": [40, 41, 42, 43, 44], "labels": [40, 41, 42, 43, 44], "completion_mask": [0, 0, 0, 1, 1]},
        {"input_ids": [50, 51, 52, 53], "completion_mask": [0, 0, 1, 1]},
        {"input_ids": [60, 61, 62], "labels": [-100, -100, 62], "assistant_masks": [1, 1, 0]}])
    manifest = pack_corpus([sp.io.reader_for(source)], tmp_path / "out", binding=binding, tokenizer=tokenizer,
                           config=sp.PackConfig(16, 1), policy="next-fit")
    assert manifest["supervision"]["applied"] == ["assistant_masks", "completion_mask", "labels"]
    batch = open_dataset(tmp_path / "out")[0]
    row = batch.inputs[0, : int(batch.valid_lengths[0])].tolist()
    assert row == [40, 41, 42, 43, 50, 51, 52, 60, 61]
    assert batch.loss_mask[0, : len(row)].tolist() == [True] * 4 + [False, True, True] + [False, True]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_the_command_line_packs_trls_ids_for_a_tokenizer_without_bos(tmp_path, tokenizer):
    # The command line adds no BOS that TRL does not add: every record's IDs and masks are TRL's.
    from seqpack.cli import main

    records = [{"prompt": p, "completion": c} for p, c in random_records(21, 40)]
    records[3]["completion"] += "<|eos|>"  # already ends with the EOS text: TRL adds none
    source = write_records(tmp_path / "sft.jsonl", records)
    assert main(["pack", str(source), "--out", str(tmp_path / "out"), "--tokenizer", str(tokenizer.path), "--eos",
                 "<|eos|>", "--capacity", "96", "--quiet"]) == 0
    assert main(["verify", str(tmp_path / "out"), "--quiet"]) == 0
    bare = TokenizerFile(tokenizer.path, eos="<|eos|>")
    assert bare.bos_id is None
    rows = trl_rows(bare, tmp_path / "trl", records)
    dataset = open_dataset(tmp_path / "out")
    assert dataset.binding.bos_id is None and dataset.manifest["binding"]["tokenizer"]["bos_id"] is None
    for ordinal, row in enumerate(rows):
        example = dataset.example(ordinal)
        assert example.document.token_ids.tolist() == row["input_ids"], ordinal
        assert example.supervised[1:].tolist() == [label != -100 for label in row["labels"][1:]], ordinal
