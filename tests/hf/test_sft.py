"""Supervised fine-tuning through seqpack.hf: TRL's masks and -100 labels, packed.

``PackingCollator`` supervises exactly the tokens TRL supervises (``SFTTrainer``'s label
building, then its padding-free collator, and transformers' ``DataCollatorWithFlattening``);
``flat`` and ``rows`` write -100 at every unsupervised target; a tiny float64 Llama with
seqpack attention on packed rows with masked prompts gives the loss and every gradient of
the model run on each example alone with sdpa and -100 labels; NaN logits at unsupervised
targets reach neither seqpack's loss nor a gradient; Trainer's and SFTTrainer's item count is
seqpack's supervised count.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from itertools import pairwise
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="seqpack.hf needs PyTorch: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")

from helpers import CONVERSATIONS, TEMPLATES, TOOL_CALL, TOOLS, train_chat_bpe, train_tokenizer
from hf_cases import CAPACITY, LENGTHS, binding, close, documents, float64_norms, model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening
from transformers.loss.loss_utils import ForCausalLMLoss

import seqpack as sp
import seqpack.hf as sph
import seqpack.torch as spt
from seqpack.errors import InvalidInputError

IDENTITY = sp.ByteTokenizer().identity


def trl_modules():
    sft = pytest.importorskip("trl.trainer.sft_trainer", reason="the oracle is TRL: pip install 'seqpack[bench]'")
    datasets = pytest.importorskip("datasets", reason="TRL prepares datasets: pip install 'seqpack[bench]'")
    datasets.disable_progress_bars()
    return sft, datasets


def trl_labels(features, completion_only_loss=True):
    """``features`` as TRL's ``SFTTrainer`` hands them to its collator: its own preparation of a
    pre-tokenized dataset builds ``labels`` from the masks (``completion_mask`` only under
    ``completion_only_loss``) or keeps given labels; Trainer then drops the other columns."""
    sft, datasets = trl_modules()
    trainer = SimpleNamespace(completion_only_loss=completion_only_loss)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, shuffle_dataset=False)
    prepared = sft.SFTTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(features), None, args,
                                               False, None, "train")
    return [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in prepared]


def supervised_of(labels):
    """TRL's labels as a supervision array over the document's tokens."""
    return np.asarray(labels) != -100


def table_of(docs, supervision, bind):
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return sp.ExampleTable.from_arrays(np.concatenate(docs), offsets, bind,
                                       supervised=np.concatenate(supervision))


def one_batch(table, bind, policy, capacity=CAPACITY, rows_per_batch=8):
    epoch = sp.pack(table, sp.PackConfig(capacity=capacity, rows_per_batch=rows_per_batch),
                    partition=sp.Partition.TRAIN, binding=bind, policy=policy)
    assert len(epoch.batches) == 1
    return epoch.batches[0]


def segments(fields):
    """Each packed document of a :func:`seqpack.hf.rows` dict in row-major order: its cells'
    ``(inputs, targets, positions)``."""
    found = []
    for row, length in enumerate(fields["valid_lengths"].tolist()):
        positions = fields["position_ids"][row, :length]
        starts = (positions == 0).nonzero().flatten().tolist() + [length]
        for begin, end in pairwise(starts):
            found.append((fields["input_ids"][row, begin:end], fields["shift_labels"][row, begin:end],
                          positions[begin:end]))
    return found


def assert_rows_are_trls_documents(fields, theirs):
    """Every document of ``fields`` (in order) is TRL's flattened document: its inputs, its
    positions and its labels (-100 first, then each cell's target)."""
    ours = segments(fields)
    cu = theirs["cu_seq_lens_q"].tolist()
    assert len(ours) == len(cu) - 1
    for (inputs, targets, positions), begin, end in zip(ours, cu[:-1], cu[1:]):
        assert torch.equal(inputs, theirs["input_ids"][0, begin:end - 1])
        assert torch.equal(positions, theirs["position_ids"][0, begin:end - 1])
        assert theirs["labels"][0, begin] == -100
        assert torch.equal(targets, theirs["labels"][0, begin + 1:end])


def assert_same(ours: dict, theirs: dict, ordered=True):
    assert (list(ours) == list(theirs)) if ordered else (set(ours) == set(theirs))
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
        else:
            assert type(ours[key]) is type(value) and ours[key] == value, key


#: The key sets a dataset's rows share (a column is in every row or none).
KEY_SETS = (("labels",), ("completion_mask",), ("assistant_masks",), ("completion_mask", "assistant_masks"),
            ("labels", "completion_mask"), ("labels", "assistant_masks"))  # TRL reads given labels alone


@st.composite
def sft_features(draw):
    """``(features, completion_only_loss)``: 1 to 6 byte-token documents of 2 to 20 predictions
    with random masks or -100 labels, each supervising at least one target."""
    keys = draw(st.sampled_from(KEY_SETS))
    completion_only_loss = draw(st.sampled_from([None, True, False]))
    features = []
    for _ in range(draw(st.integers(1, 6))):
        predictions = draw(st.integers(2, 20))
        content = draw(st.lists(st.integers(2, 257), min_size=predictions - 1, max_size=predictions - 1))
        doc = [0, *content, 1]
        bits = {key: draw(st.lists(st.booleans(), min_size=len(doc), max_size=len(doc))) for key in keys}
        applied = ["labels"] if "labels" in keys else [
            key for key in keys if key != "completion_mask" or completion_only_loss is not False]
        if not any(all(bits[key][j] for key in applied) for j in range(1, len(doc))):
            last = len(doc) - 1                       # the EOS: supervise it, so the example counts
            for key in keys:
                bits[key][last] = True
        feature = {"input_ids": doc}
        for key in keys:
            feature[key] = ([t if b else -100 for t, b in zip(doc, bits[key])] if key == "labels"
                            else [int(b) for b in bits[key]])
        features.append(feature)
    return features, completion_only_loss


@settings(derandomize=True, max_examples=40, deadline=None, database=None)
@given(sft_features())
def test_packing_collator_supervises_what_trl_supervises(case):
    """Against TRL's preparation and padding-free collator and transformers' flattening
    collator, per document; ``flat`` of the same supervision equals both whole."""
    features, completion_only_loss = case
    sft, _ = trl_modules()
    prepared = trl_labels(features, completion_only_loss is not False)
    trl_flat = sft.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(prepared)
    hf_flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(prepared)
    assert torch.equal(trl_flat["labels"], hf_flat["labels"])
    collator = sph.PackingCollator(sp.PackConfig(capacity=24, rows_per_batch=6), tokenizer_identity=IDENTITY,
                                   policy="next-fit", completion_only_loss=completion_only_loss)
    fields = collator(features)
    assert_rows_are_trls_documents(fields, trl_flat)
    count = int(np.count_nonzero(trl_flat["labels"] != -100))
    assert sph.num_items_in_batch([fields]) == count == sph.num_items_in_batch([trl_flat])

    bind = binding()
    docs = [np.asarray(f["input_ids"]) for f in prepared]
    batch = one_batch(table_of(docs, [supervised_of(f["labels"]) for f in prepared], bind), bind, "next-fit",
                      capacity=24, rows_per_batch=6)
    assert [o.ordinal for o in sorted(batch.occurrences, key=lambda o: (o.row, o.columns.start))] \
        == list(range(len(docs)))                   # next-fit keeps the input order
    assert batch.target_count == count
    assert_same(sph.flat(batch), hf_flat)
    assert_same(sph.flat(batch), trl_flat, ordered=False)


def prompt_completion(docs):
    """TRL-style features over ``docs``: prompts masked (``completion_mask``), a two-turn
    ``assistant_masks``, -100 labels, and both masks on one feature."""
    features = []
    for index, doc in enumerate(docs):
        n = doc.size
        prompt = min(max(1, n // 2), n - 1)        # BOS and the prompt's tokens: no target supervised there
        completion = [0] * prompt + [1] * (n - prompt)
        kind = index % 4
        if kind == 0:
            features.append({"input_ids": doc.tolist(), "completion_mask": completion})
        elif kind == 1:
            turns = [int(j >= n // 3 and (j < n // 2 or j >= 3 * n // 4)) for j in range(n)]
            turns[-1] = 1
            features.append({"input_ids": doc.tolist(), "assistant_masks": turns})
        elif kind == 2:
            features.append({"input_ids": doc.tolist(), "labels": np.where(completion, doc, -100).tolist()})
        else:
            turns = [int(j % 3 != 1) for j in range(n)]
            turns[-1] = 1
            features.append({"input_ids": doc.tolist(), "completion_mask": completion, "assistant_masks": turns})
    return features


def rule(feature):
    """The supervision the collator's docstring states, written out per token."""
    doc = feature["input_ids"]
    if "labels" in feature:
        return np.asarray(feature["labels"]) != -100
    keep = np.ones(len(doc), dtype=bool)
    for key in ("completion_mask", "assistant_masks"):
        if key in feature:
            keep &= np.asarray(feature[key]) == 1
    return keep


def test_rows_writes_minus_100_at_every_unsupervised_target():
    bind = binding()
    docs = documents()
    supervision = [rule(f) for f in prompt_completion(docs)]
    batch = one_batch(table_of(docs, supervision, bind), bind, "best-fit-decreasing")
    fields = sph.rows(batch)
    expected = np.full(batch.shape, -100, dtype=np.int64)
    for occurrence in batch.occurrences:
        doc, keep = docs[occurrence.ordinal], supervision[occurrence.ordinal]
        expected[occurrence.row, occurrence.columns] = np.where(keep[1:], doc[1:], -100)
    assert (expected == -100).sum() > (~batch.token_valid).sum()     # unsupervised valid targets occur
    assert np.array_equal(fields["shift_labels"].numpy(), expected)
    assert torch.equal(fields["labels"][:, 1:], fields["shift_labels"][:, :-1])
    assert np.array_equal(batch.loss_mask, expected != -100)
    assert batch.target_count == sum(int(k[1:].sum()) for k in supervision) == sph.num_items_in_batch([fields])
    collated = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8), tokenizer_identity=IDENTITY,
                                   split="hf-tests")(prompt_completion(docs))
    for key, value in fields.items():
        assert (torch.equal(collated[key], value) if isinstance(value, torch.Tensor) else collated[key] == value), key


def test_num_items_in_batch_over_collated_sft_batches_is_the_supervised_count(tmp_path):
    from transformers import Trainer, TrainingArguments

    collator = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8), tokenizer_identity=IDENTITY)
    window_features = [prompt_completion(documents(LENGTHS[:5], seed=2)),
                       prompt_completion(documents(LENGTHS[5:], seed=3))]
    window = [collator(features) for features in window_features]
    supervised = sum(int(rule(f)[1:].sum()) for features in window_features for f in features)
    every_target = sum(len(f["input_ids"]) - 1 for features in window_features for f in features)
    assert supervised < every_target
    assert sph.num_items_in_batch(window) == supervised
    trainer = Trainer(model=model("llama"), args=TrainingArguments(output_dir=str(tmp_path), report_to=[],
                                                                    use_cpu=True))
    assert int(trainer._get_num_items_in_batch(window, torch.device("cpu"))) == supervised


def separate_sft_step(net, features, count):
    """Each example alone with sdpa: its whole ``input_ids`` and -100 labels (the model shifts)."""
    net.zero_grad()
    total = 0.0
    for feature in features:
        doc = torch.tensor(feature["input_ids"])[None]
        labels = torch.where(torch.from_numpy(rule(feature))[None], doc, -100)
        loss = net(input_ids=doc, labels=labels, num_items_in_batch=count, use_cache=False).loss
        loss.backward()
        total += float(loss.detach())
    return total, {name: p.grad.clone() for name, p in net.named_parameters()}


@pytest.mark.slow
def test_packed_masked_prompts_equal_each_example_alone_with_sdpa(monkeypatch):
    """The chapters' proof with supervision: the packed loss over the supervised count and
    every parameter gradient equal the examples run alone (float64)."""
    float64_norms(monkeypatch)
    features = prompt_completion(documents())
    fields = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8),
                                 tokenizer_identity=IDENTITY)(features)
    assert fields["input_ids"].shape[0] >= 4
    count = sph.num_items_in_batch([fields])
    assert count == sum(int(rule(f)[1:].sum()) for f in features) < sum(len(f["input_ids"]) - 1 for f in features)
    ours = model("llama", torch.float64)
    ours.zero_grad()
    loss = ours(**fields, num_items_in_batch=count).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in ours.named_parameters()}
    total, expected = separate_sft_step(model("llama", torch.float64, attention="sdpa"), features, count)
    assert close(loss, torch.tensor(total, dtype=torch.float64))
    assert expected.keys() == grads.keys() and len(grads) > 10
    for name, gradient in grads.items():
        assert gradient.abs().max() > 0, name
        assert close(gradient, expected[name]), name


def poisoned_step(net, fields, poison, loss_of):
    """Loss and parameter gradients with ``poison`` added to the logits (the model's lm_head output)."""
    net.zero_grad()
    handle = net.lm_head.register_forward_hook(lambda module, args, output: output + poison)
    try:
        logits = net(**{k: v for k, v in fields.items() if k not in ("labels", "shift_labels")}).logits
    finally:
        handle.remove()
    loss = loss_of(logits)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in net.named_parameters()}


def test_nan_logits_at_unsupervised_targets_reach_no_loss_and_no_gradient():
    """NaN added to the logits at every unsupervised target (prompts and padding): seqpack's
    loss and every gradient are bit-identical to a clean run. Control: transformers'
    ForCausalLMLoss, which runs log-softmax before excluding, turns the gradients NaN."""
    features = prompt_completion(documents(LENGTHS[:6]))
    fields = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8),
                                 tokenizer_identity=IDENTITY)(features)
    unsupervised = fields["shift_labels"] == -100
    valid = torch.arange(CAPACITY)[None, :] < fields["valid_lengths"][:, None]
    assert (unsupervised & valid).any() and (unsupervised & ~valid).any()  # prompts and padding both poisoned
    poison = torch.where(unsupervised, float("nan"), 0.0)[..., None].expand(-1, -1, 300)
    net = model("llama", torch.float64)

    def seqpack_loss(logits):
        return spt.token_weighted_loss(logits, fields)

    clean_loss, clean = poisoned_step(net, fields, torch.zeros_like(poison), seqpack_loss)
    loss, grads = poisoned_step(net, fields, poison, seqpack_loss)
    assert torch.isfinite(loss) and torch.equal(loss, clean_loss)
    for name, gradient in grads.items():
        assert torch.isfinite(gradient).all() and torch.equal(gradient, clean[name]), name

    def their_loss(logits):
        return ForCausalLMLoss(logits, None, 300, shift_labels=fields["shift_labels"])

    control_loss, control = poisoned_step(net, fields, poison, their_loss)
    assert torch.isfinite(control_loss)                      # the forward excludes them ...
    assert not torch.isfinite(control["lm_head.weight"]).all()  # ... the backward does not


def features_for_errors():
    """Four byte-token documents of 5, 4, 6 and 5 tokens."""
    return [{"input_ids": d.tolist()} for d in documents(lengths=(4, 3, 5, 4))]


@pytest.mark.parametrize("change, message", [
    (lambda f: f[2].update(labels=[-100, -100, *f[2]["input_ids"][2:3], 77, *f[2]["input_ids"][4:]]),
     r"feature 2: labels\[3\] is 77 but input_ids\[3\] is \d+: a packed target .* copy input_ids or be -100"),
    (lambda f: f[0].update(labels=f[0]["input_ids"][1:]), r"feature 0: labels must be a 1-D sequence of 5 integers"),
    (lambda f: f[0].update(labels=[float(t) for t in f[0]["input_ids"]]), r"feature 0: labels must .* dtype float64"),
    (lambda f: f[1].update(completion_mask=[0, 1, 2, 1]),
     r"feature 1: completion_mask\[2\] is 2; a mask holds 0 and 1"),
    (lambda f: f[1].update(assistant_masks=[1, 1, 1]),
     r"feature 1: assistant_masks must be a 1-D sequence of 4 0s and 1s"),
    (lambda f: f[3].update(assistant_masks=["1"] * 5), r"feature 3: assistant_masks must .* dtype <U1"),
    (lambda f: f[3].update(completion_mask=[1, 0, 0, 0, 0]), r"feature 3: none of its 4 targets is supervised"),
    (lambda f: f[3].update(labels=[-100] * 5), r"feature 3: none of its 4 targets is supervised"),
    # each mask supervises some target, but no target has both
    (lambda f: f[3].update(completion_mask=[0, 1, 1, 0, 0], assistant_masks=[0, 0, 0, 1, 1]),
     r"feature 3: none of its 4 targets is supervised"),
    (lambda f: f[1].update(attention_mask=[1, 1, 1, 0]), r"feature 1: attention_mask must be all ones: .*unpadded"),
    (lambda f: f[1].update(token_type_ids=[0] * 4), r"feature 1 carries 'token_type_ids'"),
    # (these two were named as an internal example: review)
    (lambda f: f[1].update(input_ids=f[1]["input_ids"][:1]), r"feature 1 has 1 token: a document needs 2 "),
    (lambda f: f[2].update(input_ids=[]), r"feature 2 has 0 tokens: a document needs 2 "),
])
def test_packing_collator_refusals_name_the_feature_and_key(change, message):
    features = features_for_errors()
    change(features)
    collator = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8), tokenizer_identity=IDENTITY)
    with pytest.raises(InvalidInputError, match=message):
        collator(features)


def test_what_the_collator_accepts_at_each_limit():
    """The twins of the refusals: one supervised target (the EOS) is enough; entry 0 is never
    read; masks may be bool, int or float tensors; ``completion_only_loss=False`` ignores
    ``completion_mask`` (still checked) as ``SFTConfig(completion_only_loss=False)`` does."""
    collator = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8), tokenizer_identity=IDENTITY)
    features = features_for_errors()
    doc = features[3]["input_ids"]
    features[3]["completion_mask"] = [0, 0, 0, 0, 1]
    features[2]["labels"] = [12345, *features[2]["input_ids"][1:]]           # entry 0: no target
    features[1]["assistant_masks"] = torch.tensor([0.0, 1.0, 0.0, 1.0])
    features[0]["completion_mask"] = np.array([True, False, True, True, True])
    fields = collator(features)
    assert sph.num_items_in_batch([fields]) == 3 + 2 + 5 + 1
    assert doc[-1] in fields["shift_labels"]
    ignoring = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8), tokenizer_identity=IDENTITY,
                                   completion_only_loss=False)
    masked = [{"input_ids": f["input_ids"], "completion_mask": [0] * len(f["input_ids"])} for f in features]
    assert sph.num_items_in_batch([ignoring(masked)]) == sum(len(f["input_ids"]) - 1 for f in features)
    masked[0]["completion_mask"] = [0, 3, 0, 0, 0]
    with pytest.raises(InvalidInputError, match=r"feature 0: completion_mask\[1\] is 3"):
        ignoring(masked)
    with pytest.raises(InvalidInputError, match="completion_only_loss must be None, True or False, not 'yes'"):
        sph.PackingCollator(sp.PackConfig(capacity=CAPACITY), tokenizer_identity=IDENTITY, completion_only_loss="yes")


@pytest.mark.slow
def test_sft_trainer_with_packing_collator_trains_on_the_completions(tmp_path):
    """A short ``trl.SFTTrainer`` run on a pre-tokenized prompt-completion dataset: TRL builds
    the -100 labels from ``completion_mask``, PackingCollator packs them, seqpack attention
    runs the model; the loss falls and every step's item count is seqpack's supervised count."""
    pytest.importorskip("tokenizers", reason="the test trains a tokenizer: pip install 'seqpack[hf]'")
    trl_modules()
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    prompts = [f"question {i % 5}: which context does row {i % 3} keep?" for i in range(64)]
    completions = [f" answer {i % 5}: row {i % 3} keeps its own context apart" for i in range(64)]
    tokenizer = train_tokenizer(prompts + completions, tmp_path)
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    prompt_ids, prompt_offsets = tokenizer.encode(prompts)
    completion_ids, completion_offsets = tokenizer.encode(completions)
    records = []
    for i in range(len(prompts)):
        prompt = prompt_ids[prompt_offsets[i]:prompt_offsets[i + 1]].tolist()
        completion = completion_ids[completion_offsets[i]:completion_offsets[i + 1]].tolist()
        records.append({"input_ids": [bos, *prompt, *completion, eos],
                      "completion_mask": [0] * (1 + len(prompt)) + [1] * (len(completion) + 1)})
    supervised_per_row = [sum(r["completion_mask"][1:]) for r in records]
    collator = sph.PackingCollator(sp.PackConfig(capacity=128, rows_per_batch=8),
                                   tokenizer_identity=tokenizer.identity)
    collated = []                                     # (TRL's count, seqpack's count) per micro-batch

    def recording(features):
        fields = collator(features)
        collated.append((sum(int(np.count_nonzero(np.asarray(f["labels"])[1:] != -100)) for f in features),
                         sph.num_items_in_batch([fields])))
        return fields

    class CountingTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.counts.append(int(num_items_in_batch))
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>",
                                           eos_token="</s>", pad_token="</s>", unk_token="<unk>")
    args = SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                     max_steps=8, learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                     save_strategy="no", seed=0, dataloader_num_workers=0, completion_only_loss=True)
    net = model("llama", vocab_size=tokenizer.vocabulary_size)
    trainer = CountingTrainer(model=net, args=args, train_dataset=Dataset.from_list(records),
                              processing_class=hf_tokenizer, data_collator=recording)
    trainer.counts = []
    trainer.train()

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 8 and trainer.state.global_step == 8
    assert losses[-1] < 0.8 * losses[0]
    assert net.config._attn_implementation == "seqpack"
    assert len(collated) == len(trainer.counts) == 16
    assert all(theirs == ours for theirs, ours in collated)
    for step in range(8):
        window = collated[2 * step][1] + collated[2 * step + 1][1]
        assert trainer.counts[2 * step] == trainer.counts[2 * step + 1] == window
    assert sum(ours for _, ours in collated) == 2 * sum(supervised_per_row)  # two epochs of every row's completion


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", ["chatml", "zephyr", "llama2", "tools"])
def test_sft_trainer_with_packing_collator_trains_on_conversations_and_counts_tokens_as_trl(tmp_path, name):
    """PackingCollator takes conversations from templates with an EOS per turn (and no BOS
    from the tokenizer), and TRL's ``num_tokens`` counts their tokens, not one row's width per
    step: a short ``SFTTrainer`` run on TRL's own preparation of them trains under seqpack
    attention, and ``num_tokens`` equals that of TRL's padding-free run of the same steps."""
    trl_modules()
    pytest.importorskip("tokenizers", reason="the test trains a tokenizer: pip install 'seqpack[hf]'")
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from seqpack.io import TokenizerFile

    path = train_chat_bpe(tmp_path, "bpe", bos_post_processor=name == "llama2")
    eos = "<|im_end|>" if name == "chatml" else "<|eos|>"
    tokenizer = TokenizerFile(path, eos=eos)
    if name == "tools":
        records = [{"messages": TOOL_CALL[:k], "tools": json.dumps(TOOLS)} for k in (2, 4)] * 12
    else:
        records = [{"messages": conversation} for conversation in CONVERSATIONS] * 8
    processing = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=eos, pad_token="<|pad|>",
                                         bos_token=tokenizer.token_text(tokenizer.bos_id))
    processing.chat_template = TEMPLATES[name]

    class Trainer(sph.SFTTokenCount, SFTTrainer):
        pass

    def run(trainer_class, out, **options):
        args = SFTConfig(output_dir=str(tmp_path / out), per_device_train_batch_size=4, max_steps=6,
                         learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True, bf16=False, seed=0,
                         save_strategy="no", dataloader_num_workers=0, assistant_only_loss=True, max_length=None,
                         include_num_input_tokens_seen="non_padding", **options)
        net = model("llama", vocab_size=tokenizer.vocabulary_size, attention="seqpack" if out == "ours" else "sdpa")
        trainer = trainer_class(model=net, args=args, train_dataset=Dataset.from_list(records),
                                processing_class=processing,
                                **({"data_collator": collator} if out == "ours" else {}))
        trainer.train()
        return [entry for entry in trainer.state.log_history if "loss" in entry], net

    collator = sph.PackingCollator(sp.PackConfig(capacity=256, rows_per_batch=4), tokenizer_identity=tokenizer.identity)
    ours, net = run(Trainer, "ours")
    theirs, _ = run(SFTTrainer, "theirs", padding_free=True)
    assert net.config._attn_implementation == "seqpack" and len(ours) == len(theirs) == 6
    assert [entry["num_tokens"] for entry in ours] == [entry["num_tokens"] for entry in theirs]
    # Trainer's own count took a row's padding cells for tokens (the pad token is not ID 0 here) (review).
    assert processing.pad_token_id != 0
    assert [e["num_input_tokens_seen"] for e in ours] == [e["num_input_tokens_seen"] for e in theirs]
    assert ours[-1]["loss"] < ours[0]["loss"]
    assert all(np.isfinite(entry["loss"]) for entry in ours)


@pytest.mark.slow
def test_token_count_takes_the_fields_of_a_rows_batch():
    """A flat() batch raised KeyError: 'valid_lengths', None a TypeError."""
    from seqpack.hf.trainers import token_count

    batch = sp.pack(sp.ExampleTable.from_texts(["hello", "hi"], binding(), capacity=CAPACITY),
                    sp.PackConfig(CAPACITY), partition=sp.Partition.TRAIN, binding=binding()).batches[0]
    assert token_count(sph.rows(batch)).item() == 7 + 2 + 2   # (the tokens without the last, plus each last target)
    for fields, name in ((sph.flat(batch), "dict with keys"), (None, "NoneType")):
        with pytest.raises(InvalidInputError, match=f"token_count takes the fields of a seqpack.hf.rows\\(\\) batch .*"
                                                     f"not {name}"):
            token_count(fields)


def test_sft_token_count_refuses_what_shifts_the_rows_labels_itself(tmp_path):
    """A compute_loss_func (or label smoothing) shifts ``labels`` itself: on rows() batches it
    dropped each full row's last target, silently (review)."""
    pytest.importorskip("tokenizers", reason="the test trains a tokenizer: pip install 'seqpack[hf]'")
    trl_modules()
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    texts = [f"row {i} keeps its own context" for i in range(8)]
    tokenizer = train_tokenizer(texts, tmp_path)
    ids, offsets = tokenizer.encode(texts)
    records = [{"input_ids": [tokenizer.bos_id, *ids[a:b].tolist(), tokenizer.eos_id]}
               for a, b in pairwise(offsets)]
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>",
                                           eos_token="</s>", pad_token="</s>", unk_token="<unk>")
    collator = sph.PackingCollator(sp.PackConfig(capacity=64, rows_per_batch=8), tokenizer_identity=tokenizer.identity)

    class Trainer(sph.SFTTokenCount, SFTTrainer):
        pass

    for options, extra, what in (({"label_smoothing_factor": 0.1}, {}, "label smoothing"),
                                 ({}, {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: 0},
                                  "a compute_loss_func")):
        args = SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=1, report_to=[],
                         use_cpu=True, bf16=False, save_strategy="no", dataloader_num_workers=0, **options)
        trainer = Trainer(model=model("llama", vocab_size=tokenizer.vocabulary_size), args=args,
                          train_dataset=Dataset.from_list(records), processing_class=hf_tokenizer,
                          data_collator=collator, **extra)
        batch = trainer._prepare_inputs(collator([trainer.train_dataset[i] for i in range(8)]))
        with pytest.raises(InvalidInputError, match=f"^{what} shifts the labels of seqpack.hf.rows"):
            trainer.compute_loss(trainer.model, batch)
