"""``seqpack.torch.range_attention``: gradcheck, SDPA with a dense block-causal mask as the
oracle (grouped-query heads included), low-precision dtypes, strided inputs, poisoned
padding, determinism and argument errors."""

import tracemalloc

import numpy as np
import pytest

import seqpack as sp

torch = pytest.importorskip("torch", reason="seqpack.torch needs PyTorch: pip install 'seqpack[torch]'")
import seqpack.torch as st  # noqa: E402

pytestmark = pytest.mark.kernel

# Rows: three segments and padding; one segment filling the row; nothing valid.
LENGTHS = np.array([11, 13, 0])
SEGMENTS = [[4, 1, 6], [13], []]


def layout(width=13, rows_segments=SEGMENTS):
    """Segment starts and local positions of rows holding ``rows_segments`` from column 0."""
    starts = np.zeros((len(rows_segments), width), dtype=np.int64)
    positions = np.zeros_like(starts)
    for row, segments in enumerate(rows_segments):
        column = 0
        for length in segments:
            starts[row, column:column + length] = column
            positions[row, column:column + length] = np.arange(length)
            column += length
    return starts, positions


def inputs(heads, kv_heads, dtype=torch.float64, width=13, dim=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(3, heads, width, dim, generator=generator, dtype=dtype)
    k, v = (torch.randn(3, kv_heads, width, dim, generator=generator, dtype=dtype) for _ in range(2))
    return q, k, v


def dense_reference(q, k, v, scale=None):
    """SDPA with the dense block-causal mask; inactive queries see only themselves (SDPA needs a key)."""
    starts, _ = layout(q.shape[2])
    column = np.arange(q.shape[2])
    active = column[None, :] < LENGTHS[:, None]
    mask = active[:, :, None] & active[:, None, :] & (column[None, None, :] >= starts[:, :, None]) \
        & (column[None, None, :] <= column[None, :, None])
    mask |= ~active[:, :, None] & (column[None, None, :] == column[None, :, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.from_numpy(mask[:, None]), scale=scale, enable_gqa=True)
    return out, torch.from_numpy(active)[:, None, :, None]


def ours(q, k, v, **options):
    starts, _ = layout(q.shape[2])
    return st.range_attention(q, k, v, segment_starts=starts, valid_lengths=LENGTHS, **options)


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_gradcheck_in_float64(heads, kv_heads, scale):
    q, k, v = (t.requires_grad_() for t in inputs(heads, kv_heads, width=7, dim=3))
    starts, _ = layout(7, [[2, 1, 3], [7], []])

    def attention(q, k, v):
        return st.range_attention(q, k, v, segment_starts=starts, valid_lengths=[6, 7, 0], scale=scale)

    assert torch.autograd.gradcheck(attention, (q, k, v), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_forward_and_backward_match_sdpa_with_a_dense_mask(dtype, tolerance, heads, kv_heads, scale):
    q, k, v = inputs(heads, kv_heads, dtype, width=13, dim=8, seed=heads + kv_heads)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=dtype)
    results = []
    for attention in (ours, dense_reference):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, scale=scale)
        out, active = out if isinstance(out, tuple) else (out, None)
        if active is not None:
            out = out * active  # SDPA's inactive queries must not feed the objective
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, got, expected in zip(("out", "dq", "dk", "dv"), *results):
        assert got.shape == expected.shape, name
        assert (got - expected).abs().max().item() <= tolerance * max(1.0, expected.abs().max().item()), name


def test_position_ids_alone_give_the_segment_starts():
    q, k, v = inputs(4, 2)
    starts, positions = layout()
    by_positions = st.range_attention(q, k, v, position_ids=torch.from_numpy(positions), valid_lengths=LENGTHS)
    assert torch.equal(by_positions, ours(q, k, v))
    # Without valid_lengths every cell is valid; a padding cell at position 0 is a segment of its own.
    everything = st.range_attention(q, k, v, position_ids=positions)
    assert torch.equal(everything[1], ours(q, k, v)[1])  # row 1 has no padding


def test_a_uint64_layout_past_int64_in_inactive_cells_is_ignored():
    # The nn kernels ignore an inactive cell's start; the torch wrapper refused it (review).
    q, k, v = inputs(4, 2)
    starts, positions = layout()
    for name, values in (("segment_starts", starts), ("position_ids", positions)):
        huge = values.astype(np.uint64)
        huge[0, LENGTHS[0]:] = 2**64 - 1  # past row 0's valid length
        result = st.range_attention(q, k, v, valid_lengths=LENGTHS, **{name: huge})
        assert torch.equal(result, ours(q, k, v)), name
        huge[0, 0] = 2**64 - 1  # an active cell: still refused
        with pytest.raises(sp.InvalidInputError, match=f"{name} holds 18446744073709551615, outside the int64"):
            st.range_attention(q, k, v, valid_lengths=LENGTHS, **{name: huge})


def test_a_packed_batch_gives_its_own_layout():
    batch = sp.chapters.fixtures.chapter_batch("packed", sp.BatchBinding.fixture())
    fields = st.tensors(batch)
    q = torch.randn(2, 2, 6, 4, dtype=torch.float64)
    by_starts = st.range_attention(q, q, q, segment_starts=fields["segment_starts"],
                                   valid_lengths=fields["valid_lengths"])
    by_positions = st.range_attention(q, q, q, position_ids=fields["positions"], valid_lengths=fields["valid_lengths"])
    assert torch.equal(by_starts, by_positions)


def test_position_errors_and_their_twins():
    q, k, v = inputs(2, 2)
    _, positions = layout()
    broken = positions.copy()
    broken[0, 5] = 2  # the one-token segment at column 4 ended; 2 neither restarts nor continues it
    with pytest.raises(sp.InvalidInputError, match=r"position_ids\[0, 5\] = 2 after the previous position 0"):
        st.range_attention(q, k, v, position_ids=broken, valid_lengths=LENGTHS)
    broken[0, 5:11] = np.arange(1, 7)  # the twin: the segment at column 4 continues to column 10
    st.range_attention(q, k, v, position_ids=broken, valid_lengths=LENGTHS)
    broken[0, 12] = 7  # past row 0's valid length of 11: ignored
    st.range_attention(q, k, v, position_ids=broken, valid_lengths=LENGTHS)
    first = positions.copy()
    first[1, 0] = 1
    with pytest.raises(sp.InvalidInputError, match=r"position_ids\[1, 0\] = 1 after a row's first column"):
        st.range_attention(q, k, v, position_ids=first, valid_lengths=LENGTHS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_computed_in_float32(dtype):
    q, k, v = (t.to(dtype).requires_grad_() for t in inputs(4, 2, torch.float32))
    out = ours(q, k, v)
    assert out.dtype == dtype
    wide = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = ours(*wide)
    assert torch.equal(out, expected.to(dtype))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(grad)
    expected.backward(grad.float())
    for low, high in zip((q, k, v), wide):
        assert low.grad.dtype == dtype and torch.equal(low.grad, high.grad.to(dtype))


def test_strided_views_give_the_same_bits_without_copies():
    """Projections hand over ``view(B, T, H, D).transpose(1, 2)``: non-contiguous views,
    read in place (numpy allocations are traced: a copy of q would add its bytes)."""
    q, k, v = inputs(4, 2, width=13, dim=32)
    grad = torch.randn(q.shape, dtype=torch.float64)
    results, peaks = [], []
    for views in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        args = [t.transpose(1, 2).contiguous().transpose(1, 2) if views else t for t in leaves]
        assert all(not a.is_contiguous() for a in args) == views
        ours(*args).backward(grad)  # warm-up: first-use imports and caches are not the call's bytes
        for leaf in leaves:
            leaf.grad = None
        tracemalloc.start()
        out = ours(*args)
        out.backward(grad)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        results.append([out] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert peaks[1] < peaks[0] + q.numel() * q.element_size() // 2, peaks


def test_expanded_gradients_and_repeated_runs_are_bitwise_equal():
    q, k, v = inputs(4, 2)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ours(*leaves).sum().backward()  # the gradient arrives as an expanded (stride 0) tensor
        runs.append([t.grad for t in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert runs[0][1].shape == k.shape and runs[0][1].abs().sum() > 0


def test_poisoned_padding_changes_nothing():
    q, k, v = inputs(4, 2)
    active = torch.from_numpy(np.arange(13)[None, :] < LENGTHS[:, None])[:, None, :, None]
    poisoned = [torch.where(active, t, torch.full_like(t, float("nan"))) for t in (q, k, v)]
    assert torch.isnan(poisoned[0]).any()
    runs = []
    for tensors in ((q, k, v), poisoned):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = ours(*leaves)
        out.backward(torch.ones_like(out))
        runs.append([out] + [t.grad for t in leaves])
    for clean, dirty in zip(*runs):
        assert torch.equal(clean, dirty)  # no NaN anywhere, padding outputs and gradients exactly zero
    assert (runs[1][0] * ~active == 0).all() and (runs[1][1] * ~active == 0).all()


def test_argument_errors():
    q, k, v = inputs(4, 2)
    starts, positions = layout()
    with pytest.raises(sp.InvalidInputError, match="give exactly one of segment_starts and position_ids"):
        st.range_attention(q, k, v, segment_starts=starts, position_ids=positions)
    with pytest.raises(sp.InvalidInputError, match="q, k and v must share a dtype"):
        st.range_attention(q, k.float(), v, segment_starts=starts)
    with pytest.raises(sp.InvalidInputError, match="not a multiple of the 3 key/value heads"):
        st.range_attention(q, *inputs(4, 3)[1:], segment_starts=starts)
    with pytest.raises(sp.InvalidInputError, match="k has dtype torch.int64; expected a floating dtype"):
        st.range_attention(q, k.long(), v, segment_starts=starts)
    with pytest.raises(sp.InvalidInputError, match="valid_lengths\\[1\\] = 14 is outside \\[0, 13\\]"):
        st.range_attention(q, k, v, segment_starts=starts, valid_lengths=[11, 14, 0])
    st.range_attention(q, k, v, segment_starts=starts, valid_lengths=[11, 13, 0])
    with pytest.raises(sp.InvalidInputError, match="position_ids must hold integers"):
        st.range_attention(q, k, v, position_ids=torch.zeros(3, 13))
    with pytest.raises(sp.InvalidInputError, match=r"segment_starts has shape \(3, 12\); expected \(3, 13\)"):
        st.range_attention(q, k, v, segment_starts=starts[:, :12])
    with pytest.raises(sp.InvalidInputError, match="v must be a torch.Tensor, not ndarray"):
        st.range_attention(q, k, v.numpy(), segment_starts=starts)


def test_sparse_tensors_are_refused_and_negated_views_read_as_their_values():
    """A sparse q was a TypeError from numpy, a lazily negated view (``torch._neg_view``)
    a RuntimeError ('negative bit set')."""
    q, k, v = inputs(4, 2)
    with pytest.raises(sp.InvalidInputError, match=r"^q is a sparse_coo tensor; range_attention takes dense \(strided\) "
                                                   r"tensors$"):
        ours(q.to_sparse(), k, v)
    negated = torch._neg_view(-q).requires_grad_()
    plain = q.clone().requires_grad_()
    out, expected = ours(negated, k, v), ours(plain, k, v)
    assert torch.equal(out, expected)
    gradient = torch._neg_view(-torch.randn_like(out))
    out.backward(gradient)
    expected.backward(gradient.resolve_neg())
    assert torch.equal(negated.grad, plain.grad)


def test_double_backward_is_an_error_not_a_silent_zero():
    """A gradient penalty differentiates the gradient again; the kernels' gradients are not
    differentiable, and torch's once_differentiable would let the second-order terms
    through as zero. A first-order backward, with or without retain_graph, is unchanged."""
    q, k, v = (x.requires_grad_() for x in inputs(4, 2))
    out = ours(q, k, v)
    gradients = torch.autograd.grad(out.square().sum(), (q, k, v), retain_graph=True)
    assert all(torch.isfinite(g).all() for g in gradients)
    with pytest.raises(sp.InvalidInputError, match="differentiable once: its gradients cannot be differentiated"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(sp.InvalidInputError, match="differentiable once"):
        torch.autograd.grad(out.sum(), q, create_graph=True)  # an incoming gradient needing no graph


def test_the_backward_reads_the_layout_of_the_forward():
    # The forward kept the caller's int64 layout arrays: writing into them before the backward changed
    # the gradients, silently (review).
    q, k, v = (x.requires_grad_() for x in inputs(4, 2))
    starts, lengths = torch.from_numpy(layout()[0]), torch.from_numpy(LENGTHS.copy())
    out = st.range_attention(q, k, v, segment_starts=starts, valid_lengths=lengths)
    gradient = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    expected = torch.autograd.grad(ours(q, k, v), (q, k, v), gradient)
    starts.zero_()
    lengths.fill_(2)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (q, k, v), gradient), expected))


def test_layout_tensors_that_hold_no_dense_values_are_named():
    # A sparse or meta layout raised torch's TypeError or NotImplementedError (review).
    q, k, v = inputs(4, 2)
    starts, positions = (torch.from_numpy(a) for a in layout())
    for name, bad, message in (("segment_starts", starts.to_sparse(), "a sparse_coo tensor; the layout takes dense"),
                               ("segment_starts", starts.to("meta"), "on meta, which holds no values"),
                               ("position_ids", positions.to("meta"), "on meta, which holds no values"),
                               ("valid_lengths", torch.from_numpy(LENGTHS).to_sparse(), "a sparse_coo tensor")):
        other = {"segment_starts": starts} if name == "valid_lengths" else {}
        with pytest.raises(sp.InvalidInputError, match=f"{name} is {message}"):
            st.range_attention(q, k, v, **{name: bad}, **other)
    negated = torch._neg_view(-torch.from_numpy(layout()[1]))   # a lazily negated view of the positions
    assert torch.equal(st.range_attention(q, k, v, position_ids=negated, valid_lengths=LENGTHS), ours(q, k, v))
