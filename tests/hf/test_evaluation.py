"""Packed evaluation: ``seqpack.hf.evaluate`` and ``TokenWeightedEvaluation``.

The oracle is each example run alone through a model with the same weights under sdpa
attention, its float64 cross-entropy computed here from the logits; every comparison is
in float64 (transformers' RMS norms kept in float64 too), within 1e-10 + 1e-9 * max(|a|, |b|).
"""

import io
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="seqpack.hf needs PyTorch: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")

import hf_cases
from hf_cases import CAPACITY, LENGTHS

import seqpack as sp
import seqpack.hf as sph
from seqpack import InvalidInputError
from helpers import assert_close as assert_arrays_close, train_bpe

KINDS = ["llama", "qwen2"]


def assert_close(actual, expected, name):
    """helpers.assert_close, for scalars too (it reads 0-d arrays as always close)."""
    assert_arrays_close(np.atleast_1d(actual), np.atleast_1d(expected), name)


@pytest.fixture
def float64(monkeypatch):
    hf_cases.float64_norms(monkeypatch)


def alone_model(net, kind):
    """A model with ``net``'s weights under sdpa attention."""
    alone = hf_cases.model(kind, torch.float64, "sdpa", seed=1, vocab_size=net.config.vocab_size)
    alone.load_state_dict(net.state_dict())
    return alone.eval()


def alone_nll(alone, tokens, supervised=None) -> tuple[float, int]:
    """``(NLL sum, targets)`` of one example run alone as ``[1, L]``; ``supervised`` marks
    its targets (``tokens[1:]``), all of them when None."""
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.int64)[None]
    with torch.no_grad():
        logits = alone(input_ids=ids, use_cache=False).logits[0, :-1].to(torch.float64)   # [L - 1, V]
    picked = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    mask = torch.ones(picked.shape, dtype=torch.bool) if supervised is None else torch.as_tensor(supervised)
    return float(-picked[mask].sum()), int(mask.sum())


def assert_matches_alone(evaluation, alone, examples):
    """``examples``: each ``(tokens, supervised or None)`` by ordinal."""
    expected = [alone_nll(alone, tokens, supervised) for tokens, supervised in examples]
    np.testing.assert_array_equal(evaluation.ordinals, np.arange(len(examples)))
    np.testing.assert_array_equal(evaluation.targets, [count for _, count in expected])
    assert_close(evaluation.nll_sums, [nll for nll, _ in expected], "nll_sums")
    total = sum(count for _, count in expected)
    assert evaluation.total_targets == total
    assert_close(evaluation.loss, sum(nll for nll, _ in expected) / total, "loss")
    assert evaluation.ordinals.dtype == evaluation.targets.dtype == np.int64
    assert evaluation.nll_sums.dtype == np.float64


def byte_table(lengths=LENGTHS):
    docs, binding = hf_cases.documents(lengths), hf_cases.binding()
    return hf_cases.table(docs, binding), docs, binding


def data_of(form, table, binding):
    """``table``'s examples as ``form``: several batches each (one epoch)."""
    config = sp.PackConfig(capacity=CAPACITY, rows_per_batch=2)
    options = {"partition": sp.Partition.TRAIN, "binding": binding, "policy": "best-fit-decreasing"}
    if form == "epoch":
        return sp.pack(table, config, **options)
    if form == "plan":
        return sp.plan(table, config, **options)
    if form == "generator":
        return (batch for batch in sp.plan(table, config, **options))
    if form == "padded":
        return sp.pad(table, sp.PadConfig(rows_per_batch=3), partition=sp.Partition.TRAIN, binding=binding)
    raise AssertionError(form)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["epoch", "plan", "generator", "padded"])
def test_each_example_scores_as_if_alone(float64, kind, form):
    table, docs, binding = byte_table()
    net = hf_cases.model(kind, torch.float64)
    data = data_of(form, table, binding)
    if form in ("epoch", "plan"):
        assert len(data) > 1 and any(len(batch.occurrences) > batch.shape[0] for batch in data)  # shared rows
    evaluation = sph.evaluate(net, data)
    assert_matches_alone(evaluation, alone_model(net, kind), [(doc, None) for doc in docs])
    assert evaluation.example_ids == tuple(table.example_id(i) for i in range(len(docs)))
    np.testing.assert_array_equal(evaluation.targets, LENGTHS)


def test_the_result_does_not_depend_on_the_packing(float64):
    table, docs, binding = byte_table()
    net = hf_cases.model("llama", torch.float64)
    first = sph.evaluate(net, data_of("epoch", table, binding))
    one_row_each = sp.pad(table, sp.PadConfig(rows_per_batch=1), partition=sp.Partition.TRAIN, binding=binding)
    second = sph.evaluate(net, one_row_each)
    np.testing.assert_array_equal(first.targets, second.targets)
    assert_close(first.nll_sums, second.nll_sums, "nll_sums")


def test_the_models_modes_and_attention_are_left_as_they_were():
    batch, _ = hf_cases.packed()
    net = hf_cases.model("llama")
    net.train()
    net.model.layers[0].eval()
    modes = {name: module.training for name, module in net.named_modules()}
    sph.evaluate(net, [batch])
    assert {name: module.training for name, module in net.named_modules()} == modes
    assert net.config._attn_implementation == "seqpack"
    assert all(p.grad is None for p in net.parameters())


def test_evaluation_runs_in_eval_mode_without_gradients():
    batch, _ = hf_cases.packed()
    net = hf_cases.model("llama")
    net.train()
    seen = []
    net.model.layers[0].register_forward_hook(
        lambda module, args, output: seen.append((module.training, torch.is_grad_enabled())))
    sph.evaluate(net, [batch])
    assert seen == [(False, False)]


def test_the_model_sees_no_padding_cell():
    """Each batch reaches the model flattened (``flat()``): one row of its examples' tokens,
    so a padded row's empty cells are never computed."""
    table, docs, binding = byte_table()
    data = data_of("padded", table, binding)
    assert any(batch.shape[0] * batch.shape[1] > int(batch.valid_lengths.sum()) for batch in data)  # padding
    net = hf_cases.model("llama")
    shapes = []
    net.model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                        with_kwargs=True)
    sph.evaluate(net, data)
    assert len(shapes) == len(data) and all(rows == 1 for rows, _ in shapes)
    assert sum(tokens for _, tokens in shapes) == sum(len(doc) for doc in docs)


def test_a_float32_model_is_summed_in_float64():
    """A float32 model's logits are summed in float64: the sums equal the float64
    cross-entropy of those logits computed here, beyond float32's precision."""
    batch, docs = hf_cases.packed()
    net = hf_cases.model("llama")
    evaluation = sph.evaluate(net, [batch])
    with torch.no_grad():
        logits = net(**{k: v for k, v in sph.rows(batch).items() if k not in ("labels", "shift_labels")}).logits
    log_p = torch.log_softmax(logits.to(torch.float64), -1)
    expected = np.zeros(len(docs))
    for occurrence in batch.occurrences:
        columns = list(occurrence.columns)
        gold = torch.as_tensor(batch.targets[occurrence.row, columns], dtype=torch.int64)
        expected[occurrence.ordinal] = -float(log_p[occurrence.row, columns].gather(1, gold[:, None]).sum())
    assert_close(evaluation.nll_sums, expected, "nll_sums")


def write_texts(directory, count=9, seed=0):
    """``count`` text files of varied lengths; returns their texts by file name."""
    rng = np.random.default_rng(seed)
    words = ["packed", "rows", "keep", "every", "context", "apart", "and", "the", "loss", "is", "exact"]
    directory.mkdir()
    texts = {}
    for i in range(count):
        text = " ".join(rng.choice(words, int(rng.integers(1, 9))))
        (directory / f"doc{i}.txt").write_text(text)
        texts[f"doc{i}.txt"] = text
    return texts


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_dataset_packed_to_disk_from_text_files(float64, tmp_path, kind):
    from seqpack.io import open_dataset, pack_corpus

    texts = write_texts(tmp_path / "docs")
    pack_corpus([sp.io.reader_for(tmp_path / "docs")], tmp_path / "out", config=sp.PackConfig(96, 2),
                policy="best-fit-decreasing")
    dataset = open_dataset(tmp_path / "out")
    assert len(dataset) > 1
    net = hf_cases.model(kind, torch.float64)
    evaluation = sph.evaluate(net, dataset, progress=True)
    # ByteTokenizer: BOS 0, byte b as b + 2, EOS 1; each file one example.
    names = [os.path.basename(example_id) for example_id in evaluation.example_ids]
    assert sorted(names) == sorted(texts)
    examples = [([0, *(b + 2 for b in texts[name].encode()), 1], None) for name in names]
    assert_matches_alone(evaluation, alone_model(net, kind), examples)
    assert evaluation.total_targets == int(dataset.batch_targets().sum())


WORDS = ["alpha", "beta", "gamma", "delta", "question", "answer", "the", "of", "is", "what", "why"]


@pytest.mark.slow
def test_masked_prompts_count_only_supervised_targets(float64, tmp_path):
    from tokenizers import Tokenizer

    from seqpack.io import TokenizerFile, open_dataset, pack_corpus

    rng = np.random.default_rng(4)
    path = train_bpe(tmp_path, [" ".join(rng.choice(WORDS, 12)) for _ in range(300)])
    tokenizer = TokenizerFile(path, bos="<|bos|>", eos="<|eos|>")
    words = lambda low, high: " ".join(rng.choice(WORDS, int(rng.integers(low, high))))  # noqa: E731
    records = [{"prompt": words(2, 12) + "?", "completion": " " + words(1, 10)} for _ in range(14)]
    source = tmp_path / "sft.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    pack_corpus([sp.io.reader_for(source)], tmp_path / "out", tokenizer=tokenizer, config=sp.PackConfig(64, 2),
                policy="best-fit-decreasing")
    dataset = open_dataset(tmp_path / "out")
    assert dataset.version == 2 and len(dataset) > 1
    net = hf_cases.model("llama", torch.float64, vocab_size=tokenizer.vocabulary_size)
    evaluation = sph.evaluate(net, dataset)
    # TRL's rule, from the tokenizer itself: the completion's tokens (EOS appended) are the supervised targets.
    bpe = Tokenizer.from_file(str(path))
    examples, lengths = [], []
    for example_id in evaluation.example_ids:
        record = records[int(example_id.rsplit(":", 1)[1]) - 1]
        ids = bpe.encode(record["prompt"] + record["completion"] + "<|eos|>").ids
        prompt = bpe.encode(record["prompt"]).ids
        prefix = next((j for j, (a, b) in enumerate(zip(prompt, ids)) if a != b), min(len(prompt), len(ids)))
        examples.append((ids, np.arange(1, len(ids)) >= prefix))
        lengths.append(len(ids) - 1)
    assert_matches_alone(evaluation, alone_model(net, "llama"), examples)
    assert np.all(evaluation.targets < lengths)  # every prompt hides targets
    assert evaluation.total_targets == int(dataset.batch_targets().sum())


# --- refusals ---------------------------------------------------------------------------


def test_a_vocabulary_smaller_than_the_bindings_is_refused():
    batch, _ = hf_cases.packed()
    net = hf_cases.model("llama", vocab_size=200)
    calls = []
    net.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(InvalidInputError, match=r"vocabulary \(its embeddings\) has 200 entries, fewer than the "
                                                r"258 token IDs"):
        sph.evaluate(net, [batch])
    assert not calls  # refused before any forward
    table, _, binding = byte_table()
    with pytest.raises(InvalidInputError, match="has 200 entries, fewer than the 258"):
        sph.evaluate(net, data_of("plan", table, binding))
    sph.evaluate(hf_cases.model("llama", vocab_size=258), [batch])  # exactly the binding's vocabulary
    # A model that exposes no embeddings is checked on its logits (its tokens here all below 200).
    hidden = hf_cases.model("llama", vocab_size=200)
    hidden.get_input_embeddings = hidden.get_output_embeddings = lambda: None
    low = [np.array([0, 5, 6, 7, 1]), np.array([0, 9, 1])]
    low_batch = sp.pack(hf_cases.table(low, binding), sp.PackConfig(CAPACITY, 2), partition=sp.Partition.TRAIN,
                        binding=binding)[0]
    with pytest.raises(InvalidInputError, match=r"vocabulary \(its logits\) has 200 entries, fewer than the 258"):
        sph.evaluate(hidden, [low_batch])


def refused_data(batch, tmp_path) -> dict:
    """Each kind of data evaluate refuses: ``(data, what its message says)``."""
    return {
        "a path": (tmp_path, "data is a path: open the dataset first, seqpack.open_dataset"),
        "a path string": (str(tmp_path), "data is a path"),
        "a single batch": (batch, r"data is a single batch: pass a list of batches, \[batch\]"),
        "a rows() dict": (sph.rows(batch), r"data is a dict \(a tensors\(\) or rows\(\) dict names no examples\)"),
        "a tensor": (torch.zeros(3), "data is an array"),
        "a number": (7, "or an iterable of batches, not int"),
        "a list of dicts": ([sph.rows(batch)], r"item 0 of data \(dict\) is not a padded or packed batch \(a "
                                               r"tensors\(\) or rows\(\) dict names no examples\)"),
        "a list holding a number": ([batch, 3], r"item 1 of data \(int\) is not a padded or packed batch: "),
    }


@pytest.mark.parametrize("case", [
    "a path", "a path string", "a single batch", "a rows() dict", "a tensor", "a number", "a list of dicts",
    "a list holding a number"])
def test_data_of_another_kind_is_refused(tmp_path, case):
    batch, _ = hf_cases.packed()
    data, message = refused_data(batch, tmp_path)[case]
    with pytest.raises(InvalidInputError, match=message):
        sph.evaluate(hf_cases.model("llama"), data)


def test_an_example_past_a_models_learned_positions_is_named():
    # GPT-2's position table raised a bare IndexError (a traceback from seqpack score) (review).
    from transformers import GPT2Config, GPT2LMHeadModel

    batch, _ = hf_cases.packed(lengths=(5, 30, 9))
    sph.register()
    short = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    short.set_attn_implementation("seqpack")
    positions = batch.occurrence_records["stop"] - batch.occurrence_records["start"] + 1  # (its tokens)
    longest = int(np.argmax(positions))
    with pytest.raises(InvalidInputError, match=rf"batch 0: the model failed to look up an embedding .*; its longest "
                                                rf"example, '{batch.example_ids[longest]}', takes {positions.max()} "
                                                rf"positions and the model's config has n_positions 16, "
                                                rf"max_position_embeddings 16"):
        sph.evaluate(short, [batch])
    fits = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=int(positions.max()), n_embd=32, n_layer=1, n_head=2))
    fits.set_attn_implementation("seqpack")
    assert len(sph.evaluate(fits, [batch]).ordinals) == 3  # exactly the longest example's positions


def test_data_with_no_supervised_target_is_refused():
    net = hf_cases.model("llama")
    for empty in ([], iter(())):
        with pytest.raises(InvalidInputError, match=r"the data \(0 batches\) holds no supervised target: its loss "
                                                    r"has no denominator"):
            sph.evaluate(net, empty)


def test_the_model_must_run_seqpack_attention():
    batch, _ = hf_cases.packed()
    net = hf_cases.model("llama", attention="sdpa")
    fix = r"call seqpack.hf.register\(\) and model.set_attn_implementation\('seqpack'\)"
    with pytest.raises(InvalidInputError, match=r"need seqpack attention; this LlamaForCausalLM uses 'sdpa': " + fix):
        sph.evaluate(net, [batch])
    assert net.config._attn_implementation == "sdpa"
    with pytest.raises(InvalidInputError, match="must be a transformers causal LM"):
        sph.evaluate(torch.nn.Linear(2, 2), [batch])
    with pytest.raises(InvalidInputError, match="not function"):
        sph.evaluate(lambda **kwargs: None, [batch])
    # transformers accepts "seqpack" for a model that never calls an attention function
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    own = OpenAIGPTLMHeadModel._from_config(OpenAIGPTConfig(vocab_size=300, n_embd=32, n_layer=1, n_head=2),
                                            attn_implementation="seqpack")
    assert own.config._attn_implementation == "seqpack"
    with pytest.raises(InvalidInputError, match="OpenAIGPTLMHeadModel computes attention in its own code, never "
                                                "through transformers' AttentionInterface"):
        sph.evaluate(own, [batch])


def test_an_example_met_twice_is_refused():
    table, _, binding = byte_table()
    net = hf_cases.model("llama")
    epoch = data_of("epoch", table, binding)
    two_epochs = [*epoch, *epoch]
    with pytest.raises(InvalidInputError, match=rf"example \d+ \('#\d+'\) occurs again in batch {len(epoch)}: "
                                                r"evaluate scores each example once"):
        sph.evaluate(net, two_epochs)


def test_batches_under_different_bindings_are_refused():
    batch, _ = hf_cases.packed()
    docs = hf_cases.documents()
    other = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="elsewhere")
    foreign = sp.pack(hf_cases.table(docs, other), sp.PackConfig(CAPACITY, 8), partition=sp.Partition.TRAIN,
                      binding=other)[0]
    with pytest.raises(InvalidInputError, match="batch 1 was built under another binding"):
        sph.evaluate(hf_cases.model("llama"), [batch, foreign])


def test_progress_is_a_bool_and_draws_examples_and_targets(monkeypatch):
    pytest.importorskip("tqdm", reason="the bar needs tqdm: pip install 'seqpack[corpus]'")
    batch, _ = hf_cases.packed()
    net = hf_cases.model("llama")
    with pytest.raises(InvalidInputError, match="progress must be a bool"):
        sph.evaluate(net, [batch], progress=1)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    table, _, binding = byte_table()
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    sph.evaluate(net, data_of("epoch", table, binding), progress=True)  # an epoch knows its examples
    drawn = terminal.getvalue().split("\r")[-1]
    assert drawn.startswith("evaluating: 100%") and "10/10" in drawn and " examples/s, 140 targets, " in drawn
    assert drawn.rstrip().endswith(" targets/s]")
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    sph.evaluate(net, [batch])
    assert quiet.getvalue() == ""


def test_an_evaluation_is_read_only_and_consistent():
    evaluation = sph.Evaluation(np.array([0, 1]), ("a", "b"), np.array([2, 3]), np.array([1.0, 2.0]))
    assert evaluation.loss == 3.0 / 5 and evaluation.total_targets == 5
    with pytest.raises(ValueError):
        evaluation.nll_sums[0] = 0.0
    with pytest.raises(InvalidInputError, match="one entry per example"):
        sph.Evaluation(np.array([0, 1]), ("a",), np.array([2, 3]), np.array([1.0, 2.0]))


# --- Trainer.evaluate -------------------------------------------------------------------


def trainer_features():
    """Byte documents of uneven lengths, some with a completion mask: batches of four
    features hold very different target counts."""
    docs = hf_cases.documents((2, 3, 2, 4, 40, 37, 31, 30, 5, 9, 24, 3))
    features = []
    for i, doc in enumerate(docs):
        feature = {"input_ids": doc.tolist()}
        if i % 3 == 1:
            feature["completion_mask"] = [0] * (doc.size // 2) + [1] * (doc.size - doc.size // 2)
        features.append(feature)
    return features


def alone_scores(net, features) -> np.ndarray:
    """``[features, 2]``: each feature's NLL sum and supervised targets, run alone (the
    completion mask's entry ``j`` is about token ``j`` as a target)."""
    alone = alone_model(net, "llama")
    return np.array([alone_nll(alone, f["input_ids"], None if "completion_mask" not in f
                               else np.asarray(f["completion_mask"][1:], dtype=bool)) for f in features])


def trainer(cls, net, features, tmp_path):
    from transformers import TrainingArguments

    collator = sph.PackingCollator(sp.PackConfig(capacity=64, rows_per_batch=4),
                                   tokenizer_identity=sp.ByteTokenizer().identity)
    # remove_unused_columns=False: else Trainer drops completion_mask (no argument of the model's forward).
    args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), per_device_eval_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
                             remove_unused_columns=False)
    return cls(model=net, args=args, eval_dataset=features, data_collator=collator)


def weighted_setup(attention="seqpack"):
    """``(Weighted, features, net, scored)``: the mixin before ``Trainer``, the trainer
    features, a float64 Llama with ``attention`` and each feature scored alone."""
    from transformers import Trainer

    class Weighted(sph.TokenWeightedEvaluation, Trainer):
        pass

    features = trainer_features()
    net = hf_cases.model("llama", torch.float64, attention=attention, initializer_range=0.3)
    return Weighted, features, net, alone_scores(net, features)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["seqpack", "sdpa"])
def test_trainer_eval_loss_is_token_weighted(float64, tmp_path, attention):
    from transformers import Trainer

    Weighted, features, net, scored = weighted_setup(attention)
    expected = scored.sum(0)[0] / scored.sum(0)[1]

    weighted = trainer(Weighted, net, features, tmp_path).evaluate()
    plain = trainer(Trainer, net, features, tmp_path).evaluate()
    assert_close(weighted["eval_loss"], expected, "eval_loss")
    # Trainer's own: the mean of the three batches' mean losses (float32), a batch of 10 targets
    # weighing as much as one of 105.
    batches = scored.reshape(3, 4, 2).sum(1)
    assert batches[:, 1].tolist() == [10, 105, 30]
    means = np.mean(batches[:, 0] / batches[:, 1])
    assert abs(plain["eval_loss"] - means) <= 1e-5 * means
    assert abs(plain["eval_loss"] - expected) > 100 * 1e-5 * expected
    assert set(weighted) == set(plain)  # the same metrics, by the same names


@pytest.mark.slow
def test_every_evaluation_loop_is_token_weighted_and_training_is_untouched(float64, tmp_path):
    from transformers import Trainer

    Weighted, features, net, scored = weighted_setup()
    expected = scored.sum(0)[0] / scored.sum(0)[1]
    run = trainer(Weighted, net, features, tmp_path)
    assert_close(run.evaluate(metric_key_prefix="val")["val_loss"], expected, "val_loss")
    assert_close(run.predict(features).metrics["test_loss"], expected, "test_loss")
    assert_close(run.evaluate(eval_dataset={"a": features[:6], "b": features})["eval_b_loss"], expected, "eval_b_loss")
    # Outside an evaluation loop, compute_loss is Trainer's.
    batch = {k: v for k, v in run.data_collator(features[:4]).items()}
    plain = trainer(Trainer, net, features, tmp_path)
    with torch.no_grad():
        assert torch.equal(run.compute_loss(net, dict(batch)), plain.compute_loss(net, dict(batch)))
    assert run._token_totals is None


@pytest.mark.slow
def test_labels_without_shift_labels_are_shifted_as_the_models_loss_shifts_them(float64, tmp_path):
    """transformers' own flattening collator gives unshifted ``labels`` only (-100 where masked)."""
    from transformers import DataCollatorWithFlattening

    Weighted, features, net, scored = weighted_setup()
    flattened = [{"input_ids": f["input_ids"],
                  "labels": [t if m else -100 for t, m in zip(f["input_ids"], f.get("completion_mask",
                                                                                      [1] * len(f["input_ids"])))]}
                 for f in features]
    run = trainer(Weighted, net, flattened, tmp_path)
    run.data_collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    assert_close(run.evaluate()["eval_loss"], scored.sum(0)[0] / scored.sum(0)[1], "eval_loss")


@pytest.mark.slow
def test_a_padding_collators_batch_encoding_is_weighted_too(float64, tmp_path):
    """transformers' causal-LM collator returns a BatchEncoding, a mapping but no dict: its
    batches added nothing, so eval_loss stayed Trainer's mean of batch means (review)."""
    from transformers import BatchEncoding

    Weighted, features, net, _ = weighted_setup()
    plain = [{"input_ids": f["input_ids"]} for f in features]
    scored = alone_scores(net, plain)

    def padding_collator(batch):   # DataCollatorForLanguageModeling(mlm=False)'s fields, padded right
        width = max(len(f["input_ids"]) for f in batch)
        ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in batch])
        present = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in batch])
        return BatchEncoding({"input_ids": ids, "attention_mask": present, "labels": ids.masked_fill(present == 0, -100)})

    run = trainer(Weighted, net, plain, tmp_path)
    run.model.set_attn_implementation("sdpa")
    run.data_collator = padding_collator
    assert_close(run.evaluate()["eval_loss"], scored.sum(0)[0] / scored.sum(0)[1], "eval_loss")


def test_outputs_without_logits_are_refused(tmp_path):
    from transformers import Trainer

    class FusedLoss(Trainer):  # as Liger's fused loss returns: a loss, no logits
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
            return (loss, {"loss": loss}) if return_outputs else loss

    class Weighted(sph.TokenWeightedEvaluation, FusedLoss):
        pass

    run = trainer(Weighted, hf_cases.model("llama"), trainer_features()[:4], tmp_path)
    with pytest.raises(InvalidInputError, match="sums the NLL from the model's logits, and this evaluation batch's "
                                                "outputs hold none"):
        run.evaluate()
    assert run._token_totals is None


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:`return_outputs=True`:FutureWarning")  # TRL recomputes the logits for it
def test_sft_trainer_eval_loss_is_token_weighted(float64, tmp_path):
    """Before ``trl.SFTTrainer``: TRL prepares the prompt-completion features (labels -100 on
    the prompts), PackingCollator packs them, and ``eval_loss`` is the completions' NLL per target."""
    pytest.importorskip("tokenizers", reason="the test trains a tokenizer: pip install 'seqpack[hf]'")
    pytest.importorskip("trl", reason="the test runs TRL: pip install 'seqpack[bench]'")
    datasets = pytest.importorskip("datasets", reason="TRL's datasets: pip install 'seqpack[bench]'")
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from helpers import train_tokenizer

    class Weighted(sph.TokenWeightedEvaluation, SFTTrainer):
        pass

    prompts = [f"question {i}: " + "which row? " * (i % 5) for i in range(10)]
    completions = [" answer: " + "its own. " * (1 + 3 * (i % 4)) for i in range(10)]
    tokenizer = train_tokenizer(prompts + completions, tmp_path)
    features = []
    for prompt, completion in zip(prompts, completions):
        p, c = (tokenizer.encode([text])[0].tolist() for text in (prompt, completion))
        features.append({"input_ids": [tokenizer.bos_id, *p, *c, tokenizer.eos_id],
                         "completion_mask": [0] * (1 + len(p)) + [1] * (len(c) + 1)})
    net = hf_cases.model("llama", torch.float64, vocab_size=tokenizer.vocabulary_size, initializer_range=0.3)
    scored = alone_scores(net, features)
    processing = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>",
                                         eos_token="</s>", pad_token="</s>", unk_token="<unk>")
    args = SFTConfig(output_dir=str(tmp_path / "out"), per_device_eval_batch_size=4, report_to=[], use_cpu=True,
                     bf16=False, save_strategy="no", seed=0, dataloader_num_workers=0, completion_only_loss=True)
    collator = sph.PackingCollator(sp.PackConfig(capacity=128, rows_per_batch=4),
                                   tokenizer_identity=tokenizer.identity)
    dataset = datasets.Dataset.from_list(features)
    run = Weighted(model=net, args=args, train_dataset=dataset, eval_dataset=dataset, processing_class=processing,
                   data_collator=collator)
    metrics = run.evaluate()
    assert_close(metrics["eval_loss"], scored.sum(0)[0] / scored.sum(0)[1], "eval_loss")
    assert "eval_mean_token_accuracy" in metrics  # TRL's own metrics stay
