"""``seqpack bench attention`` times only methods that compute the same attention."""

import numpy as np
import pytest

from seqpack.bench.attention import (
    GQA,
    check_agreement,
    fused_method,
    gqa_kv_heads,
    numpy_dense_method,
    torch_is_causal_method,
)
from seqpack.bench.workloads import workload
from seqpack.errors import SeqpackError


def timed(w, dtype, *methods):
    return [({"method": name}, *build(w, dtype, 1)) for name, build in methods]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_peers_agree_with_the_fused_kernels_in_the_run(dtype):
    w = workload("c")
    apart = check_agreement(w, dtype, timed(w, dtype, ("seqpack fused", fused_method),
                                            ("numpy dense masked", numpy_dense_method)))
    assert 0 < apart < {"float32": 1e-5, "float64": 1e-13}[dtype]


def altered(build, change):
    """``build``'s method with ``change`` applied to the output its results() return."""
    def method(w, dtype, threads):
        forward, forward_backward, results = build(w, dtype, threads)

        def changed():
            out, *grads = results()
            change(out)
            return [out, *grads]

        return forward, forward_backward, changed

    return method


def test_a_method_computing_something_else_is_refused():
    # Negative control: the dense peer as if B's first query had read A's last key.
    w = workload("c")
    leaky = altered(numpy_dense_method, lambda out: out.__setitem__((0, 0, 3), out[0, 0, 3] + 1e-3))
    with pytest.raises(SeqpackError, match=r"leaky computes another out than seqpack fused \(float64\)"):
        check_agreement(w, "float64", timed(w, "float64", ("seqpack fused", fused_method), ("leaky", leaky)))


def test_the_fused_paths_must_give_the_same_bits():
    w = workload("c")
    nudged = altered(fused_method, lambda out: out.__setitem__((0, 0, 0), np.nextafter(out[0, 0, 0], np.inf)))
    with pytest.raises(SeqpackError, match=r"seqpack fused \[avx2\] gives other bits than seqpack fused in out"):
        check_agreement(w, "float64", timed(w, "float64", ("seqpack fused", fused_method),
                                            ("seqpack fused [avx2]", nudged)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_grouped_query_row_is_checked_against_repeated_heads(dtype):
    # The only GQA row was compared with itself: a NaN output passed (review).
    w = workload("b")

    def grouped(w, dtype, threads):
        return fused_method(w, dtype, threads, gqa_kv_heads(w))

    methods = (("seqpack fused", fused_method), (f"{GQA} 4:1", grouped))
    assert check_agreement(w, dtype, timed(w, dtype, *methods)) <= {"float32": 1e-6, "float64": 1e-14}[dtype]
    broken = altered(grouped, lambda out: out.__setitem__((0, 0, 0), np.nan))
    with pytest.raises(SeqpackError, match=rf"{GQA} 4:1 computes another out than seqpack fused on key/value heads "
                                           rf"repeated to every query head \({dtype}\): nan apart"):
        check_agreement(w, dtype, timed(w, dtype, ("seqpack fused", fused_method), (f"{GQA} 4:1", broken)))


def test_is_causal_is_timed_but_not_compared():
    # It attends across examples on purpose (the table says "wrong"); comparing it would refuse every run.
    pytest.importorskip("torch", reason="the torch peers need the torch extra")
    w = workload("c")
    check_agreement(w, "float64", timed(w, "float64", ("seqpack fused", fused_method),
                                        ("torch SDPA is_causal (no isolation, wrong)", torch_is_causal_method)))


def test_a_head_size_whose_arrays_do_not_fit_is_refused_before_any_allocation(monkeypatch):
    # --head-dim 4096 on workload (a) was killed by the kernel at 21 GB (review).
    from seqpack.bench import attention
    from seqpack.errors import InvalidInputError

    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 2**30 // 4096}  # 1 GiB available
    monkeypatch.setattr(attention.os, "sysconf", pages.__getitem__)
    attention.check_memory(["a"], ["float64"], [64])  # 12 copies of 32 MiB fit
    with pytest.raises(InvalidInputError, match=r"workload \(a\) at head_dim 256 needs about 1.5 GiB for its arrays; "
                                                 r"1.0 GiB are available: choose a smaller --head-dim"):
        attention.check_memory(["c", "a"], ["float64"], [64, 256])
    attention.check_memory(["a"], ["float32"], [128])  # float32 halves it
