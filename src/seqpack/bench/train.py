"""``seqpack bench train``: a Hugging Face training step, seqpack attention on packed rows against HF's ways.

    seqpack bench train [--repeats 3] [--threads 2] [--layers 4] [--json]

Needs the ``hf`` extra (transformers and PyTorch); ``HF_HUB_OFFLINE`` is set, nothing is
downloaded.

The step: forward + backward of a random ``LlamaForCausalLM`` (hidden 256, ``--layers`` (4), 8
heads, intermediate 688, vocabulary 512, float32) over the 23 lognormal examples of
workload (a) (median 250 tokens, sigma 1.0, ``default_rng(0)``; 7,051 targets), one
model and one set of examples for every method, all in this process:

- ``HF per-example``: each example alone (batch 1, sdpa, no mask);
- ``HF padded``: right-padded batches of 16 with ``attention_mask`` (sdpa);
- ``HF packed sdpa``: packed rows (``seqpack.hf.rows``: ``position_ids``, no mask;
  transformers detects the packing and builds a dense block-causal mask);
- ``seqpack packed``: the same rows with ``attn_implementation="seqpack"``;
- ``no-op bound``: the same rows with attention replaced by a function that returns its
  query and hands zero gradients to its key and value (what the rest of the model costs:
  the key and value projections still run their backward, as they must for any real
  attention);
- ``query-only no-op``: the same with a function that returns its query and nothing
  else, so that autograd also skips the key and value projections' backward (a lower
  bound than the model's real cost; the issue's figure was measured this way).

Packed methods run for next-fit and best-fit-decreasing rows of capacity 2048, and for
the next-fit rows' examples flattened into one row with no padding (``seqpack.hf.flat``,
``DataCollatorWithFlattening``'s layout; sdpa then gets a dense block-causal mask of
that row). Every method's loss is the step's NLL sum over its targets
(``num_items_in_batch``, as ``Trainer`` passes it), and the warm-up round checks that every
HF and seqpack method computes the same loss and gradients, float32 rounding apart. Each
round times every method once, in turn, so load changes hit all of them; figures are medians over rounds, and the ratios are medians of per-round ratios
with their range. Printed beside them: the CPU, the threads, the load average before and
after, and the float32 matmul peak measured in the same run. A last table gives each
layout's ceiling: its no-op bound against the best HF baseline and against sdpa on the
same layout, the most any attention could reach there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from .._arguments import check_int
from .._threads import kernel_threads
from ..data.binding import BatchBinding, Partition
from ..data.table import ExampleTable
from ..data.tokenizer import ByteTokenizer
from ..errors import InvalidInputError, SeqpackError
from ..packing.config import PackConfig
from ..packing.planning import pack
from . import plain_summary
from .measure import cpu_description, matmul_peak
from .workloads import next_fit_lognormal

CAPACITY = 2048
POLICIES = ("next-fit", "best-fit-decreasing")
BASELINES = ("HF per-example", "HF padded (16)")


def _import_hf():
    """``torch`` and ``seqpack.hf``, or an error naming the extra."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch

        from .. import hf
    except ImportError:
        raise InvalidInputError("seqpack bench train needs the 'hf' extra: pip install 'seqpack[hf]'") from None
    return torch, hf


def query_only_attention(module, query, key, value, attention_mask, **kwargs):
    """The query-only bound: the query handed on as ``[B, T, H, D]``, key and value unused
    (so their projections get no gradient)."""
    return query.transpose(1, 2), None


def noop_attention_function(torch):
    """An attention function that costs nothing but keeps key and value in the graph:
    the query handed on as ``[B, T, H, D]`` (a fresh tensor, as attention's output is),
    the incoming gradient handed back to the query, zeros to key and value."""

    class NoopAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value):
            ctx.shapes = key.shape, value.shape
            return query.transpose(1, 2).contiguous()

        @staticmethod
        def backward(ctx, grad):
            key_shape, value_shape = ctx.shapes
            return grad.transpose(1, 2), grad.new_zeros(key_shape), grad.new_zeros(value_shape)

    def noop_attention(module, query, key, value, attention_mask, **kwargs):
        return NoopAttention.apply(query, key, value), None

    return noop_attention


def examples():
    """The 23 framed documents of workload (a), in next-fit order, and their binding."""
    predictions = [length for row in next_fit_lognormal(4, CAPACITY) for length in row]
    rng = np.random.default_rng(1)
    docs = [np.concatenate([[0], rng.integers(2, 258, size=n - 1), [1]]) for n in predictions]
    binding = BatchBinding.for_tokenizer(ByteTokenizer(), split="bench-hf")
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([d.size for d in docs], out=offsets[1:])
    return docs, ExampleTable.from_arrays(np.concatenate(docs), offsets, binding), binding


def make_model(torch, hf, layers: int):
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    hf.register()
    AttentionInterface.register("noop", noop_attention_function(torch))
    AttentionInterface.register("noop-query", query_only_attention)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, use_cache=False)
    return LlamaForCausalLM(config)


def steps(torch, hf, docs, table, binding):
    """Each method: (attention implementation, list of model keyword dicts, targets)."""
    targets = sum(d.size - 1 for d in docs)
    alone = [{"input_ids": torch.from_numpy(d[None, :-1]), "shift_labels": torch.from_numpy(d[None, 1:]),
              "labels": torch.from_numpy(d[None, 1:])} for d in docs]
    padded = []
    for first in range(0, len(docs), 16):
        group = docs[first:first + 16]
        width = max(d.size - 1 for d in group)
        ids = torch.zeros(len(group), width, dtype=torch.int64)
        mask = torch.zeros(len(group), width, dtype=torch.int64)
        shift = torch.full((len(group), width), -100, dtype=torch.int64)
        for row, d in enumerate(group):
            ids[row, :d.size - 1] = torch.from_numpy(d[:-1])
            mask[row, :d.size - 1] = 1
            shift[row, :d.size - 1] = torch.from_numpy(d[1:])
        padded.append({"input_ids": ids, "attention_mask": mask, "shift_labels": shift, "labels": shift})
    methods = {"HF per-example": ("sdpa", alone, targets), "HF padded (16)": ("sdpa", padded, targets)}
    layouts, packed = [], {}
    for policy in POLICIES:
        epoch = pack(table, PackConfig(capacity=CAPACITY, rows_per_batch=8), partition=Partition.TRAIN,
                     binding=binding, policy=policy)
        (batch,) = epoch.batches
        if batch.target_count != targets:
            raise AssertionError(f"{policy} rows hold {batch.target_count} targets, not {targets}")
        layouts.append((f"{policy} ({batch.shape[0]} rows)", hf.rows(batch)))
        packed[policy] = batch
    flat = hf.flat(packed["next-fit"])
    layouts.append((f"flat (1 row of {flat['input_ids'].shape[1]} tokens)", flat))
    for label, fields in layouts:
        methods[f"HF packed sdpa, {label}"] = ("sdpa", [fields], targets)
        methods[f"seqpack packed, {label}"] = ("seqpack", [fields], targets)
        methods[f"no-op bound, {label}"] = ("noop", [fields], targets)
        methods[f"query-only no-op, {label}"] = ("noop-query", [fields], targets)
    for _, batches, _ in methods.values():
        for fields in batches:  # every method's loss: the step's NLL sum over its targets
            fields.update(use_cache=False, num_items_in_batch=targets)
    return methods


def run(model, implementation, batches) -> float:
    """One step (gradients from zero); its loss, the NLL sum over the step's targets."""
    model.set_attn_implementation(implementation)
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for fields in batches:
        batch_loss = model(**fields).loss
        batch_loss.backward()
        loss += batch_loss.item()
    return loss


#: What float32 rounding may change between two methods' steps: the relative difference
#: of the losses and of the whole gradients (a method of another objective is off by 2x).
LOSS_TOLERANCE, GRADIENT_TOLERANCE = 1e-4, 1e-3


def warm_up_and_compare(torch, model, methods) -> float:
    """Run every method once; the attention methods (not the bounds) must compute the same
    step as the first: loss and gradients equal up to float32 rounding, else an error
    (timing methods that compute different things would measure nothing). Returns the
    largest relative gradient difference."""
    first, largest = None, 0.0
    for name, (implementation, batches, _) in methods.items():
        loss = run(model, implementation, batches)
        if implementation not in ("sdpa", "seqpack"):
            continue
        gradient = torch.cat([parameter.grad.reshape(-1) for parameter in model.parameters()])
        if first is None:
            first = name, loss, gradient
            continue
        difference = float((gradient - first[2]).norm() / first[2].norm())
        largest = max(largest, difference)
        if abs(loss - first[1]) > LOSS_TOLERANCE * abs(first[1]) or difference > GRADIENT_TOLERANCE:
            raise SeqpackError(f"{name} computes another step than {first[0]}: loss {loss:.6f} against "
                               f"{first[1]:.6f}, gradients {difference:.1e} apart (relative)")
    return largest


def ratios_of(samples: dict, methods: tuple = ("seqpack",)) -> dict:
    """(method, peer) -> median, min and max over rounds of the peer's time over the
    method's, for the packed methods whose name starts with one of ``methods``."""
    ratios = {}
    packed_sdpa = [name for name in samples if name.startswith("HF packed")]
    for name in samples:
        if not name.startswith(methods):
            continue
        suffix = name.split(", ", 1)[1]
        against = {"best HF baseline": None, "HF packed sdpa": f"HF packed sdpa, {suffix}",
                   "no-op bound": f"no-op bound, {suffix}", "query-only no-op": f"query-only no-op, {suffix}"}
        if not name.startswith("seqpack"):  # a bound: against the baselines only
            against = {label: other for label, other in against.items() if label in ("best HF baseline",
                                                                                     "HF packed sdpa")}
        for label, other in against.items():
            per_round = []
            for index, ours in enumerate(samples[name]):
                if other is None:
                    best = min(samples[b][index] for b in (*BASELINES, *packed_sdpa))
                    per_round.append(best / ours)
                else:
                    per_round.append(samples[other][index] / ours)
            ratios[(name, label)] = (statistics.median(per_round), min(per_round), max(per_round))
    return ratios


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and options of ``seqpack bench train``."""
    parser.description = plain_summary(__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="rounds, each timing every method once (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the model (default 4)")
    parser.add_argument("--json", action="store_true", help="print machine-readable records")


def run_command(options: argparse.Namespace) -> int:
    """Measure every method in rounds and print the tables (or JSON)."""
    check_int("--repeats", options.repeats)
    check_int("--threads", options.threads)
    check_int("--layers", options.layers)
    torch, hf = _import_hf()
    torch.set_num_threads(options.threads)
    docs, table, binding = examples()
    model = make_model(torch, hf, options.layers)
    methods = steps(torch, hf, docs, table, binding)
    load_before = os.getloadavg()
    peak = matmul_peak("float32")[0]
    apart = warm_up_and_compare(torch, model, methods)
    samples = {name: [] for name in methods}
    for _ in range(options.repeats):
        for name, (implementation, batches, _) in methods.items():
            start = time.perf_counter()
            run(model, implementation, batches)
            samples[name].append(time.perf_counter() - start)
    load_after = os.getloadavg()

    targets = next(iter(methods.values()))[2]
    rate = {name: targets / statistics.median(times) for name, times in samples.items()}
    ratios = ratios_of(samples)
    ceilings = ratios_of(samples, ("no-op bound",))
    if options.json:
        print(json.dumps({
            "cpu": cpu_description(), "threads": options.threads, "layers": options.layers, "load_before": load_before,
            "load_after": load_after, "matmul_peak_gflops": peak, "targets": targets, "gradients_apart": apart,
            "seconds": samples, "targets_per_second": rate,
            "ratios": {f"{name} / {label}": list(value) for (name, label), value in ratios.items()},
            "ceilings": {f"{name} / {label}": list(value) for (name, label), value in ceilings.items()},
        }, indent=2))
        return 0
    print(f"CPU: {cpu_description()}; {os.cpu_count()} logical CPUs; torch threads {options.threads}, "
          f"seqpack kernel threads {kernel_threads(None)}; torch {torch.__version__}")
    print(f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, after "
          f"{tuple(round(x, 2) for x in load_after)}; float32 matmul peak in this run {peak:.0f} GFLOP/s")
    print(f"step: forward + backward, {options.layers} layers, {len(docs)} examples, {targets:,} targets, "
          f"capacity {CAPACITY}, float32; medians of {options.repeats} rounds")
    print(f"every HF and seqpack method computes the same step: the loss over {targets:,} targets, gradients at "
          f"most {apart:.1e} apart (relative)\n")
    print("| method | step s (median) | min..max s | targets/s |")
    print("| --- | --- | --- | --- |")
    for name, times in samples.items():
        print(f"| {name} | {statistics.median(times):.3f} | {min(times):.3f}..{max(times):.3f} | {rate[name]:,.0f} |")
    baselines = [name for name in samples if name.startswith(BASELINES) or name.startswith("HF packed")]
    fastest = min(baselines, key=lambda name: statistics.median(samples[name]))
    print(f"\nbest HF baseline: the fastest HF method of each round (by median: {fastest})")
    print("\n| seqpack packed | against | speed ratio (median of rounds) | round range |")
    print("| --- | --- | --- | --- |")
    for (name, label), (median, low, high) in ratios.items():
        print(f"| {name.split(', ', 1)[1]} | {label} | {median:.2f}x | {low:.2f}x..{high:.2f}x |")
    print("\nThe ceiling: no attention makes a packed step faster than its no-op bound.\n")
    print("| no-op bound | against | speed ratio (median of rounds) | round range |")
    print("| --- | --- | --- | --- |")
    for (name, label), (median, low, high) in ceilings.items():
        print(f"| {name.split(', ', 1)[1]} | {label} | {median:.2f}x | {low:.2f}x..{high:.2f}x |")
    return 0
