"""seqpack.torch.range_attention: its autograd overhead over the raw kernels, and GQA vs MHA.

    python bench/bench_torch.py [--repeats 7] [--dtype float32,float64] [--threads N]

Workload (a) (see ``seqpack.bench.workloads``): 4 rows of 2048, 8 query heads, head_dim 64.

1. Overhead: ``range_attention`` forward, and forward + ``backward()``, against the numpy
   kernels called directly on the same arrays (fresh outputs on both sides, as autograd
   allocates them). Each round times both, alternating, so load changes hit both; the
   overhead is the median of the per-round ratios. On a busy machine that ratio is
   noise, so each autograd call is also split in place: the time spent inside the
   kernel calls it makes against the rest of the call (the wrapper: layout checks, views,
   autograd). The issue's target: under 5%.
2. Grouped-query heads: 8 query heads over 2 key/value heads against 8 over 8, forward
   and forward + backward through the autograd function.

Every figure is printed beside the CPU, the thread count, the load average before and
after, and the float32/float64 matmul peak measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from seqpack._threads import default_threads
from seqpack.bench.measure import matmul_peak
from timing import positive
from seqpack.bench.workloads import workload
from seqpack.nn.attention import range_attention_backward, range_attention_forward

try:  # the torch extra; --help answers without it
    import torch

    from seqpack.torch import attention as torch_attention, range_attention
except ImportError:
    torch = None

KERNELS = ("range_attention_forward", "range_attention_backward")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            flags = next(line for line in info if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "?"
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "baseline x86-64"


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def paired(first, second, repeats: int, calls: int):
    """Medians of ``first`` and ``second`` (alternating, ``calls`` calls per sample) and of their ratio."""
    first(), second()  # warm-up
    a, b = [], []
    for _ in range(repeats):
        a.append(seconds(lambda: [first() for _ in range(calls)]) / calls)
        b.append(seconds(lambda: [second() for _ in range(calls)]) / calls)
    ratios = [y / x for x, y in zip(a, b)]
    return statistics.median(a), statistics.median(b), statistics.median(ratios), (min(ratios), max(ratios))


def split_in_call(call, repeats: int):
    """Median seconds of ``call`` outside and inside the numpy kernels it calls, per call."""
    inside = [0.0]
    originals = {name: getattr(torch_attention, name) for name in KERNELS}

    def timed(kernel):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return kernel(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - start
        return wrapper

    for name, kernel in originals.items():
        setattr(torch_attention, name, timed(kernel))
    try:
        call()  # warm-up
        outside, kernels = [], []
        for _ in range(repeats):
            inside[0] = 0.0
            total = seconds(call)
            outside.append(total - inside[0])
            kernels.append(inside[0])
    finally:
        for name, kernel in originals.items():
            setattr(torch_attention, name, kernel)
    ratios = [o / k for o, k in zip(outside, kernels)]
    return statistics.median(outside), statistics.median(kernels), statistics.median(ratios)


def attention_calls(q, k, v, dout, lengths, starts, threads):
    """(raw forward, raw forward+backward, torch forward, torch forward+backward) closures."""
    def raw_forward():
        return range_attention_forward(q, k, v, lengths, starts, threads=threads)

    def raw_both():
        out, lse = raw_forward()
        range_attention_backward(q, k, v, out, lse, dout, lengths, starts, threads=threads)

    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tdout = torch.from_numpy(dout)
    tstarts, tlengths = torch.from_numpy(starts), torch.from_numpy(lengths)

    def torch_forward():
        with torch.no_grad():
            return range_attention(tq, tk, tv, segment_starts=tstarts, valid_lengths=tlengths)

    def torch_both():
        for t in (tq, tk, tv):
            t.grad = None
        range_attention(tq, tk, tv, segment_starts=tstarts, valid_lengths=tlengths).backward(tdout)

    return raw_forward, raw_both, torch_forward, torch_both


def dtype_list(text: str) -> list[str]:
    """An ``argparse`` type: float32 and/or float64, comma-separated (the kernels' dtypes)."""
    names = text.split(",")
    if not names or any(name not in ("float32", "float64") for name in names):
        raise argparse.ArgumentTypeError(f"expected float32 and/or float64, comma-separated, got {text!r}")
    return names


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive, default=7)
    parser.add_argument("--dtype", default="float32,float64", type=dtype_list,
                        help="comma-separated: float32, float64")
    parser.add_argument("--threads", type=positive, default=None)
    options = parser.parse_args(argv)
    if torch is None:
        parser.error("this benchmark needs the 'torch' extra: pip install torch==2.13.0 'seqpack[torch]'")
    threads = default_threads() if options.threads is None else options.threads
    torch.set_num_threads(threads)
    dtypes = options.dtype
    w = workload("a")
    rows, heads, width, head_dim = w.shape
    lengths = np.ascontiguousarray(w.valid_lengths, dtype=np.int64)
    starts = np.ascontiguousarray(w.segment_starts, dtype=np.int64)
    load_before = os.getloadavg()
    peaks = {dtype: matmul_peak(dtype)[0] for dtype in dtypes}

    overhead, grouped = [], []
    for dtype in dtypes:
        q, k, v, dout = w.tensors(dtype)
        raw_f, raw_b, torch_f, torch_b = attention_calls(q, k, v, dout, lengths, starts, threads)
        overhead.append((dtype, "forward", *paired(raw_f, torch_f, options.repeats, 3),
                         split_in_call(torch_f, options.repeats)))
        overhead.append((dtype, "forward+backward", *paired(raw_b, torch_b, options.repeats, 1),
                         split_in_call(torch_b, options.repeats)))
        kv_heads = 2
        group = heads // kv_heads
        k2, v2 = np.ascontiguousarray(k[:, ::group]), np.ascontiguousarray(v[:, ::group])
        _, _, mha_f, mha_b = attention_calls(q, k, v, dout, lengths, starts, threads)
        _, _, gqa_f, gqa_b = attention_calls(q, k2, v2, dout, lengths, starts, threads)
        grouped.append((dtype, "forward", *paired(mha_f, gqa_f, options.repeats, 3)))
        grouped.append((dtype, "forward+backward", *paired(mha_b, gqa_b, options.repeats, 1)))
    load_after = os.getloadavg()

    print(f"CPU: {cpu_name()} ({cpu_flags()}), {os.cpu_count()} logical CPUs; threads {threads} for "
          f"the kernels and torch; torch {torch.__version__}, numpy {np.__version__}")
    print(f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, after "
          f"{tuple(round(x, 2) for x in load_after)}; matmul peak in this run (torch.mm 4096^3): "
          + ", ".join(f"{dtype} {peak:.0f} GFLOP/s" for dtype, peak in peaks.items()))
    print(f"workload (a): rows {rows}, T {width}, {heads} query heads, head_dim {head_dim}, "
          f"{w.edges:,} permitted edges ({100 * w.edges / w.dense_cells:.1f}% of dense); "
          f"medians of {options.repeats} alternating rounds\n")
    print("| dtype | pass | raw kernels ms | range_attention ms | paired overhead (median, range) "
          "| in-call: wrapper ms / kernels ms | wrapper / kernels |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype, name, raw, wrapped, ratio, (low, high), (outside, inside, share) in overhead:
        print(f"| {dtype} | {name} | {1e3 * raw:.1f} | {1e3 * wrapped:.1f} | {100 * (ratio - 1):+.1f}% "
              f"({100 * (low - 1):+.1f}% to {100 * (high - 1):+.1f}%) | {1e3 * outside:.2f} / {1e3 * inside:.1f} "
              f"| {100 * share:.2f}% |")
    print("\n| dtype | pass | MHA 8:8 ms | GQA 8:2 ms | GQA / MHA (median of rounds) |")
    print("| --- | --- | --- | --- | --- |")
    for dtype, name, mha, gqa, ratio, _ in grouped:
        print(f"| {dtype} | {name} | {1e3 * mha:.1f} | {1e3 * gqa:.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
