"""``seqpack score`` run as a user runs it: every row against its example scored alone, the
printed total, ``--batches`` and ``--force``, each refusal, and what an interrupt leaves.

One packed dataset serves every test: text files (some cut into windows), JSONL text
records and prompt-completion records (a version-2 dataset, some targets unsupervised),
tokenized by a byte-level BPE trained here; one random Llama saved with ``save_pretrained``.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import one_error_line, run, train_bpe

torch = pytest.importorskip("torch", reason="seqpack score needs the hf extra: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack score needs the hf extra: pip install 'seqpack[hf]'")
parquet = pytest.importorskip("pyarrow.parquet", reason="seqpack score writes Parquet: pip install 'seqpack[corpus]'")

import seqpack as sp  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [("packing keeps examples apart " * (1 + 3 * (i % 5))).strip() + f" {i}" for i in range(12)]
RECORDS = [{"text": f"line {i}: " + "a json record " * (1 + i % 3)} for i in range(5)]
PAIRS = [{"prompt": f"Question {i}: what is packed?", "completion": " whole examples" + " apart" * (i % 3)}
         for i in range(4)]
CAPACITY = 24


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """``(root, dataset directory, model directory)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("score")
    (root / "docs").mkdir()
    for index, text in enumerate(TEXTS):
        (root / "docs" / f"{index:02d}.txt").write_text(text)
    (root / "records.jsonl").write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    (root / "pairs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    (root / "bpe").mkdir()
    tokenizer = train_bpe(root / "bpe", TEXTS + [r["text"] for r in RECORDS] + [p["prompt"] + p["completion"]
                                                                              for p in PAIRS], vocab_size=300)
    packed = root / "packed"
    result = run("pack", root / "docs", root / "records.jsonl", root / "pairs.jsonl", "--tokenizer", tokenizer,
                 "--eos", "<|eos|>", "--out", packed, "--capacity", CAPACITY, "--rows-per-batch", 2, "--cut-long",
                 "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    dataset = sp.open_dataset(packed)
    assert dataset.version == 2 and len(dataset) > 4
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=dataset.binding.vocabulary_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, use_cache=False))
    model.save_pretrained(root / "model")
    return root, packed, root / "model"


@pytest.fixture(scope="module")
def scored(corpus):
    """``(rows of the float64 scores file by column, the printed JSON totals)`` of the whole dataset."""
    root, packed, model = corpus
    result = run("score", packed, "--model", model, "--out", root / "all.parquet", "--dtype", "float64", "--json",
                 "--quiet")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return parquet.read_table(root / "all.parquet"), json.loads(result.stdout)


def alone(model_dir, dataset, ordinal):
    """``(supervised targets, NLL sum)`` of example ``ordinal`` run by itself: sdpa, float64,
    a cross-entropy computed here in float64 from the logits."""
    from transformers import AutoModelForCausalLM

    if not hasattr(alone, "model"):
        alone.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa",
                                                           local_files_only=True).eval()
    example = dataset.example(ordinal)
    inputs = torch.from_numpy(example.inputs.astype(np.int64))[None]                 # [1, T]
    with torch.no_grad():
        logits = alone.model(input_ids=inputs, use_cache=False).logits[0]             # [T, V]
    assert logits.dtype == torch.float64
    log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    gold = log_p[torch.arange(inputs.shape[1]), torch.from_numpy(example.targets.astype(np.int64))]
    mask = torch.from_numpy(np.array(example.loss_mask, dtype=bool))
    return int(mask.sum()), float(-gold[mask].sum())


def close(a, b):
    return abs(a - b) <= 1e-10 + 1e-9 * max(abs(a), abs(b))


@pytest.mark.slow
def test_every_row_is_its_example_scored_alone(corpus, scored):
    root, packed, model = corpus
    table, totals = scored
    dataset = sp.open_dataset(packed)
    rows = table.to_pylist()
    assert table.column_names == ["example", "input", "line", "example_id", "targets", "nll_sum", "nll_mean",
                                  "perplexity"]
    assert [row["example"] for row in rows] == list(range(dataset.occurrence_count))
    windows = unsupervised = 0
    for row in rows:
        assert row["example_id"] == dataset.example_id(row["example"])
        # The input and line, read back from the example's ID (file:line for JSONL, the file's name for a text file).
        named = row["example_id"].split("[")[0]
        windows += "[" in row["example_id"]
        if named.endswith(".txt"):
            assert (row["input"], row["line"]) == (named, 1)
        else:
            name, line = named.rsplit(":", 1)
            assert (row["input"], row["line"]) == (name, int(line))
        targets, nll = alone(model, dataset, row["example"])
        unsupervised += len(dataset.example(row["example"])) - targets
        assert row["targets"] == targets
        assert close(row["nll_sum"], nll), (row, nll)
        assert close(row["nll_mean"], nll / targets) and close(row["perplexity"], math.exp(nll / targets))
    assert windows > 0 and unsupervised > 0  # cut documents and prompts occur
    assert {row["input"] for row in rows} >= {str(root / "records.jsonl"), str(root / "pairs.jsonl")}
    # The printed total is the token-weighted mean over every target, not a mean of the rows' means.
    sums, counts = np.array(table["nll_sum"]), np.array(table["targets"])
    assert totals["targets"] == counts.sum() == dataset.batch_targets().sum()
    assert close(totals["loss"], sums.sum() / counts.sum()) and close(totals["perplexity"], math.exp(totals["loss"]))
    assert not close(totals["loss"], float(np.mean(sums / counts)))
    assert (totals["examples"], totals["batches"], totals["dtype"]) == (len(rows), len(dataset), "float64")
    assert json.loads(table.schema.metadata[b"seqpack.scores"]) == totals


@pytest.mark.slow
def test_batches_limits_and_force_replaces(corpus, scored):
    root, packed, model = corpus
    table, _ = scored
    dataset = sp.open_dataset(packed)
    out = root / "first.parquet"
    result = run("score", packed, "--model", model, "--out", out, "--dtype", "float64", "--batches", 3, "--quiet")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    first = parquet.read_table(out).to_pylist()
    expected = sorted(o.ordinal for number in range(3) for o in dataset.batch(number).occurrences)
    assert [row["example"] for row in first] == expected
    whole = {row["example"]: row for row in table.to_pylist()}
    for row in first:
        assert row["targets"] == whole[row["example"]]["targets"]
        assert close(row["nll_sum"], whole[row["example"]]["nll_sum"])
    # The text report: the token-weighted loss over these batches' targets.
    lines = result.stdout.splitlines()
    targets = sum(row["targets"] for row in first)
    assert lines[0].startswith(f"scored {len(first)} examples, {targets:,} targets (3 batches of {len(dataset)}) of ")
    loss = sum(row["nll_sum"] for row in first) / targets
    assert lines[1].startswith(f"loss {loss:.6f} nats per target (token-weighted mean), perplexity ")
    assert lines[2] == f"wrote {out}"
    # An existing file is kept without --force and replaced with it.
    before = out.read_bytes()
    line = one_error_line(run("score", packed, "--model", model, "--out", out, "--batches", 1))
    assert line == f"seqpack: error: {out} already exists (--force replaces it)" and out.read_bytes() == before
    link = root / "link.parquet"  # --force replaced a link (or a FIFO) with a file (review)
    link.symlink_to(out)
    line = one_error_line(run("score", packed, "--model", model, "--out", link, "--force", "--batches", 1))
    assert line == (f"seqpack: error: --out {link} is a symbolic link; seqpack writes a new file or replaces a "
                    f"regular one whole: name a file") and link.is_symlink()
    link.unlink()
    result = run("score", packed, "--model", model, "--out", out, "--force", "--batches", 1, "--threads", 1, "--json")
    assert result.returncode == 0, result.stderr
    replaced = parquet.read_table(out).num_rows
    assert replaced == len(dataset.batch(0).occurrences) == json.loads(result.stdout)["examples"]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []


def test_a_perplexity_past_the_float_range_is_json_null(corpus):
    from transformers import LlamaForCausalLM

    root, packed, model = corpus
    diverged = root / "diverged"
    weights = LlamaForCausalLM.from_pretrained(model)
    with torch.no_grad():
        weights.lm_head.weight.mul_(1e4)  # a loss of thousands of nats per target
    weights.save_pretrained(diverged)
    out = root / "diverged.parquet"
    result = run("score", packed, "--model", diverged, "--out", out, "--batches", 1, "--json", "--quiet")
    assert result.returncode == 0, result.stderr
    totals = json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert totals["loss"] > 710 and totals["perplexity"] is None
    stored = parquet.read_schema(out).metadata[b"seqpack.scores"]
    assert json.loads(stored, parse_constant=lambda name: pytest.fail(f"{name} is not JSON")) == totals
    text = run("score", packed, "--model", diverged, "--out", out, "--batches", 1, "--force", "--quiet").stdout
    assert text.splitlines()[1].endswith("perplexity inf")


def small_vocabulary(root, vocabulary):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / "small-model"
    if not path.exists():
        LlamaForCausalLM(LlamaConfig(vocab_size=vocabulary - 1, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                     use_cache=False)).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing model", "empty model directory", "not a causal LM", "no weights",
                                  "truncated weights", "weights of other shapes", "small vocabulary",
                                  "not a dataset", "inside the dataset", "a directory", "malformed config",
                                  "a file of the model"])
def test_each_refusal_is_one_line(corpus, case):
    root, packed, model = corpus
    out, extra = root / f"refused-{case.replace(' ', '-')}.parquet", []
    vocabulary = sp.open_dataset(packed).binding.vocabulary_size
    target = root / case.replace(" ", "-")
    if case in ("empty model directory", "not a causal LM", "no weights", "malformed config"):
        target.mkdir(exist_ok=True)
        if case == "malformed config":  # transformers' ZeroDivisionError was a traceback (review)
            config = json.loads((model / "config.json").read_text())
            (target / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
        elif case == "not a causal LM":
            (target / "config.json").write_text(json.dumps({"model_type": "vit"}))
        elif case == "no weights":
            (target / "config.json").write_text((model / "config.json").read_text())
        model = target
    elif case in ("truncated weights", "weights of other shapes"):
        shutil.copytree(model, target, dirs_exist_ok=True)
        if case == "truncated weights":
            weights = (model / "model.safetensors").read_bytes()
            (target / "model.safetensors").write_bytes(weights[:len(weights) // 2])
        else:
            config = json.loads((model / "config.json").read_text())
            (target / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
        model = target
    messages = {
        "missing model": f"{root / 'missing-model'}: no such directory (--model takes a directory written by "
                         f"save_pretrained)",
        "empty model directory": f"{target}: no config.json: not a model written by save_pretrained",
        "not a causal LM": f"{target}: a 'vit' model is not a causal LM (AutoModelForCausalLM has no class for it)",
        "no weights": f"{target}: cannot load the model: Error no file named model.safetensors",
        "truncated weights": f"{target}: cannot load the model: Error while deserializing header",
        "weights of other shapes": f"{target}: 6 weights of the checkpoint do not fit config.json (first: "
                                   f"model.layers.0.mlp.down_proj.weight is [64, 128] in the checkpoint, [64, 96] "
                                   f"in the model)",
        "small vocabulary": f"the model's vocabulary (its embeddings) has {vocabulary - 1} entries, fewer than the "
                            f"{vocabulary} token IDs",
        "not a dataset": f"{root / 'docs'}/manifest.json: missing",
        "inside the dataset": f"--out {packed / 'scores.parquet'} is inside the packed dataset {packed.resolve()}",
        "a directory": f"{root / 'docs'} is a directory; --force replaces only a file",
        "malformed config": f"{target}: not a transformers model: integer modulo by zero",
        "a file of the model": f"{model / 'config.json'} is not a Parquet file; --force replaces only a scores "
                               f"file",
    }
    if case == "missing model":
        model = root / "missing-model"
    elif case == "small vocabulary":
        model = small_vocabulary(root, vocabulary)
    elif case == "not a dataset":
        packed = root / "docs"
    elif case == "inside the dataset":
        out = packed / "scores.parquet"
    elif case == "a directory":
        out, extra = root / "docs", ["--force"]
    elif case == "a file of the model":  # --force replaced the model's config.json (review)
        out, extra = model / "config.json", ["--force"]
        config = out.read_bytes()
    line = one_error_line(run("score", packed, "--model", model, "--out", out, *extra))
    assert line.startswith(f"seqpack: error: {messages[case]}"), line
    if case == "a file of the model":
        assert out.read_bytes() == config
    assert case in ("a directory", "a file of the model") or not out.exists()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("args, message", [
    (("--batches", "0"), "--batches must be at least 1"),
    (("--threads", "0"), "--threads must be at least 1"),
    (("--dtype", "float16"), "invalid choice: 'float16'"),
])
def test_usage_errors(tmp_path, args, message):
    result = run("score", tmp_path, "--model", tmp_path, "--out", tmp_path / "s.parquet", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("hidden, message", [
    (("pyarrow",), "the 'corpus' extra: pip install 'seqpack[corpus]'"),
    # Both at once: it named one, and the other on the next run (review).
    (("pyarrow", "transformers"), "the 'hf' and 'corpus' extras: pip install 'seqpack[hf,corpus]'"),
])
def test_without_its_extras_it_names_them(tmp_path, hidden, message):
    (tmp_path / "a.txt").write_text("hello")
    assert run("pack", tmp_path / "a.txt", "--out", tmp_path / "ds", "--quiet").returncode == 0
    script = (f"import sys\nsys.modules.update(dict.fromkeys({hidden!r}))\nfrom seqpack.cli import main\n"
              "sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", script, "score", str(tmp_path / "ds"), "--model", str(tmp_path),
                             "--out", str(tmp_path / "s.parquet")], capture_output=True, text=True, timeout=120)
    assert one_error_line(result) == f"seqpack: error: seqpack score needs {message}"


#: A score that sends itself ``sys.argv[2]`` at ``sys.argv[1]``, a moment of its run: in
#: the model's second forward, once the file is written (not yet fsynced), at the rename (or link),
#: or while the totals print. ``slow`` says "forward" before each forward and sleeps,
#: for a signal sent from outside. The rest is the command line.
SIGNAL_SCRIPT = """
import os, signal, sys, time
import pyarrow.parquet, transformers
from seqpack import cli
from seqpack.io import scores
moment, number = sys.argv[1], getattr(signal, sys.argv[2])
kill = lambda: os.kill(os.getpid(), number)
forward, write, replace, link, report = (transformers.LlamaForCausalLM.forward, pyarrow.parquet.write_table,
                                         scores.os.replace, scores.os.link, cli._print_score)
calls = []
def forwarding(self, *args, **kwargs):
    calls.append(1)
    if moment == "slow":
        print("forward", file=sys.stderr, flush=True)
        time.sleep(0.3)
    elif moment == "scoring" and len(calls) == 2:
        kill()
    return forward(self, *args, **kwargs)
def writing(table, where, **kwargs):
    write(table, where, **kwargs)
    if moment == "writing":
        kill()
def replacing(source, target):
    if moment == "renaming":
        kill()
    replace(source, target)
def linking(source, target):   # (the publish without --force)
    if moment == "renaming":
        kill()
    link(source, target)
def reporting(*args):
    if moment == "printing":
        kill()
    report(*args)
transformers.LlamaForCausalLM.forward, pyarrow.parquet.write_table = forwarding, writing
scores.os.replace, scores.os.link, cli._print_score = replacing, linking, reporting
sys.exit(cli.main(sys.argv[3:]))
"""


def signalled(moment, number, dataset, model, out, *extra):
    return subprocess.Popen([sys.executable, "-c", SIGNAL_SCRIPT, moment, number, "score", str(dataset), "--model",
                             str(model), "--out", str(out), "--quiet", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def hidden(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("moment, number", [("scoring", "SIGINT"), ("writing", "SIGINT"), ("writing", "SIGTERM"),
                                            ("renaming", "SIGINT"), ("printing", "SIGTERM")])
def test_a_signal_leaves_no_partial_file(corpus, moment, number):
    """Before the rename the file and its temporary sibling are gone; from the rename on
    the file is complete, and the command says so."""
    root, packed, model = corpus
    out = root / f"signalled-{moment}.parquet"
    process = signalled(moment, number, packed, model, out)
    stdout, stderr = process.communicate(timeout=300)
    if moment in ("renaming", "printing"):
        assert (process.returncode, stderr) == (
            0, f"seqpack: {out} is complete: it was written before the signal took effect\n")
        assert parquet.read_table(out).num_rows == sp.open_dataset(packed).occurrence_count
    else:
        status, line = {"SIGINT": (130, "seqpack: interrupted\n"), "SIGTERM": (143, "seqpack: terminated\n")}[number]
        assert (process.returncode, stderr, stdout) == (status, line, "")
        assert not out.exists()
    assert hidden(root) == []


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_ctrl_c_from_outside_while_scoring(corpus):
    root, packed, model = corpus
    out = root / "ctrl-c.parquet"
    process = signalled("slow", "SIGINT", packed, model, out)
    assert process.stderr.readline() == "forward\n"
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr, stdout) == (130, "seqpack: interrupted\n", "")
    assert not out.exists() and hidden(root) == []


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_a_killed_score_leaves_only_a_hidden_sibling_which_the_next_removes(corpus):
    root, packed, model = corpus
    out = root / "killed.parquet"
    process = signalled("writing", "SIGKILL", packed, model, out, "--batches", "2")
    process.communicate(timeout=300)
    assert process.returncode == -signal.SIGKILL
    assert not out.exists()
    (left,) = hidden(root)
    assert left.startswith(".killed.parquet.seqpack-partial-")
    result = run("score", packed, "--model", model, "--out", out, "--batches", 2, "--quiet")
    assert result.returncode == 0, result.stderr
    assert hidden(root) == [] and parquet.read_table(out).num_rows > 0


@pytest.mark.slow
def test_threads_set_torch_and_the_kernels(corpus, tmp_path, monkeypatch):
    import seqpack.hf
    from seqpack import cli
    from seqpack._threads import default_threads

    root, packed, model = corpus
    seen, evaluate = [], seqpack.hf.evaluate

    def spying(*args, **kwargs):
        seen.append((torch.get_num_threads(), default_threads()))
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(seqpack.hf, "evaluate", spying)
    kept = torch.get_num_threads()
    try:
        assert cli.main(["score", str(packed), "--model", str(model), "--out", str(tmp_path / "t.parquet"),
                         "--threads", "1", "--batches", "1", "--quiet"]) == 0
    finally:
        torch.set_num_threads(kept)
    assert seen == [(1, 1)]


def test_score_has_help():
    result = run("score", "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: seqpack score")
    for flag in ("--model", "--out", "--force", "--batches", "--threads", "--dtype", "--quiet", "--json"):
        assert flag in result.stdout
