"""Fused range attention vs the numpy dense masked path under pytest-benchmark.

    pytest bench/bench_attention.py          # the pytest-benchmark table
    seqpack bench attention                  # every method, ratios and % of matmul peak

Workloads (b) and (c) run forward plus backward; workload (a) runs forward only here
(its dense float64 backward takes seconds per round). See ``seqpack.bench.attention``.
"""

import pytest

from seqpack.bench.attention import fused_method, numpy_dense_method
from seqpack.bench.workloads import workload

METHODS = {"fused": fused_method, "dense": numpy_dense_method}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("name", ["b", "c"])
def test_forward_backward(benchmark, name, method):
    w = workload(name)
    _, forward_backward, _ = METHODS[method](w, "float64", None)
    benchmark.extra_info.update(workload=name, edges=w.edges, dense_cells=w.dense_cells)
    benchmark(forward_backward)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_forward_workload_a(benchmark, dtype, method):
    w = workload("a")
    forward, *_ = METHODS[method](w, dtype, None)
    benchmark.extra_info.update(workload="a", edges=w.edges, dense_cells=w.dense_cells)
    benchmark.pedantic(forward, rounds=3, iterations=1, warmup_rounds=1)
