"""Helpers shared by the tests: what more than one test module builds, runs or checks.

Only what several modules use lives here; a module's own builders stay in it. Optional
dependencies (tokenizers, transformers, TRL, PyTorch) are imported inside the helpers that
need them, so that importing this module needs only numpy, pytest, hypothesis and seqpack.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import strategies as st

import seqpack as sp


# --- finite differences -------------------------------------------------------------


def numerical_gradient(objective: Callable[[], float], array: np.ndarray, step: float = 1e-6) -> np.ndarray:
    """Central differences ``(f(x + h) - f(x - h)) / 2h`` of ``objective()`` in each entry of ``array``.

    ``array`` (C-contiguous, so that its flat view aliases it) is perturbed in place, one
    entry at a time, and restored exactly.
    """
    if not array.flags.c_contiguous:
        raise AssertionError("numerical_gradient needs a C-contiguous array")
    gradient = np.zeros(array.shape)
    flat = array.reshape(-1)
    for index in range(flat.size):
        saved = flat[index]
        flat[index] = saved + step
        upper = objective()
        flat[index] = saved - step
        lower = objective()
        flat[index] = saved
        gradient.reshape(-1)[index] = (upper - lower) / (2 * step)
    return gradient


# --- range attention: the permission rule and row layouts -----------------------------


def permitted(valid_lengths, segment_starts):
    """Dense [rows, T, T] permission and [rows, T] activity, straight from the rule."""
    width = segment_starts.shape[1]
    column = np.arange(width)
    active = column[None, :] < np.asarray(valid_lengths)[:, None]  # [rows, T]
    starts = np.where(active, segment_starts, 0)
    keys, queries = column[None, None, :], column[None, :, None]
    mask = (  # [rows, T(query), T(key)]
        active[:, :, None] & active[:, None, :] & (keys >= starts[:, :, None]) & (keys <= queries)
    )
    return mask, active


def assert_close(actual, expected, name):
    """``|a - b| <= 1e-10 + 1e-9 * max(|a|, |b|)`` everywhere; a failure names the first index that is not."""
    actual, expected = np.atleast_1d(actual), np.atleast_1d(expected)  # argwhere finds nothing in a 0-d array
    limit = 1e-10 + 1e-9 * np.maximum(np.abs(actual), np.abs(expected))
    bad = np.argwhere(~(np.abs(actual - expected) <= limit))
    assert bad.size == 0, f"{name} differs at {tuple(bad[0])}: {actual[tuple(bad[0])]} vs {expected[tuple(bad[0])]}"


def starts_from_lengths(segment_lengths, width, rng):
    """One row's starts for consecutive segments; inactive columns hold junk."""
    row = rng.integers(-5, width + 5, size=width)
    column = 0
    for length in segment_lengths:
        row[column : column + length] = column
        column += length
    return row, column


def mixed_layout(width, rng):
    """Rows: one segment filling the row, all padding, one-token segments, random cuts."""
    rows = []
    rows.append([width])
    rows.append([])
    rows.append([1] * min(width, 5))
    cuts, left = [], int(rng.integers(0, width + 1))
    while left:
        length = int(rng.integers(1, left + 1))
        cuts.append(length)
        left -= length
    rows.append(cuts)
    starts = np.empty((len(rows), width), dtype=np.int64)
    lengths = np.empty(len(rows), dtype=np.int64)
    for r, segment_lengths in enumerate(rows):
        starts[r], lengths[r] = starts_from_lengths(segment_lengths, width, rng)
    return lengths, starts


# --- example tables and their batches -------------------------------------------------

BIG = 1 << 30
BATCH_FIELDS = ("inputs", "targets", "positions", "segments", "segment_starts",
                "token_valid", "target_valid", "loss_mask", "valid_lengths")


def flat(documents):
    """``(token_ids, offsets)`` of documents given as token lists."""
    sizes = [len(d) for d in documents]
    tokens = np.concatenate([np.asarray(d, dtype=np.int64) for d in documents]) if documents else []
    return tokens, np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


def predicting(lengths):
    """Whole framed documents with the given prediction counts (each at least 2)."""
    return [[0, *(10 + k % 200 for k in range(n - 1)), 1] for n in lengths]


def table_of(texts, binding, **options):
    """A table over ``texts`` (token lists); ``options`` are ``from_arrays`` keywords."""
    return sp.ExampleTable.from_arrays(*flat(texts), binding, **options)


def example_list(documents, binding, ranges=None, which=None, ids=None):
    """The SequenceExample list equivalent to ``ExampleTable.from_arrays`` with the same arguments."""
    if ranges is None:
        ranges = [(0, len(d)) for d in documents]
    if which is None:
        which = range(len(ranges))
    docs = [sp.BatchDocument(f"d{i}", d) for i, d in enumerate(documents)]
    names = ids if ids is not None else [f"#{i}" for i in range(len(ranges))]
    return [sp.SequenceExample.from_range(name, docs[d], tuple(r), binding)
            for name, d, r in zip(names, which, ranges)]


@st.composite
def corpora(draw, max_documents=6, max_content=16):
    """Random framed documents and examples over them.

    Returns ``(documents, options)``: ``options`` are ``from_arrays`` keywords, with
    whole documents, one range per document, or ranges mapped to documents (reused).
    """
    count = draw(st.integers(1, max_documents))
    documents = [[0, *draw(st.lists(st.integers(2, 265), min_size=1, max_size=max_content)), 1]
                 for _ in range(count)]
    mode = draw(st.sampled_from(["whole", "ranges", "mapped"]))
    options = {}
    if mode != "whole":
        which = (list(range(count)) if mode == "ranges"
                 else draw(st.lists(st.integers(0, count - 1), min_size=1, max_size=10)))
        ranges = []
        for d in which:
            size = len(documents[d])
            start = draw(st.integers(0, size - 2))
            ranges.append([start, draw(st.integers(start + 2, size))])
        options["ranges"] = ranges
        if mode == "mapped":
            options["documents"] = which
    examples = len(options.get("ranges", documents))
    if draw(st.booleans()):
        options["ids"] = [f"x{i}" for i in range(examples)]
    return documents, options


def both_paths(documents, options, binding):
    """The table and the equivalent SequenceExample list."""
    table = table_of(documents, binding, **options)
    examples = example_list(documents, binding, options.get("ranges"), options.get("documents"),
                            options.get("ids"))
    return table, examples


def assert_same_batches(left, right):
    """Equal field arrays, occurrences and shapes, batch by batch; every batch verifies."""
    left, right = list(left), list(right)
    assert len(left) == len(right)
    for a, b in zip(left, right):
        assert a.shape == b.shape
        for field in BATCH_FIELDS:
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
        assert a.occurrences == b.occurrences
        a.verify()
        b.verify()


def random_table(lengths, binding, seed=0):
    """Whole-document examples with the given prediction counts (each at least 2) and random content."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths + 1)))
    tokens = rng.integers(2, 266, size=int(offsets[-1]), dtype=np.int32)
    tokens[offsets[:-1]] = 0
    tokens[offsets[1:] - 1] = 1
    return sp.ExampleTable.from_arrays(tokens, offsets, binding)


def plan(count=60, seed=3):
    """A plan of about 20 one-row batches with uneven target counts."""
    from packed_cases import packed_plan, random_predictions

    return packed_plan(random_predictions(np.random.default_rng(seed), count, 12), 16, 1, seed)


def ids(items) -> list:
    """Each batch item named by the first segment of each of its rows (unique per batch)."""
    return [tuple(item["segments"][:, 0].tolist()) for item in items]


# --- the reference decoder ------------------------------------------------------------


def randomize(decoder, rng):
    """Random parameters in place: each norm near 1, every other weight drawn around 0."""
    for name, value in decoder.named_parameters().items():
        if name.endswith("norm"):
            value[...] = 1.0 + rng.normal(0.0, 0.2, value.shape)
        else:
            value[...] = rng.normal(0.0, 0.4, value.shape)


# --- files: JSONL, Megatron, sealed manifests ------------------------------------------


def write_jsonl(path, records, blank_lines=False):
    """A JSONL file of ``records`` (dicts, one a line) at ``path``; returns the path.

    Every other line keeps its non-ASCII characters and the rest escape them, so that a
    reader meets both spellings; ``blank_lines`` puts an empty line between records."""
    lines = [json.dumps(record, ensure_ascii=bool(i % 2)) + "\n" for i, record in enumerate(records)]
    path.write_text(("\n" if blank_lines else "").join(lines), encoding="utf-8")
    return path


def pyarrow():
    """pyarrow, or the test skipped (the corpus extra)."""
    return pytest.importorskip("pyarrow",
                               reason="Parquet and Arrow need the corpus extra: pip install 'seqpack[corpus]'")


def datasets_library():
    """``datasets`` with its progress bars off, or the test skipped (the bench extra)."""
    datasets = pytest.importorskip("datasets", reason="save_to_disk directories come from the bench extra: "
                                                      "pip install 'seqpack[bench]'")
    datasets.disable_progress_bars()
    return datasets


def write_parquet(path, records, **options):
    """A Parquet file of ``records`` (dicts) at ``path``; returns the path."""
    pa = pyarrow()
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path, **options)
    return path


def write_saved(path, records, num_shards=3):
    """A ``datasets.Dataset.save_to_disk`` directory of ``records`` in ``num_shards`` files; returns the path."""
    datasets = datasets_library()
    columns = {key: [record[key] for record in records] for key in records[0]}
    datasets.Dataset.from_dict(columns).save_to_disk(str(path), num_shards=num_shards)
    return path


def write_megatron(prefix, documents, dtype=np.uint16):
    """A Megatron indexed dataset ``PREFIX.idx/.bin`` (the layout of ECOSYSTEM.md)."""
    from seqpack.io.readers import MEGATRON_DTYPES, MEGATRON_MAGIC

    dtype = np.dtype(dtype)
    code = {np.dtype(v): k for k, v in MEGATRON_DTYPES.items()}[dtype]
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize)))
    with open(f"{prefix}.bin", "wb") as handle:
        for document in documents:
            handle.write(np.asarray(document, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as handle:
        handle.write(MEGATRON_MAGIC + (1).to_bytes(8, "little") + bytes([code]))
        handle.write(len(documents).to_bytes(8, "little") + (len(documents) + 1).to_bytes(8, "little"))
        handle.write(lengths.tobytes() + pointers.astype(np.int64).tobytes()
                     + np.arange(len(documents) + 1, dtype=np.int64).tobytes())


def reseal(directory, manifest: dict) -> None:
    """Write ``manifest`` (edited on purpose) into the dataset at ``directory``, sealed
    again, so that a test reaches the checks behind the seal."""
    from pathlib import Path

    from seqpack.io import format as fmt

    (Path(directory) / fmt.MANIFEST).write_text(json.dumps(fmt.seal(manifest)))


# --- tokenizers trained here, and TRL's preparation as an oracle ----------------------


def train_bpe(directory, lines, vocab_size: int = 320,
              specials=("<unk>", "<|bos|>", "<|eos|>", "<|pad|>")):
    """A byte-level BPE trained on ``lines``, saved as ``directory/tokenizer.json``; returns the path."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = Path(directory)
    corpus = directory / "bpe-train.txt"
    corpus.write_text("\n".join(lines), encoding="utf-8")
    tokenizer = Tokenizer(models.BPE(unk_token=specials[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(corpus)], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def train_tokenizer(texts, path):
    """A byte-level BPE (``<s>`` and ``</s>`` its BOS and EOS) trained on ``texts``, saved as
    ``path/tokenizer.json`` and opened as a ``TokenizerFile``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from seqpack.io.tokenizer_file import TokenizerFile

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    source = path / "corpus.txt"
    source.write_text("\n".join(texts))
    tokenizer.train([str(source)], trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    return TokenizerFile(path / "tokenizer.json", bos="<s>", eos="</s>")


CHAT_BPE_CORPUS = [
    "Question: what is two plus two? Answer: four.",
    "hello world, hello there, world peace",
    "The quick brown fox jumps over the lazy dog.",
    "unbelievable understanding underneath",
    "Ünïcödé text survives",
    "ab ba aab abba  baab a.b ab. ba. aa bb",
    'weather? sunny {"city": "Paris"} get_weather It is sunny.',
] * 20
CHAT_BPE_SPECIALS = ["<unk>", "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def train_chat_bpe(root, name: str, bos_post_processor: bool):
    """A byte-level BPE trained on ``CHAT_BPE_CORPUS`` with the chat specials, saved as
    ``root/NAME.json``; with ``bos_post_processor``, one that adds BOS as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus = root / "train.txt"
    corpus.write_text("\n".join(CHAT_BPE_CORPUS))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=CHAT_BPE_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(corpus)], trainer)
    if bos_post_processor:  # Llama's: "<s> $A"
        bos = tokenizer.token_to_id("<|bos|>")
        tokenizer.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                                 special_tokens=[("<|bos|>", bos)])
    path = root / f"{name}.json"
    tokenizer.save(str(path))
    return path


#: Chat templates that end each assistant turn with EOS, as real ones do; each marks the assistant's tokens.
TEMPLATES = {
    # ChatML, packed with --eos '<|im_end|>': every turn ends with it.
    "chatml": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
               "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}"
               "<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    # Zephyr: an EOS after every turn, the user's too.
    "zephyr": ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}"
               "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{{ eos_token }}"
               "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    # Llama 2: a BOS before every user turn and an EOS after every answer.
    "llama2": ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ m['content'] }} [/INST]"
               "{% elif m['role'] == 'assistant' %}{% generation %} {{ m['content'] }} {{ eos_token }}"
               "{% endgeneration %}{% else %}<<SYS>>{{ m['content'] }}<</SYS>>{% endif %}{% endfor %}"),
    # Tool calls rendered from the message's own keys, the tools list from the record.
    "tools": ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}<{{ m['role'] }}>"
              "{% if m['role'] == 'assistant' %}{% generation %}{% if m['tool_calls'] %}"
              "{{ m['tool_calls'] | tojson }}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}"
              "{% endgeneration %}{% else %}{{ m['content'] }}{% if m['name'] %} ({{ m['name'] }}){% endif %}"
              "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello world"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox?"},
     {"role": "assistant", "content": "lazy dog"}, {"role": "user", "content": "ok"},
     {"role": "assistant", "content": "four."}],
    [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}],  # an empty answer
]
TOOL_CALL = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny", "name": "get_weather"},
             {"role": "assistant", "content": "It is sunny."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather of a city"}}]


def trl_rows(bound, tmp_path, records, *, template=None, eos="<|eos|>", preference=False, **config):
    """TRL's own preparation of ``records``: the rows of a constructed ``SFTTrainer``'s train
    dataset (``DPOTrainer``'s with ``preference``, given a reference model)."""
    pytest.importorskip("torch", reason="TRL needs PyTorch: pip install 'seqpack[hf]'")
    datasets = pytest.importorskip("datasets", reason="TRL's datasets come with the bench extra: "
                                                      "pip install 'seqpack[bench]'")
    trl = pytest.importorskip("trl", reason="the TRL oracle needs the bench extra: pip install 'seqpack[bench]'")
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    processing = PreTrainedTokenizerFast(tokenizer_file=str(bound.path), eos_token=eos, pad_token="<|pad|>",
                                         bos_token=bound.token_text(bound.bos_id))
    processing.chat_template = template
    model = LlamaForCausalLM(LlamaConfig(vocab_size=bound.vocabulary_size, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    settings, trainer, more = trl.SFTConfig, trl.SFTTrainer, {}
    if preference:
        settings, trainer, more = trl.DPOConfig, trl.DPOTrainer, {"ref_model": LlamaForCausalLM(model.config)}
    args = settings(output_dir=str(tmp_path), report_to=[], max_length=None, use_cpu=True, bf16=False, **config)
    prepared = trainer(model=model, args=args, processing_class=processing,
                       train_dataset=datasets.Dataset.from_list(records), **more)
    return list(prepared.train_dataset)


# --- the seqpack command --------------------------------------------------------------


def seqpack_command():
    """The console script installed beside this interpreter."""
    script = shutil.which("seqpack", path=os.path.dirname(sys.executable))
    assert script, "the seqpack console script is not installed beside this Python (pip install the package)"
    return script


def run(*args, timeout=300, stdout=subprocess.PIPE, env=None, cwd=None):
    """``seqpack ARGS...`` run as a user runs it; stderr (and stdout unless told otherwise) captured as text."""
    return subprocess.run([seqpack_command(), *map(str, args)], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def one_error_line(result, status=1):
    """The one ``seqpack: error: ...`` line of a run that exited with ``status``."""
    assert result.returncode == status, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("seqpack: error: "), result.stderr
    return lines[0]


# --- distributed: gloo ranks on loopback ------------------------------------------------


def run_on_gloo_ranks(check: Callable[[int, int], None], world_size: int = 2) -> None:
    """``check(rank, world_size)`` in ``world_size`` spawned processes joined by a ``gloo``
    group on loopback; an assertion that fails in any rank fails the caller with its traceback.

    ``check`` must be a module-level function (it is pickled by name)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_gloo_rank, args=(world_size, port, check), nprocs=world_size, join=True)


def _gloo_rank(rank: int, world_size: int, port: int, check: Callable[[int, int], None]) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        check(rank, world_size)
        dist.barrier()  # no rank tears gloo down while its peer still talks to it
    finally:
        dist.destroy_process_group()
    # End as a forked multiprocessing child ends, without the interpreter's teardown: a gloo
    # worker thread may still hold a finished collective's tensors, and dropping them takes
    # the GIL, which finalization refuses by ending the thread inside C++ (std::terminate,
    # SIGABRT: about once in a hundred runs under load with torch 2.13, seen in a core dump).
    os._exit(0)


def supervised_table(lengths, seed, binding, *, ids=False):
    """Whole framed documents of ``lengths`` predictions (at least 2), random content, and a
    random supervision leaving each example at least one supervised target (``ids``: named
    ``doc-0``, ``doc-1``...)."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(np.asarray(lengths, dtype=np.int64), 2)
    offsets = np.concatenate(([0], np.cumsum(lengths + 1)))
    tokens = rng.integers(2, 258, size=int(offsets[-1]), dtype=np.int32)
    tokens[offsets[:-1]], tokens[offsets[1:] - 1] = 0, 1
    supervised = rng.random(tokens.shape[0]) < rng.uniform(0.2, 1.0)
    supervised[offsets[:-1] + 1 + rng.integers(0, lengths)] = True
    names = [f"doc-{i}" for i in range(len(lengths))] if ids else None
    return sp.ExampleTable.from_arrays(tokens, offsets, binding, supervised=supervised, ids=names)


def preference_table(lengths, seed, binding, *, ids=False):
    """Preference pairs as DPO makes them: examples ``2p`` and ``2p + 1`` (``lengths`` of them,
    an even count, each at least 1 prediction) are pair ``p``'s chosen and rejected
    sequences, the ranges ``[0, n + 1)`` of documents ``[BOS, content..., EOS]`` that share a
    random prompt (BOS first) and are supervised on the rest, their completion (``ids``:
    named ``c0``, ``r0``, ``c1``...)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    documents, supervised, ranges = [], [], []
    for chosen, rejected in lengths.reshape(-1, 2).tolist():
        prompt = [0, *rng.integers(2, 258, size=int(rng.integers(0, min(chosen, rejected)))).tolist()]
        for n in (chosen, rejected):
            documents.append([*prompt, *rng.integers(2, 258, size=n + 1 - len(prompt)).tolist(), 1])
            supervised.append([False] * len(prompt) + [True] * (n + 2 - len(prompt)))
            ranges.append((0, n + 1))
    names = [f"{'cr'[i % 2]}{i // 2}" for i in range(len(lengths))] if ids else None
    return sp.ExampleTable.from_arrays(*flat(documents), binding, ranges=ranges, supervised=np.concatenate(supervised),
                                       ids=names)
