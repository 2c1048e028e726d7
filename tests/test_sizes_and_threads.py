"""Sizes and limits are exact Python ints, and thread counts follow one documented rule."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import seqpack as sp
from seqpack import _openmp, _threads

TRAIN = sp.Partition.TRAIN
SCALARS = [int, np.int32, np.int64, np.uint64]


def table_of(lengths, binding):
    """One document per prediction length, content ID 5."""
    documents = [[0] + [5] * (n - 1) + [1] for n in lengths]
    tokens = np.array([t for d in documents for t in d], dtype=np.int32)
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in documents])))
    return sp.ExampleTable.from_arrays(tokens, offsets, binding)


@pytest.mark.parametrize("kind", SCALARS)
def test_configs_hold_python_ints(kind):
    pack = sp.PackConfig(kind(2048), kind(8), kind(16384), kind(2**30))
    pad = sp.PadConfig(kind(4), kind(100), kind(50), kind(2**30))
    for value in (pack.capacity, pack.rows_per_batch, pack.max_cells, pack.max_memory_bytes,
                  pad.rows_per_batch, pad.max_cells, pad.max_width, pad.max_memory_bytes):
        assert type(value) is int
    assert pack == sp.PackConfig(2048, 8, 16384, 2**30) and sp.PackConfig(kind(6)).max_cells == 48
    limits = sp.DecodeLimits(kind(10), kind(20))
    assert type(limits.max_tokens) is type(limits.max_bytes) is int
    config = sp.DecoderConfig(kind(266), kind(8), kind(2), kind(16), kind(2), kind(16))
    assert all(type(getattr(config, name)) is int for name in ("vocabulary_size", "width", "heads"))


@pytest.mark.parametrize("kind", SCALARS)
def test_budget_edge_is_exact_with_numpy_scalars(binding, kind):
    """The numpy type of the limits changes nothing: the same requirement, the same edge."""
    table = table_of([3, 5, 2, 4], binding)
    exact = sp.plan(table, sp.PackConfig(6), partition=TRAIN, binding=binding).epoch_requirement()
    fits = sp.PackConfig(kind(6), kind(8), kind(48), kind(exact))
    assert sp.pack(table, fits, partition=TRAIN, binding=binding).memory_peak == exact
    with pytest.raises(sp.MemoryBudgetError) as caught:
        sp.pack(table, sp.PackConfig(kind(6), kind(8), kind(48), kind(exact - 1)), partition=TRAIN, binding=binding)
    assert (caught.value.required, caught.value.maximum) == (exact, exact - 1)


def test_int32_capacity_products_do_not_wrap(binding):
    """2**16 rows of an int32 capacity 2**16 are 2**32 cells, never a wrapped negative count."""
    table = table_of([2] * 4, binding)
    config = sp.PackConfig(np.int32(65536), np.int32(65536), np.int32(2**31 - 1))
    assert config.max_cells == 2**31 - 1
    with pytest.raises(sp.MemoryBudgetError) as caught:  # a whole row of 2**16 cells, ~1.2 MB
        sp.pack(table, sp.PackConfig(np.int32(65536), max_memory_bytes=np.int32(1 << 20)),
                partition=TRAIN, binding=binding)
    assert caught.value.required > 1 << 20 > 0
    cells = sp.PackConfig(np.int32(65536), np.int32(65536)).max_cells
    assert cells == 2**32 and isinstance(cells, int) and not isinstance(cells, np.integer)


@pytest.mark.parametrize("bad", [True, np.bool_(True), 2.0, "8", None])
def test_configs_reject_non_integers(bad):
    with pytest.raises(sp.InvalidInputError, match="capacity must be an int"):
        sp.PackConfig(bad)


def test_uint64_values_are_named_not_wrapped(binding):
    """A uint64 past 2**63 - 1 is reported as the number it is."""
    huge = np.array([2**64 - 1], dtype=np.uint64)
    with pytest.raises(sp.InvalidInputError, match="18446744073709551615"):
        sp.range_attention_forward(np.zeros((1, 1, 1, 4)), np.zeros((1, 1, 1, 4)), np.zeros((1, 1, 1, 4)),
                                   huge, np.zeros((1, 1), np.int64))
    tokens = np.array([0, 5, 1], np.int32)
    with pytest.raises(sp.InvalidInputError, match="18446744073709551615"):
        sp.ExampleTable.from_arrays(tokens, [0, 3], binding, ranges=np.array([[0, 2**64 - 1]], np.uint64))
    with pytest.raises(sp.InvalidInputError, match="18446744073709551615"):
        sp.nn.range_softmax_forward(np.zeros((1, 2, 2)), lengths=np.array([2**64 - 1], np.uint64))


def test_ints_too_long_to_print_are_named_by_their_size(binding):
    """An int past 4300 digits made every limit's message raise Python's own ValueError
    ('Exceeds the limit ... for integer string conversion') instead of the seqpack error."""
    big = 10**5000
    table = sp.ExampleTable.from_texts(["hello world", "abc"], binding, capacity=16)
    epoch = sp.pack(table, sp.PackConfig(16, 1), partition=TRAIN, binding=binding)
    calls = [
        (sp.InvalidInputError, "capacity is an int of 16610 bits; the maximum is 2147483647", lambda: sp.PackConfig(big)),
        (sp.InvalidInputError, "max_cells must be at least 1, got a negative int of 16610 bits",
         lambda: sp.PackConfig(8, max_cells=-big)),
        (sp.InvalidInputError, "capacity must be in .*, got an int of 16610 bits", lambda: sp.place([1], big)),
        (sp.BatchIndexError, "batch an int of 16610 bits is outside this epoch's batches", lambda: epoch[big]),
        (sp.InvalidInputError, "example an int of 16610 bits is outside", lambda: table.example(big)),
        (sp.InvalidInputError, "row an int of 16610 bits is outside", lambda: epoch.batches[0].allowed_keys(big)),
    ]
    for error, message, call in calls:
        with pytest.raises(error, match=message):
            call()


# --- threads -------------------------------------------------------------------------------


def cgroup_tree(tmp_path, files: dict, membership: str):
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "self-cgroup").write_text(membership)
    return str(tmp_path), str(tmp_path / "self-cgroup")


def test_cgroup_quota_v2_and_v1(tmp_path):
    root, member = cgroup_tree(tmp_path / "v2", {"app/cpu.max": "150000 100000\n", "cpu.max": "max 100000\n"},
                               "0::/app\n")
    assert _threads.cgroup_cpu_limit(root, member) == 2  # 1.5 CPUs round up
    root, member = cgroup_tree(tmp_path / "nested", {"a/cpu.max": "100000 100000", "a/b/cpu.max": "max 100000"},
                               "0::/a/b\n")
    assert _threads.cgroup_cpu_limit(root, member) == 1  # the ancestor's quota binds
    root, member = cgroup_tree(tmp_path / "v1", {"cpu,cpuacct/cpu.cfs_quota_us": "300000",
                                                 "cpu,cpuacct/cpu.cfs_period_us": "100000"},
                               "4:cpu,cpuacct:/\n")
    assert _threads.cgroup_cpu_limit(root, member) == 3
    root, member = cgroup_tree(tmp_path / "none", {"cpu.max": "max 100000"}, "0::/\n")
    assert _threads.cgroup_cpu_limit(root, member) is None
    assert _threads.cgroup_cpu_limit(str(tmp_path / "missing"), str(tmp_path / "missing" / "x")) is None


def child_threads(env: dict, code: str = "print(_threads.default_threads())") -> str:
    script = "from seqpack import _threads\n" + code
    return subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_default_threads_follow_omp_num_threads_and_threadpoolctl():
    assert child_threads({"OMP_NUM_THREADS": "1"}) == "1"
    cores = _threads.available_cores()
    wanted = min(cores, _threads.cgroup_cpu_limit() or cores)
    # A build without OpenMP (setup.py's fallback) runs its kernels on one thread (review).
    expected = wanted if _openmp.BUILT_WITH_OPENMP else 1
    assert child_threads({"OMP_NUM_THREADS": str(wanted)}) == str(expected)
    assert child_threads({"OMP_THREAD_LIMIT": "1"}) == "1"
    threadpoolctl = pytest.importorskip("threadpoolctl", reason="the test extra has it: pip install 'seqpack[test]'")
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert _threads.default_threads() == 1


def test_default_threads_follow_torch_set_num_threads():
    """PyTorch and seqpack share one OpenMP runtime, whichever is imported first, so a
    training script's ``torch.set_num_threads`` also bounds seqpack's kernels."""
    pytest.importorskip("torch", reason="needs the torch extra: pip install 'seqpack[torch]'")
    for first in ("import seqpack, torch", "import torch, seqpack"):
        code = f"{first}; torch.set_num_threads(1); from seqpack import _threads; print(_threads.default_threads())"
        assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.strip() == "1", first


def test_multiprocessing_children_default_to_one_thread(tmp_path):
    """A spawned pool worker (a data-loader worker started without fork) takes one core."""
    script = tmp_path / "pool.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp
        from seqpack import _threads

        def threads(_):
            return _threads.default_threads()

        if __name__ == "__main__":
            with mp.get_context("spawn").Pool(1) as pool:
                print(pool.map(threads, [0])[0], _threads.default_threads() >= 1)
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "1 True", result.stderr


def test_threads_argument_is_checked():
    for bad in (0, -1, True, 1.5, "2", _threads.MAX_THREADS + 1):
        with pytest.raises(sp.InvalidInputError, match="threads"):
            _threads.kernel_threads(bad)
    assert _threads.kernel_threads(np.int64(3)) == 3


def test_a_plan_s_threads_fill_each_batch_built_alone(binding, monkeypatch):
    """plan.batch(i) and plan.batches() filled a large batch on the default thread count,
    whatever threads the plan was given (epoch() kept them)."""
    from seqpack.layout import fields

    seen = []
    fill = fields._fill.fill_rows
    monkeypatch.setattr(fields._fill, "fill_rows", lambda *args: seen.append(args[-1]) or fill(*args))
    capacity = fields.PARALLEL_CELLS // 2  # two rows of a batch reach the parallel fill
    plan = sp.plan(table_of([capacity] * 2, binding), sp.PackConfig(capacity, 2), partition=TRAIN, binding=binding,
                   policy="best-fit-decreasing", threads=1)
    plan.batch(0), next(plan.batches()), next(plan.batches(reuse_buffers=True)), plan.epoch()
    assert seen == [1, 1, 1, 1]


# Calls until half a second has passed (at least two), so an optimized and a bounds-checked
# build both measure long enough for the CPU/wall ratio without a fixed, slow workload.
ATTENTION_LOAD = """
import os, numpy as np, time, seqpack as sp
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((4, 8, 1024, 64)).astype(np.float32) for _ in range(3))
lengths, starts = np.full(4, 1024), np.zeros((4, 1024), np.int64)
out, lse = np.empty_like(q), np.empty(q.shape[:3], np.float32)
before = len(os.listdir("/proc/self/task"))
sp.range_attention_forward(q, k, v, lengths, starts, out=out, lse=lse)
cpu, wall, calls = time.process_time(), time.perf_counter(), 0
while calls < 2 or time.perf_counter() - wall < 0.5:
    sp.range_attention_forward(q, k, v, lengths, starts, out=out, lse=lse)
    calls += 1
print((time.process_time() - cpu) / (time.perf_counter() - wall), len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_omp_num_threads_one_keeps_kernels_on_one_core():
    """Under OMP_NUM_THREADS=1 the kernel starts no thread and CPU time stays at wall time.

    The control (no OMP_NUM_THREADS) shows the kernel does start threads otherwise; it
    counts the OpenMP pool's threads rather than CPU time, which a busy machine lowers.
    numpy's OpenBLAS is held to one thread in both runs so that only OpenMP's threads differ.
    """
    blas = {"OPENBLAS_NUM_THREADS": "1"}
    ratio, started = child_threads({**blas, "OMP_NUM_THREADS": "1"}, ATTENTION_LOAD).split()
    print(f"CPU/wall with OMP_NUM_THREADS=1: {float(ratio):.2f}, threads started: {started}")
    assert float(ratio) < 1.15 and int(started) == 0
    if _threads.default_threads() >= 2:
        env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
        ratio, started = subprocess.run(
            [sys.executable, "-c", ATTENTION_LOAD], env={**env, **blas}, capture_output=True, text=True, check=True
        ).stdout.split()
        print(f"CPU/wall without it: {float(ratio):.2f}, threads started: {started}")
        assert int(started) >= 1
    else:  # said, so that a one-core run is not read as a passed control
        print(f"control not run: {_threads.default_threads()} kernel thread here, so there is no pool to count")
