"""Scoring examples with a causal LM on the CPU: seqpack's packed evaluation against Hugging Face's ways.

    python bench/bench_score.py                          # 32 examples, 5 rounds: the table in RESULTS.md
    python bench/bench_score.py --examples 128 --repeats 5 --json

Needs the ``hf`` extra; ``HF_HUB_OFFLINE`` is set, nothing is downloaded. ``--examples``
lognormal examples (token counts median 250, sigma 1.0, ``numpy.random.default_rng(0)``,
clipped to [3, 2048]; random byte-tokenizer content) scored by a random
``LlamaForCausalLM`` (hidden 256, 4 layers, 8 heads, intermediate 688, vocabulary 512,
float32, eval mode, no gradients): each method computes every example's NLL sum (float64
from the logits), one model and one set of examples for all, in this process:

- ``HF per example``: each example alone (batch 1, sdpa, no mask);
- ``HF padded``: right-padded batches of ``--padded-batch`` (8, ``Trainer``'s evaluation
  default) in order, with ``attention_mask`` (sdpa);
- ``HF packed sdpa``: the examples of each seqpack batch flattened by
  ``transformers.DataCollatorWithFlattening`` into one row (``position_ids``; transformers
  detects the packing and builds a dense block-causal mask for sdpa);
- ``seqpack``: ``seqpack.hf.evaluate`` of the plan (best-fit-decreasing, batches of 4 rows
  of 2048, each handed to the model flattened by ``seqpack.hf.flat``: no padding), seqpack
  attention;
- ``no-op bound``: the same flattened batches and the same per-example sums with attention
  replaced by a function that returns its query: what the rest of the model costs, the
  most any attention could reach on them.

Each round runs every method once, in turn, so load changes hit all of them; figures are
medians over rounds and the ratios medians of per-round ratios. Every method's per-example
sums are checked against seqpack's (the largest difference is printed; past ``AGREEMENT``
relative, the script stops and reports no timing). Then
``seqpack.torch.sequence_logprobs`` against ``seqpack.torch.objective.loss_sum`` on the same
logits (one seqpack batch's, float32), forward and forward + backward (target: within 1.1x),
and the peak memory each forward adds to its logits, each measured alone in a fresh process
(the growth of its resident set above the one before, on Linux), beside the bound ``sequence_logprobs`` states: one
``[cells, vocabulary]`` tensor in the logits' dtype.
Printed beside them: the CPU, the threads, the load average before and after, the float32
matmul peak measured in this run and the peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from timing import arguments, check_agreement

CAPACITY = 2048
ROWS_PER_BATCH = 4
METHODS = ("HF per example", "HF padded", "HF packed sdpa", "seqpack", "no-op bound")
BASELINES = ("HF per example", "HF padded", "HF packed sdpa")
#: The largest relative difference of a per-example sum from seqpack's (float32 logits, sums in float64).
AGREEMENT = 1e-6
#: Samples of the sequence_logprobs / loss_sum timings (each ~20 ms; a few ms per call, so noisy).
LOGPROB_SAMPLES = 25


def documents(count: int) -> list[np.ndarray]:
    """``count`` framed byte-tokenizer documents (int64) of lognormal token counts."""
    rng = np.random.default_rng(0)
    sizes = np.clip(np.rint(rng.lognormal(np.log(250), 1.0, count)), 3, CAPACITY + 1).astype(int)
    content = np.random.default_rng(1)
    return [np.concatenate([[0], content.integers(2, 258, size=n - 2), [1]]).astype(np.int64) for n in sizes]


def score_plan(docs: list[np.ndarray]):
    """The seqpack plan of ``docs``: best-fit-decreasing batches of ``ROWS_PER_BATCH`` rows of ``CAPACITY``."""
    import seqpack as sp

    binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="bench-score")
    offsets = np.concatenate([[0], np.cumsum([d.size for d in docs])]).astype(np.int64)
    table = sp.ExampleTable.from_arrays(np.concatenate(docs), offsets, binding)
    return sp.plan(table, sp.PackConfig(capacity=CAPACITY, rows_per_batch=ROWS_PER_BATCH),
                   partition=sp.Partition.TRAIN, binding=binding, policy="best-fit-decreasing")


#: Run in a fresh process (Linux): how far the resident set grows above what it was before one
#: forward of ``sys.argv[1]`` on random float32 logits of the first batch's shape and
#: ``sys.argv[3]`` classes (the peak is reset through ``/proc/self/clear_refs`` first).
MEMORY_PROBE = """
import json, sys
import torch
sys.path.insert(0, sys.argv[4])
from bench_score import documents, score_plan
from seqpack.torch import sequence_logprobs
from seqpack.torch.objective import loss_sum
def kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))
def forward(logits, batch):
    return sequence_logprobs(logits, batch).sums if sys.argv[1] == "sequence_logprobs" else loss_sum(logits, batch)[0]
small = score_plan(documents(1)).batch(0)  # a first call starts the thread pools, not counted
forward(torch.randn(*small.shape, int(sys.argv[3])), small)
batch = score_plan(documents(int(sys.argv[2]))).batch(0)
logits = torch.randn(*batch.shape, int(sys.argv[3]))
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")  # the peak resident set (VmHWM) starts again from the current one
before = kib("VmRSS")
result = forward(logits, batch)
print(json.dumps({"extra_bytes": (kib("VmHWM") - before) * 1024, "logits_bytes": logits.numel() * logits.element_size()}))
"""


def logprob_memory(examples: int, classes: int) -> dict:
    """Peak bytes each forward adds to its logits, each in a fresh process."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = {}
    for which in ("sequence_logprobs", "loss_sum"):
        done = subprocess.run([sys.executable, "-c", MEMORY_PROBE, which, str(examples), str(classes), here],
                              capture_output=True, text=True, check=True)
        found[which] = json.loads(done.stdout.splitlines()[-1])
    return found


def make_model(torch, hf):
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    from seqpack.bench.train import query_only_attention

    hf.register()
    AttentionInterface.register("noop-query", query_only_attention)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, use_cache=False)
    return LlamaForCausalLM(config).eval()


def nll_sum(torch, logits, targets) -> float:
    """``-sum log p(targets)`` of ``[T, V]`` logits, in float64."""
    log_p = torch.log_softmax(logits.double(), dim=-1)
    return float(-log_p.gather(1, targets[:, None]).sum())


class Methods:
    """Each method as a call returning every example's NLL sum (float64 ``[examples]``)."""

    def __init__(self, torch, hf, model, docs, plan):
        self.torch, self.hf, self.model, self.docs, self.plan = torch, hf, model, docs, plan
        self.padded_batch = 8
        self.groups = [[o.ordinal for o in batch.occurrences] for batch in plan.batches()]

    def _using(self, implementation):
        if self.model.config._attn_implementation != implementation:
            self.model.set_attn_implementation(implementation)

    def per_example(self, chosen):
        torch, sums = self.torch, np.zeros(len(self.docs))
        self._using("sdpa")
        with torch.no_grad():
            for i in chosen:
                tokens = torch.from_numpy(self.docs[i])
                logits = self.model(input_ids=tokens[None, :-1], use_cache=False).logits[0]   # [T, V]
                sums[i] = nll_sum(torch, logits, tokens[1:])
        return sums

    def padded(self, chosen):
        torch, sums = self.torch, np.zeros(len(self.docs))
        self._using("sdpa")
        with torch.no_grad():
            for first in range(0, len(chosen), self.padded_batch):
                group = chosen[first:first + self.padded_batch]
                width = max(self.docs[i].size - 1 for i in group)
                ids = torch.zeros(len(group), width, dtype=torch.int64)
                mask = torch.zeros(len(group), width, dtype=torch.int64)
                for row, i in enumerate(group):
                    ids[row, :self.docs[i].size - 1] = torch.from_numpy(self.docs[i][:-1])
                    mask[row, :self.docs[i].size - 1] = 1
                logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits   # [B, T, V]
                for row, i in enumerate(group):
                    n = self.docs[i].size - 1
                    sums[i] = nll_sum(torch, logits[row, :n], torch.from_numpy(self.docs[i][1:]))
        return sums

    def packed_sdpa(self, groups):
        from transformers import DataCollatorWithFlattening

        torch, sums = self.torch, np.zeros(len(self.docs))
        collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        self._using("sdpa")
        with torch.no_grad():
            for group in groups:
                batch = collate([{"input_ids": self.docs[i].tolist()} for i in group])
                logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                    use_cache=False).logits[0]                                   # [N, V]
                cu = batch["cu_seq_lens_q"].tolist()
                for k, i in enumerate(group):
                    sums[i] = nll_sum(torch, logits[cu[k]:cu[k + 1] - 1],
                                      batch["input_ids"][0, cu[k] + 1:cu[k + 1]])
        return sums

    def seqpack(self, batches):
        self._using(self.hf.NAME)
        evaluation = self.hf.evaluate(self.model, batches)
        sums = np.zeros(len(self.docs))
        sums[evaluation.ordinals] = evaluation.nll_sums
        return sums

    def noop(self, batches):
        from seqpack.torch import sequence_logprobs

        torch, sums = self.torch, np.zeros(len(self.docs))
        self._using("noop-query")
        with torch.no_grad():
            for batch in batches.batches(reuse_buffers=True) if hasattr(batches, "batches") else batches:
                fields = self.hf.flat(batch)
                inputs = {k: v for k, v in fields.items() if k != "labels"}
                scored = sequence_logprobs(self.model(**inputs, use_cache=False).logits.double(), fields)
                sums[batch.occurrence_records["ordinal"]] = -scored.sums.numpy()
        return sums

    def calls(self, warm_up=False):
        """Each method over every example (seqpack's batches built as they are scored); to
        warm up, over a few examples of the first batch (seqpack: that batch)."""
        if warm_up:
            batches, groups = [self.plan.batch(0)], [self.groups[0][:4]]
        else:
            batches, groups = self.plan, self.groups
        chosen = sorted(i for group in groups for i in group)
        return {"HF per example": lambda: self.per_example(chosen), "HF padded": lambda: self.padded(chosen),
                "HF packed sdpa": lambda: self.packed_sdpa(groups), "seqpack": lambda: self.seqpack(batches),
                "no-op bound": lambda: self.noop(batches)}


def logprob_timings(torch, model, hf, batch, repeats: int):
    """Seconds (median, min, max) of ``sequence_logprobs`` and ``loss_sum`` on one batch's
    logits, forward and forward + backward, and their totals' relative difference."""
    from seqpack.bench.measure import measure_in_turns
    from seqpack.torch import sequence_logprobs
    from seqpack.torch.objective import loss_sum

    model.set_attn_implementation(hf.NAME)
    with torch.no_grad():
        inputs = {k: v for k, v in hf.rows(batch).items() if k not in ("labels", "shift_labels")}
        logits = model(**inputs).logits.contiguous()                                    # [rows, T, V] float32
    leaf = logits.clone().requires_grad_()

    def both(call):
        def run():
            leaf.grad = None
            call(leaf).backward()
        return run

    calls = [lambda: sequence_logprobs(logits, batch), lambda: loss_sum(logits, batch),
             both(lambda x: -sequence_logprobs(x, batch).sums.sum()), both(lambda x: loss_sum(x, batch)[0])]
    timed = measure_in_turns(calls, repeats)
    ours, theirs = float(-sequence_logprobs(logits, batch).sums.double().sum()), float(loss_sum(logits, batch)[0])
    difference = abs(ours - theirs) / abs(theirs)
    return timed, tuple(logits.shape), difference


def main(argv=None) -> dict:
    args = arguments(__doc__.splitlines()[0], 5, ("--examples", 32, "examples scored"),
                     ("--padded-batch", 8, "HF padded batch size")).parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    import seqpack.hf as hf
    from seqpack._threads import kernel_threads
    from seqpack.bench.measure import cpu_description, matmul_peak

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    peak = matmul_peak("float32")[0]
    docs = documents(args.examples)
    plan = score_plan(docs)
    targets = int(sum(d.size - 1 for d in docs))
    model = make_model(torch, hf)
    methods = Methods(torch, hf, model, docs, plan)
    methods.padded_batch = args.padded_batch

    for call in methods.calls(warm_up=True).values():
        call()
    samples = {name: [] for name in METHODS}
    sums = {}
    for _ in range(args.repeats):
        for name, call in methods.calls().items():
            start = time.perf_counter()
            sums[name] = call()
            samples[name].append(time.perf_counter() - start)
    first_batch = plan.batch(0)
    (sequence_fwd, loss_fwd, sequence_both, loss_both), logits_shape, difference = logprob_timings(
        torch, model, hf, first_batch, LOGPROB_SAMPLES)
    memory = logprob_memory(args.examples, logits_shape[-1])
    load_after = os.getloadavg()

    reference = sums["seqpack"]
    agreement = {name: (float(np.max(np.abs(sums[name] - reference))),
                        float(np.max(np.abs(sums[name] - reference) / np.maximum(np.abs(reference), 1e-300))))
                 for name in BASELINES}  # the no-op bound computes no attention: its sums are not scores
    check_agreement({name: relative for name, (_, relative) in agreement.items()}, AGREEMENT, "per-example NLL sums")
    check_agreement({"sequence_logprobs": difference}, AGREEMENT, "total log-probabilities (against loss_sum)")
    rate = {name: targets / statistics.median(times) for name, times in samples.items()}

    def ratio(name, against):
        """Median over rounds of ``against``'s time over ``name``'s (``against`` None: the fastest HF method)."""
        per_round = [(min(samples[b][k] for b in BASELINES) if against is None else samples[against][k]) / mine
                     for k, mine in enumerate(samples[name])]
        return statistics.median(per_round), min(per_round), max(per_round)

    fastest = min(BASELINES, key=lambda name: statistics.median(samples[name]))
    result = {
        "cpu": cpu_description(), "threads": args.threads, "kernel_threads": kernel_threads(None),
        "torch": torch.__version__, "transformers": transformers.__version__, "load_before": load_before,
        "load_after": load_after, "matmul_peak_gflops": peak,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "examples": args.examples, "targets": targets, "batches": len(plan), "rows": plan.row_count,
        "repeats": args.repeats,
        "seconds": samples, "targets_per_second": rate,
        "against_best_hf": {name: ratio(name, None) for name in METHODS}, "best_hf": fastest,
        "seqpack_against_noop": ratio("seqpack", "no-op bound"),
        "max_difference": {name: {"absolute": a, "relative": r} for name, (a, r) in agreement.items()},
        "logprobs": {"logits": list(logits_shape), "sequence_logprobs": {"forward": sequence_fwd,
                                                                         "forward_backward": sequence_both},
                     "loss_sum": {"forward": loss_fwd, "forward_backward": loss_both},
                     "total_difference": difference, "forward_peak_memory": memory},
    }
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return result
    print(f"CPU: {result['cpu']}; {os.cpu_count()} logical CPUs; torch threads {args.threads}, seqpack kernel "
          f"threads {result['kernel_threads']}; torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, after "
          f"{tuple(round(x, 2) for x in load_after)}; float32 matmul peak in this run {peak:.0f} GFLOP/s; "
          f"peak RSS {result['peak_rss_mib']:.0f} MiB")
    print(f"scoring: forward only, float32 model, NLL sums in float64; {args.examples} examples, {targets:,} targets; "
          f"seqpack: {len(plan)} batches of at most {ROWS_PER_BATCH} rows of {CAPACITY} (best-fit-decreasing), "
          f"{plan.row_count} rows, {targets / (plan.row_count * CAPACITY):.1%} of their cells targets, each batch "
          f"flattened for the model (seqpack.hf.flat); medians of {args.repeats} rounds\n")
    labels = {"HF per example": "HF per example (batch 1, sdpa)",
              "HF padded": f"HF padded batches of {args.padded_batch} (sdpa, attention_mask)",
              "HF packed sdpa": "HF packed sdpa (DataCollatorWithFlattening, the seqpack batches' examples)",
              "seqpack": "**seqpack packed (`seqpack.hf.evaluate`)**",
              "no-op bound": "no-op attention bound (seqpack's flattened batches)"}
    print("| method | s (median) | min..max s | targets/s | against the best HF method | max NLL-sum difference "
          "from seqpack (relative) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in METHODS:
        times = samples[name]
        median, low, high = result["against_best_hf"][name]
        absolute, relative = agreement.get(name, (0.0, 0.0))
        print(f"| {labels[name]} | {statistics.median(times):.3f} | {min(times):.3f}..{max(times):.3f} | "
              f"{rate[name]:,.0f} | {median:.2f}x ({low:.2f}..{high:.2f}) | "
              f"{'-' if name in ('seqpack', 'no-op bound') else f'{absolute:.1e} ({relative:.1e})'} |")
    noop = result["seqpack_against_noop"]
    print(f"\nbest HF method: the fastest of each round (by median: {fastest}); seqpack reaches "
          f"{noop[0]:.2f} ({noop[1]:.2f}..{noop[2]:.2f}) of its no-op bound, which is "
          f"{result['against_best_hf']['no-op bound'][0]:.2f}x the best HF method")
    print(f"\nper-example sums from logits {tuple(logits_shape)} float32 (one seqpack batch); medians of "
          f"{LOGPROB_SAMPLES} samples, taking turns; their totals differ by {difference:.1e} (relative)\n")
    print("| | `sequence_logprobs` ms | `loss_sum` ms | ratio | within 1.1x |")
    print("| --- | --- | --- | --- | --- |")
    for label, mine, theirs in (("forward", sequence_fwd, loss_fwd), ("forward + backward", sequence_both, loss_both)):
        share = mine[0] / theirs[0]
        print(f"| {label} | {mine[0] * 1e3:.2f} | {theirs[0] * 1e3:.2f} | {share:.2f}x | "
              f"{'met' if share <= 1.1 else 'not met'} |")
    logits_bytes = memory["loss_sum"]["logits_bytes"]
    print(f"\npeak memory a forward adds to its logits ({logits_bytes / 2**20:.0f} MiB, float32), each alone in a "
          f"fresh process: sequence_logprobs {memory['sequence_logprobs']['extra_bytes'] / 2**20:.1f} MiB "
          f"({memory['sequence_logprobs']['extra_bytes'] / logits_bytes:.2f} of the logits; the stated bound is "
          f"1.00), loss_sum {memory['loss_sum']['extra_bytes'] / 2**20:.1f} MiB "
          f"({memory['loss_sum']['extra_bytes'] / logits_bytes:.2f})")
    return result


if __name__ == "__main__":
    main()
