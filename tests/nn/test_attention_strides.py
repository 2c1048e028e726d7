"""Strided arrays go into the range attention kernels without copies.

The kernels take any array whose last axis is contiguous and whose other strides are
non-negative multiples of the item size: ``[B, H, T, D]`` views of ``[B, T, H, D]``
storage (as a Hugging Face model's projections hand them over) are read, and outputs
written, in place. The results are bitwise those of contiguous arrays.
"""

import tracemalloc

import numpy as np
import pytest
from helpers import mixed_layout

from seqpack import InvalidInputError
from seqpack.nn.attention import range_attention_backward, range_attention_forward

pytestmark = pytest.mark.kernel

NAMES = ("out", "lse", "dq", "dk", "dv")


def heads_view(x):
    """``x`` [B, H, T, D] stored as [B, T, H, D] and viewed back as [B, H, T, D]."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def run_both(q, k, v, dout, lengths, starts, **options):
    out, lse = range_attention_forward(q, k, v, lengths, starts, **options)
    grads = range_attention_backward(q, k, v, out, lse, dout, lengths, starts, **options)
    return (out, lse, *grads)


def case(seed=0, heads=4, kv_heads=2, width=90, head_dim=8, dtype=np.float64):
    rng = np.random.default_rng(seed)
    lengths, starts = mixed_layout(width, rng)
    rows = len(lengths)
    q, dout = (rng.standard_normal((rows, heads, width, head_dim)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((rows, kv_heads, width, head_dim)).astype(dtype) for _ in range(2))
    return q, k, v, dout, lengths, starts


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 3)])
def test_views_of_token_major_storage_give_the_contiguous_bits(dtype, heads, kv_heads):
    q, k, v, dout, lengths, starts = case(heads=heads, kv_heads=kv_heads, dtype=dtype)
    expected = run_both(q, k, v, dout, lengths, starts)
    views = [heads_view(x) for x in (q, k, v, dout)]
    assert not views[0].flags.c_contiguous
    for name, a, b in zip(NAMES, expected, run_both(*views, lengths, starts)):
        assert a.tobytes() == b.tobytes(), name


def test_outputs_are_written_straight_into_token_major_storage():
    q, k, v, dout, lengths, starts = case(seed=1)
    expected = run_both(q, k, v, dout, lengths, starts)
    rows, heads, width, head_dim = q.shape
    out_storage = np.full((rows, width, heads, head_dim), np.nan)
    lse_storage = np.full((rows, heads, 2, width), np.nan)  # every other [T] block
    grad_storage = [np.full((rows, width, x.shape[1], head_dim), np.nan) for x in (q, k, v)]
    out = out_storage.transpose(0, 2, 1, 3)
    lse = lse_storage[:, :, 0]
    q_in, k_in, v_in, dout_in = (heads_view(x) for x in (q, k, v, dout))
    got_out, got_lse = range_attention_forward(q_in, k_in, v_in, lengths, starts, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    grads = [g.transpose(0, 2, 1, 3) for g in grad_storage]
    returned = range_attention_backward(q_in, k_in, v_in, out, lse, dout_in, lengths, starts,
                                        dq=grads[0], dk=grads[1], dv=grads[2])
    assert all(a is b for a, b in zip(returned, grads))
    for name, a, b in zip(NAMES, expected, (out, lse, *grads)):
        assert np.array_equal(a, b), name
    assert np.isnan(lse_storage[:, :, 1]).all()  # the blocks in between are untouched


def test_other_strides_are_taken_in_place_too():
    """Every other head, every other cell, a broadcast (stride 0) K head axis."""
    q, k, v, dout, lengths, starts = case(seed=2, heads=2, kv_heads=1)
    expected = run_both(q, k, v, dout, lengths, starts)
    wide = np.zeros(q.shape[:1] + (4,) + q.shape[2:])
    wide[:, ::2] = q
    cells = np.zeros(q.shape[:2] + (2 * q.shape[2],) + q.shape[3:])
    cells[:, :, ::2] = dout
    broadcast_k = np.broadcast_to(k[:, :1], k.shape)  # one head, stride 0 on the head axis
    actual = run_both(wide[:, ::2], broadcast_k, v, cells[:, :, ::2], lengths, starts)
    for name, a, b in zip(NAMES, expected, actual):
        assert a.tobytes() == b.tobytes(), name


def test_no_input_sized_copy_is_made():
    q, k, v, dout, lengths, starts = case(seed=3, width=256, head_dim=32)
    views = [heads_view(x) for x in (q, k, v, dout)]
    out = np.empty(q.shape[:1] + q.shape[2:3] + q.shape[1:2] + q.shape[3:]).transpose(0, 2, 1, 3)
    lse = np.empty(q.shape[:3])
    grads = [np.empty_like(x) for x in views[:3]]
    range_attention_forward(*views[:3], lengths, starts, out=out, lse=lse)  # warm up
    tracemalloc.start()
    try:
        range_attention_forward(*views[:3], lengths, starts, out=out, lse=lse)
        range_attention_backward(*views[:3], out, lse, views[3], lengths, starts,
                                 dq=grads[0], dk=grads[1], dv=grads[2])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < q.nbytes // 8, (peak, q.nbytes)
    # The negative control: a copy of a view (what the kernels no longer make) is traced.
    tracemalloc.start()
    try:
        np.ascontiguousarray(views[0])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak >= q.nbytes


@pytest.mark.parametrize(
    "make",
    [lambda x: x[..., ::-1],  # reversed last axis
     lambda x: x[:, :, ::-1],  # negative cell stride
     lambda x: np.asfortranarray(x),  # last axis not contiguous
     lambda x: np.frombuffer(b"\0" + x.tobytes(), x.dtype, count=x.size, offset=1).reshape(x.shape)
     if x.dtype.itemsize > 1 else x,  # unaligned
     lambda x: np.lib.stride_tricks.as_strided(x, strides=x.strides[:2] + (0,) + x.strides[3:]),
     lambda x: x.astype(x.dtype.newbyteorder(">" if x.dtype.byteorder != ">" else "<"))],  # refused before (review)
    ids=["reversed-last", "negative-cells", "fortran", "unaligned", "zero-cell-stride", "byte-swapped"],
)
def test_layouts_the_kernels_cannot_take_are_copied_with_the_same_result(make):
    q, k, v, dout, lengths, starts = case(seed=4, heads=2, kv_heads=1, width=40)
    odd = [make(x) for x in (q, k, v, dout)]
    expected = run_both(*(np.ascontiguousarray(x) for x in odd), lengths, starts)
    for name, a, b in zip(NAMES, expected, run_both(*odd, lengths, starts)):
        assert a.tobytes() == b.tobytes(), name


def test_strided_buffers_that_overlap_are_rejected_and_disjoint_ones_accepted():
    q, k, v, dout, lengths, starts = case(seed=5)
    rows, heads, width, head_dim = q.shape
    # out and dq interleaved in one [rows, T, 2, heads, d] array: disjoint, both accepted.
    shared = np.empty((rows, width, 2, heads, head_dim))
    out, dq = shared[:, :, 0].transpose(0, 2, 1, 3), shared[:, :, 1].transpose(0, 2, 1, 3)
    out, lse = range_attention_forward(q, k, v, lengths, starts, out=out)
    range_attention_backward(q, k, v, out, lse, dout, lengths, starts, dq=dq)
    # The same storage for q and out: rejected.
    storage = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    with pytest.raises(InvalidInputError, match="out overlaps q in memory"):
        range_attention_forward(storage.transpose(0, 2, 1, 3), k, v, lengths, starts,
                                out=storage.transpose(0, 2, 1, 3))
    # dk and dv as views of the same cells, once with heads swapped: rejected.
    kv = np.empty((rows, width, k.shape[1], head_dim))
    with pytest.raises(InvalidInputError, match="dk overlaps dv in memory"):
        range_attention_backward(q, k, v, out, lse, dout, lengths, starts,
                                 dk=kv.transpose(0, 2, 1, 3), dv=kv[:, :, ::-1].transpose(0, 2, 1, 3)[:, ::-1])


def test_outputs_may_not_alias_inputs_given_as_other_buffers():
    """An input given as a memoryview or a torch tensor is checked by its memory too."""
    q, k, v, dout, lengths, starts = case(seed=7, kv_heads=4)
    v = v.copy()
    with pytest.raises(InvalidInputError, match="out overlaps v in memory"):
        range_attention_forward(q, k, memoryview(v), lengths, starts, out=v)
    torch = pytest.importorskip("torch", reason="the torch case needs the torch extra: pip install 'seqpack[torch]'")
    with pytest.raises(InvalidInputError, match="out overlaps v in memory"):
        range_attention_forward(q, k, torch.from_numpy(v), lengths, starts, out=v)
    out, lse = range_attention_forward(q, k, v, lengths, starts)
    k = k.copy()
    with pytest.raises(InvalidInputError, match="dq overlaps k in memory"):
        range_attention_backward(q, torch.from_numpy(k), v, out, lse, dout, lengths, starts, dq=k)


def test_buffers_that_overlap_themselves_or_reverse_are_rejected():
    q, k, v, dout, lengths, starts = case(seed=6)
    base = np.empty(q.shape)
    shared_heads = np.lib.stride_tricks.as_strided(base, strides=(base.strides[0], 0) + base.strides[2:])
    with pytest.raises(InvalidInputError, match=r"out overlaps itself in memory \(strides"):
        range_attention_forward(q, k, v, lengths, starts, out=shared_heads)
    with pytest.raises(InvalidInputError, match="out must be writeable, with a contiguous last axis"):
        range_attention_forward(q, k, v, lengths, starts, out=base[:, :, ::-1])
    with pytest.raises(InvalidInputError, match="lse must be writeable, with a contiguous last axis"):
        range_attention_forward(q, k, v, lengths, starts, lse=np.empty(q.shape[:3] + (2,))[..., 0])
    range_attention_forward(q, k, v, lengths, starts, out=base[:, ::-1][:, ::-1], lse=np.empty(q.shape[:3]))


def test_axes_of_length_one_may_have_any_stride():
    """numpy calls such arrays C-contiguous whatever those strides are: they must not reach
    the tile products as a row stride."""
    q, k, v, dout, lengths, starts = case(seed=7, heads=2, kv_heads=1, width=1)
    expected = run_both(q, k, v, dout, lengths, starts)
    views = []
    for x in (q, k, v, dout):
        strides = [2**40 if n == 1 else s for n, s in zip(x.shape, x.strides)]
        strides[2] = 2**40 if x is q else -(2**40)  # past a C int, or negative
        views.append(np.lib.stride_tricks.as_strided(x, strides=strides))
    assert views[1].strides[1] == 2**40 and views[0].strides[2] == 2**40
    for name, a, b in zip(NAMES, expected, run_both(*views, lengths, starts)):
        assert a.tobytes() == b.tobytes(), name


def test_ragged_arguments_are_named():
    # numpy's ValueError escaped from every nn entry point but the loss's logits (review).
    from seqpack.nn import masked_nll, range_softmax_forward, segment_spans
    from seqpack.nn.ops import embedding
    from seqpack.nn.autograd import Tensor

    q = np.zeros((1, 1, 3, 4))
    ragged = [[0, 1], [2]]
    cases = [
        (lambda: range_attention_forward(q, q, q, ragged, np.zeros((1, 3), int)), "valid_lengths"),
        (lambda: range_attention_forward(q, q, q, [3], ragged), "segment_starts"),
        (lambda: range_attention_forward([[[[0.0], [1.0, 2.0]]]], q, q, [3], np.zeros((1, 3), int)), "q"),
        (lambda: range_softmax_forward(ragged, [2], [[0, 0]]), "scores"),
        (lambda: range_softmax_forward(np.zeros((2, 2)), ragged, [[0, 0], [0, 0]]), "lengths"),
        (lambda: segment_spans([3], ragged), "segment_starts"),
        (lambda: masked_nll(np.zeros((2, 5)), ragged, np.ones(2, bool)), "targets"),
        (lambda: masked_nll(np.zeros((2, 5)), np.zeros(2, int), ragged), "loss_mask"),
        (lambda: embedding(Tensor(np.zeros((4, 2))), ragged), "token IDs"),
    ]
    for call, name in cases:
        with pytest.raises(InvalidInputError, match=f"^{name} is not a regular array"):
            call()
    with pytest.raises(InvalidInputError, match=r"the embedding table must be \[V, D\], got shape \(4,\)"):
        embedding(Tensor(np.zeros(4)), [0])
