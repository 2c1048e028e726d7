"""Prompt-completion records to a packed dataset on disk, against TRL's SFT preparation, in one run.

    python bench/bench_sft.py                     # 50,000 records, the table below
    python bench/bench_sft.py --records 20000 --repeats 3 --json

The records are ``{"prompt", "completion"}`` JSONL lines whose word counts are lognormal
(prompt median 40 words, completion median 80, sigma 0.6, ``numpy.random.default_rng(0)``),
words drawn from the Python standard library's sources with their frequencies, and a
byte-level BPE of 2,000 tokens trained here on the first 5,000 records (all untimed).
Same records and tokenizer for every method, one process, ``--threads`` threads (default 2):
seqpack's ``threads=`` and the tokenizers pool (``RAYON_NUM_THREADS``, set before it starts),
which the floor and TRL use:

- **seqpack**: ``seqpack.io.pack_corpus`` of the JSONL file (TRL's boundary rule,
  completion-only loss, best-fit-decreasing at capacity 2048) to a dataset on disk, checksums,
  fsync and publish; then, as its own row, ``verify_dataset`` of it.
- **TRL**: ``trl.SFTTrainer(...)`` constructed over the records as a ``datasets.Dataset``
  with ``packing=True, packing_strategy="bfd", completion_only_loss=True``: its own dataset
  preparation (add EOS, tokenize, build the labels, pack), reached through its public API;
  and, as its own row, the same construction over the first 10 records: TRL's fixed cost
  (the trainer, the accelerator, the model on its device), which the TRL row includes.
- **floor**: what TRL's rule needs encoded, every prompt and every prompt + completion,
  by ``Tokenizer.encode_batch_fast`` on texts already in memory.

Printed: each median, tokens per second, the ratios, the dataset's bytes per token, and
the issue's targets (seqpack within 1.25x of the floor, at least 3.5x TRL, at most 2.4
bytes per token). The CPU, the load average before and after and the peak RSS head the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from timing import conditions, positive

CAPACITY = 2048
ROWS = 8
VOCABULARY = 2000
SPECIALS = ["<unk>", "<|bos|>", "<|eos|>", "<|pad|>"]


def words_of_the_stdlib(files: int = 200) -> tuple[list[str], np.ndarray]:
    """Words of the first ``files`` standard-library sources and their frequencies."""
    from seqpack.data.corpus import stdlib_sources

    counts: dict[str, int] = {}
    for path in stdlib_sources()[:files]:
        for word in re.findall(r"[A-Za-z]{2,}", Path(path).read_text(encoding="utf-8", errors="replace")):
            counts[word] = counts.get(word, 0) + 1
    words = sorted(counts)
    weights = np.array([counts[w] for w in words], dtype=np.float64)
    return words, weights / weights.sum()


def make_records(count: int) -> list[dict]:
    rng = np.random.default_rng(0)
    words, weights = words_of_the_stdlib()
    lengths = np.clip(rng.lognormal(np.log([40, 80]), 0.6, (count, 2)).astype(int), 1, 700)
    drawn = rng.choice(len(words), int(lengths.sum()), p=weights)
    texts, at = [], 0
    for prompt, completion in lengths.tolist():
        texts.append((" ".join(words[i] for i in drawn[at: at + prompt]) + "\nAnswer:",
                      " " + " ".join(words[i] for i in drawn[at + prompt: at + prompt + completion])))
        at += prompt + completion
    return [{"prompt": p, "completion": c} for p, c in texts]


def train_tokenizer(records: list[dict], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIALS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCABULARY, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((r["prompt"] + r["completion"] for r in records[:5000]), trainer)
    tokenizer.save(str(path))


def median(call, repeats: int, before=None) -> float:
    """The median of ``repeats`` timed calls after one untimed call (``before`` runs untimed before each)."""
    seconds = []
    for index in range(repeats + 1):
        if before is not None:
            before()
        start = time.perf_counter()
        call()
        if index:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def seqpack_rows(work: Path, source: Path, tokenizer_path: Path, threads: int, repeats: int):
    import seqpack as sp
    from seqpack import io

    tokenizer = io.TokenizerFile(tokenizer_path, bos="<|bos|>", eos="<|eos|>")
    binding = sp.BatchBinding.for_tokenizer(tokenizer.identity, split="corpus")
    out = work / "packed"

    def pack():
        return io.pack_corpus([io.reader_for(source)], out, binding=binding, tokenizer=tokenizer,
                              config=sp.PackConfig(CAPACITY, ROWS), policy="best-fit-decreasing", force=True,
                              threads=threads)

    packed = median(pack, repeats)
    verified = median(lambda: io.verify_dataset(out), repeats)
    manifest = json.loads((out / "manifest.json").read_text())
    disk = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    return packed, verified, manifest, disk


def floor_seconds(records: list[dict], tokenizer_path: Path, repeats: int) -> float:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    prompts = [r["prompt"] for r in records]
    joint = [r["prompt"] + r["completion"] for r in records]

    def encode():
        tokenizer.encode_batch_fast(prompts, add_special_tokens=False)
        tokenizer.encode_batch_fast(joint, add_special_tokens=False)

    return median(encode, repeats)


def trl_seconds(work: Path, records: list[dict], tokenizer_path: Path, repeats: int,
                fixed_repeats: int) -> tuple[float, float]:
    """TRL's preparation of ``records``, and of their first 10 (its fixed cost)."""
    import datasets
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    datasets.disable_caching()
    processing = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path), bos_token="<|bos|>",
                                         eos_token="<|eos|>", pad_token="<|pad|>", unk_token="<unk>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    dataset, few = datasets.Dataset.from_list(records), datasets.Dataset.from_list(records[:10])
    config = SFTConfig(output_dir=str(work / "trl"), packing=True, packing_strategy="bfd", max_length=CAPACITY,
                       completion_only_loss=True, report_to=[], use_cpu=True, bf16=False,
                       dataset_num_proc=None, disable_tqdm=True)

    def prepare(records):
        return lambda: SFTTrainer(model=model, args=config, train_dataset=records, processing_class=processing)

    return median(prepare(dataset), repeats), median(prepare(few), fixed_repeats)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=positive, default=50_000)
    parser.add_argument("--repeats", type=positive, default=3, help="timed runs of seqpack and the floor")
    parser.add_argument("--trl-repeats", type=positive, default=1, help="timed runs of TRL (each is long)")
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # the tokenizers pool, before it starts
    header = conditions()
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        records = make_records(args.records)
        source = work / "sft.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        tokenizer_path = work / "tokenizer.json"
        train_tokenizer(records, tokenizer_path)
        packed, verified, manifest, disk = seqpack_rows(work, source, tokenizer_path, args.threads, args.repeats)
        floor = floor_seconds(records, tokenizer_path, args.repeats)
        trl, trl_fixed = trl_seconds(work, records, tokenizer_path, args.trl_repeats, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tokens = manifest["counts"]["tokens"]
    result = {
        "conditions": header, "load_before": load_before, "load_after": os.getloadavg(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "records": args.records, "tokens": tokens, "supervised_targets": manifest["counts"]["supervised_targets"],
        "mismatched_prompts": manifest["supervision"]["mismatched_prompts"], "threads": args.threads,
        "seconds": {"seqpack pack": packed, "seqpack verify": verified, "floor": floor, "trl": trl},
        "trl_fixed_seconds": trl_fixed, "bytes_on_disk": disk, "bytes_per_token": disk / tokens,
    }
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return result
    seconds = result["seconds"]
    print(f"{header}; load after {' '.join(f'{v:.2f}' for v in result['load_after'])}; "
          f"peak RSS {result['peak_rss_mib']:.0f} MiB; --threads {args.threads}: seqpack's threads= and "
          f"the tokenizers pool (RAYON_NUM_THREADS) of the floor and TRL")
    print(f"{args.records:,} prompt-completion records, {tokens:,} tokens "
          f"({result['supervised_targets']:,} supervised targets, {result['mismatched_prompts']:,} prompts no prefix), "
          f"BPE of {VOCABULARY}, capacity {CAPACITY}, best-fit-decreasing; medians of {args.repeats} "
          f"(TRL: {args.trl_repeats}; its 10-record fixed cost: {args.repeats}) after one untimed run\n")
    print("| method | s | M tokens/s | vs floor | TRL / it |")
    print("| --- | --- | --- | --- | --- |")
    rows = [("seqpack `pack_corpus`: JSONL to a packed dataset on disk", seconds["seqpack pack"]),
            ("seqpack `verify_dataset` of it", seconds["seqpack verify"]),
            ("seqpack pack + verify", seconds["seqpack pack"] + seconds["seqpack verify"]),
            ("TRL `SFTTrainer` dataset preparation (tokenize, labels, bfd)", seconds["trl"]),
            ("floor: `encode_batch_fast` of prompts and prompt + completion", seconds["floor"])]
    for name, value in rows:
        print(f"| {name} | {value:.2f} | {tokens / value / 1e6:.2f} | {value / seconds['floor']:.2f}x | "
              f"{seconds['trl'] / value:.2f}x |")
    print(f"| TRL's fixed cost: the same construction over 10 records (in the TRL row) | {trl_fixed:.2f} | - | "
          f"{trl_fixed / seconds['floor']:.2f}x | - |")
    to_floor, over_trl = seconds["seqpack pack"] / seconds["floor"], seconds["trl"] / seconds["seqpack pack"]
    print(f"\non disk: {disk:,} bytes = {result['bytes_per_token']:.3f} bytes/token")
    print(f"targets: within 1.25x of the floor: {to_floor:.2f}x ({'met' if to_floor <= 1.25 else 'not met'}); "
          f"at least 3.5x TRL: {over_trl:.2f}x ({'met' if over_trl >= 3.5 else 'not met'}; "
          f"{(seconds['trl'] - trl_fixed) / seconds['seqpack pack']:.2f}x without TRL's fixed cost); "
          f"at most 2.4 bytes/token: {result['bytes_per_token']:.3f} "
          f"({'met' if result['bytes_per_token'] <= 2.4 else 'not met'})")
    return result


if __name__ == "__main__":
    main()
