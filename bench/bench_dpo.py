"""One DPO step on the CPU: seqpack's packed preference pairs against TRL's padded ``DPOTrainer`` step.

    python bench/bench_dpo.py                          # 16 pairs, 3 rounds
    python bench/bench_dpo.py --pairs 32 --repeats 5 --json

Needs the ``hf`` and ``bench`` extras (transformers, TRL, datasets); ``HF_HUB_OFFLINE`` is set,
nothing is downloaded.

``--pairs`` preference pairs from ``numpy.random.default_rng(0)``: prompt lengths lognormal
(median 120 tokens, sigma 0.8, clipped to [4, 512]), chosen and rejected completion lengths
drawn apart from another lognormal (median 180, sigma 0.8, the EOS included, clipped to at
least 2 and to at most 1024 tokens with the prompt: the prompt and sequence limits of TRL's
former defaults, ``max_prompt_length=512`` and ``max_length=1024``), random content tokens
(``default_rng(1)``); about 4% of the prompts and 3% of the completions are clipped above. A word-level tokenizer (vocabulary 512: pad 0, EOS 1, one
word per content ID) turns them into the ``prompt``/``chosen``/``rejected`` text records TRL
1.16 takes (its ``DPOTrainer`` refuses records that carry only ``prompt_ids``, ``chosen_ids``
and ``rejected_ids``: its ``extract_prompt`` reads ``chosen``); every completion ends with the
EOS text, so TRL appends none, and its tokenization gives back exactly the generated IDs
(checked). The policy is a random ``LlamaForCausalLM`` (hidden 256, 4 layers, 8 heads,
intermediate 688, vocabulary 512, float32) and the reference a copy whose weights are each
scaled by ``1 + 0.1 * N(0, 1)`` (with identical weights the loss would be log 2 whatever the
log-probabilities); each method has its own policy and reference, with the same weights. The
step: the policy's forward and backward and the reference's forward over all the pairs at
once, DPO sigmoid loss, beta 0.1:

- ``TRL padded``: TRL's own step. A real ``trl.DPOTrainer`` (``DPOConfig``: a per-device batch
  of all the pairs, ``loss_type="sigmoid"``, ``beta=0.1``, no truncation (``max_length=None``),
  no precomputed reference, activation checkpointing off (TRL's default is on; seqpack's step
  has none), float32 on the CPU) builds its padded batch with its own collator
  (``DataCollatorForPreference``: ``2 * pairs`` rows, chosen then rejected, right-padded to
  the longest); the step is ``trainer.compute_loss(policy, batch)`` (TRL's fused LM head, its
  loss code and its metrics) and ``loss.backward()``, sdpa attention.
- ``seqpack packed``: the same trainer and options made packed as a user makes them:
  ``seqpack.hf.PackedDPO`` mixed in, ``seqpack.hf.PreferenceCollator`` as its collator
  (best-fit-decreasing by pairs: chosen and rejected side by side in one row, rows of 2048
  predictions), ``attn_implementation="seqpack"``. The same ``compute_loss`` and ``backward()``:
  the policy and the reference run on the packed rows, each pair's sums come from
  ``seqpack.torch.pair_logprobs``, TRL's own code computes the loss and the metrics from them.

Each round runs every method's step once, in turn, so load changes hit both; figures are
medians over rounds and the ratio the median of per-round ratios (target: seqpack at least
1.5x TRL). The two losses and every pair's chosen and rejected log-probabilities (TRL's from
its own ``compute_ref_log_probs`` run on the policy) are compared. In float32 the sums (some
hundreds of nats) agree to about 1e-6 relative; the loss reads
``(chosen - reference chosen) - (rejected - reference rejected)``, a few nats left of such sums,
so cancellation leaves it about 1e-4 relative (past ``LOSS_AGREEMENT`` or ``LOGPS_AGREEMENT`` the
script stops and reports no timing). Reported beside them: the cells each step computes (TRL: ``2 * pairs``
rows times the padded width, and the real tokens among them; seqpack: rows times 2048, and the
real cells), the peak memory each step adds, measured alone in a fresh process per method (the
growth of the resident set above the one before, on Linux, after a first small step), the CPU,
the threads, the load average before and after, and the peak RSS.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from timing import arguments, check_agreement

CAPACITY = 2048
VOCABULARY = 512
PAD, EOS = 0, 1
BETA = 0.1
PROMPT = (120, 0.8, 4, 512)     # tokens: median, sigma, clipped to [low, high]
COMPLETION = (180, 0.8, 2)       # tokens, the EOS included: median, sigma, at least; at most SEQUENCE - prompt
SEQUENCE = 1024                  # prompt + completion at most: a pair fills at most 2046 of a row's 2048 predictions
METHODS = ("TRL padded", "seqpack packed")
ID_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")
#: The largest relative differences between the two steps (float32; see above): the loss, each pair's sums.
LOSS_AGREEMENT, LOGPS_AGREEMENT = 1e-3, 1e-4


def preference_pairs(count: int) -> list[dict]:
    """``count`` pairs of token IDs (``prompt_ids``, ``chosen_ids``, ``rejected_ids``), each
    completion ending with the EOS; content IDs in [2, VOCABULARY). The first ``k`` pairs are
    the same for every ``count`` >= ``k``."""
    (p_median, p_sigma, p_low, p_high), (c_median, c_sigma, c_low) = PROMPT, COMPLETION
    normal = np.random.default_rng(0).standard_normal((count, 3))       # prompt, chosen, rejected
    prompts = np.clip(np.rint(p_median * np.exp(p_sigma * normal[:, 0])), p_low, p_high).astype(int)
    completions = np.clip(np.rint(c_median * np.exp(c_sigma * normal[:, 1:])), c_low,
                          (SEQUENCE - prompts)[:, None]).astype(int)
    content = np.random.default_rng(1)

    def ids(n):
        return content.integers(2, VOCABULARY, size=n).tolist()

    return [{"prompt_ids": ids(p), "chosen_ids": ids(c - 1) + [EOS], "rejected_ids": ids(r - 1) + [EOS]}
            for p, (c, r) in zip(prompts, completions)]


def word_tokenizer():
    """A ``PreTrainedTokenizerFast`` with one word per ID: ``<pad>`` 0, ``<eos>`` 1, ``w2`` ... ``w511``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, VOCABULARY)}}
    words = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def text_records(pairs: list[dict]) -> list[dict]:
    """The pairs as the text records ``DPOTrainer`` tokenizes back into the same IDs."""
    def words(ids):
        return "".join("<eos>" if i == EOS else f" w{i}" for i in ids)

    return [{"prompt": words(p["prompt_ids"]).lstrip(), "chosen": words(p["chosen_ids"]),
             "rejected": words(p["rejected_ids"])} for p in pairs]


def tokenizer_identity(tokenizer):
    """The seqpack identity of ``word_tokenizer()``: no BOS, EOS 1, the digest of its JSON."""
    import seqpack as sp

    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    return sp.TokenizerIdentity.external(VOCABULARY, None, EOS, digest)


def policy_and_reference(attention: str):
    """The random policy (train mode) and its reference (eval mode, no gradients), both using
    ``attention``: the reference's weights are the policy's, each scaled by ``1 + 0.1 * N(0, 1)``
    (``torch`` seed 1), so that the loss is not log 2 by construction and comparing it tells
    something. The same weights for every method."""
    import torch

    import seqpack.hf as hf
    from seqpack.bench.train import make_model

    policy, reference = (make_model(torch, hf, layers=4) for _ in range(2))  # seeded: the same weights
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in reference.parameters():
            weight.mul_(1 + 0.1 * torch.randn(weight.shape, generator=noise))
    for model in (policy, reference):
        model.set_attn_implementation(attention)
    reference.eval().requires_grad_(False)
    return policy.train(), reference


class DPOStep:
    """A ``trl.DPOTrainer`` over the pairs (its own preparation of their text records) and its step.

    Subclasses name the attention implementation, the trainer class and the collator: the
    step is always TRL's ``compute_loss`` on the collator's batch and ``backward()``."""

    attention = "sdpa"

    def trainer_class(self):
        from trl import DPOTrainer

        return DPOTrainer

    def collator(self, tokenizer, pairs: int):
        """The trainer's ``data_collator`` (None: TRL's own)."""
        return None

    def __init__(self, pairs: list[dict], workdir: str):
        import datasets
        from trl import DPOConfig

        datasets.disable_progress_bars()
        tokenizer = word_tokenizer()
        self.policy, reference = policy_and_reference(self.attention)
        args = DPOConfig(output_dir=workdir, per_device_train_batch_size=len(pairs), loss_type="sigmoid", beta=BETA,
                         report_to="none", max_length=None, precompute_ref_log_probs=False,
                         activation_checkpointing=False, use_cpu=True, bf16=False)
        self.trainer = self.trainer_class()(
            model=self.policy, ref_model=reference, args=args, processing_class=tokenizer,
            data_collator=self.collator(tokenizer, len(pairs)),
            train_dataset=datasets.Dataset.from_list(text_records(pairs)))
        self.features = [{key: record[key] for key in ID_KEYS} for record in self.trainer.train_dataset]
        if self.features != pairs:
            raise AssertionError("TRL's preparation changed the generated pairs' token IDs")

    def collate(self, features: list[dict]) -> dict:
        return self.trainer.data_collator(features)

    def step(self, batch: dict) -> float:
        """The policy's forward and backward and the reference's forward: the loss."""
        self.policy.zero_grad(set_to_none=True)
        loss = self.trainer.compute_loss(self.policy, batch)
        loss.backward()
        self.trainer._metrics["train"].clear()  # TRL's log() clears them; no step here logs
        return loss.item()

    def logps(self, batch: dict):
        """Each pair's chosen and rejected log-probability sums under the policy (float64
        ``[pairs]``), by TRL's ``compute_ref_log_probs``."""
        chosen, rejected = self.trainer.compute_ref_log_probs(self.policy, batch)
        return chosen.double().numpy(), rejected.double().numpy()

    def cells(self, batch: dict) -> dict:
        """The cells the models compute and the real ones among them (TRL: tokens)."""
        rows, width = batch["input_ids"].shape
        return {"rows": rows, "width": width, "cells": rows * width, "real": int(batch["attention_mask"].sum())}


class TRLPadded(DPOStep):
    """TRL 1.16's own step on its collator's padded batch (sdpa)."""


class SeqpackPacked(DPOStep):
    """The same trainer made packed by ``seqpack.hf.PackedDPO`` and fed by
    ``PreferenceCollator`` (best-fit-decreasing by pairs): seqpack attention on the packed
    rows, each pair's sums from ``pair_logprobs``, TRL's loss code on them."""

    attention = "seqpack"

    def trainer_class(self):
        from trl import DPOTrainer

        import seqpack.hf as hf

        return type("PackedDPOTrainer", (hf.PackedDPO, DPOTrainer), {})

    def collator(self, tokenizer, pairs: int):
        import seqpack as sp
        import seqpack.hf as hf

        return hf.PreferenceCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=pairs),
                                     tokenizer_identity=tokenizer_identity(tokenizer))

    def cells(self, batch: dict) -> dict:
        """The packed rows' cells (predictions) and the real ones among them."""
        packed = batch["packed_rows"]
        rows, width = packed["input_ids"].shape
        return {"rows": rows, "width": width, "cells": rows * width, "real": int(packed["valid_lengths"].sum())}


METHOD_CLASSES = {"TRL padded": TRLPadded, "seqpack packed": SeqpackPacked}


#: Run in a fresh process (Linux): how far the resident set grows above what it was before
#: one step of method ``sys.argv[1]`` over ``sys.argv[2]`` pairs on ``sys.argv[3]`` threads
#: (after a first step over 2 pairs, not counted, which starts the thread pools).
MEMORY_PROBE = """
import json, sys, tempfile
import torch
sys.path.insert(0, sys.argv[4])
from bench_dpo import METHOD_CLASSES, preference_pairs
def kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))
torch.set_num_threads(int(sys.argv[3]))
pairs = preference_pairs(int(sys.argv[2]))
with tempfile.TemporaryDirectory() as workdir:
    method = METHOD_CLASSES[sys.argv[1]](pairs, workdir)
    method.step(method.collate(method.features[:2]))
    method.policy.zero_grad(set_to_none=True)
    batch = method.collate(method.features)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak resident set (VmHWM) starts again from the current one
    before = kib("VmRSS")
    method.step(batch)
    print(json.dumps({"extra_bytes": (kib("VmHWM") - before) * 1024, "before_bytes": before * 1024}))
"""


def step_memory(pairs: int, threads: int) -> dict:
    """Peak bytes each method's step adds, each in a fresh process."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = {}
    for name in METHODS:
        done = subprocess.run([sys.executable, "-c", MEMORY_PROBE, name, str(pairs), str(threads), here],
                              capture_output=True, text=True, check=True)
        found[name] = json.loads(done.stdout.splitlines()[-1])
    return found


def main(argv=None) -> dict:
    args = arguments(__doc__.splitlines()[0], 3, ("--pairs", 16, "preference pairs in the step")).parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    import trl

    from seqpack._threads import kernel_threads
    from seqpack.bench.measure import cpu_description, matmul_peak

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    peak = matmul_peak("float32")[0]
    pairs = preference_pairs(args.pairs)
    with tempfile.TemporaryDirectory() as workdir:
        methods = {name: METHOD_CLASSES[name](pairs, workdir) for name in METHODS}
        batches = {name: method.collate(method.features) for name, method in methods.items()}
        for name, method in methods.items():
            method.step(batches[name])  # untimed: first touches of memory, thread pools
        samples = {name: [] for name in METHODS}
        losses = {}
        for _ in range(args.repeats):
            for name, method in methods.items():
                start = time.perf_counter()
                losses[name] = method.step(batches[name])
                samples[name].append(time.perf_counter() - start)
        logps = {name: method.logps(batches[name]) for name, method in methods.items()}
        cells = {name: method.cells(batches[name]) for name, method in methods.items()}
    memory = step_memory(args.pairs, args.threads)
    load_after = os.getloadavg()

    trl_name, ours = METHODS
    per_round = [theirs / mine for theirs, mine in zip(samples[trl_name], samples[ours])]
    loss_difference = abs(losses[ours] - losses[trl_name]) / abs(losses[trl_name])
    logps_difference = {side: float(np.max(np.abs(logps[ours][k] - logps[trl_name][k]) / np.abs(logps[trl_name][k])))
                        for k, side in enumerate(("chosen", "rejected"))}
    check_agreement({ours: loss_difference}, LOSS_AGREEMENT, "losses")
    check_agreement({f"{ours}, {side}": value for side, value in logps_difference.items()}, LOGPS_AGREEMENT,
                    "per-pair log-probabilities")
    targets = sum(len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs)
    result = {
        "cpu": cpu_description(), "threads": args.threads, "kernel_threads": kernel_threads(None),
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
        "load_before": load_before, "load_after": load_after, "matmul_peak_gflops": peak,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "pairs": args.pairs, "completion_targets": targets, "repeats": args.repeats,
        "seconds": samples, "seqpack_speedup": (statistics.median(per_round), min(per_round), max(per_round)),
        "loss": losses, "loss_relative_difference": loss_difference,
        "logps_max_relative_difference": logps_difference, "cells": cells, "step_peak_memory": memory,
    }
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return result
    print(f"CPU: {result['cpu']}; {os.cpu_count()} logical CPUs; torch threads {args.threads}, seqpack kernel "
          f"threads {result['kernel_threads']}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"trl {trl.__version__}")
    print(f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, after "
          f"{tuple(round(x, 2) for x in load_after)}; float32 matmul peak in this run {peak:.0f} GFLOP/s; peak RSS "
          f"{result['peak_rss_mib']:.0f} MiB")
    print(f"one DPO step (sigmoid, beta {BETA}): {args.pairs} pairs, {targets:,} completion targets; medians of "
          f"{args.repeats} rounds\n")
    labels = {trl_name: "TRL padded (`DPOTrainer.compute_loss`, its collator, sdpa)",
              ours: "**seqpack packed (`PreferenceCollator`, best-fit-decreasing by pairs, seqpack attention)**"}
    print("| method | step s (median) | min..max s | cells computed | of which real | peak memory of the step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in METHODS:
        times, shape = samples[name], cells[name]
        print(f"| {labels[name]} | {statistics.median(times):.3f} | {min(times):.3f}..{max(times):.3f} | "
              f"{shape['cells']:,} ({shape['rows']} x {shape['width']}) | {shape['real']:,} "
              f"({shape['real'] / shape['cells']:.1%}) | {memory[name]['extra_bytes'] / 2**20:.0f} MiB |")
    speedup = result["seqpack_speedup"]
    print(f"\nseqpack against TRL: {speedup[0]:.2f}x (rounds {speedup[1]:.2f}..{speedup[2]:.2f}; target 1.5x: "
          f"{'met' if speedup[0] >= 1.5 else 'not met'}); cells {cells[trl_name]['cells'] / cells[ours]['cells']:.2f}x "
          f"fewer")
    print(f"loss: TRL {losses[trl_name]:.7f}, seqpack {losses[ours]:.7f}, relative difference {loss_difference:.1e}; "
          f"per-pair log-probabilities, largest relative difference: chosen {logps_difference['chosen']:.1e}, "
          f"rejected {logps_difference['rejected']:.1e} (float32)")
    return result


if __name__ == "__main__":
    main()
