"""seqpack.hf collators against transformers' and TRL's own, and Trainer's loss denominator.

``flat(batch)`` equals ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
return_seq_idx=True)`` (and TRL's padding-free collator) on the same examples: keys,
dtypes, values. ``ForCausalLMLoss`` with ``num_items_in_batch`` equals seqpack's
token-weighted loss over micro-batches, and Trainer's own count equals
``num_items_in_batch``.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="seqpack.hf needs PyTorch: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")

from helpers import run_on_gloo_ranks
from hf_cases import CAPACITY, LENGTHS, binding, documents, packed
from transformers import DataCollatorWithFlattening
from transformers.loss.loss_utils import ForCausalLMLoss

import seqpack as sp
import seqpack.hf as sph
import seqpack.torch as spt
from seqpack.errors import CapacityError, InvalidInputError, TokenizerError


def row_major_documents(batch, docs):
    order = sorted(batch.occurrences, key=lambda o: (o.row, o.columns.start))
    return [docs[o.ordinal] for o in order]


def assert_same(ours: dict, theirs: dict):
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert type(ours[key]) is type(value) and ours[key] == value, key


@pytest.mark.parametrize("policy", ["next-fit", "best-fit-decreasing"])
def test_flat_equals_transformers_flattening_collator(policy):
    batch, docs = packed(policy=policy)
    assert batch.shape[0] > 1
    features = [{"input_ids": d.tolist()} for d in row_major_documents(batch, docs)]
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    assert_same(sph.flat(batch), theirs)


def test_flat_of_a_padded_batch_and_the_ecosystem_fixture():
    bind = binding()
    examples = [sp.SequenceExample.from_document(name, sp.BatchDocument(name, ids), bind)
                for name, ids in (("a", [0, 5, 6, 7, 1]), ("b", [0, 9, 10, 1]))]
    (batch,) = sp.pad(examples, sp.PadConfig(rows_per_batch=2), partition=sp.Partition.TRAIN, binding=bind)
    ours = sph.flat(batch)
    assert ours["input_ids"].tolist() == [[0, 5, 6, 7, 1, 0, 9, 10, 1]]
    assert ours["labels"].tolist() == [[-100, 5, 6, 7, 1, -100, 9, 10, 1]]
    assert ours["cu_seq_lens_q"].tolist() == [0, 5, 9] and ours["max_length_q"] == 5
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": [0, 5, 6, 7, 1]}, {"input_ids": [0, 9, 10, 1]}])
    assert_same(ours, theirs)


@pytest.mark.slow
def test_flat_equals_trl_padding_free_collator():
    trl = pytest.importorskip("trl.trainer.sft_trainer", reason="TRL is not installed")
    batch, docs = packed()
    features = [{"input_ids": d.tolist()} for d in row_major_documents(batch, docs)]
    theirs = trl.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(features)
    ours = sph.flat(batch)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


def test_rows_keys_dtypes_and_values():
    batch, _ = packed()
    fields = sph.rows(batch)
    assert list(fields) == ["input_ids", "position_ids", "shift_labels", "labels", "valid_lengths", "use_cache"]
    assert fields["use_cache"] is False and "attention_mask" not in fields
    for key in ("input_ids", "position_ids", "shift_labels", "labels", "valid_lengths"):
        assert fields[key].dtype == torch.int64, key
    tensors = spt.tensors(batch)
    assert torch.equal(fields["shift_labels"], tensors["shift_labels"])
    assert torch.equal(fields["labels"][:, 1:], tensors["shift_labels"][:, :-1])
    assert (fields["labels"][:, 0] == -100).all()
    width = batch.shape[1]
    for row, length in enumerate(batch.valid_lengths.tolist()):
        positions = fields["position_ids"][row]
        assert positions[:length].tolist() == batch.positions[row, :length].tolist()
        assert positions[length:].tolist() == list(range(width - length))  # padding: a segment of its own
        assert (fields["shift_labels"][row, length:] == -100).all()
    assert (batch.valid_lengths < width).any()


def supervised_dataset_on_disk(directory):
    """A small packed dataset with supervision (format version 2): several batches, padded rows."""
    rng = np.random.default_rng(11)
    ids = [rng.integers(2, 258, int(n)).tolist() for n in rng.integers(1, 30, 40)]
    masks = [[int(rng.random() < 0.6) for _ in row[:-1]] + [1] for row in ids]
    source = directory / "sft.jsonl"
    source.write_text("".join(json.dumps({"input_ids": i, "completion_mask": m}) + "\n" for i, m in zip(ids, masks)))
    bind = binding()
    sp.io.pack_corpus([sp.io.reader_for(source)], directory / "packed", binding=bind, tokenizer=sp.ByteTokenizer(),
                      config=sp.PackConfig(capacity=CAPACITY, rows_per_batch=3))
    return sp.open_dataset(directory / "packed")


def test_rows_and_flat_take_the_torch_datasets_items_as_they_are(tmp_path):
    on_disk = supervised_dataset_on_disk(tmp_path)
    assert on_disk.manifest["format_version"] == 2 and len(on_disk) > 5
    stream = spt.IterableBatchDataset(on_disk, shuffle=True, seed=3)
    numbers = stream.rank_batches(0).tolist()
    assert numbers != sorted(numbers)  # shuffled
    items = list(torch.utils.data.DataLoader(stream, batch_size=None))
    mapped = spt.BatchDataset(on_disk)
    assert len(items) == len(numbers) == len(on_disk)
    for item, number in zip(items, numbers):
        batch = on_disk[number]
        for make in (sph.rows, sph.flat):
            for source in (item, mapped[number]):
                assert_same(make(source), make(batch))
    assert any((b.valid_lengths < CAPACITY).any() and (b.target_valid & ~b.loss_mask).any() for b in on_disk)


def test_rows_and_flat_refuse_a_dict_that_is_not_a_tensors_dict():
    batch, _ = packed()
    item = spt.tensors(batch)
    prefix = "expected a padded or packed batch or its tensors\\(\\) dict .*; this dict "
    cases = [
        ({k: v for k, v in item.items() if k != "shift_labels"}, prefix + "lacks 'shift_labels'$"),
        ({**item, "attention_mask": item["token_valid"]},
         prefix + "has 'attention_mask', which tensors\\(\\) does not make$"),
        ({k: v for k, v in item.items() if k != "inputs"} | {"labels": item["shift_labels"]},
         prefix + "lacks 'inputs' and has 'labels'"),
        (sph.rows(batch), prefix + "lacks 'inputs', .* and has 'labels', 'position_ids', 'use_cache', which"),
        ({**item, "input_ids": item["input_ids"].int()},
         "the tensors\\(\\) dict's input_ids must be a torch.int64 tensor of shape .* not torch.int32"),
        ({**item, "valid_lengths": item["valid_lengths"][:1]}, "valid_lengths must be a torch.int64 tensor of shape"),
        ({**item, "inputs": item["inputs"].tolist()}, "inputs must be a \\[rows, T\\] tensor, not list"),
    ]
    for value, message in cases:
        for make in (sph.rows, sph.flat):
            with pytest.raises(InvalidInputError, match=message):
                make(value)
    with pytest.raises(InvalidInputError, match="expected a padded or packed batch, not list"):
        sph.rows([batch])


def test_loss_with_num_items_in_batch_equals_the_token_weighted_loss():
    """ForCausalLMLoss over two micro-batches with Trainer's count equals seqpack's objective
    (rows via shift_labels, flat via unshifted labels); a mean of micro-batch means does not."""
    first, _ = packed(lengths=LENGTHS[:5], seed=2)
    second, _ = packed(lengths=LENGTHS[5:], seed=3)
    window = [first, second]
    count = sph.num_items_in_batch(window)
    assert count == sph.num_items_in_batch([sph.rows(b) for b in window]) \
        == sph.num_items_in_batch([sph.flat(b) for b in window]) == first.target_count + second.target_count
    generator = torch.Generator().manual_seed(0)
    # float32: ForCausalLMLoss computes in float32 whatever the logits' dtype
    logits = [torch.randn(*b.shape, 300, generator=generator) for b in window]
    objective = spt.LossAccumulator(window)
    expected = sum(float(objective(l, b)) for l, b in zip(logits, window))
    by_rows = sum(float(ForCausalLMLoss(l, sph.rows(b)["labels"], 300, num_items_in_batch=count,
                                        shift_labels=sph.rows(b)["shift_labels"])) for l, b in zip(logits, window))
    by_flat = 0.0
    for l, b in zip(logits, window):
        fields = sph.flat(b)
        cells = l[torch.from_numpy(b.token_valid.copy())]          # row-major valid cells
        ends = (fields["cu_seq_lens_q"][1:] - torch.arange(1, len(fields["cu_seq_lens_q"]))).tolist()
        rows_out, begin = [], 0
        for end in ends:                                         # each example's cells, then one extra row
            rows_out += [cells[begin:end], torch.randn(1, 300, generator=generator)]
            begin = end
        flat_logits = torch.cat(rows_out)[None]
        by_flat += float(ForCausalLMLoss(flat_logits, fields["labels"], 300, num_items_in_batch=count))
    assert abs(by_rows - expected) <= 1e-6 * abs(expected)
    assert abs(by_flat - expected) <= 1e-6 * abs(expected)
    mean_of_means = sum(float(ForCausalLMLoss(l, None, 300, shift_labels=sph.rows(b)["shift_labels"]))
                        for l, b in zip(logits, window)) / 2
    assert abs(mean_of_means - expected) > 1e-3


def test_num_items_in_batch_equals_trainers_own_count(tmp_path):
    from hf_cases import model
    from transformers import Trainer, TrainingArguments

    window = [packed(lengths=LENGTHS[:5], seed=2)[0], packed(lengths=LENGTHS[5:], seed=3)[0]]
    trainer = Trainer(model=model("llama"), args=TrainingArguments(output_dir=str(tmp_path), report_to=[],
                                                                    use_cpu=True))
    for make in (sph.rows, sph.flat):
        samples = [make(b) for b in window]
        theirs = trainer._get_num_items_in_batch(samples, torch.device("cpu"))  # a float tensor in transformers 5
        assert int(theirs) == sph.num_items_in_batch(samples)
        # seqpack's objective takes Trainer's count as it comes
        assert spt.step_target_count([theirs]) == spt.LossAccumulator([theirs]).denominator == int(theirs)
        logits = torch.randn(*window[0].shape, window[0].binding.vocabulary_size, dtype=torch.float64)
        ours = spt.token_weighted_loss(logits, window[0], denominator=theirs)
        assert ours == spt.token_weighted_loss(logits, window[0], denominator=int(theirs))
    with pytest.raises(InvalidInputError, match="a target count is 70.5, not a whole number of targets"):
        spt.LossAccumulator([torch.tensor(141.0) / 2])
    with pytest.raises(InvalidInputError, match="denominator is 70.5, not a whole number of targets"):
        spt.token_weighted_loss(logits, window[0], denominator=torch.tensor(141.0) / 2)
    with pytest.raises(InvalidInputError, match="a step needs at least one eligible target"):
        sph.num_items_in_batch([{"labels": [[5, -100, -100]]}])  # the first label is no target


def test_packing_collator_packs_features_into_rows():
    docs = documents()
    collator = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8),
                                   tokenizer_identity=sp.ByteTokenizer().identity, split="hf-tests")
    fields = collator([{"input_ids": d.tolist()} for d in docs])
    batch, _ = packed()
    for key, value in sph.rows(batch).items():
        assert (torch.equal(fields[key], value) if isinstance(value, torch.Tensor) else fields[key] == value), key


def test_packing_collator_takes_a_list_of_features():
    """A generator raised 'has no len()' and a float 'is not iterable'."""
    collator = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY), tokenizer_identity=sp.ByteTokenizer().identity,
                                   split="hf-tests")
    features = [{"input_ids": d.tolist()} for d in documents()]
    for bad, name in (((f for f in features), "generator"), (2.5, "float"), ("text", "str")):
        with pytest.raises(InvalidInputError, match=f"PackingCollator takes a list of features \\(dicts\\), not {name}"):
            collator(bad)
    assert torch.equal(collator(tuple(features))["input_ids"], collator(features)["input_ids"])


def test_packing_collator_errors_and_the_exact_limit():
    docs = documents()
    features = [{"input_ids": d.tolist()} for d in docs]
    rows_needed = packed()[0].shape[0]
    identity = sp.ByteTokenizer().identity
    exact = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=rows_needed), tokenizer_identity=identity)
    assert exact(features)["input_ids"].shape == (rows_needed, CAPACITY)
    short = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=rows_needed - 1),
                                tokenizer_identity=identity)
    with pytest.raises(CapacityError, match=f"need {rows_needed} rows of {CAPACITY}"):
        short(features)
    # Features are documents as TRL prepared them: any IDs of the vocabulary, at least a target.
    assert exact([{"input_ids": [5, 1, 0, 6]}])["valid_lengths"].tolist() == [3]
    with pytest.raises(TokenizerError, match="token 266 at position 1 is out of vocabulary"):
        exact([{"input_ids": [5, 266, 6]}])
    with pytest.raises(InvalidInputError, match="PackConfig"):
        sph.PackingCollator({"capacity": 8}, tokenizer_identity=identity)


def test_a_feature_over_the_capacity_is_named_with_the_remedy():
    """A feature of more predictions than the capacity: a CapacityError naming its place in the
    call, its predictions, the capacity and what to change; exactly the capacity packs."""
    identity = sp.ByteTokenizer().identity
    collator = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8), tokenizer_identity=identity)
    short, exact, over = documents(lengths=(5, CAPACITY, CAPACITY + 1))
    fields = collator([{"input_ids": short.tolist()}, {"input_ids": exact.tolist()}])
    assert fields["input_ids"].shape == (2, CAPACITY) and fields["valid_lengths"].tolist() == [CAPACITY, 5]
    with pytest.raises(CapacityError) as caught:
        collator([{"input_ids": short.tolist()}, {"input_ids": exact.tolist()}, {"input_ids": over.tolist()}])
    assert str(caught.value).startswith(
        f"feature 2 has {CAPACITY + 1} predictions ({CAPACITY + 2} input_ids); PackConfig's capacity is {CAPACITY}: "
        f"raise it to at least {CAPACITY + 1} (with TRL, to at least SFTConfig's max_length - 1), or set "
        f"SFTConfig's max_length to at most {CAPACITY + 1} so that TRL truncates every feature to fit")
    assert (caught.value.cells, caught.value.maximum) == (CAPACITY + 1, CAPACITY)
    # What the message promises: the feature as TRL truncates it to max_length = capacity + 1 packs.
    truncated = collator([{"input_ids": over[: CAPACITY + 1].tolist()}])
    assert truncated["valid_lengths"].tolist() == [CAPACITY]
    assert truncated["input_ids"][0].tolist() == over[:CAPACITY].tolist()
    # Every feature fits but the rows do not: the batch error, as before.
    one_row = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=1), tokenizer_identity=identity)
    with pytest.raises(CapacityError, match=f"2 features need 2 rows of {CAPACITY}; the config allows 1 per batch"):
        one_row([{"input_ids": exact.tolist()}, {"input_ids": short.tolist()}])


def counting_rank(rank: int, world_size: int) -> None:
    """Each rank holds one micro-batch; every rank's count is the union's."""
    batches = [packed(lengths=LENGTHS[:5], seed=2)[0], packed(lengths=LENGTHS[5:], seed=3)[0]]
    mine = [sph.rows(batches[rank])]
    assert sph.num_items_in_batch(mine) == sum(b.target_count for b in batches)


@pytest.mark.slow
def test_num_items_in_batch_sums_over_gloo_ranks():
    run_on_gloo_ranks(counting_rank)


def test_packing_collator_refuses_what_it_would_ignore():
    """Keys that agree with supervising every target change nothing; padding, labels that
    are not one per token and unknown keys are errors naming the feature (the supervision
    keys' own rules: tests/hf/test_sft.py)."""
    docs = documents()
    identity = sp.ByteTokenizer().identity
    collator = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8), tokenizer_identity=identity)
    plain = collator([{"input_ids": d.tolist()} for d in docs])
    agreeing = collator([{"input_ids": d.tolist(), "labels": d.tolist(), "attention_mask": [1] * d.size,
                          "completion_mask": np.ones(d.size, dtype=bool), "assistant_masks": torch.ones(d.size)}
                         for d in docs])
    for key, value in plain.items():
        assert (torch.equal(agreeing[key], value) if isinstance(value, torch.Tensor) else agreeing[key] == value), key

    def with_change(index, key, value):
        features = [{"input_ids": d.tolist()} for d in docs]
        features[index][key] = value
        return features

    padded_mask = [1] * (docs[1].size - 1) + [0]
    cases = [
        (with_change(0, "labels", docs[0][1:].tolist()),
         f"feature 0: labels must be a 1-D sequence of {docs[0].size} integers"),
        (with_change(1, "attention_mask", padded_mask), "feature 1: attention_mask must be all ones: .*unpadded"),
        (with_change(1, "token_type_ids", [0] * docs[1].size), "feature 1 carries 'token_type_ids'"),
        # -101 marks a reader's record without labels; a feature's own is refused (review: it was supervised).
        (with_change(1, "labels", [-100] * (docs[1].size - 1) + [-101]),
         rf"feature 1: labels\[{docs[1].size - 1}\] is -101 but input_ids\[{docs[1].size - 1}\] is "),
        ([{"labels": docs[0].tolist()}], "feature 0 has no input_ids"),
        ([{"input_ids": docs[0].tolist()}, [5, 6]], "feature 1 is a list, not a dict of token IDs"),  # (a TypeError)
        # IDs past int32 are named with their feature, a uint64 one unwrapped (review).
        (with_change(1, "input_ids", np.array([5, 2**63 + 5], dtype=np.uint64)),
         r"feature 1: input_ids holds 9223372036854775813, outside the int32 range"),
        (with_change(1, "input_ids", [5, 2**40]), r"feature 1: input_ids holds 1099511627776, outside the int32"),
    ]
    for features, message in cases:
        with pytest.raises(InvalidInputError, match=message):
            collator(features)


# Regression: non-integer labels or a lone batch were counted by num_items_in_batch.
def test_num_items_in_batch_refuses_labels_that_are_not_integers_and_a_lone_batch():
    batch, _ = packed(lengths=(5, 3, 9))
    fields = sph.rows(batch)
    assert sph.num_items_in_batch([{"shift_labels": fields["shift_labels"].tolist()}]) == batch.target_count
    assert sph.num_items_in_batch([{"labels": [[-100, 5, -100, 7]]}]) == 2
    assert sph.num_items_in_batch([{"labels": np.array([[9, 5, 6]], dtype=np.int16)}]) == 2
    for labels, message in ((torch.tensor([[True, False, True]]), "labels must hold integers, got torch.bool"),
                            (torch.tensor([[5.0, 6.0, -100.0]]), "labels must hold integers, got torch.float32"),
                            (None, "labels must hold integers")):
        for key in ("labels", "shift_labels"):
            with pytest.raises(InvalidInputError, match=message):
                sph.num_items_in_batch([{key: labels}])
    from transformers import BatchEncoding

    # transformers' padding collators give a BatchEncoding (a mapping, not a dict) (review)
    assert sph.num_items_in_batch([BatchEncoding({"labels": torch.tensor([[-100, 5, -100, 7]])})]) == 2
    for lone in (batch, fields, BatchEncoding(fields)):
        with pytest.raises(InvalidInputError, match="one micro-batch .* pass the list"):
            sph.num_items_in_batch(lone)


# From the eee632d contract fuzz: a count or None given to num_items_in_batch was a TypeError.
def test_num_items_in_batch_refuses_what_is_not_a_list_of_micro_batches():
    """A count or None was a TypeError from iterating it."""
    for value, found in ((5, "int"), (None, "NoneType")):
        with pytest.raises(InvalidInputError, match=f"batches must be a list of the step's micro-batches, not {found}"):
            sph.num_items_in_batch(value)


# Regression: input_ids that are not one integer sequence were collated silently.
def test_packing_collator_refuses_input_ids_that_are_not_one_integer_sequence():
    collator = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8),
                                   tokenizer_identity=sp.ByteTokenizer().identity)
    docs = documents(lengths=(5, 3))
    good = {"input_ids": docs[0].tolist()}
    cases = [
        ("abc", "shape \\(\\) and dtype <U3"),
        (7, "shape \\(\\) and dtype int64"),
        ([docs[1].tolist()], "shape \\(1, 4\\)"),
        (torch.from_numpy(docs[1][None]), "shape \\(1, 4\\)"),
        (np.ones(4, dtype=bool), "dtype bool"),
        (docs[1].astype(np.float64), "dtype float64"),
    ]
    for value, message in cases:
        with pytest.raises(InvalidInputError, match=f"feature 1: input_ids must be a 1-D sequence .*{message}"):
            collator([good, {"input_ids": value}])
    assert collator([good, {"input_ids": torch.from_numpy(docs[1]).int()}])["input_ids"].shape[1] == CAPACITY
