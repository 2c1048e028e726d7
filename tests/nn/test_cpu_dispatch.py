"""One result on every CPU: each compiled CPU path (exp loops, tile products, K/V transposes)
gives the same bits and runs its own code, and no path depends on an ifunc (which musl does
not have)."""

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import seqpack
from seqpack.nn import _attention

pytestmark = pytest.mark.kernel


@pytest.fixture
def every_path():
    """Each CPU path this CPU runs, forced in turn; the best one restored afterwards."""
    yield _attention.cpu_paths()
    assert _attention.use_cpu_path(-1) >= 0


#: Comparing the baseline with itself proves nothing: say so instead of passing.
needs_two_paths = pytest.mark.skipif(
    len(_attention.cpu_paths()) < 2,
    reason=f"this CPU runs only {', '.join(_attention.cpu_paths())}: no other CPU path to compare with the baseline")


def layout(rows=3, width=150, longest=90, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(width // 2, width + 1, rows)
    starts = np.zeros((rows, width), np.int64)
    for row in range(rows):
        column = 0
        while column < lengths[row]:
            size = int(rng.integers(1, longest))
            starts[row, column:column + size] = column
            column += size
    return lengths, starts


# Short segments; and long ones, whose products cut their inner axis into chunks (past
# 256 keys), on head_dim 40 (a partial column strip on both paths); and head_dim 13,
# whose K and V transposes end in a partial block of columns (and segments of any length
# in a partial block of rows).
@needs_two_paths
@pytest.mark.parametrize("width, longest, head_dim", [(150, 90, 40), (150, 90, 13), (900, 800, 40)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_cpu_path_gives_the_same_bits(every_path, dtype, width, longest, head_dim):
    rng = np.random.default_rng(1)
    q, k, v, dout = (4 * rng.standard_normal((3, 2, width, head_dim)).astype(dtype) for _ in range(4))
    lengths, starts = layout(width=width, longest=longest)
    results = {}
    for path in every_path:
        assert _attention.use_cpu_path(_attention.CPU_PATHS.index(path)) == _attention.CPU_PATHS.index(path)
        out, lse = seqpack.range_attention_forward(q, k, v, lengths, starts, threads=2)
        grads = seqpack.range_attention_backward(q, k, v, out, lse, dout, lengths, starts, threads=2)
        results[path] = [a.view(np.uint8) for a in (out, lse, *grads)]
    print("CPU paths compared:", list(results))
    assert "baseline" in results and len(results) >= 2
    for path, arrays in results.items():
        for mine, baseline in zip(arrays, results["baseline"]):
            assert np.array_equal(mine, baseline), f"{path} differs from baseline"


@needs_two_paths
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_cpu_path_gives_the_same_bits_at_the_exp_limits(every_path, dtype):
    """Scores far below the exp's cut-off (exact zeros), infinite and NaN inputs: every
    path gives the same bits, and NaN in the same places (a NaN's sign and payload depend
    on the order of an instruction's operands, so they may differ between paths)."""
    rng = np.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal((2, 2, 150, 24)).astype(dtype) for _ in range(4))
    q *= 40                                          # scores spread over thousands
    k[0, 0, 7, 3], k[0, 1, 30, 0] = np.inf, -np.inf  # infinite scores, NaN after the shift
    q[1, 0, 60, 5] = np.nan
    lengths, starts = layout(rows=2, width=150, longest=120, seed=3)
    results = {}
    with np.errstate(invalid="ignore"):
        for path in every_path:
            _attention.use_cpu_path(_attention.CPU_PATHS.index(path))
            out, lse = seqpack.range_attention_forward(q, k, v, lengths, starts, threads=2)
            grads = seqpack.range_attention_backward(q, k, v, out, lse, dout, lengths, starts, threads=2)
            results[path] = [out, lse, *grads]
    assert np.isnan(results["baseline"][0]).any()
    for path, arrays in results.items():
        for mine, baseline in zip(arrays, results["baseline"]):
            nan = np.isnan(baseline)
            assert np.array_equal(np.isnan(mine), nan), f"{path} has NaN elsewhere than baseline"
            assert np.array_equal(mine[~nan].view(np.uint8), baseline[~nan].view(np.uint8)), (
                f"{path} differs from baseline")


#: The AVX-512 products exist only where the CPU has AVX-512: elsewhere say why they are not compared.
needs_avx512 = pytest.mark.skipif(
    "avx512" not in _attention.cpu_paths(),
    reason=f"this CPU runs only {', '.join(_attention.cpu_paths())}: no AVX-512 path to compare")


# The AVX-512 tile products (two strips of B per block) keep each element's chain: the same bits as every path.
@needs_avx512
@pytest.mark.parametrize("head_dim", [13, 32, 64, 128])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_avx512_path_gives_the_bits_of_every_other_path(every_path, dtype, head_dim, kv_heads):
    rng = np.random.default_rng(head_dim)
    q, dout = (3 * rng.standard_normal((2, 4, 600, head_dim)).astype(dtype) for _ in range(2))
    k, v = (3 * rng.standard_normal((2, kv_heads, 600, head_dim)).astype(dtype) for _ in range(2))
    lengths, starts = layout(rows=2, width=600, longest=500, seed=head_dim)  # chunked chains past 256 keys
    results = {}
    for path in every_path:
        _attention.use_cpu_path(_attention.CPU_PATHS.index(path))
        for threads in (1, 2):
            out, lse = seqpack.range_attention_forward(q, k, v, lengths, starts, threads=threads)
            grads = seqpack.range_attention_backward(q, k, v, out, lse, dout, lengths, starts, threads=threads)
            results[path, threads] = [a.view(np.uint8) for a in (out, lse, *grads)]
    assert ("avx512", 2) in results and ("baseline", 1) in results
    for key, arrays in results.items():
        for mine, baseline in zip(arrays, results["baseline", 1]):
            assert np.array_equal(mine, baseline), f"{key} differs from the baseline on one thread"


def test_each_path_runs_its_own_code(every_path):
    """A vector path that fell back on the portable code would give the same bits, only slower:
    each group of kernel code reports the path it was switched to (the transposes and row
    reductions have AVX2 code only, which the AVX-512 path runs)."""
    for path in every_path:
        assert _attention.use_cpu_path(_attention.CPU_PATHS.index(path)) >= 0
        plain = "baseline" if path == "baseline" else "avx2"
        assert _attention.paths_in_use() == {"exp": path, "products": path, "transposes": plain,
                                             "reductions": plain}


def test_a_path_this_cpu_cannot_run_is_refused(every_path):
    for number, name in enumerate(_attention.CPU_PATHS):
        if name not in every_path:
            assert _attention.use_cpu_path(number) == -1
    assert _attention.use_cpu_path(7) == -1


STT_GNU_IFUNC = 10


def ifunc_symbols(path: Path) -> list[str]:
    """Names of the GNU_IFUNC symbols in an ELF64 little-endian shared object."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path.name} is not little-endian ELF64"
    section_offset, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]
    found = []
    for name, kind, _, _, offset, size, link, _, _, symbol_size in sections:
        if kind not in (2, 11):  # SYMTAB, DYNSYM
            continue
        strings = sections[link]
        for start in range(offset, offset + size, symbol_size):
            symbol_name, info = struct.unpack_from("<IB", data, start)
            if info & 0xF == STT_GNU_IFUNC:
                end = data.index(b"\0", strings[4] + symbol_name)
                found.append(data[strings[4] + symbol_name:end].decode())
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads ELF shared objects (Linux)")
def test_no_kernel_needs_an_ifunc():
    """target_clones would make ifunc symbols; the dispatch is a plain function pointer."""
    modules = sorted(Path(seqpack.__file__).parent.rglob("*.so"))
    assert any(module.name.startswith("_attention") for module in modules)
    for module in modules:
        assert ifunc_symbols(module) == [], module.name
