"""Timing shared by the ``seqpack bench`` suites: medians of ~20 ms samples, a matmul peak,
the CPU it ran on."""

from __future__ import annotations

import importlib.util
import platform
import statistics
import time

import numpy as np

SAMPLE_SECONDS = 0.02


def optional_torch():
    """The ``torch`` module, or None when it is not installed."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch


def measure(function, repeats: int):
    """Seconds per call: median, min, max over ``repeats`` samples of ~20 ms each."""
    (timing,) = measure_in_turns([function], repeats)
    if isinstance(timing, Exception):
        raise timing
    return timing


def measure_in_turns(functions, repeats: int) -> list:
    """Seconds per call of each function (median, min, max over ``repeats`` samples of
    ~20 ms each), the functions taking turns sample by sample, so that a machine whose
    speed drifts within minutes slows all of them alike. A function that raises in its
    warm-up gets the exception in its place and no samples."""
    calls = []
    for function in functions:
        try:
            function()  # warm-up: first-touch pages, compiled code, caches
            start = time.perf_counter()
            function()
            once = time.perf_counter() - start
        except Exception as error:  # a peer without this operation (no backward): reported
            calls.append(error)
            continue
        calls.append(max(1, int(SAMPLE_SECONDS / max(once, 1e-9))))
    samples = [[] for _ in functions]
    for _ in range(repeats):
        for function, count, taken in zip(functions, calls, samples):
            if isinstance(count, Exception):
                continue
            start = time.perf_counter()
            for _ in range(count):
                function()
            taken.append((time.perf_counter() - start) / count)
    return [count if isinstance(count, Exception) else (statistics.median(taken), min(taken), max(taken))
            for count, taken in zip(calls, samples)]


def matmul_product(dtype):
    """One large matrix product of ``dtype``: ``(call, flops, label)`` (torch.mm when torch
    is installed, else numpy's matmul)."""
    torch = optional_torch()
    if torch is not None:
        size, label = 4096, "torch.mm 4096^3"
        a = torch.randn(size, size, dtype=getattr(torch, np.dtype(dtype).name))
        b = torch.randn(size, size, dtype=a.dtype)

        def call():
            torch.mm(a, b)

    else:
        size, label = 2048, "numpy matmul 2048^3"
        rng = np.random.default_rng(2)
        a = rng.standard_normal((size, size)).astype(dtype)
        b = rng.standard_normal((size, size)).astype(dtype)

        def call():
            a @ b

    return call, 2 * size**3, label


def matmul_peak(dtype):
    """GFLOP/s of one large matrix product (median of 3) on the threads torch (or numpy's
    BLAS) is set to use, and how it was measured."""
    call, flops, label = matmul_product(dtype)
    return flops / measure(call, 3)[0] / 1e9, label


SIMD_FLAGS = ("sse4_2", "avx", "fma", "avx2", "avx512f", "avx512bw", "avx512_vnni", "amx_tile")


def cpu_description(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU model and its vector-instruction flags (from /proc/cpuinfo where it exists)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open(cpuinfo, encoding="utf-8") as lines:
            for line in lines:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return f"{model}; {' '.join(flag for flag in SIMD_FLAGS if flag in flags) or 'flags unknown'}"
