"""No silent wrong answer: aliased buffers, memory of the loss and of validation, the head_dim
limit, and the smaller edges a hostile caller finds."""

import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import seqpack as sp
from seqpack.nn import _attention
from seqpack.nn.kernel_arguments import MAX_HEAD_DIM

TRAIN = sp.Partition.TRAIN


def attention_inputs(dtype=np.float64, shape=(2, 2, 70, 8)):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    lengths = np.array([70, 41])
    starts = np.zeros(shape[:1] + shape[2:3], np.int64)
    starts[0, 30:] = 30
    return q, k, v, dout, lengths, starts


# --- aliased output buffers ------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["q", "k", "v"])
def test_forward_out_aliasing_an_input_is_refused(alias):
    q, k, v, _, lengths, starts = attention_inputs()
    inputs = {"q": q, "k": k, "v": v}
    with pytest.raises(sp.InvalidInputError, match=f"out overlaps {alias} in memory"):
        sp.range_attention_forward(q, k, v, lengths, starts, out=inputs[alias])
    expected, _ = sp.range_attention_forward(q, k, v, lengths, starts)
    buffer = np.empty_like(q)
    assert np.array_equal(sp.range_attention_forward(q, k, v, lengths, starts, out=buffer)[0], expected)


def test_an_overlap_too_hard_to_decide_is_refused_as_one(monkeypatch):
    # The error was looked up as np.exceptions.TooHardError, which numpy 1.24 (the oldest
    # supported) does not have: the lookup itself would have raised AttributeError (review).
    from seqpack import _arguments

    def too_hard(*arrays, **options):
        raise _arguments._TOO_HARD("too hard")

    assert _arguments._TOO_HARD is getattr(np, "exceptions", np).TooHardError
    monkeypatch.setattr(np, "shares_memory", too_hard)
    q, k, v, _, lengths, starts = attention_inputs()
    with pytest.raises(sp.InvalidInputError, match="out overlaps q in memory"):
        sp.range_attention_forward(q, k, v, lengths, starts, out=q)


def test_lse_overlapping_q_and_gradients_sharing_a_buffer_are_refused():
    q, k, v, dout, lengths, starts = attention_inputs()
    lse_view = q.reshape(-1)[: 2 * 2 * 70].reshape(2, 2, 70)  # a view into q's memory
    with pytest.raises(sp.InvalidInputError, match="lse overlaps q"):
        sp.range_attention_forward(q, k, v, lengths, starts, lse=lse_view)
    out, lse = sp.range_attention_forward(q, k, v, lengths, starts)
    shared = np.empty_like(q)
    with pytest.raises(sp.InvalidInputError, match="dq overlaps dk"):
        sp.range_attention_backward(q, k, v, out, lse, dout, lengths, starts, dq=shared, dk=shared)
    with pytest.raises(sp.InvalidInputError, match="dv overlaps dout"):
        sp.range_attention_backward(q, k, v, out, lse, dout, lengths, starts, dv=dout)
    scores = np.random.default_rng(1).standard_normal((2, 4, 4))
    with pytest.raises(sp.InvalidInputError, match="out overlaps scores"):
        sp.nn.range_softmax_forward(scores, out=scores)


def test_head_dim_past_the_tile_budget_is_refused():
    assert MAX_HEAD_DIM == _attention.MAX_HEAD_DIM == 4096
    lengths, starts = np.array([2]), np.zeros((1, 2), np.int64)
    fits = np.ones((1, 1, 2, MAX_HEAD_DIM), np.float32)
    sp.range_attention_forward(fits, fits, fits, lengths, starts)
    wide = np.ones((1, 1, 2, MAX_HEAD_DIM + 1), np.float32)
    with pytest.raises(sp.InvalidInputError, match="head_dim 4097 exceeds 4096"):
        sp.range_attention_forward(wide, wide, wide, lengths, starts)


# --- memory ------------------------------------------------------------------------------------


def big_packed_batch(binding, rows=8, width=512):
    rng = np.random.default_rng(2)
    lengths = rng.integers(20, 200, 40)
    docs = [[0, *rng.integers(2, 266, n - 1).tolist(), 1] for n in lengths]
    tokens = np.array([t for d in docs for t in d], np.int32)
    offsets = np.concatenate(([0], np.cumsum([len(d) for d in docs])))
    table = sp.ExampleTable.from_arrays(tokens, offsets, binding)
    return sp.pack(table, sp.PackConfig(width, rows_per_batch=rows), partition=TRAIN, binding=binding)[0]


@pytest.mark.slow
def test_float32_loss_holds_about_twice_the_logits(binding):
    """Forward and backward on float32 logits: no float64 copy, gradient in float32."""
    batch = big_packed_batch(binding)
    vocabulary = 8192  # a wide vocabulary, so that the logits dominate every other allocation
    tracemalloc.start()
    logits = np.random.default_rng(3).standard_normal(batch.shape + (vocabulary,), dtype=np.float32)
    gradient = _loss_and_gradient(logits, batch, vocabulary)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"logits {logits.nbytes / 2**20:.0f} MiB, traced peak {peak / 2**20:.0f} MiB "
          f"({peak / logits.nbytes:.2f}x)")
    assert gradient.dtype == np.float32 and gradient.shape == logits.shape
    assert peak <= 2.2 * logits.nbytes


def _loss_and_gradient(logits, batch, vocabulary):
    """The masked loss of ``batch`` under a vocabulary of ``vocabulary`` IDs (targets stay below 266)."""
    from seqpack.nn.loss import masked_nll

    loss = masked_nll(logits, batch.targets, batch.loss_mask)
    reference = float(np.mean([
        np.log(np.exp(logits[r, c].astype(np.float64)).sum()) - logits[r, c, batch.targets[r, c]]
        for r, c in zip(*np.nonzero(batch.loss_mask))
    ]))
    assert loss.mean == pytest.approx(reference, rel=1e-6)
    return loss.backward()["logits"]


def test_complex_and_non_numeric_logits_are_refused(binding):
    batch = sp.chapters.chapter_batch("packed", binding)
    logits = np.zeros(batch.shape + (binding.vocabulary_size,), np.complex128)
    with pytest.raises(sp.InvalidInputError, match="logits must be real numbers, got dtype complex128"):
        sp.masked_loss(logits, batch)
    with pytest.raises(sp.InvalidInputError, match="takes a padded or packed batch"):
        sp.masked_loss(logits.real, sp.pack(sp.chapters.chapter_examples("packed", binding), sp.PackConfig(6),
                                            partition=TRAIN, binding=binding))
    assert sp.masked_loss(logits.real.astype(np.float32), batch).mean == pytest.approx(np.log(266), rel=1e-6)


def test_torch_tensors_numpy_cannot_view_are_named(binding):
    """A tensor that requires grad (or has its negative bit set) raised torch's RuntimeError
    from the numpy layer's functions (review)."""
    torch = pytest.importorskip("torch", reason="the torch extra has it: pip install 'seqpack[torch]'")
    batch = sp.chapters.chapter_batch("packed", binding)
    logits = torch.zeros(batch.shape + (binding.vocabulary_size,), dtype=torch.float64, requires_grad=True)
    q = torch.zeros((1, 1, 4, 2), dtype=torch.float64)
    layout = (np.array([4]), np.zeros((1, 4), np.int64))
    calls = [("logits", lambda: sp.masked_loss(logits, batch)),
             ("logits", lambda: sp.nn.sequence_logprobs(logits, batch)),
             ("k", lambda: sp.nn.range_attention_forward(q, q.clone().requires_grad_(True), q, *layout))]
    for name, call in calls:
        with pytest.raises(sp.InvalidInputError, match=f"{name} must be a numpy array \\(seqpack.torch takes torch "
                                                         f"tensors\\): Can't call numpy\\(\\) on Tensor that"):
            call()


def test_validation_memory_does_not_grow_with_the_vocabulary():
    """A tokenizer seqpack does not decode, with 2**31 IDs: nothing sized by the vocabulary."""
    identity = sp.TokenizerIdentity(2**31, 0, 1, "cd" * 32)
    binding = sp.BatchBinding.for_tokenizer(identity, split="huge-vocabulary")
    tokens = np.array([0, 2**31 - 1, 5, 1] * 1000, np.int64)
    offsets = np.arange(0, 4001, 4)
    tracemalloc.start()
    table = sp.ExampleTable.from_arrays(tokens, offsets, binding)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(table) == 1000 and peak < 1 << 20


# --- the smaller edges -----------------------------------------------------------------------


def test_a_lone_surrogate_is_a_tokenizer_error():
    with pytest.raises(sp.TokenizerError, match="lone surrogate.*character 2") as caught:
        sp.ByteTokenizer().encode_document("ab\ud800c")
    assert caught.value.position == 2


def test_table_example_outside_the_table_is_refused(binding):
    table = sp.ExampleTable.from_arrays([0, 5, 1, 0, 6, 1], [0, 3, 6], binding)
    assert table.example(1).id == "#1" and table.example_id(np.int64(0)) == "#0"
    for ordinal, message in ((-1, r"example -1 is outside this table's examples \[0, 2\)"),
                             (2, r"example 2 is outside this table's examples \[0, 2\)"),
                             (True, "an example ordinal must be an int, not bool"),
                             (1.0, "an example ordinal must be an int, not float")):
        with pytest.raises(sp.InvalidInputError, match=message):
            table.example(ordinal)


def run_cli(*arguments, **options):
    return subprocess.run([sys.executable, "-m", "seqpack", *arguments], capture_output=True, text=True,
                          **options)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes")
def test_cli_on_a_closed_pipe_exits_quietly():
    result = subprocess.run(f"{sys.executable} -m seqpack demo packed | head -1", shell=True,
                            capture_output=True, text=True, executable="/bin/bash",
                            env={"PATH": "/usr/bin:/bin", "SHELLOPTS": "pipefail"})
    assert result.stdout == "{\n" and result.stderr == "" and result.returncode == 0


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_cli_on_a_full_disk_prints_one_line_and_exits_1():
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "seqpack", "demo", "packed"], stdout=full,
                                stderr=subprocess.PIPE, text=True)
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["seqpack: error: cannot write the output: No space left on device"]


@pytest.mark.slow
@pytest.mark.bench
def test_bench_help_and_every_selected_dtype():
    help_text = run_cli("bench", "--help")
    assert help_text.returncode == 0 and "attention" in help_text.stdout
    assert run_cli("bench", "attention", "--help").returncode == 0
    table = run_cli("bench", "attention", "--workload", "c", "--dtype", "float32", "--repeats", "1")
    assert table.returncode == 0 and "workload (c) float32" in table.stdout and "seqpack fused" in table.stdout


def test_arguments_of_a_wrong_type_are_named(tmp_path):
    """Each of these raised Python's or numpy's own error (an array's ambiguous truth value,
    'NoneType is not iterable', an AttributeError, an offset overflow, a ragged array), or
    was accepted: verify_dataset(batches="no") verified the batches, and text_field=2.5
    failed later with 'no field 2.5'."""
    from seqpack import io

    binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="tests")
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    io.pack_corpus([io.JsonLines(tmp_path / "a.jsonl")], tmp_path / "out", binding=binding,
                   tokenizer=sp.ByteTokenizer(), config=sp.PackConfig(16))
    table = sp.ExampleTable.from_texts(["hello"], binding, capacity=16)
    batch = sp.pack(table, sp.PackConfig(16, 1), partition=TRAIN, binding=binding).batches[0]
    array = np.array([1, 2])
    calls = [
        ("long must be one of .*, not array", lambda: sp.ExampleTable.from_texts(["x"], binding, capacity=8, long=array)),
        ("attention must be one of .*, not array", lambda: sp.nn.Decoder(sp.DecoderConfig.small(), 0, array)),
        ("binding must be a BatchBinding, not ndarray",
         lambda: sp.nn.masked_loss(np.zeros((1, 16, 258)), batch, binding=array)),
        ("logits is not a regular array", lambda: sp.nn.masked_loss([[1.0, 2.0], [3.0]], batch)),
        ("logits is not a regular array", lambda: sp.nn.sequence_logprobs([[1.0, 2.0], [3.0]], batch)),
        ("texts must be a sequence of str or bytes, not NoneType",
         lambda: sp.ExampleTable.from_texts(None, binding, capacity=8)),
        ("paths must be a path or a list of paths, not NoneType", lambda: io.TextFiles(None)),
        ("text_field must be a field name \\(a str\\), not float", lambda: io.JsonLines(tmp_path / "a.jsonl",
                                                                                      text_field=2.5)),
        ("start is 1180591620717411303424; the maximum is 9223372036854775807",
         lambda: io.JsonLines(tmp_path / "a.jsonl", start=2**70)),
        ("expected a path \\(str or os.PathLike\\), got NoneType", lambda: io.verify_dataset(None)),
        ("batches must be a bool, got str", lambda: io.verify_dataset(tmp_path / "out", batches="no")),
        ("expected a path \\(str or os.PathLike\\) for tokenizer, got float",
         lambda: io.verify_dataset(tmp_path / "out", tokenizer=2.5)),
        ("progress must be a seqpack.io Progress or None, not str",
         lambda: io.verify_dataset(tmp_path / "out", progress="x")),
    ]
    for message, call in calls:
        with pytest.raises(sp.InvalidInputError, match=message):
            call()
