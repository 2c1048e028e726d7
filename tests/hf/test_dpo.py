"""TRL's ``DPOTrainer`` on packed preference pairs: ``PreferenceCollator`` and ``PackedDPO``.

The oracle is TRL 1.16's own padded step: ``DPOTrainer`` with its ``DataCollatorForPreference``
and sdpa attention, its loss code and metrics. TRL's fused LM head computes in float32 (its
tiles and statistics are float32 whatever the model's dtype), so for the float64 comparison
both trainers get a head with the fused head's contract (``log_probs``, ``entropy``,
``mean_logits``, ``is_top1`` of each next-token label, zero at -100) computed from the
model's float64 logits; that head is checked against TRL's own at float32 precision.
"""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="seqpack.hf needs PyTorch: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")

from hf_cases import close, float64_norms, model  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hs  # noqa: E402
from hypothesis.strategies import composite  # noqa: E402

import seqpack as sp  # noqa: E402
import seqpack.hf as sph  # noqa: E402
import seqpack.torch as spt  # noqa: E402
from seqpack.errors import CapacityError, InvalidInputError, TokenizerError  # noqa: E402

IDENTITY = sp.ByteTokenizer().identity
PAIRS = 4                                     # pairs per step in the comparison


def trl_modules():
    """``(trl.trainer.dpo_trainer, datasets)``, or the test is skipped."""
    dpo = pytest.importorskip("trl.trainer.dpo_trainer", reason="the oracle is TRL: pip install 'seqpack[bench]'")
    datasets = pytest.importorskip("datasets", reason="TRL prepares datasets: pip install 'seqpack[bench]'")
    datasets.disable_progress_bars()
    return dpo, datasets


@pytest.fixture(scope="module")
def text_pairs(tmp_path_factory):
    """``(records, tokenizer file, transformers tokenizer)``: prompt/chosen/rejected text records
    of varied lengths and a byte-level BPE trained on them, as a TRL user starts."""
    pytest.importorskip("tokenizers", reason="the test trains a tokenizer: pip install 'seqpack[hf]'")
    from transformers import PreTrainedTokenizerFast

    from helpers import train_tokenizer

    prompts = [f"question {i}: which row keeps context {i % 3}" + " and why" * (i % 4) + "?" for i in range(8)]
    chosen = [f" row {i % 3} keeps it" + " apart" * (i % 5) for i in range(8)]
    rejected = [" no row" + " at all" * (i % 3) + " ever" * (i % 2) for i in range(8)]
    path = tmp_path_factory.mktemp("dpo-tokenizer")
    tokenizer = train_tokenizer(prompts + chosen + rejected, path)
    processing = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), bos_token="<s>",
                                         eos_token="</s>", pad_token="</s>", unk_token="<unk>")
    records = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in zip(prompts, chosen, rejected)]
    return records, tokenizer, processing


def float64_head(net, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
    """``trl.trainer.utils.add_fused_lm_head``'s contract, computed from the model's own logits
    in its dtype: with ``fused_lm_head=True``, each next-token label's log-probability, and the
    entropy, mean logit and top-1 flag of its distribution, zero where the label is -100."""
    from trl.trainer.utils import FusedCausalLMOutput

    original = net.forward

    def forward(*args, fused_lm_head=False, labels=None, **kwargs):
        if not fused_lm_head:
            return original(*args, **kwargs) if labels is None else original(*args, labels=labels, **kwargs)
        logits = original(*args, **kwargs).logits[:, :-1]                          # [B, S - 1, V]
        gold = labels[:, 1:]
        mask = gold != -100
        logp = logits.log_softmax(-1)
        zero = logits.new_zeros(())
        picked = logp.gather(-1, gold.clamp(min=0)[..., None])[..., 0]
        return FusedCausalLMOutput(
            log_probs=torch.where(mask, picked, zero),
            entropy=torch.where(mask, torch.special.entr(logp.exp()).sum(-1), zero).detach(),
            mean_logits=torch.where(mask, logits.mean(-1), zero).detach(),
            is_top1=(logits.argmax(-1) == gold) & mask, label_mask=mask)

    net.forward = forward


def packed_trainer():
    """The class a user writes: ``class Trainer(seqpack.hf.PackedDPO, trl.DPOTrainer)``."""
    dpo, _ = trl_modules()

    class Trainer(sph.PackedDPO, dpo.DPOTrainer):
        pass

    return Trainer


def trainer(kind, records, tokenizer, processing, tmp_path, *, dtype=torch.float64, policy=None, **options):
    """TRL's own ``DPOTrainer`` (``kind="theirs"``: its collator, sdpa) or the packed one
    (``"ours"``: ``PreferenceCollator``, ``PackedDPO``, seqpack attention) on ``records``, the
    reference a model of other weights (seed 1); ``policy``: that model (default a new one)."""
    dpo, datasets = trl_modules()
    ours = kind == "ours"
    attention = "seqpack" if ours else "sdpa"
    arguments = {"output_dir": str(tmp_path / kind), "per_device_train_batch_size": PAIRS, "use_cpu": True,
                 "bf16": False, "report_to": [], "max_length": None, "gradient_checkpointing": False, "seed": 0,
                 "save_strategy": "no", "dataloader_num_workers": 0, **options}
    extra = {"data_collator": sph.PreferenceCollator(sp.PackConfig(capacity=128, rows_per_batch=PAIRS),
                                                     tokenizer_identity=tokenizer.identity)} if ours else {}
    return (packed_trainer() if ours else dpo.DPOTrainer)(
        model=policy or model("llama", dtype, attention=attention, vocab_size=tokenizer.vocabulary_size),
        ref_model=model("llama", dtype, attention=attention, seed=1, vocab_size=tokenizer.vocabulary_size),
        args=dpo.DPOConfig(**arguments), train_dataset=datasets.Dataset.from_list(records),
        processing_class=processing, **extra)


def step(dpo_trainer):
    """One training step's loss on the first ``PAIRS`` features, the policy's and the reference's
    ``(chosen, rejected)`` per pair, TRL's logged metrics and every parameter's gradient."""
    features = [dpo_trainer.train_dataset[i] for i in range(PAIRS)]
    batch = dpo_trainer._prepare_inputs(dpo_trainer.data_collator(features))
    dpo_trainer.model.train()
    loss = dpo_trainer.compute_loss(dpo_trainer.model, batch)
    loss.backward()
    policy = dpo_trainer.compute_ref_log_probs(dpo_trainer.model, batch)
    if "ref_chosen_logps" in batch:
        reference = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    else:
        reference = dpo_trainer.compute_ref_log_probs(dpo_trainer.ref_model, batch)
    metrics = {name: values[-1] for name, values in dpo_trainer._metrics["train"].items()}
    return loss, policy, reference, metrics, dict(dpo_trainer.model.named_parameters()), batch


@pytest.mark.slow
@pytest.mark.parametrize("precompute", [False, True], ids=["reference-model", "precomputed"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_the_packed_step_is_trls_padded_step(loss_type, precompute, text_pairs, tmp_path, monkeypatch):
    dpo, _ = trl_modules()
    float64_norms(monkeypatch)
    monkeypatch.setattr(dpo, "add_fused_lm_head", float64_head)
    options = {"loss_type": [loss_type], "beta": 0.1, "precompute_ref_log_probs": precompute}
    theirs = step(trainer("theirs", *text_pairs, tmp_path, **options))
    ours = step(trainer("ours", *text_pairs, tmp_path, **options))

    packed = ours[5]["packed_rows"]
    assert packed["input_ids"].shape[0] < 2 * PAIRS                 # pairs share rows
    assert torch.equal(ours[5]["completion_mask"], theirs[5]["completion_mask"])
    assert theirs[0].item() > 0 and close(ours[0], theirs[0]), (ours[0], theirs[0])
    for side in range(2):
        assert close(ours[1][side], theirs[1][side]) and close(ours[2][side], theirs[2][side])
        assert ours[2][side].dtype == theirs[2][side].dtype
    assert not close(theirs[1][0], theirs[2][0])                      # the rewards are not all zero
    assert set(ours[3]) == set(theirs[3]) >= {"rewards/chosen", "rewards/margins", "logps/rejected", "entropy"}
    for name, value in theirs[3].items():
        assert close(torch.tensor(ours[3][name], dtype=torch.float64), torch.tensor(value, dtype=torch.float64)), name
    assert ours[3]["num_tokens"] == theirs[3]["num_tokens"]
    for name, parameter in theirs[4].items():
        assert parameter.grad.abs().sum() > 0 and close(ours[4][name].grad, parameter.grad), name


def test_the_float64_head_is_trls_fused_head(text_pairs, tmp_path):
    """The oracle's head agrees with TRL's own (which computes in float32) on TRL's padded batch."""
    from trl.trainer.utils import add_fused_lm_head

    theirs = trainer("theirs", *text_pairs, tmp_path)
    batch = theirs.data_collator([theirs.train_dataset[i] for i in range(PAIRS)])
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    heads = [copy.deepcopy(theirs.ref_model) for _ in range(2)]
    add_fused_lm_head(heads[0], outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    float64_head(heads[1])
    trl_head, ours = (net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                          use_cache=False, fused_lm_head=True) for net in heads)
    assert trl_head.log_probs.dtype == torch.float32 and ours.log_probs.dtype == torch.float64
    for field in ("log_probs", "entropy", "mean_logits"):
        assert torch.allclose(getattr(trl_head, field).double(), getattr(ours, field), rtol=1e-5, atol=1e-5), field
    assert torch.equal(trl_head.is_top1, ours.is_top1) and (labels[:, 1:] != -100).sum() > 20


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_a_short_packed_dpo_run_widens_the_margins(text_pairs, tmp_path):
    """Sixteen ``PackedDPO`` steps (DPOConfig's defaults: sigmoid loss, gradient checkpointing)
    over eight pairs, four a step, the reference a frozen copy of the policy."""
    dpo, datasets = trl_modules()
    records, tokenizer, processing = text_pairs
    net = model("llama", vocab_size=tokenizer.vocabulary_size)
    args = dpo.DPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=PAIRS, max_steps=16,
                         learning_rate=3e-3, beta=0.1, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                         max_length=None, save_strategy="no", seed=0, dataloader_num_workers=0)
    run = packed_trainer()(model=net, ref_model=copy.deepcopy(net), args=args,
                  train_dataset=datasets.Dataset.from_list(records), processing_class=processing,
                  data_collator=sph.PreferenceCollator(sp.PackConfig(capacity=128, rows_per_batch=PAIRS),
                                                       tokenizer_identity=tokenizer.identity))
    run.train()
    logs = [entry for entry in run.state.log_history if "loss" in entry]
    assert len(logs) == 16 and net.config._attn_implementation == "seqpack" and args.gradient_checkpointing
    assert logs[0]["loss"] == pytest.approx(np.log(2)) and logs[0]["rewards/margins"] == 0.0  # policy = reference
    last = logs[-4:]                                            # each pair twice
    assert max(e["loss"] for e in last) < 0.5 * logs[0]["loss"]
    assert min(e["rewards/margins"] for e in last) > 2 * max(e["rewards/margins"] for e in logs[:2]) > 0
    assert all(e["rewards/accuracies"] == 1.0 for e in last)


@pytest.mark.slow
@pytest.mark.parametrize("precompute", [False, True], ids=["reference-model", "precomputed"])
def test_evaluate_reports_trls_padded_evaluation(precompute, text_pairs, tmp_path, monkeypatch):
    """``trainer.evaluate(dataset)`` over two batches of four pairs: the same ``eval_loss`` and
    ``eval_rewards/...``, ``eval_logps/...`` metrics as TRL's padded evaluation (float64)."""
    dpo, datasets = trl_modules()
    float64_norms(monkeypatch)
    monkeypatch.setattr(dpo, "add_fused_lm_head", float64_head)
    options = {"per_device_eval_batch_size": PAIRS, "precompute_ref_log_probs": precompute}
    theirs, ours = (trainer(kind, *text_pairs, tmp_path, **options).evaluate(datasets.Dataset.from_list(text_pairs[0]))
                    for kind in ("theirs", "ours"))
    timing = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}
    assert set(ours) == set(theirs) >= {"eval_loss", "eval_rewards/margins", "eval_logps/chosen", *timing}
    assert theirs["eval_loss"] > 0 and theirs["eval_rewards/margins"] != 0
    for name in set(theirs) - timing:
        assert close(torch.tensor(ours[name], dtype=torch.float64), torch.tensor(theirs[name], dtype=torch.float64)), \
            (name, ours[name], theirs[name])


# --- the collator ----------------------------------------------------------------------------


def packed_sequences(packed: dict) -> list:
    """Each occurrence of ``packed_rows`` in row-major order: its row, first column, tokens (the
    cells' inputs, then the last target) and which tokens are supervised targets."""
    found = []
    for row, length in enumerate(packed["valid_lengths"].tolist()):
        positions = packed["position_ids"][row, :length].tolist()
        starts = [c for c, p in enumerate(positions) if p == 0] + [length]
        for begin, end in zip(starts, starts[1:]):
            labels = packed["shift_labels"][row, begin:end]
            tokens = [*packed["input_ids"][row, begin:end].tolist(), int(labels[-1])]
            found.append((row, begin, tokens, [False, *(labels != -100).tolist()]))
    return found


@composite
def preference_features(draw):
    """1 to 5 features of byte-token IDs: prompts of 0 to 8 tokens, completions of 1 to 8 (two
    tokens at least without a prompt), and TRL's precomputed reference log-probabilities or none."""
    ids = hs.integers(0, 257)
    features = []
    with_references = draw(hs.booleans())
    for _ in range(draw(hs.integers(1, 5))):
        prompt = draw(hs.lists(ids, max_size=8))
        least = 1 if prompt else 2
        feature = {"prompt_ids": prompt, "chosen_ids": draw(hs.lists(ids, min_size=least, max_size=8)),
                   "rejected_ids": draw(hs.lists(ids, min_size=least, max_size=8))}
        if with_references:
            feature.update(ref_chosen_logps=-draw(hs.floats(0, 50)), ref_rejected_logps=-draw(hs.floats(0, 50)))
        features.append(feature)
    return features


@pytest.mark.slow
@settings(derandomize=True, max_examples=40, deadline=None)
@given(preference_features(), hs.sampled_from(["next-fit", "first-fit-decreasing", "best-fit-decreasing"]))
def test_the_collator_gives_trls_batch_and_packs_each_pair_whole(features, policy):
    dpo, _ = trl_modules()
    collator = sph.PreferenceCollator(sp.PackConfig(capacity=40, rows_per_batch=5), tokenizer_identity=IDENTITY,
                                      policy=policy)
    theirs = dpo.DataCollatorForPreference(pad_token_id=0)(copy.deepcopy(features))
    ours = collator(features)
    assert list(ours) == [*theirs, "packed_rows"]
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
    packed = ours["packed_rows"]
    pair_ids = packed["pair_ids"].tolist()
    assert sorted(pair_ids) == list(range(len(features))) and packed["pair_ids"].dtype == torch.int64
    occurrences = packed_sequences(packed)
    assert len(occurrences) == 2 * len(features)
    for k, (row, begin, tokens, supervised) in enumerate(occurrences):
        feature = features[pair_ids[k // 2]]
        prompt = feature["prompt_ids"]
        assert tokens == prompt + feature["rejected_ids" if k % 2 else "chosen_ids"]
        assert supervised == [j >= max(1, len(prompt)) for j in range(len(tokens))]  # TRL's completion_mask
        if k % 2:                                             # the rejected right after its chosen
            chosen_row, chosen_begin, chosen_tokens, _ = occurrences[k - 1]
            assert row == chosen_row and begin == chosen_begin + len(chosen_tokens) - 1
    counts = spt.pair_logprobs(torch.zeros(packed["input_ids"].shape + (258,)), packed)
    shifted = theirs["completion_mask"][:, 1:].sum(1)
    assert counts.chosen_counts.tolist() == shifted[pair_ids].tolist()
    assert counts.rejected_counts.tolist() == shifted[[len(features) + p for p in pair_ids]].tolist()


def pair_features():
    """Three features: 3 + 2 and 3 + 3 tokens, 2 + 4 and 2 + 1, none + 2 and none + 3."""
    return [{"prompt_ids": [0, 5, 6], "chosen_ids": [7, 1], "rejected_ids": [9, 9, 1]},
            {"prompt_ids": [0, 4], "chosen_ids": [3, 3, 3, 1], "rejected_ids": [1]},
            {"prompt_ids": [], "chosen_ids": [8, 1], "rejected_ids": [2, 2, 1]}]


def collate(features, capacity=12, rows_per_batch=3):
    return sph.PreferenceCollator(sp.PackConfig(capacity=capacity, rows_per_batch=rows_per_batch),
                                  tokenizer_identity=IDENTITY)(features)


@pytest.mark.parametrize("change, error, message", [
    (lambda f: f.clear(), InvalidInputError, "PreferenceCollator received no features"),
    (lambda f: f[1].pop("rejected_ids"), InvalidInputError,
     r"feature 1 lacks rejected_ids; its keys are \['chosen_ids', 'prompt_ids'\] \(trl.DPOTrainer prepares"),
    (lambda f: f[0].update(chosen_ids=[7.0, 1.0]), InvalidInputError,
     r"feature 0: chosen_ids must be a 1-D sequence of integer token ids, got shape \(2,\) and dtype float64"),
    (lambda f: f[2].update(prompt_ids=[[0, 1]]), InvalidInputError, r"feature 2: prompt_ids must be a 1-D"),
    (lambda f: f[1].update(prompt_ids=[[0, 1], [2]]), InvalidInputError,
     r"feature 1: prompt_ids is not a regular array: setting an array element with a sequence"),
    (lambda f: f[2].update(rejected_ids=[2, 258, 1]), TokenizerError,
     r"example 'feature 2 rejected' \(index 5\), document 5: token 258 at position 1 is out of vocabulary"),
    (lambda f: f.__setitem__(1, None), InvalidInputError, "feature 1 is a NoneType, not a dict of token IDs"),
    (lambda f: f[1].update(chosen_ids=[]), InvalidInputError,
     "feature 1: chosen_ids is empty; a completion needs at least one token"),
    (lambda f: f[2].update(chosen_ids=[1]), InvalidInputError,
     "feature 2: prompt_ids and chosen_ids make a sequence of one token, which has no target"),
    (lambda f: f[0].update(rejected_ids=[9] * 7 + [1]), CapacityError,
     r"feature 0's chosen and rejected sequences have 4 \+ 10 = 14 predictions, and a pair shares one row; "
     r"PackConfig's capacity is 12: raise it to at least 14"),
    (lambda f: f.extend(copy.deepcopy(f)), CapacityError,
     r"6 features need 4 rows of 12; the config allows 3 per batch: lower the batch size that made it "
     r"\(per_device_train_batch_size, per_device_eval_batch_size or precompute_ref_batch_size\)"),
    (lambda f: [x.update(ref_chosen_logps=-1.0) for x in f[:2]], InvalidInputError,
     "feature 2 lacks ref_chosen_logps, which feature 0 carries"),
    (lambda f: [x.update(ref_rejected_logps="-1.0") for x in f], InvalidInputError,
     "ref_rejected_logps must be one number per feature"),
    (lambda f: [x.update(ref_rejected_logps=[-1.0, -2.0]) for x in f], InvalidInputError,
     r"ref_rejected_logps must be one real number per feature; the features give a torch.float32 tensor of "
     r"shape \(3, 2\)"),
    (lambda f: [x.update(ref_rejected_logps=True) for x in f], InvalidInputError,
     r"ref_rejected_logps must be one real number per feature; the features give a torch.bool tensor"),
    (lambda f: [x.update(ref_rejected_logps=-1j) for x in f], InvalidInputError,
     r"ref_rejected_logps must be one real number per feature; the features give a torch.complex64 tensor"),
])
def test_the_collator_refuses_naming_the_feature(change, error, message):
    features = pair_features()
    change(features)
    with pytest.raises(error, match=message):
        collate(features)


def test_the_collator_takes_a_list_of_features():
    # A generator raised "has no len()" and an array of features numpy's truth-value error (review).
    features = pair_features()
    for bad, name in (((f for f in features), "generator"), (np.array(features), "ndarray"), ("text", "str")):
        with pytest.raises(InvalidInputError, match=f"PreferenceCollator takes a list of features \\(dicts\\), "
                                                    f"not {name}"):
            collate(bad)
    assert torch.equal(collate(tuple(features))["input_ids"], collate(features)["input_ids"])


def test_what_the_collator_accepts_at_each_limit():
    """The refusals' twins: a pair of exactly ``capacity`` predictions, exactly
    ``rows_per_batch`` rows, a completion of one token after a prompt, a sequence of two tokens
    without one (one target), the vocabulary's last ID, references in every feature (stacked
    as TRL stacks them), other keys (ignored, as TRL ignores them)."""
    features = pair_features()
    features[0]["rejected_ids"] = [9] * 5 + [1]                   # 4 + 8 = 12 predictions
    features[2]["rejected_ids"] = [257, 1]
    for feature in features:
        feature.update(ref_chosen_logps=-1.5, ref_rejected_logps=-2.5, prompt="text TRL keeps")
    batch = collate(features, rows_per_batch=2)
    assert batch["packed_rows"]["input_ids"].shape == (2, 12) and batch["packed_rows"]["valid_lengths"][0] == 12
    assert batch["ref_chosen_logps"].dtype == torch.float32 and batch["ref_rejected_logps"].tolist() == [-2.5] * 3
    counts = spt.pair_logprobs(torch.zeros(2, 12, 258), batch["packed_rows"])
    assert sorted(zip(counts.pair_ids.tolist(), counts.chosen_counts.tolist(), counts.rejected_counts.tolist())) == \
        [(0, 2, 6), (1, 4, 1), (2, 1, 1)]
    for feature, value in zip(features, (-3, -2, np.int64(-5))):   # whole numbers: TRL stacks them as int64 (review)
        feature.update(ref_chosen_logps=value)
    theirs = trl_modules()[0].DataCollatorForPreference(pad_token_id=0)(copy.deepcopy(features))["ref_chosen_logps"]
    ours = collate(features, rows_per_batch=2)["ref_chosen_logps"]
    assert ours.dtype == theirs.dtype == torch.int64 and ours.tolist() == theirs.tolist() == [-3, -2, -5]
    with pytest.raises(InvalidInputError, match="config must be a PackConfig, not int"):
        sph.PreferenceCollator(12, tokenizer_identity=IDENTITY)
    with pytest.raises(InvalidInputError, match="policy"):
        sph.PreferenceCollator(sp.PackConfig(12), tokenizer_identity=IDENTITY, policy="worst-fit")


# --- PackedDPO's refusals ----------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"ld_alpha": 0.5}, r"DPOConfig\(ld_alpha=...\) weighs each token's log-probability; PackedDPO gives TRL one sum"),
    ({"use_weighting": True}, r"DPOConfig\(use_weighting=True\) weighs each token's log-probability"),
    ({"loss_type": ["sigmoid", "sft"]}, "loss_type 'sft' averages each token's log-probability"),
])
def test_packed_dpo_refuses_per_token_options(options, message, text_pairs, tmp_path):
    with pytest.raises(InvalidInputError, match=message):
        trainer("ours", *text_pairs, tmp_path, **options)
    trainer("ours", *text_pairs, tmp_path, loss_type=["sigmoid", "ipo"])     # the twin: sums suffice


def test_a_deep_copy_of_a_packed_model_runs_its_own_weights(text_pairs, tmp_path):
    # Iterative DPO: the next round's reference is a copy of this round's policy.
    ours = trainer("ours", *text_pairs, tmp_path)
    batch = ours._prepare_inputs(ours.data_collator([ours.train_dataset[i] for i in range(PAIRS)]))
    before = ours.compute_ref_log_probs(ours.model, batch)
    frozen = copy.deepcopy(ours.model)
    with torch.no_grad():
        for parameter in ours.model.parameters():
            parameter.mul_(1.5)
    assert all(torch.equal(a, b) for a, b in zip(ours.compute_ref_log_probs(frozen, batch), before))
    assert not torch.equal(ours.compute_ref_log_probs(ours.model, batch)[0], before[0])


def test_a_second_trainer_on_the_same_policy_keeps_its_plain_forward(text_pairs, tmp_path):
    # Iterative DPO's next round on the same policy: TRL wraps seqpack's forward again, and a plain
    # forward (generate, a user's call) then recursed forever between the two wrappers (review).
    first = trainer("ours", *text_pairs, tmp_path)
    net, ids = first.model, torch.tensor([[1, 5, 6, 7]])
    before = net(input_ids=ids, use_cache=False).logits
    second = trainer("ours", *text_pairs, tmp_path, policy=net)
    assert torch.equal(net(input_ids=ids, use_cache=False).logits, before)
    assert net.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 6)
    features = [second.train_dataset[i] for i in range(PAIRS)]
    twice, once = (t.compute_loss(t.model, t._prepare_inputs(t.data_collator(features))) for t in (second, first))
    assert torch.equal(twice, once)  # the fused step is unchanged by the second wrapping


def test_packed_dpo_refuses_a_batch_trl_would_truncate_or_without_packed_rows(text_pairs, tmp_path):
    dpo, _ = trl_modules()
    probe = trainer("ours", *text_pairs, tmp_path)
    features = [probe.train_dataset[i] for i in range(PAIRS)]
    longest = int(probe.data_collator(features)["input_ids"].shape[1])
    exact = trainer("ours", *text_pairs, tmp_path, max_length=longest)
    assert exact.compute_loss(exact.model, exact.data_collator(features)) > 0  # the twin: the longest fits
    short = trainer("ours", *text_pairs, tmp_path, max_length=longest - 1)
    with pytest.raises(InvalidInputError, match=f"a sequence of this batch has {longest} tokens; DPOConfig's "
                                                f"max_length is {longest - 1}, so TRL would truncate it"):
        short.compute_loss(short.model, short.data_collator(features))
    padded = dpo.DataCollatorForPreference(pad_token_id=0)(features)
    with pytest.raises(InvalidInputError, match="this batch has none: give the trainer a seqpack.hf.PreferenceCo"):
        probe.compute_loss(probe.model, padded)
    shifted = probe.data_collator(features)
    shifted["packed_rows"]["pair_ids"] += 1                          # pair 0 is nowhere, pair P beyond the batch
    with pytest.raises(InvalidInputError, match="packed_rows and the padded batch beside it hold different seq"):
        probe.compute_loss(probe.model, shifted)
