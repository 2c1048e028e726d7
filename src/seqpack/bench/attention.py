"""``seqpack bench attention``: fused range attention against dense and PyTorch peers.

Everything runs in one process on the same inputs, with the same thread count for every
method (the kernel's ``threads``, ``torch.set_num_threads``, and numpy's BLAS through
``threadpoolctl`` when it is installed; without it numpy's BLAS keeps its default, all
cores). Each method is timed as a forward pass and as a forward plus backward pass with
a fixed upstream gradient; a sample repeats a call until it lasts about 20 ms, the
methods' forwards take turns sample by sample, then their forwards plus backwards (so a
machine whose speed drifts slows them alike), and the report gives the median of the
samples with their min-max. Useful work counts only permitted edges: 4*head_dim
FLOPs per edge forward and 12*head_dim forward plus backward, compared with a matmul
peak measured in the same run, in turns with the forward plus backward samples.

Workloads (``--workload``) are described in :mod:`seqpack.bench.workloads`;
``--head-dim`` runs them at other head sizes. The fused kernels run on the best CPU path
this CPU has (named in the table), or on each path ``--cpu-path`` names, side by side in
one run (every path gives the same bits).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys

import numpy as np

from .._arguments import check_int
from .._threads import default_threads
from ..errors import InvalidInputError, SeqpackError
from ..nn import _attention
from ..nn.attention import _profile, range_attention_backward, range_attention_forward
from ..nn.softmax import range_softmax_backward, range_softmax_forward
from . import plain_summary
from .measure import cpu_description, matmul_product, measure_in_turns, optional_torch
from .workloads import WORKLOADS, Workload, workload

DTYPES = ("float32", "float64")


# --- methods: each returns (forward, forward_backward, results) callables, or a reason string;
# results() runs forward and backward once more and returns out, dq, dk, dv as numpy arrays
# (None where the method has no backward) for the in-run agreement check ---


def fused_method(w: Workload, dtype, threads, kv_heads=None, path: str | None = None):
    """The fused kernels into reused buffers; ``kv_heads`` (grouped-query): K and V with
    that many heads, the same query heads and work; ``path``: on that CPU path (each call
    switches to it; None: the best)."""
    q, k, v, dout = w.tensors(dtype)
    if kv_heads is not None:
        k, v = (np.ascontiguousarray(x[:, :kv_heads]) for x in (k, v))
    out, lse = np.empty_like(q), np.empty(w.shape[:3], dtype=dtype)
    grads = [np.empty_like(q), np.empty_like(k), np.empty_like(v)]
    layout = (w.valid_lengths, w.segment_starts)
    number = -1 if path is None else _attention.CPU_PATHS.index(path)

    def forward():
        _attention.use_cpu_path(number)
        range_attention_forward(q, k, v, *layout, threads=threads, out=out, lse=lse)

    def forward_backward():
        forward()
        range_attention_backward(
            q, k, v, out, lse, dout, *layout, threads=threads, dq=grads[0], dk=grads[1], dv=grads[2]
        )

    def results():
        forward_backward()
        return [x.copy() for x in (out, *grads)]

    return forward, forward_backward, results


def permission(w: Workload):
    """Dense [rows, 1, T, T] block-causal permission, kept apart from the attention math."""
    width = w.segment_starts.shape[1]
    column = np.arange(width)
    active = column[None, :] < w.valid_lengths[:, None]
    keys, queries = column[None, None, :], column[None, :, None]
    mask = active[:, :, None] & (keys >= w.segment_starts[:, :, None]) & (keys <= queries)
    return mask[:, None], active[:, None, :, None]


def numpy_dense_method(w: Workload, dtype, threads):
    """Dense scores, the row-level range mask, a masked stable softmax, dense products."""
    q, k, v, dout = w.tensors(dtype)
    mask, active = permission(w)
    scale = np.dtype(dtype).type(1 / math.sqrt(w.head_dim))

    def forward():
        scores = np.where(mask, q @ k.swapaxes(-1, -2) * scale, -np.inf)  # [rows, heads, T, T]
        top = scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores - np.where(active, top, 0))
        weights /= np.where(active, weights.sum(axis=-1, keepdims=True), 1)
        weights = np.where(active, weights, 0)
        return weights, weights @ v

    def forward_backward():
        weights, _ = forward()
        dv = weights.swapaxes(-1, -2) @ dout
        dweights = dout @ v.swapaxes(-1, -2)
        dscores = weights * (dweights - (weights * dweights).sum(axis=-1, keepdims=True))
        return dscores @ k * scale, dscores.swapaxes(-1, -2) @ q * scale, dv

    return forward, forward_backward, lambda: [forward()[1], *forward_backward()]


def reference_path_method(w: Workload, dtype, threads):
    """Dense scores + the range causal softmax kernels of ``seqpack.nn.softmax`` (float64)."""
    if np.dtype(dtype) != np.float64:
        return "unavailable: the range softmax kernels are float64 only"
    q, k, v, dout = w.tensors(dtype)
    rows, heads, width, _ = w.shape
    lengths = np.broadcast_to(w.valid_lengths[:, None], (rows, heads))
    starts = np.broadcast_to(w.segment_starts[:, None], (rows, heads, width))
    scale = 1 / math.sqrt(w.head_dim)

    def forward():
        scores = q @ k.swapaxes(-1, -2) * scale  # [rows, heads, T, T]
        weights = range_softmax_forward(scores, lengths, starts)
        return weights, weights @ v

    def forward_backward():
        weights, _ = forward()
        dv = weights.swapaxes(-1, -2) @ dout
        dweights = dout @ v.swapaxes(-1, -2)
        dscores = range_softmax_backward(weights, dweights, lengths, starts)
        return dscores @ k * scale, dscores.swapaxes(-1, -2) @ q * scale, dv

    return forward, forward_backward, lambda: [forward()[1], *forward_backward()]


def torch_tensors(w: Workload, dtype):
    torch = optional_torch()
    return [torch.from_numpy(x) for x in w.tensors(dtype)]


def torch_timed(torch, run, inputs, dout, assemble=None):
    """Forward under no_grad, and forward plus backward through autograd; ``assemble``
    turns ``run``'s result into one tensor of the output's shape (default: it is one)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]

    def forward():
        with torch.no_grad():
            run(*inputs)

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None
        output = run(*leaves)
        torch.autograd.backward(output, dout)
        return output

    def results():
        output = forward_backward()
        output = output if assemble is None else assemble(output)
        return [output.detach().numpy(), *(leaf.grad.numpy() for leaf in leaves)]

    return forward, forward_backward, results


def torch_dense_mask_method(w: Workload, dtype, threads):
    torch = optional_torch()
    if torch is None:
        return "unavailable: torch is not installed"
    q, k, v, dout = torch_tensors(w, dtype)
    return torch_timed(torch, dense_mask_attention(torch, w), (q, k, v), dout)


def dense_mask_attention(torch, w: Workload):
    """SDPA with the dense block-causal mask of ``w``'s rows, as a function of q, k, v."""
    mask, active = permission(w)
    # Inactive queries attend to themselves so that no softmax row is empty (no NaN); their
    # output is then zeroed, as every other method's is.
    mask = mask | (~active[..., 0][..., None] & np.eye(w.shape[2], dtype=bool))
    mask, inactive = torch.from_numpy(mask), torch.from_numpy(~active)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run(q, k, v):
        return sdpa(q, k, v, attn_mask=mask).masked_fill(inactive, 0)

    return run


def torch_is_causal_method(w: Workload, dtype, threads):
    torch = optional_torch()
    if torch is None:
        return "unavailable: torch is not installed"
    q, k, v, dout = torch_tensors(w, dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run(q, k, v):
        return sdpa(q, k, v, is_causal=True)

    return torch_timed(torch, run, (q, k, v), dout)


def _segment_slices(w: Workload):
    for row, row_segments in enumerate(w.segments):
        column = 0
        for length in row_segments:
            yield row, column, column + length
            column += length


def torch_per_segment_method(w: Workload, dtype, threads, contiguous: bool):
    torch = optional_torch()
    if torch is None:
        return "unavailable: torch is not installed"
    q, k, v, dout = torch_tensors(w, dtype)
    spans = list(_segment_slices(w))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def scatter(pieces):
        """The per-segment pieces in one [rows, heads, T, D] array, zero at padding."""
        whole = np.zeros(w.shape, dtype=dtype)
        for (row, start, end), piece in zip(spans, pieces):
            whole[row, :, start:end] = piece.detach().numpy()[0]
        return whole
    if contiguous:
        pieces = [
            [x[row : row + 1, :, start:end].contiguous() for row, start, end in spans]
            for x in (q, k, v, dout)
        ]

        def run_contiguous(qs, ks, vs):
            return [sdpa(a, b, c, is_causal=True) for a, b, c in zip(qs, ks, vs)]

        leaves = [[p.clone().requires_grad_(True) for p in group] for group in pieces[:3]]

        def forward():
            with torch.no_grad():
                run_contiguous(*pieces[:3])

        def forward_backward():
            for group in leaves:
                for leaf in group:
                    leaf.grad = None
            outputs = run_contiguous(*leaves)
            torch.autograd.backward(outputs, pieces[3])
            return outputs

        def results():
            outputs = forward_backward()
            return [scatter(outputs)] + [scatter([leaf.grad for leaf in group]) for group in leaves]

        return forward, forward_backward, results

    def run_slices(q, k, v):
        outputs = []
        for row, start, end in spans:
            window = (slice(row, row + 1), slice(None), slice(start, end))
            outputs.append(sdpa(q[window], k[window], v[window], is_causal=True))
        return outputs

    upstream = [dout[row : row + 1, :, start:end] for row, start, end in spans]
    return torch_timed(torch, run_slices, (q, k, v), upstream,
                       assemble=lambda outputs: torch.from_numpy(scatter(outputs)))


def torch_flex_method(w: Workload, dtype, threads):
    torch = optional_torch()
    if torch is None:
        return "unavailable: torch is not installed"
    if np.dtype(dtype) != np.float32:
        return "unavailable: FlexAttention on the CPU supports float32 only"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q, k, v, dout = torch_tensors(w, dtype)
        segment = np.full(w.segment_starts.shape, -1, dtype=np.int64)
        for index, (row, start, end) in enumerate(_segment_slices(w)):
            segment[row, start:end] = index
        segment = torch.from_numpy(segment)

        def document(b, h, query, key):
            same = segment[b, query] == segment[b, key]
            return same & (segment[b, query] >= 0) & (key <= query)

        rows, _, width, _ = w.shape
        block_mask = create_block_mask(document, rows, None, width, width, device="cpu")
        compiled = torch.compile(flex_attention)

        def forward():
            with torch.no_grad():
                compiled(q, k, v, block_mask=block_mask)

        forward()
    except Exception as error:  # a failed compile is a result to report, not a crash
        return f"unavailable: {type(error).__name__}: {str(error).splitlines()[0][:80]}"
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None
        compiled(*leaves, block_mask=block_mask).backward(dout)

    def results():  # FlexAttention has no backward on the CPU: the output alone
        with torch.no_grad():
            output = compiled(q, k, v, block_mask=block_mask).numpy()
        try:
            forward_backward()
        except Exception:
            return [output, None, None, None]
        return [output, *(leaf.grad.numpy() for leaf in leaves)]

    return forward, forward_backward, results


def gqa_kv_heads(w: Workload) -> int:
    """Key/value heads of the grouped-query row: a quarter of the query heads (at least 1)."""
    return max(1, w.heads // 4)


GQA = "seqpack fused GQA"


def method_label(method: str, w: Workload) -> str:
    """A method's name in the records and tables; the grouped-query row names the ratio of
    query to key/value heads it actually runs on ``w`` ("seqpack fused GQA 8:2 [avx2]")."""
    if method.startswith(GQA):
        return f"{GQA} {w.heads}:{gqa_kv_heads(w)}{method[len(GQA):]}"
    return method


METHODS = [
    ("seqpack fused", fused_method),
    (GQA, lambda w, d, t: fused_method(w, d, t, gqa_kv_heads(w))),
    ("seqpack reference path", reference_path_method),
    ("numpy dense masked", numpy_dense_method),
    ("torch SDPA dense bool mask", torch_dense_mask_method),
    ("torch SDPA is_causal (no isolation, wrong)", torch_is_causal_method),
    ("torch SDPA per segment, contiguous", lambda w, d, t: torch_per_segment_method(w, d, t, True)),
    ("torch SDPA per segment, slices", lambda w, d, t: torch_per_segment_method(w, d, t, False)),
    ("torch FlexAttention document mask", torch_flex_method),
]


def methods_on(paths) -> list:
    """:data:`METHODS`, the fused rows once per CPU path in ``paths`` (None: the best path's)."""
    if not paths:
        return METHODS
    fused = []
    for path in paths:
        fused.append((f"seqpack fused [{path}]", lambda w, d, t, path=path: fused_method(w, d, t, path=path)))
        fused.append((f"{GQA} [{path}]",
                      lambda w, d, t, path=path: fused_method(w, d, t, gqa_kv_heads(w), path=path)))
    return fused + METHODS[2:]


def run(workloads, dtypes, repeats, threads, cpu_paths=None, head_dims=None):
    """Measure every method on every selected workload (at each of ``head_dims``, None:
    its own), in ``dtypes`` (None: each workload's own), the fused kernels on each of
    ``cpu_paths`` (None: the best this CPU runs); yield records."""
    torch = optional_torch()
    if torch is not None:
        torch.set_num_threads(threads)
    cpu = cpu_description()
    best = _attention.CPU_PATHS[_attention.use_cpu_path(-1)]
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    methods = methods_on(cpu_paths)
    for name, head_dim in ((name, head_dim) for name in workloads for head_dim in head_dims or [None]):
        w = workload(name) if head_dim is None else dataclasses.replace(workload(name), head_dim=head_dim)
        for dtype in dtypes or w.dtypes:
            peak, flops, peak_source = matmul_product(dtype)
            records, timed = [], []
            for method, build in methods:
                record = {"workload": name, "dtype": dtype, "method": method_label(method, w), "threads": threads}
                record.update(head_dim=w.head_dim, edges=w.edges, dense_cells=w.dense_cells, peak_source=peak_source,
                              cpu=cpu, cpu_path=best, cpu_paths=_attention.cpu_paths(), load_average_before=load)
                records.append(record)
                calls = build(w, dtype, threads)
                if isinstance(calls, str):
                    record["note"] = calls
                else:
                    timed.append((record, *calls))
            peers_apart = check_agreement(w, dtype, timed)
            # The methods' forwards take turns, one sample each per round; then their
            # forwards+backwards (a failed backward, such as FlexAttention's, cannot touch
            # a forward measured before it), with the matmul peak taking its turn among
            # them, so that the peak and the kernels meet the same machine.
            forwards = measure_in_turns([forward for _, forward, _, _ in timed], repeats)
            *both_ways, peak_timing = measure_in_turns(
                [forward_backward for _, _, forward_backward, _ in timed] + [peak], repeats)
            for record in records:
                record["peers_apart"] = peers_apart
                record["peak_gflops"] = flops / peak_timing[0] / 1e9
                record["peak_gflops_range"] = [flops / peak_timing[2] / 1e9,
                                               flops / peak_timing[1] / 1e9]
            for (record, _, forward_backward, _), ahead, both in zip(timed, forwards, both_ways):
                if isinstance(ahead, Exception):
                    raise ahead
                record.update(_milliseconds("forward", ahead))
                if isinstance(both, Exception):  # e.g. FlexAttention has no CPU backward: report it
                    record["note"] = f"no backward: {type(both).__name__}"
                else:
                    record.update(_milliseconds("forward_backward", both))
                if record["method"].startswith("seqpack fused"):
                    record["kv_heads"] = gqa_kv_heads(w) if record["method"].startswith(GQA) else w.heads
                    record["profile"] = profile(forward_backward, repeats)
            _attention.use_cpu_path(-1)
            yield from records


# Relative to the largest magnitude of each result: float32 peers sum in other orders.
PEER_TOLERANCE = {"float32": 1e-4, "float64": 1e-10}
WRONG = "torch SDPA is_causal"  # attends across examples on purpose: timed, not compared


def check_agreement(w: Workload, dtype: str, timed) -> float:
    """Run every method once more and compare its output and gradients with the first
    fused row's (the grouped-query rows: the first GQA row's, and that row with the fused
    kernels' on key/value heads repeated to every query head): the fused rows on other CPU
    paths must give the same bits, the peers agree up to :data:`PEER_TOLERANCE` (the
    output and dq at active queries), else an error, since timing methods that compute
    different things would measure nothing. Returns the peers' largest relative
    difference."""
    first, largest = {}, 0.0
    for record, _, _, results in timed:
        method = record["method"]
        if method.startswith(WRONG):
            continue
        arrays, group = results(), method.startswith(GQA)
        if group not in first:
            first[group] = method, arrays
            if group:
                repeated = "seqpack fused on key/value heads repeated to every query head"
                largest = max(largest, _peer_apart(w, dtype, method, arrays, repeated, gqa_reference(w, dtype)))
            continue
        name, expected = first[group]
        if method.startswith("seqpack fused"):
            for label, got, want in zip(("out", "dq", "dk", "dv"), arrays, expected):
                if not np.array_equal(got, want):
                    raise SeqpackError(f"{method} gives other bits than {name} in {label} ({dtype})")
            continue
        largest = max(largest, _peer_apart(w, dtype, method, arrays, name, expected))
    return largest


def _peer_apart(w: Workload, dtype: str, method: str, arrays, name: str, expected) -> float:
    """The largest difference of ``method``'s results from ``name``'s, relative to the
    largest value (the output and dq at active queries only); past :data:`PEER_TOLERANCE`
    an error."""
    active = (np.arange(w.shape[2])[None, :] < w.valid_lengths[:, None])[:, None, :, None]
    largest = 0.0
    for label, got, want in zip(("out", "dq", "dk", "dv"), arrays, expected):
        if got is None:
            continue
        where = active if label in ("out", "dq") else True
        apart = float(np.max(np.abs(np.where(where, got - want, 0)))) / max(float(np.max(np.abs(want))), 1e-300)
        if not apart <= PEER_TOLERANCE[dtype]:
            raise SeqpackError(f"{method} computes another {label} than {name} ({dtype}): "
                               f"{apart:.1e} apart relative to its largest value")
        largest = max(largest, apart)
    return largest


def gqa_reference(w: Workload, dtype: str) -> list:
    """What the grouped-query row must give: the fused kernels on its key/value heads
    repeated to every query head (query head ``h`` reads head ``h // group``), the key and
    value gradients summed over each group."""
    q, k, v, dout = w.tensors(dtype)
    kv = gqa_kv_heads(w)
    group = w.heads // kv
    k, v = (np.repeat(x[:, :kv], group, axis=1) for x in (k, v))
    out, lse = range_attention_forward(q, k, v, w.valid_lengths, w.segment_starts)
    dq, dk, dv = range_attention_backward(q, k, v, out, lse, dout, w.valid_lengths, w.segment_starts)
    rows, _, width, head_dim = dk.shape
    return [out, dq, *(x.reshape(rows, kv, group, width, head_dim).sum(axis=2) for x in (dk, dv))]


def profile(forward_backward, calls: int) -> dict:
    """Milliseconds per forward+backward call in each profile bucket of the kernels
    (thread-time: tile products against everything else, per phase), from separate
    instrumented calls so that the timings above stay uninstrumented."""
    with _profile() as seconds:
        for _ in range(calls):
            forward_backward()
    return {name: 1e3 * value / calls for name, value in seconds.items()}


PHASES = (("forward", "forward"), ("backward dS", "dS"), ("backward dQ", "dQ"),
          ("backward dK", "dK"), ("backward dV", "dV"))


def non_gemm_share(profile_ms: dict) -> float:
    """The share of the kernels' thread-time spent outside tile products (setup included)."""
    gemm = sum(value for name, value in profile_ms.items() if name.endswith("_gemm"))
    return 1 - gemm / sum(profile_ms.values())


def _milliseconds(name, timing):
    median, low, high = timing
    return {f"{name}_ms": 1e3 * median, f"{name}_ms_range": [1e3 * low, 1e3 * high]}


def _cell(record, name):
    median = record[f"{name}_ms"]
    low, high = record[f"{name}_ms_range"]
    if median < 10:
        return f"{median:.3f} ({low:.3f}-{high:.3f})"
    return f"{median:.1f} ({low:.0f}-{high:.0f})"


def print_table(records, out=sys.stdout):
    """Markdown tables: one per (workload, dtype), ratios against seqpack fused."""
    groups = {}
    for record in records:
        groups.setdefault((record["workload"], record["head_dim"], record["dtype"]), []).append(record)
    for (name, head_dim, dtype), group in groups.items():
        w, first = workload(name), group[0]
        rows, heads, width, _ = w.shape
        print(
            f"\nworkload ({name}) {dtype}: rows {rows}, T {width}, heads {heads}, head_dim "
            f"{head_dim}; permitted edges {first['edges']:,} of {first['dense_cells']:,} dense "
            f"cells ({100 * first['edges'] / first['dense_cells']:.1f}%); "
            f"threads {first['threads']}; "
            f"matmul peak {first['peak_gflops']:.0f} GFLOP/s ({first['peak_source']}, median "
            f"of its turns among the fwd+bwd samples, "
            f"{first['peak_gflops_range'][0]:.0f}-{first['peak_gflops_range'][1]:.0f}); "
            f"CPU {first.get('cpu', 'unknown')}; fused kernels on CPU path "
            f"{first['cpu_path'] if first['method'] == 'seqpack fused' else 'as named'} (this CPU runs "
            f"{', '.join(first['cpu_paths'])}); load average before the run "
            f"{' '.join(f'{v:.2f}' for v in first['load_average_before']) if first.get('load_average_before') else 'unknown'}",
            file=out,
        )
        print(f"results checked in the run: the fused rows give the same bits on every path; every "
              f"other method but is_causal agrees with seqpack fused (grouped-query: on repeated key/value "
              f"heads) to {first['peers_apart']:.1e} (largest difference relative to the largest value)", file=out)
        fused = group[0]  # seqpack fused, on the best path or the first one named
        print(
            "| method | fwd ms (min-max) | fwd+bwd ms (min-max) | fwd / fused | fwd+bwd / fused "
            "| useful GFLOP/s fwd+bwd | % of peak |",
            file=out,
        )
        print("| --- | --- | --- | --- | --- | --- | --- |", file=out)
        for r in group:
            forward, both = r.get("forward_ms"), r.get("forward_backward_ms")
            if forward is None:
                print(f"| {r['method']} | {r['note']} | | | | | |", file=out)
                continue
            ratio_f = forward / fused["forward_ms"] if fused.get("forward_ms") else math.nan
            fused_both = fused.get("forward_backward_ms")
            ratio_b = both / fused_both if both and fused_both else math.nan
            if both:
                gflops = 12 * head_dim * r["edges"] / (both * 1e-3) / 1e9
            else:
                gflops = 4 * head_dim * r["edges"] / (forward * 1e-3) / 1e9
            label = "" if both else " (fwd)"
            both_cell = _cell(r, "forward_backward") if both else r.get("note", "-")
            print(
                f"| {r['method']} | {_cell(r, 'forward')} | {both_cell} | {ratio_f:.2f} | "
                f"{ratio_b:.2f} | {gflops:.1f}{label} | {100 * gflops / r['peak_gflops']:.1f}% |",
                file=out,
            )
        for r in group:
            if "profile" in r:
                print_profile(r, out)


def print_profile(record, out=sys.stdout):
    """Where the fused kernels' thread-time goes, per phase, from the instrumented calls."""
    ms = record["profile"]
    print(
        f"\n{record['method']} ({record['kv_heads']} key/value head{'s' * (record['kv_heads'] != 1)}), "
        f"thread-ms per fwd+bwd "
        f"call: tile products vs everything else; outside tile products "
        f"{100 * non_gemm_share(ms):.1f}%",
        file=out,
    )
    print("| phase | tile products ms | other ms | other share |", file=out)
    print("| --- | --- | --- | --- |", file=out)
    for label, key in PHASES:
        gemm, other = ms[f"{key}_gemm"], ms[f"{key}_other"]
        print(f"| {label} | {gemm:.3f} | {other:.3f} | {100 * other / max(gemm + other, 1e-12):.1f}% |",
              file=out)
    setup = ms["forward_setup"] + ms["backward_setup"]
    print(f"| setup (plan, zero padding, scratch) | - | {setup:.3f} | |", file=out)


def _csv(choices):
    def parse(text):
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return items

    return parse


def _head_dims(text: str) -> list[int]:
    try:
        sizes = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(not 1 <= size <= _attention.MAX_HEAD_DIM for size in sizes):
        raise argparse.ArgumentTypeError(f"head sizes are integers in [1, {_attention.MAX_HEAD_DIM}]; got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and options of ``seqpack bench attention``."""
    parser.description = plain_summary(__doc__)
    parser.add_argument("--json", action="store_true", help="print machine-readable records")
    parser.add_argument("--repeats", type=int, default=5, help="samples per measurement (default 5)")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="threads for every method (default: seqpack's default thread count)",
    )
    parser.add_argument("--workload", type=_csv(WORKLOADS), default=list(WORKLOADS),
                        help="comma-separated workloads (default a,b,c)")
    parser.add_argument("--dtype", type=_csv(DTYPES), default=None,
                        help="comma-separated dtypes for every workload (default: a in both, b and c in float64)")
    parser.add_argument("--cpu-path", type=_csv(_attention.CPU_PATHS), default=None,
                        help="comma-separated CPU paths to run the fused kernels on, side by side "
                             "(baseline, avx2, avx512; default: the best this CPU runs)")
    parser.add_argument("--head-dim", type=_head_dims, default=None,
                        help="comma-separated head sizes to run each workload at (default: its own)")


#: Copies of one [rows, heads, T, head_dim] array the methods hold at once, rounded up
#: (each method's inputs, leaves, gradients and results).
HELD_ARRAYS = 12


def check_memory(workloads, dtypes, head_dims) -> None:
    """Refuse a run whose arrays would not fit this machine's available memory (a large
    ``--head-dim`` on workload (a)), before anything is allocated."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: nothing to compare with
        return
    for name in workloads:
        w = workload(name)
        rows, heads, width, head_dim = w.shape
        for size in head_dims or [head_dim]:
            itemsize = max(np.dtype(dtype).itemsize for dtype in dtypes or w.dtypes)
            needed = HELD_ARRAYS * rows * heads * width * size * itemsize
            if needed > available:
                raise InvalidInputError(
                    f"workload ({name}) at head_dim {size} needs about {needed / 2**30:.1f} GiB for its arrays; "
                    f"{available / 2**30:.1f} GiB are available: choose a smaller --head-dim")


def run_command(options: argparse.Namespace) -> int:
    """Measure and print the comparison table (or JSON records)."""
    if options.repeats < 1:
        raise InvalidInputError("--repeats must be at least 1")
    threads = default_threads() if options.threads is None else check_int("--threads", options.threads)
    missing = [path for path in options.cpu_path or () if path not in _attention.cpu_paths()]
    if missing:
        raise InvalidInputError(f"--cpu-path {', '.join(missing)}: this CPU runs only "
                                f"{', '.join(_attention.cpu_paths())}")
    check_memory(options.workload, options.dtype, options.head_dim)
    measure = dict(cpu_paths=options.cpu_path, head_dims=options.head_dim)
    if importlib.util.find_spec("threadpoolctl") is not None:  # optional: pin numpy's BLAS too
        from threadpoolctl import threadpool_limits

        with threadpool_limits(threads):
            records = list(run(options.workload, options.dtype, options.repeats, threads, **measure))
    else:
        records = list(run(options.workload, options.dtype, options.repeats, threads, **measure))
    if options.json:
        json.dump(records, sys.stdout, indent=1)
        print()
    else:
        print_table(records)
    return 0
