"""Preference pairs on disk (format version 3): from DPO records to batches of whole pairs.

The oracle is the in-memory path: the records as an ``ExampleTable`` (pair ``p`` is examples
``2p``, prompt + chosen, and ``2p + 1``, prompt + rejected, each supervised on its
completion) planned by ``seqpack.plan(..., pairs=True)`` under the same policy. The dataset
on disk must give the same batches, each pair side by side in one row with the global
ordinals ``2p`` and ``2p + 1``, whatever the policy or the shard count.
"""

import json
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack import CapacityError, InvalidInputError
from seqpack.io import format as fmt
from seqpack.io import open_dataset, pack_corpus, reader_for, verify_dataset
from helpers import reseal, write_jsonl

POLICIES = ["next-fit", "first-fit-decreasing", "best-fit-decreasing"]
FIELDS = ("inputs", "targets", "positions", "segments", "token_valid", "target_valid", "loss_mask", "valid_lengths")
TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="corpus")


def random_pairs(seed: int, count: int, longest: int = 12) -> list[dict]:
    """Pre-tokenized preference records (TRL's ``prompt_ids``, ``chosen_ids``, ``rejected_ids``);
    a prompt may be empty, a completion never is (and each sequence has a target)."""
    rng = np.random.default_rng(seed)
    ids = lambda low: rng.integers(2, 258, int(rng.integers(low, longest + 1))).tolist()  # noqa: E731
    records = []
    for _ in range(count):
        prompt = ids(0)
        records.append({"prompt_ids": prompt, "chosen_ids": ids(2 - bool(prompt)),
                        "rejected_ids": ids(2 - bool(prompt))})
    return records


def pack(paths, out, config, **options) -> dict:
    return pack_corpus([reader_for(path) for path in paths], out, binding=BINDING, tokenizer=TOKENIZER,
                       config=config, **options)


def oracle(records) -> sp.ExampleTable:
    """Each record's two sequences as an in-memory table, supervised on the completions."""
    documents, supervised = [], []
    for record in records:
        prompt = record["prompt_ids"]
        for side in ("chosen_ids", "rejected_ids"):
            documents.append(prompt + record[side])
            supervised.append([False] * max(len(prompt), 1) + [True] * (len(record[side]) - (not prompt)))
    offsets = np.cumsum([0] + [len(document) for document in documents])
    return sp.ExampleTable.from_arrays(np.concatenate(documents), offsets, BINDING, as_given=True,
                                       supervised=np.concatenate(supervised))


def assert_whole_pairs(dataset, records) -> None:
    """Every batch holds whole pairs, each chosen (``2p``) right before its rejected
    (``2p + 1``) in one row, and each sequence is its record's, supervised on its completion."""
    assert dataset.pairs and dataset.pair_count == len(records)
    assert dataset.pair_map().tolist() == [[2 * p, 2 * p + 1] for p in range(len(records))]
    for batch in dataset:
        found = batch.occurrence_records
        chosen, rejected = found[0::2], found[1::2]
        assert (chosen["ordinal"] % 2 == 0).all() and (rejected["ordinal"] == chosen["ordinal"] + 1).all()
        assert (rejected["row"] == chosen["row"]).all() and (rejected["start"] == chosen["stop"]).all()
    for p, record in enumerate(records):
        prompt = record["prompt_ids"]
        for ordinal, side in ((2 * p, "chosen_ids"), (2 * p + 1, "rejected_ids")):
            example = dataset.example(ordinal)
            assert example.document.token_ids.tolist() == prompt + record[side]
            assert example.loss_mask.tolist() == [k + 1 >= len(prompt) for k in range(example.loss_mask.size)]


@pytest.mark.parametrize("policy", POLICIES)
def test_jsonl_pairs_give_the_batches_of_the_in_memory_pack(tmp_path, policy):
    records = random_pairs(1, 40)
    config = sp.PackConfig(48, 3)  # the longest pair: 46 predictions
    manifest = pack([write_jsonl(tmp_path / "dpo.jsonl", records)], tmp_path / "out", config, policy=policy)
    assert manifest["format_version"] == 3
    assert manifest["counts"]["pairs"] == manifest["report"]["pairs"] == manifest["parts"][0]["pairs"] == 40
    assert manifest["supervision"]["applied"] == ["preference IDs"]
    part = tmp_path / "out" / "part-00000"
    assert sorted(p.name for p in part.iterdir()) == sorted(fmt.part_files(3))
    assert np.load(part / fmt.PAIRS_FILE).tolist() == [[2 * p, 2 * p + 1] for p in range(40)]
    dataset = open_dataset(tmp_path / "out")
    packed = sp.plan(oracle(records), config, partition=sp.Partition.TRAIN, binding=BINDING, policy=policy,
                     pairs=True)
    assert len(dataset) == len(packed)
    for mine, theirs in zip(dataset, packed):
        for field in FIELDS:
            np.testing.assert_array_equal(getattr(mine, field), getattr(theirs, field), err_msg=field)
    assert dataset.batch_pairs().tolist() == packed.batch_pairs().tolist()
    assert dataset.report() == packed.report()
    assert_whole_pairs(dataset, records)
    assert verify_dataset(tmp_path / "out")["pairs"] == 40


def test_parquet_string_records_are_encoded_as_dpo_encodes_them(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet needs the corpus extra: pip install 'seqpack[corpus]'")
    pytest.importorskip("tokenizers", reason="a tokenizers file needs the hf extra: pip install 'seqpack[hf]'")
    import pyarrow.parquet as pq

    from helpers import train_bpe
    from seqpack.io import TokenizerFile
    from seqpack.io.preference_encoders import encode_preference

    words = ["alpha", "beta", "gamma", "question", "answer", "the", "of", "is", "why"]
    rng = np.random.default_rng(2)
    text = lambda: " ".join(rng.choice(words, int(rng.integers(1, 8))))  # noqa: E731
    tokenizer = TokenizerFile(train_bpe(tmp_path, [text() for _ in range(200)]), bos="<|bos|>", eos="<|eos|>")
    binding = sp.BatchBinding.for_tokenizer(tokenizer.identity, split="corpus")
    columns = {"prompt": [text() + "?" for _ in range(30)], "chosen": [" " + text() for _ in range(30)],
               "rejected": [" " + text() for _ in range(30)]}
    pq.write_table(pa.table(columns), tmp_path / "dpo.parquet", row_group_size=10)
    config = sp.PackConfig(48, 2)
    manifest = pack_corpus([reader_for(tmp_path / "dpo.parquet")], tmp_path / "out", binding=binding,
                           tokenizer=tokenizer, config=config, policy="first-fit-decreasing", shards=3)
    assert manifest["format_version"] == 3 and len(manifest["parts"]) == 3  # one per row group
    assert manifest["counts"]["pairs"] == 30 and manifest["supervision"]["applied"] == ["preference"]
    encoded = encode_preference(tokenizer, columns["prompt"], columns["chosen"], columns["rejected"])
    dataset = open_dataset(tmp_path / "out")
    for ordinal in range(60):
        begin, end = encoded.offsets[ordinal], encoded.offsets[ordinal + 1]
        example = dataset.example(ordinal)
        assert example.document.token_ids.tolist() == encoded.tokens[begin:end].tolist()
        assert example.loss_mask.tolist() == encoded.supervised[begin + 1:end].tolist()
        assert dataset.example_id(ordinal) == f"{tmp_path / 'dpo.parquet'} row {ordinal // 2}"
    for batch in dataset:
        ordinals = batch.occurrence_records["ordinal"]
        assert (ordinals[0::2] % 2 == 0).all() and (ordinals[1::2] == ordinals[0::2] + 1).all()
    verify_dataset(tmp_path / "out")


@settings(derandomize=True, max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 9), st.integers(1, 9)).map(
    lambda sizes: (sizes[0], *(max(size, 2 - sizes[0]) for size in sizes[1:]))),  # every sequence has a target
    min_size=1, max_size=30),
       st.sampled_from(POLICIES), st.integers(1, 4), st.integers(0, 1 << 20))
def test_no_policy_or_shard_count_splits_a_pair(tmp_path_factory, sizes, policy, shards, seed):
    rng = np.random.default_rng(seed)
    records = [{"prompt_ids": rng.integers(2, 258, a).tolist(), "chosen_ids": rng.integers(2, 258, b).tolist(),
                "rejected_ids": rng.integers(2, 258, c).tolist()} for a, b, c in sizes]
    directory = tmp_path_factory.mktemp("pairs")
    # One file that shards cut into line ranges, and the same records in two files.
    one = [write_jsonl(directory / "one.jsonl", records)]
    two = [write_jsonl(directory / "a.jsonl", records[::2]), write_jsonl(directory / "b.jsonl", records[1::2])]
    capacity = max(a + b + c for a, b, c in sizes) + max(a for a, _, _ in sizes)  # the longest pair fits
    for name, paths, order in (("one", one, records), ("two", two, records[::2] + records[1::2])):
        manifest = pack(paths, directory / name, sp.PackConfig(capacity, 2), policy=policy, shards=shards,
                        long="cut")
        assert [part["examples"] for part in manifest["parts"]] == [2 * part["pairs"] for part in manifest["parts"]]
        dataset = open_dataset(directory / name)
        assert_whole_pairs(dataset, order)
        verify_dataset(directory / name, batches=False)


def test_pair_logprobs_reads_every_pair_of_a_sharded_dataset_once(tmp_path):
    torch = pytest.importorskip("torch", reason="pair_logprobs needs PyTorch: pip install 'seqpack[torch]'")
    from seqpack.torch import pair_logprobs

    records = random_pairs(6, 50)
    pack([write_jsonl(tmp_path / "dpo.jsonl", records)], tmp_path / "out", sp.PackConfig(48, 2),
         policy="best-fit-decreasing", shards=3)
    dataset = open_dataset(tmp_path / "out")
    assert len(dataset.parts) == 3 and [part.first_example % 2 for part in dataset.parts] == [0, 0, 0]
    generator, seen = torch.Generator().manual_seed(0), []
    for batch in dataset:
        logits = torch.randn(*batch.inputs.shape, 258, dtype=torch.float64, generator=generator)
        found = pair_logprobs(logits, batch)
        seen += found.pair_ids.tolist()
        # Each sequence's supervised targets: its completion's tokens (but a first token, which is none).
        counts = [len(records[p][side]) - (not records[p]["prompt_ids"]) for p in found.pair_ids.tolist()
                  for side in ("chosen_ids", "rejected_ids")]
        assert found.chosen_counts.tolist() + found.rejected_counts.tolist() == counts[0::2] + counts[1::2]
    assert sorted(seen) == list(range(50))  # global pair numbers across the parts, each pair once


@pytest.mark.parametrize("long", ["error", "cut"])
def test_a_pair_longer_than_a_row_is_refused_under_every_long_mode(tmp_path, long):
    records = random_pairs(3, 6)
    records[2] = {"prompt_ids": [5] * 10, "chosen_ids": [6] * 30, "rejected_ids": [7] * 25}  # 39 + 34 predictions
    source = write_jsonl(tmp_path / "dpo.jsonl", records)
    with pytest.raises(CapacityError, match=rf"^{tmp_path / 'dpo.jsonl'}:3: the preference pair \(chosen 39 \+ "
                                            r"rejected 34\) has 73 predictions; capacity is 72; its chosen and "
                                            r"rejected sequences share one row, and a pair is never cut"):
        pack([source], tmp_path / "out", sp.PackConfig(72, 2), long=long)
    assert not (tmp_path / "out").exists()
    manifest = pack([source], tmp_path / "out", sp.PackConfig(73, 2), long=long)  # exactly a row: packed whole
    assert manifest["counts"]["examples"] == 12 and manifest["long_documents"] == long
    dataset = open_dataset(tmp_path / "out")
    assert [int(part.lengths.max()) for part in dataset.parts] == [39]
    assert_whole_pairs(dataset, records)


@pytest.mark.parametrize("shards", [None, 2])  # one shard, or each input its own (checked across shards)
@pytest.mark.parametrize("preference_first", [True, False])
def test_preference_records_beside_other_records_are_refused(tmp_path, shards, preference_first):
    pairs = write_jsonl(tmp_path / "dpo.jsonl", random_pairs(4, 5))
    text = tmp_path / "text.txt"
    text.write_text("a plain document, longer than the preference records " * 40)  # a JSONL file smaller: not cut
    (first, first_line), (other, other_line) = ((pairs, 1), (text, None))[::1 if preference_first else -1]
    where = lambda path, line: f"{path}:{line}" if line else f"{path}"  # noqa: E731
    kind = "not a preference record, but" if preference_first else "a preference record, but"
    named = "is one" if preference_first else "is not"
    with pytest.raises(InvalidInputError, match=rf"^{where(other, other_line)}: {kind} {where(first, first_line)} "
                                                rf"{named}: a dataset of preference pairs holds nothing else$") as raised:
        pack_corpus([reader_for(first), reader_for(other)], tmp_path / "out", binding=BINDING, tokenizer=TOKENIZER,
                    config=sp.PackConfig(64, 2), shards=shards, long="cut")
    assert (raised.value.path, raised.value.line) == (str(other), other_line)
    assert not (tmp_path / "out").exists()


def test_datasets_without_pairs_are_written_and_read_as_before(tmp_path):
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "hello there"}, {"text": "again"}])
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]}])
    for version, source in ((1, text), (2, sft)):
        out = tmp_path / f"v{version}"
        manifest = pack([source], out, sp.PackConfig(16, 2))
        assert manifest["format_version"] == version
        assert "pairs" not in manifest["counts"] and "pairs" not in manifest["report"]
        assert sorted(p.name for p in (out / "part-00000").iterdir()) == sorted(fmt.part_files(version))
        dataset = open_dataset(out)
        assert not dataset.pairs and dataset.pair_count == 0 and dataset.batch_pairs().tolist() == [0]
        with pytest.raises(InvalidInputError, match=rf"format version {version} holds no preference pairs"):
            dataset.pair_map()
        assert verify_dataset(out)["pairs"] is None


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    root = tmp_path_factory.mktemp("paired")
    pack([write_jsonl(root / "dpo.jsonl", random_pairs(5, 20))], root / "out", sp.PackConfig(48, 2),
         policy="best-fit-decreasing")
    return root / "out"


def resealed(paired, tmp_path, edit):
    """A copy of the dataset whose manifest ``edit`` changed, sealed again."""
    target = tmp_path / "copy"
    shutil.copytree(paired, target)
    manifest = json.loads((target / fmt.MANIFEST).read_text())
    manifest.pop(fmt.SEAL)
    edit(manifest)
    reseal(target, manifest)
    return target


@pytest.mark.parametrize("edit, message", [
    # Read as version 2, the pairs would be lost: every trace of version 3 is named.
    (lambda m: m.update(format_version=2),
     r"format version 2, but the manifest holds counts\.pairs \(and 3 more\), which only version 3 and later write"),
    (lambda m: m["counts"].pop("pairs"), r"format version 3, but the manifest lacks counts\.pairs, which version "
                                            r"3 and later always write"),
    (lambda m: m["parts"][0]["files"].pop(fmt.PAIRS_FILE), r"lacks parts\[0\]\.files\.pairs\.npy"),
    (lambda m: m["parts"][0].pop("pairs"), r"lacks parts\[0\]\.pairs"),
])
def test_a_version_3_manifest_holds_exactly_what_version_3_writes(paired, tmp_path, edit, message):
    with pytest.raises(InvalidInputError, match=rf"manifest\.json: .*{message}"):
        open_dataset(resealed(paired, tmp_path, edit))


def test_a_version_2_part_holding_a_pair_map_is_refused(paired, tmp_path):
    def lowered(manifest):  # every manifest trace of version 3 gone; pairs.npy left behind
        manifest["format_version"] = 2
        del manifest["counts"]["pairs"], manifest["report"]["pairs"], manifest["parts"][0]["pairs"]
        del manifest["parts"][0]["files"][fmt.PAIRS_FILE]

    target = resealed(paired, tmp_path, lowered)
    with pytest.raises(InvalidInputError, match=r"part-00000/pairs\.npy: a part of a version-2 dataset holds no "
                                                r"pairs\.npy; only version 3 and later write one"):
        open_dataset(target)
    (target / "part-00000" / fmt.PAIRS_FILE).unlink()
    assert not open_dataset(target).pairs  # the pairs are gone: a version-2 dataset, as the manifest says
