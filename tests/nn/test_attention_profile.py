"""The range attention kernels' instrumentation: off by default, consistent when on, and
never a change in the results."""

import io
import time

import numpy as np
import pytest
from helpers import mixed_layout

from seqpack.bench.attention import fused_method, non_gemm_share, print_profile, profile
from seqpack.bench.workloads import workload
from seqpack.nn import _attention
from seqpack.nn.attention import _profile, range_attention_backward, range_attention_forward

pytestmark = pytest.mark.kernel

FORWARD = ("forward_gemm", "forward_other", "forward_setup")


def inputs(dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    lengths, starts = mixed_layout(200, rng)
    rows = len(lengths)
    q, dout = (rng.standard_normal((rows, 4, 200, 32)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((rows, 2, 200, 32)).astype(dtype) for _ in range(2))
    return q, k, v, dout, lengths, starts


def run_both(q, k, v, dout, lengths, starts, threads):
    out, lse = range_attention_forward(q, k, v, lengths, starts, threads=threads)
    return (out, lse, *range_attention_backward(q, k, v, out, lse, dout, lengths, starts, threads=threads))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_results_are_bitwise_the_same_with_the_profile_on_and_off(dtype, threads):
    case = inputs(dtype)
    plain = run_both(*case, threads)
    with _profile() as seconds:
        timed = run_both(*case, threads)
    assert sum(seconds.values()) > 0
    again = run_both(*case, threads)
    for a, b, c in zip(plain, timed, again):
        assert a.tobytes() == b.tobytes() == c.tobytes()


def test_profile_buckets_are_consistent():
    case = inputs()
    with _profile() as forward_only:
        range_attention_forward(*case[:3], *case[4:], threads=1)
    assert set(forward_only) == set(_attention.PROFILE_BUCKETS)
    assert all(value >= 0 for value in forward_only.values())
    assert forward_only["forward_gemm"] > 0 and forward_only["forward_other"] > 0
    assert all(value == 0 for name, value in forward_only.items() if name not in FORWARD)
    began = time.perf_counter()
    with _profile() as both:
        run_both(*case, threads=2)
    wall = time.perf_counter() - began
    outside = ("dQ_other", "dK_other", "dV_other")  # the products read the panels transposed
    assert all(value > 0 for name, value in both.items() if name not in outside)
    assert all(both[name] == 0 for name in outside)
    # Thread-time inside the kernels fits in the wall time of two threads.
    assert sum(both.values()) <= 2 * wall
    assert not _attention.profile_on()  # off again once the block ends


def test_the_profile_is_off_after_a_block_that_raised():
    with pytest.raises(ZeroDivisionError):
        with _profile():
            assert _attention.profile_on()
            1 / 0
    assert not _attention.profile_on()


def test_the_benchmark_reports_the_breakdown():
    w = workload("b")
    _, forward_backward, _ = fused_method(w, "float64", 1, kv_heads=1)
    ms = profile(forward_backward, 2)
    assert set(ms) == set(_attention.PROFILE_BUCKETS) and all(value >= 0 for value in ms.values())
    assert 0 < non_gemm_share(ms) < 1
    text = io.StringIO()
    print_profile({"method": "seqpack fused GQA", "kv_heads": 1, "profile": ms}, text)
    table = text.getvalue()
    for phase in ("forward", "backward dS", "backward dQ", "backward dK", "backward dV", "setup"):
        assert f"| {phase}" in table
    assert f"outside tile products {100 * non_gemm_share(ms):.1f}%" in table
