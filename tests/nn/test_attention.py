"""Fused range attention against a dense numpy oracle of the same rule.

The rule: a valid query t of row r attends to keys segment_starts[r, t] .. t; inactive
queries give zero output, zero log-sum-exp and zero gradients.
"""

import math
import platform

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import InvalidInputError
from seqpack.nn.attention import range_attention_backward, range_attention_forward, segment_spans

from helpers import assert_close, mixed_layout, permitted, starts_from_lengths

pytestmark = pytest.mark.kernel

WIDTHS = [1, 2, 3, 17, 63, 64, 65, 127, 128, 129, 200]


# --- oracle -------------------------------------------------------------------------


def reference_forward(q, k, v, valid_lengths, segment_starts):
    """Dense scores, explicit mask, stable softmax; computes in q's dtype."""
    mask, active = permitted(valid_lengths, segment_starts)
    mask, active = mask[:, None], active[:, None]  # broadcast over heads
    scale = q.dtype.type(1 / math.sqrt(q.shape[-1]))
    scores = np.where(mask, np.einsum("rhtd,rhsd->rhts", q, k) * scale, -np.inf)
    top = np.where(active, scores.max(axis=-1), 0)  # [rows, heads, T]
    weights = np.where(mask, np.exp(scores - top[..., None]), 0)
    total = np.where(active, weights.sum(axis=-1), 1)
    probabilities = weights / total[..., None]  # [rows, heads, T, T]
    out = np.einsum("rhts,rhsd->rhtd", probabilities, np.where(active[..., None], v, 0))
    lse = np.where(active, top + np.log(total), 0)
    return out, lse, probabilities


def reference_backward(q, k, v, dout, valid_lengths, segment_starts):
    """Gradients of sum(out * dout) through the dense oracle."""
    _, active = permitted(valid_lengths, segment_starts)
    active = active[:, None, :, None]
    q, k, v, dout = (np.where(active, x, 0) for x in (q, k, v, dout))
    _, _, probabilities = reference_forward(q, k, v, valid_lengths, segment_starts)
    scale = q.dtype.type(1 / math.sqrt(q.shape[-1]))
    dv = np.einsum("rhts,rhtd->rhsd", probabilities, dout)
    dp = np.einsum("rhtd,rhsd->rhts", dout, v)
    ds = probabilities * (dp - (probabilities * dp).sum(axis=-1, keepdims=True))
    dq = np.einsum("rhts,rhsd->rhtd", ds, k) * scale
    dk = np.einsum("rhts,rhtd->rhsd", ds, q) * scale
    return dq, dk, dv


# --- layouts ------------------------------------------------------------------------


def tensors(rng, shape, dtype=np.float64, count=4):
    return [rng.standard_normal(shape).astype(dtype) for _ in range(count)]


def run_both(q, k, v, dout, lengths, starts, **options):
    out, lse = range_attention_forward(q, k, v, lengths, starts, **options)
    grads = range_attention_backward(q, k, v, out, lse, dout, lengths, starts, **options)
    return (out, lse, *grads)


NAMES = ("out", "lse", "dq", "dk", "dv")


def check_against_oracle(q, k, v, dout, lengths, starts):
    fused = run_both(q, k, v, dout, lengths, starts)
    expected = reference_forward(q, k, v, lengths, starts)[:2]
    expected += reference_backward(q, k, v, dout, lengths, starts)
    for name, a, b in zip(NAMES, fused, expected):
        assert_close(a, b, name)
    return fused


# --- equivalence ----------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_matches_oracle_on_mixed_layouts(width):
    rng = np.random.default_rng(width)
    lengths, starts = mixed_layout(width, rng)
    assert lengths[1] == 0 and lengths[0] == width  # an all-padding row and a full row occur
    head_dim = (1, 3, 16)[width % 3]
    q, k, v, dout = tensors(rng, (len(lengths), 2, width, head_dim))
    out, lse, dq, dk, dv = check_against_oracle(q, k, v, dout, lengths, starts)
    for array in (out, dq, dk, dv):
        assert not array[1].any()  # the all-padding row is exactly zero
    assert not lse[1].any()


@pytest.mark.parametrize("head_dim", [64, 80, 300])
def test_matches_oracle_for_head_dims_that_shrink_the_tile(head_dim):
    rng = np.random.default_rng(head_dim)
    lengths, starts = mixed_layout(150, rng)
    check_against_oracle(*tensors(rng, (len(lengths), 1, 150, head_dim)), lengths, starts)


@st.composite
def layouts(draw):
    width = draw(st.integers(1, 70))
    rows = draw(st.integers(1, 3))
    segment_rows = []
    for _ in range(rows):
        left = draw(st.integers(0, width))
        cuts = []
        while left:
            length = draw(st.integers(1, left))
            cuts.append(length)
            left -= length
        segment_rows.append(cuts)
    return width, segment_rows, draw(st.integers(0, 2**32 - 1))


@settings(derandomize=True, max_examples=40, deadline=None)
@given(layouts())
def test_matches_oracle_on_random_layouts(layout):
    width, segment_rows, seed = layout
    rng = np.random.default_rng(seed)
    starts = np.empty((len(segment_rows), width), dtype=np.int32)
    lengths = np.empty(len(segment_rows), dtype=np.int32)
    for r, cuts in enumerate(segment_rows):
        starts[r], lengths[r] = starts_from_lengths(cuts, width, rng)
    check_against_oracle(*tensors(rng, (len(lengths), 2, width, 5)), lengths, starts)
    spans = segment_spans(lengths, starts)
    expected = []
    for r, cuts in enumerate(segment_rows):
        column = 0
        for length in cuts:
            expected.append((r, column, column + length))
            column += length
    assert spans.tolist() == [list(span) for span in expected]


def test_finite_differences_of_the_objective():
    rng = np.random.default_rng(7)
    width = 7
    lengths = np.array([6, 3])
    starts = np.array([[0, 1, 1, 1, 4, 4, 0], [0, 0, 0, 0, 0, 0, 0]])
    q, k, v, weight = tensors(rng, (2, 2, width, 3))

    def objective(q, k, v):
        return float((range_attention_forward(q, k, v, lengths, starts)[0] * weight).sum())

    out, lse = range_attention_forward(q, k, v, lengths, starts)
    grads = range_attention_backward(q, k, v, out, lse, weight, lengths, starts)
    step = 1e-6
    for which, grad in enumerate(grads):
        numeric = np.zeros_like(grad)
        for index in np.ndindex(grad.shape):
            plus, minus = [q.copy(), k.copy(), v.copy()], [q.copy(), k.copy(), v.copy()]
            plus[which][index] += step
            minus[which][index] -= step
            numeric[index] = (objective(*plus) - objective(*minus)) / (2 * step)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)
    for grad in grads:
        assert not grad[0, :, 6:].any() and not grad[1, :, 3:].any()


def test_float32_error_is_within_a_small_multiple_of_a_float32_oracle():
    rng = np.random.default_rng(3)
    lengths, starts = mixed_layout(129, rng)
    q, k, v, dout = tensors(rng, (len(lengths), 2, 129, 32))
    exact = reference_forward(q, k, v, lengths, starts)[:2]
    exact += reference_backward(q, k, v, dout, lengths, starts)
    low = [x.astype(np.float32) for x in (q, k, v, dout)]
    fused = run_both(*low, lengths, starts)
    oracle = reference_forward(*low[:3], lengths, starts)[:2]
    oracle += reference_backward(*low, lengths, starts)
    for name, a, b, c in zip(NAMES, fused, oracle, exact):
        assert a.dtype == np.float32
        fused_error = np.abs(a - c).max()
        oracle_error = np.abs(b - c).max()
        assert fused_error <= 4 * oracle_error + 1e-7, (name, fused_error, oracle_error)


# --- poison, degenerate rows, determinism --------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_in_padding_leaves_valid_results_bit_identical(dtype):
    rng = np.random.default_rng(11)
    lengths, starts = mixed_layout(65, rng)
    q, k, v, dout = tensors(rng, (len(lengths), 2, 65, 8), dtype)
    clean = run_both(q, k, v, dout, lengths, starts)
    padding = ~permitted(lengths, starts)[1][:, None, :, None]
    poisoned = [np.where(padding, np.nan, x) for x in (q, k, v, dout)]
    out, lse = range_attention_forward(*poisoned[:3], lengths, starts)
    # Padding cells of out and lse are also poisoned: the backward must not read them.
    out_in = np.where(padding, np.nan, out)
    lse_in = np.where(padding[..., 0], np.inf, lse)
    grads = range_attention_backward(*poisoned[:3], out_in, lse_in, poisoned[3], lengths, starts)
    for name, a, b in zip(NAMES, clean, (out, lse, *grads)):
        assert not np.isnan(b).any(), name
        assert np.array_equal(a, b), name


def test_nan_in_other_segments_leaves_a_segment_bit_identical():
    rng = np.random.default_rng(12)
    width = 90
    starts_row, used = starts_from_lengths([30, 1, 40, 9], width, rng)
    lengths, starts = np.array([used]), starts_row[None]
    q, k, v, dout = tensors(rng, (1, 3, width, 8))
    clean = run_both(q, k, v, dout, lengths, starts)
    inside = np.zeros(width, dtype=bool)
    inside[31:71] = True  # the 40-token segment
    outside = ~inside[None, None, :, None]
    poisoned = run_both(*(np.where(outside, np.nan, x) for x in (q, k, v, dout)), lengths, starts)
    for name, a, b in zip(NAMES, clean, poisoned):
        assert np.array_equal(a[:, :, inside], b[:, :, inside]), name
        assert not np.isnan(b[:, :, inside]).any(), name
    # Negative control: poisoning a key of the segment itself does reach its outputs.
    k_bad = k.copy()
    k_bad[0, 0, 35] = np.nan
    assert np.isnan(range_attention_forward(q, k_bad, v, lengths, starts)[0][0, 0, 40]).all()


# (where, cell): a non-finite value put in one valid cell of the long segment [20, 320).
POISONED_CELLS = [(name, cell) for name in ("q", "k", "v", "dout") for cell in (20, 83, 84, 150, 319)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_non_finite_cell_reaches_only_the_results_that_read_it(dtype):
    """An inf or NaN in a valid cell of a segment meets the zeros that stand for later
    keys (or earlier queries) in the tile products; 0 * inf is NaN, so every row's chain
    must skip them. Queries before a poisoned key or value, every other query of a
    poisoned query or upstream gradient, and the keys after it keep their exact results,
    on every CPU path, across query tiles (64) and product chunks (256 keys), with
    grouped-query heads."""
    from seqpack.nn import _attention

    rng = np.random.default_rng(13)
    width = 330
    starts_row, used = starts_from_lengths([20, 300, 5], width, rng)
    lengths, starts = np.array([used]), starts_row[None]
    q, dout = tensors(rng, (1, 4, width, 40), dtype, count=2)
    k, v = tensors(rng, (1, 2, width, 40), dtype, count=2)
    before_segment, segment_end = 20, 320
    try:
        for path in _attention.cpu_paths():
            assert _attention.use_cpu_path(_attention.CPU_PATHS.index(path)) >= 0
            clean = dict(zip(NAMES, run_both(q, k, v, dout, lengths, starts)))
            for (name, cell), bad in [(poisoned, bad) for bad in (np.inf, np.nan) for poisoned in POISONED_CELLS]:
                inputs = {"q": q.copy(), "k": k.copy(), "v": v.copy(), "dout": dout.copy()}
                inputs[name][0, 1, cell, 7] = bad  # query head 1 or key/value head 1 (query heads 2 and 3)
                results = dict(zip(NAMES, run_both(*inputs.values(), lengths, starts)))
                cells = np.arange(width)
                outside = (cells < before_segment) | (cells >= segment_end)
                if name in ("k", "v"):  # queries before it never see it
                    kept = {"out": outside | (cells < cell), "lse": outside | (cells < cell),
                            "dq": outside | (cells < cell), "dk": outside, "dv": outside}
                else:  # its own query's results only, and keys up to it
                    kept = {"out": cells != cell, "lse": cells != cell, "dq": cells != cell,
                            "dk": outside | (cells > cell), "dv": outside | (cells > cell)}
                    if name == "dout":
                        kept["out"] = kept["lse"] = np.ones(width, dtype=bool)
                for result, keep in kept.items():
                    assert np.array_equal(clean[result][:, :, keep], results[result][:, :, keep]), \
                        (path, name, cell, bad, result)
    finally:
        assert _attention.use_cpu_path(-1) >= 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_are_bitwise_equal_across_runs_and_thread_counts(dtype):
    rng = np.random.default_rng(5)
    lengths = np.array([256, 200])
    starts = np.zeros((2, 256), dtype=np.int64)
    starts[1, 100:] = 100
    inputs = tensors(rng, (2, 4, 256, 32), dtype)
    first = run_both(*inputs, lengths, starts, threads=1)
    for threads in (2, 2, 1, None):
        again = run_both(*inputs, lengths, starts, threads=threads)
        for name, a, b in zip(NAMES, first, again):
            assert a.tobytes() == b.tobytes(), (name, threads)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="torch.set_flush_denormal switches flush-to-zero on x86 CPUs only")
def test_every_thread_works_in_the_callers_floating_point_mode():
    """An OpenMP pool thread kept the floating-point mode it started with: with
    flush-to-zero switched on in the caller (torch.set_flush_denormal) once the pool
    existed, the item another thread ran kept its subnormal outputs, and threads=1 and 2
    differed in 32768 of 262144 cells."""
    torch = pytest.importorskip("torch", reason="switches flush-to-zero with torch: pip install 'seqpack[torch]'")
    rng = np.random.default_rng(0)
    lengths, starts = np.array([1024]), np.zeros((1, 1024), dtype=np.int64)
    starts[0, 512:] = 512
    q, k, v, dout = tensors(rng, (1, 4, 1024, 64), np.float32)
    v *= np.float32(1e-39)   # subnormal values, so that outputs and gradients are subnormal
    run_both(q, k, v, dout, lengths, starts, threads=2)   # the pool exists now
    assert torch.set_flush_denormal(True)
    try:
        first = run_both(q, k, v, dout, lengths, starts, threads=1)
        second = run_both(q, k, v, dout, lengths, starts, threads=2)
    finally:
        torch.set_flush_denormal(False)
    for name, a, b in zip(NAMES, first, second):
        assert a.tobytes() == b.tobytes(), name


def test_inactive_queries_give_zero_output_lse_and_gradients():
    rng = np.random.default_rng(2)
    lengths = np.array([0, 3])
    starts = np.zeros((2, 5), dtype=np.int64)
    out, lse, dq, dk, dv = run_both(*tensors(rng, (2, 1, 5, 4)), lengths, starts)
    for array in (out, lse, dq, dk, dv):
        assert not array[0].any() and not array[1, :, 3:].any()
        assert np.isfinite(array).all()
    assert np.abs(out[1, :, :3]).min() > 0


def test_empty_shapes_give_empty_results():
    for shape in [(0, 2, 4, 3), (2, 0, 4, 3), (2, 2, 0, 3)]:
        q = np.zeros(shape)
        lengths = np.zeros(shape[0], dtype=np.int64)
        starts = np.zeros((shape[0], shape[2]), dtype=np.int64)
        out, lse = range_attention_forward(q, q, q, lengths, starts)
        grads = range_attention_backward(q, q, q, out, lse, q, lengths, starts)
        assert out.shape == shape and lse.shape == shape[:3]
        assert all(g.shape == shape for g in grads)


# --- array layouts and buffers -----------------------------------------------------------


def test_read_only_and_non_contiguous_inputs_match_contiguous_ones():
    rng = np.random.default_rng(9)
    lengths, starts = mixed_layout(40, rng)
    q, k, v, dout = tensors(rng, (len(lengths), 2, 40, 6))
    expected = run_both(q, k, v, dout, lengths, starts)
    # [rows, T, heads, d] storage viewed as [rows, heads, T, d], read-only.
    strided = []
    for x in (q, k, v, dout):
        view = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        view.flags.writeable = False
        strided.append(view)
    wide_starts = np.zeros((len(lengths), 80), dtype=np.int16)
    wide_starts[:, ::2] = starts
    odd_lengths = np.repeat(lengths.astype(np.uint8), 2)[::2]
    for array in (odd_lengths, wide_starts):
        array.flags.writeable = False
    actual = run_both(*strided, odd_lengths, wide_starts[:, ::2])
    for name, a, b in zip(NAMES, expected, actual):
        assert np.array_equal(a, b), name


def test_caller_buffers_are_filled_and_returned():
    rng = np.random.default_rng(4)
    lengths, starts = mixed_layout(30, rng)
    q, k, v, dout = tensors(rng, (len(lengths), 2, 30, 4))
    expected = run_both(q, k, v, dout, lengths, starts)
    buffers = [np.full_like(q, np.nan), np.full(q.shape[:3], np.nan)]
    buffers += [np.full_like(q, np.nan) for _ in range(3)]
    out, lse = range_attention_forward(q, k, v, lengths, starts, out=buffers[0], lse=buffers[1])
    assert out is buffers[0] and lse is buffers[1]
    grads = range_attention_backward(
        q, k, v, out, lse, dout, lengths, starts, dq=buffers[2], dk=buffers[3], dv=buffers[4]
    )
    assert all(g is b for g, b in zip(grads, buffers[2:]))
    for name, a, b in zip(NAMES, expected, buffers):
        assert np.array_equal(a, b), name


# --- validation: every error beside its passing twin ---------------------------------------


def small_case(dtype=np.float64):
    rng = np.random.default_rng(0)
    q, k, v = tensors(rng, (2, 1, 4, 3), dtype, count=3)
    return q, k, v, np.array([4, 2]), np.array([[0, 0, 2, 2], [0, 1, 0, 0]])


def forward_with(**changes):
    q, k, v, lengths, starts = small_case()
    arguments = dict(q=q, k=k, v=v, valid_lengths=lengths, segment_starts=starts)
    options = {name: changes.pop(name) for name in ("threads", "out", "lse") if name in changes}
    arguments.update(changes)
    return range_attention_forward(*arguments.values(), **options)


@pytest.mark.parametrize(
    "bad, good, message",
    [
        (dict(q=np.zeros((2, 1, 4, 3), np.float16)), dict(q=np.zeros((2, 1, 4, 3), np.float64)),
         "q must be float32 or float64"),
        (dict(k=np.zeros((2, 1, 4, 3), np.float32)), dict(k=np.zeros((2, 1, 4, 3))),
         "k has dtype float32; q has float64"),
        (dict(q=np.zeros((2, 4, 3))), dict(q=np.zeros((2, 1, 4, 3))), r"q must be \[rows"),
        (dict(v=np.zeros((2, 1, 4, 2))), dict(v=np.zeros((2, 1, 4, 3))), "v has shape"),
        (dict(q=np.zeros((2, 1, 4, 0)), k=np.zeros((2, 1, 4, 0)), v=np.zeros((2, 1, 4, 0))),
         dict(q=np.zeros((2, 1, 4, 1)), k=np.zeros((2, 1, 4, 1)), v=np.zeros((2, 1, 4, 1))),
         "head_dim must be at least 1"),
        (dict(valid_lengths=np.array([4.0, 2.0])), dict(valid_lengths=np.array([4, 2], np.int8)),
         "valid_lengths must have an integer dtype"),
        (dict(segment_starts=np.zeros((2, 4), np.float32)),
         dict(segment_starts=np.zeros((2, 4), np.uint16)), "segment_starts must have an integer"),
        (dict(valid_lengths=np.array([4, 2, 0])), dict(valid_lengths=np.array([4, 2])),
         r"valid_lengths has shape \(3,\); expected \(2,\)"),
        (dict(segment_starts=np.zeros((2, 5), int)), dict(segment_starts=np.zeros((2, 4), int)),
         r"segment_starts has shape \(2, 5\)"),
        (dict(valid_lengths=np.array([5, 2])), dict(valid_lengths=np.array([4, 2])),
         r"valid_lengths\[0\] = 5 is outside \[0, 4\]"),
        (dict(valid_lengths=np.array([4, -1])), dict(valid_lengths=np.array([4, 0])),
         r"valid_lengths\[1\] = -1 is outside \[0, 4\]"),
        (dict(segment_starts=np.array([[0, 0, 3, 3], [0, 1, 0, 0]])),
         dict(segment_starts=np.array([[0, 0, 2, 2], [0, 1, 0, 0]])),
         r"segment_starts\[0, 2\] = 3 for valid query 2 of row 0 is outside \[0, 2\]"),
        (dict(segment_starts=np.array([[0, 0, 2, 2], [-1, 1, 0, 0]])),
         dict(segment_starts=np.array([[0, 0, 2, 2], [0, 1, 0, 0]])),
         r"segment_starts\[1, 0\] = -1"),
        (dict(segment_starts=np.array([[0, 0, 2, 0], [0, 1, 0, 0]])),
         dict(segment_starts=np.array([[0, 0, 2, 2], [0, 1, 0, 0]])),
         r"segment_starts\[0, 3\] = 0 neither starts a segment at column 3 nor continues"),
        (dict(segment_starts=np.array([[0, 0, 1, 1], [0, 1, 0, 0]])),
         dict(segment_starts=np.array([[0, 0, 0, 0], [0, 1, 0, 0]])),
         r"segment_starts\[0, 2\] = 1 neither starts"),
        (dict(threads=0), dict(threads=1), "threads must be at least 1, got 0"),
        (dict(threads=True), dict(threads=np.int64(2)), "threads must be an int"),
        (dict(threads=1.0), dict(threads=None), "threads must be an int"),
        (dict(out=np.zeros((2, 1, 4, 3), np.float32)), dict(out=np.zeros((2, 1, 4, 3))),
         "out has shape"),
        (dict(out=np.zeros((2, 1, 3, 4)).transpose(0, 1, 3, 2)), dict(out=np.zeros((2, 1, 4, 3))),
         "out must be writeable, with a contiguous last axis"),
        (dict(lse=np.zeros((2, 1, 4)).tolist()), dict(lse=np.zeros((2, 1, 4))),
         "lse must be a numpy array"),
    ],
)
def test_forward_errors_beside_passing_twins(bad, good, message):
    forward_with(**good)
    with pytest.raises(InvalidInputError, match=message):
        forward_with(**bad)


def test_inactive_starts_are_ignored():
    # Column 3 of row 1 is padding: its start may break every rule.
    q, k, v, lengths, starts = small_case()
    expected = range_attention_forward(q, k, v, lengths, starts)
    starts[1, 2:] = [77, -3]
    actual = range_attention_forward(q, k, v, lengths, starts)
    assert all(np.array_equal(a, b) for a, b in zip(expected, actual))
    # Even a uint64 start past int64 there (it was refused: review); in an active cell it is.
    wide = starts.astype(np.uint64)
    wide[1, 2:] = np.iinfo(np.uint64).max
    actual = range_attention_forward(q, k, v, lengths, wide)
    assert all(np.array_equal(a, b) for a, b in zip(expected, actual))
    assert np.array_equal(segment_spans(lengths, wide), segment_spans(lengths, starts))
    wide[0, 0] = np.iinfo(np.uint64).max
    with pytest.raises(InvalidInputError, match=r"segment_starts holds 18446744073709551615, outside the int64"):
        range_attention_forward(q, k, v, lengths, wide)


def test_read_only_output_buffer_is_rejected():
    q, k, v, lengths, starts = small_case()
    out = np.zeros_like(q)
    out.flags.writeable = False
    with pytest.raises(InvalidInputError, match="out must be writeable, with a contiguous last axis"):
        range_attention_forward(q, k, v, lengths, starts, out=out)


def test_backward_errors_beside_passing_twins():
    q, k, v, lengths, starts = small_case()
    out, lse = range_attention_forward(q, k, v, lengths, starts)
    range_attention_backward(q, k, v, out, lse, out, lengths, starts)
    with pytest.raises(InvalidInputError, match=r"lse has shape \(2, 1\); expected \(2, 1, 4\)"):
        range_attention_backward(q, k, v, out, lse[..., 0], out, lengths, starts)
    with pytest.raises(InvalidInputError, match="dout has dtype float32; q has float64"):
        range_attention_backward(q, k, v, out, lse, out.astype(np.float32), lengths, starts)
    with pytest.raises(InvalidInputError, match="dq has shape"):
        range_attention_backward(q, k, v, out, lse, out, lengths, starts, dq=lse)
    bad_starts = starts.copy()
    bad_starts[0, 3] = 0
    with pytest.raises(InvalidInputError, match=r"segment_starts\[0, 3\] = 0 neither starts"):
        range_attention_backward(q, k, v, out, lse, out, lengths, bad_starts)


def test_segment_spans_twins():
    lengths, starts = np.array([4, 0, 3]), np.array([[0, 1, 1, 3], [9, 9, 9, 9], [0, 0, 0, 5]])
    assert segment_spans(lengths, starts).tolist() == [[0, 0, 1], [0, 1, 3], [0, 3, 4], [2, 0, 3]]
    with pytest.raises(InvalidInputError, match=r"segment_starts\[2, 3\] = 5"):
        segment_spans(np.array([4, 0, 4]), starts)
    with pytest.raises(InvalidInputError, match=r"segment_starts must be \[rows, T\]"):
        segment_spans(lengths, starts[0])
