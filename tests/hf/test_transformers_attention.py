"""seqpack attention inside transformers models equals transformers' own attention.

A tiny ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` (random weights,
4 query heads, 2 key/value heads) with ``attn_implementation="seqpack"`` on packed rows gives every valid
logit, the loss and every parameter gradient of the same model run on each example
alone with ``"sdpa"`` (float64 within ``1e-10 + 1e-9 * max``, float32 within 1e-5), and
of ``"sdpa"`` on the same packed rows. No ``[T, T]`` tensor is ever made, strided views
are read in place, and what seqpack attention cannot compute is an error.
"""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="seqpack.hf needs PyTorch: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")

from hf_cases import CAPACITY, close, float64_norms, model, packed
from transformers import AutoModelForCausalLM, FalconConfig, GPT2Config  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss

import seqpack.hf as sph
import seqpack.hf.attention as attention_module
from seqpack.errors import InvalidInputError


def separate_step(net, batch, docs, count):
    """Each example alone (no position_ids, no mask): logits per example, loss over ``count``."""
    net.zero_grad()
    logits, total = [], 0.0
    for doc in docs:
        inputs = torch.from_numpy(doc[None, :-1])
        out = net(input_ids=inputs, use_cache=False)
        loss = ForCausalLMLoss(out.logits, None, net.config.vocab_size, num_items_in_batch=count,
                               shift_labels=torch.from_numpy(doc[None, 1:]))
        loss.backward()
        total += float(loss.detach())
        logits.append(out.logits[0])
    return logits, total, {name: p.grad.clone() for name, p in net.named_parameters()}


def packed_step(net, batch):
    net.zero_grad()
    out = net(**sph.rows(batch))
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in net.named_parameters()}


def cells_of(batch, logits, docs):
    """Each document's logits out of the packed ``[rows, T, V]`` logits (documents in input order)."""
    found = []
    for occurrence in sorted(batch.occurrences, key=lambda o: o.ordinal):
        found.append(logits[occurrence.row, occurrence.columns.start:occurrence.columns.stop])
    assert [len(f) for f in found] == [len(d) - 1 for d in docs]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_seqpack_equals_each_example_alone_with_sdpa(kind, dtype, monkeypatch):
    if dtype == torch.float64:
        float64_norms(monkeypatch)
    batch, docs = packed()
    assert batch.shape[0] >= 4 and (batch.valid_lengths == CAPACITY).any() and (batch.valid_lengths < CAPACITY).any()
    ours = model(kind, dtype)
    out, grads = packed_step(ours, batch)
    reference = model(kind, dtype, attention="sdpa")
    logits, loss, expected = separate_step(reference, batch, docs, batch.target_count)
    assert close(out.loss, torch.tensor(loss, dtype=out.loss.dtype))
    for got, want in zip(cells_of(batch, out.logits, docs), logits):
        assert close(got, want)
    assert expected.keys() == grads.keys() and len(grads) > 10
    for name, gradient in grads.items():
        assert gradient.abs().max() > 0, name
        assert close(gradient, expected[name]), name


def positions_withheld_model(kind, attention):
    """A float64 model whose layers never hand ``position_ids`` to their attention function
    (GPTBigCode's blocks do not get them; Persimmon's attention takes them as a named
    argument and keeps them)."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM, PersimmonConfig, PersimmonForCausalLM

    sph.register()
    torch.manual_seed(0)
    if kind == "gpt_bigcode":
        built = GPTBigCodeForCausalLM(GPTBigCodeConfig(
            vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False, attn_pdrop=0.0,
            resid_pdrop=0.0, embd_pdrop=0.0))
    else:
        built = PersimmonForCausalLM(PersimmonConfig(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            use_cache=False, pad_token_id=None, bos_token_id=0, eos_token_id=1))
    built.set_attn_implementation(attention)
    return built.double()


@pytest.mark.slow
@pytest.mark.parametrize("padding_mask", [False, True], ids=["positions", "positions-and-mask"])
@pytest.mark.parametrize("kind", ["gpt_bigcode", "persimmon"])
def test_packed_rows_stay_apart_when_the_model_withholds_position_ids(kind, padding_mask):
    """transformers found the packing in the model's position_ids and composed it into the
    mask function; seqpack's mask hook passes those sequences on. Before, these models' rows
    were one segment each: every example attended to the examples packed before it. With a
    2-D padding mask transformers does not look for packing at all (sdpa then mixes the
    examples); the hook reads the model's position_ids itself."""
    batch, docs = packed()
    ours = positions_withheld_model(kind, "seqpack")
    reference = positions_withheld_model(kind, "sdpa")
    fields = sph.rows(batch)
    if padding_mask:
        columns = torch.arange(batch.shape[1])
        fields["attention_mask"] = (columns[None, :] < fields["valid_lengths"][:, None]).long()
        assert not fields["attention_mask"].all()
    with torch.no_grad():
        out = ours(**fields)
        for got, doc in zip(cells_of(batch, out.logits, docs), docs):
            alone = reference(input_ids=torch.from_numpy(doc[None, :-1]), use_cache=False).logits[0]
            assert close(got, alone)
        if not padding_mask:
            assert close(out.loss, reference(**sph.rows(batch)).loss)


@pytest.mark.slow
def test_packed_seqpack_equals_packed_sdpa(monkeypatch):
    float64_norms(monkeypatch)
    batch, _ = packed(seed=1)
    valid = torch.from_numpy(batch.token_valid.copy())
    out, grads = packed_step(model("llama", torch.float64), batch)
    want, expected = packed_step(model("llama", torch.float64, attention="sdpa"), batch)
    assert close(out.loss, want.loss)
    assert close(out.logits[valid], want.logits[valid])
    for name, gradient in grads.items():
        assert close(gradient, expected[name]), name


def test_flat_batch_with_cu_seq_lens_equals_rows():
    """flat() hands the model cu_seq_lens_q (and seq_idx, position_ids): the same logits as rows()."""
    batch, docs = packed(lengths=(5, 3, 9, 2))
    net = model("llama", torch.float64)
    with torch.no_grad():
        by_rows = net(**sph.rows(batch)).logits
        by_flat = net(**sph.flat(batch)).logits[0]
    ends = np.cumsum([len(d) for d in sorted_docs(batch, docs)])
    pieces = np.split(by_flat.numpy(), ends[:-1])
    valid = batch.token_valid
    flat_cells = by_rows.numpy()[valid]
    assert close(torch.from_numpy(np.concatenate([p[:-1] for p in pieces])), torch.from_numpy(flat_cells))


def sorted_docs(batch, docs):
    """Documents in row-major order of the batch (flat()'s order)."""
    order = sorted(batch.occurrences, key=lambda o: (o.row, o.columns.start))
    return [docs[o.ordinal] for o in order]


def test_each_segment_source_gives_the_same_layout():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5, 6, 8], dtype=torch.int32)
    expected = np.array([[0, 0, 0, 3, 3, 5, 6, 6]])
    for kwargs in ({"position_ids": positions}, {"seq_idx": seq_idx}, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}):
        lengths, starts = attention_module.layout(1, 8, None, kwargs)
        assert lengths.tolist() == [8] and np.array_equal(starts, expected), kwargs
    # transformers' rule: a position that does not continue the previous one starts a segment
    lengths, starts = attention_module.layout(1, 4, None, {"position_ids": torch.tensor([[5, 6, 2, 3]])})
    assert starts.tolist() == [[0, 0, 2, 2]]
    # offsets over two rows of 4: the second row holds one sequence and one padding cell
    lengths, starts = attention_module.layout(2, 4, None, {"cu_seq_lens_q": torch.tensor([0, 4, 7])})
    assert lengths.tolist() == [4, 3] and starts.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    lengths, _ = attention_module.layout(2, 4, mask, {})
    assert lengths.tolist() == [3, 4]


def test_padding_is_skipped_and_poison_in_it_changes_nothing():
    batch, _ = packed(lengths=(5, 3, 9, 2, 30))
    fields = sph.rows(batch)
    assert (batch.valid_lengths < CAPACITY).any()
    net = model("llama", torch.float64)
    seen = []
    real = attention_module.range_attention_forward

    def spy(q, k, v, lengths, starts, **kwargs):
        seen.append(np.asarray(lengths).copy())
        poisoned = np.arange(q.shape[2])[None, None, :, None] >= np.asarray(lengths)[:, None, None, None]
        k = np.where(poisoned, np.nan, k)  # NaN in every padding key: must never be read
        v = np.where(poisoned, np.nan, v)
        return real(q, k, v, lengths, starts, **kwargs)

    attention_module.range_attention_forward = spy
    try:
        with torch.no_grad():
            logits = net(**fields).logits
    finally:
        attention_module.range_attention_forward = real
    assert all(np.array_equal(s, batch.valid_lengths) for s in seen) and len(seen) == 2
    valid = torch.from_numpy(batch.token_valid.copy())
    assert torch.isfinite(logits[valid]).all()
    with torch.no_grad():
        clean = net(**fields).logits
    assert torch.equal(logits[valid], clean[valid])


@pytest.mark.slow
def test_views_are_read_in_place_and_the_output_is_written_into_cells_storage():
    batch, _ = packed(lengths=(5, 3, 9))
    net = model("llama", torch.float64)
    calls = []
    real_forward, real_backward = attention_module.range_attention_forward, attention_module.range_attention_backward

    def forward(q, k, v, lengths, starts, out=None, **kwargs):
        calls.append(("forward", v.strides, out.strides, v.shape, out.shape))
        return real_forward(q, k, v, lengths, starts, out=out, **kwargs)

    def backward(*args, dq=None, dk=None, dv=None, **kwargs):
        calls.append(("backward", dq.strides, dk.strides, dq.shape, dk.shape))
        return real_backward(*args, dq=dq, dk=dk, dv=dv, **kwargs)

    attention_module.range_attention_forward, attention_module.range_attention_backward = forward, backward
    try:
        net(**sph.rows(batch)).loss.backward()
    finally:
        attention_module.range_attention_forward = real_forward
        attention_module.range_attention_backward = real_backward
    assert [c[0] for c in calls] == ["forward", "forward", "backward", "backward"]
    for name, first, second, shape_one, shape_two in calls:
        for strides, (rows, heads, width, head_dim) in ((first, shape_one), (second, shape_two)):
            # [B, heads, T, D] views of [B, T, heads, D] storage: the cell stride spans every head
            assert strides == (8 * width * heads * head_dim, 8 * head_dim, 8 * heads * head_dim, 8), name


@pytest.mark.slow
def test_no_t_by_t_tensor_is_made():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for tensor in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(tensor, torch.Tensor):
                    self.shapes.append(tuple(tensor.shape))
            return result

    batch, _ = packed()
    width = batch.shape[1]
    found = {}
    for implementation in ("seqpack", "sdpa"):
        net = model("llama", torch.float64, attention=implementation)
        fields = sph.rows(batch)
        with Shapes() as mode:
            net(**fields).loss.backward()
        found[implementation] = [s for s in mode.shapes if len(s) >= 2 and s[-2:] == (width, width)]
    assert found["seqpack"] == []
    assert found["sdpa"]  # negative control: transformers builds the dense block mask for sdpa


@pytest.mark.parametrize("case, message", [
    ("dropout", "no dropout"),
    ("cache", "use_cache=False"),
    ("window", "sliding window \\(or attention chunk\\) of 8"),
    ("mask4d", "4-D attention mask"),
    ("left", "not right-padded"),
    ("softcap", "softcapping"),
    ("weights", "computes no attention weights"),
    ("built cache", "does not use a cache \\(the model built a cache for this call\\)"),
    ("captured weights", "computes no attention weights"),
    ("kept weights", "computes no attention weights"),
    ("alibi", "does not compute an additive position bias \\(this model's config has alibi=True\\)"),
])
def test_what_seqpack_attention_cannot_compute_is_an_error(case, message):
    sph.register()
    batch, _ = packed(lengths=(5, 3, 9, 12))
    fields = sph.rows(batch)
    if case == "dropout":
        net = model("llama", attention_dropout=0.1)
        net.train()
    elif case == "cache":
        net = model("llama")
        fields["use_cache"] = True
    elif case == "window":
        net = model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    elif case == "mask4d":
        net = model("llama")
        fields["attention_mask"] = torch.ones(batch.shape[0], 1, batch.shape[1], batch.shape[1], dtype=torch.bool)
    elif case == "left":
        net = model("llama")
        fields = {"input_ids": fields["input_ids"], "attention_mask": torch.tensor([[0] + [1] * (batch.shape[1] - 1)]
                                                                                  * batch.shape[0])}
    elif case == "weights":
        net = model("llama")
        fields["output_attentions"] = True
    elif case == "built cache":  # GPTBigCode hands use_cache to no attention call
        net = positions_withheld_model("gpt_bigcode", "seqpack")
        net.config.use_cache = True
        del fields["use_cache"]
    elif case == "captured weights":  # GPT-2 collects them by hooks, without telling its attention calls
        config = GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0)
        net = AutoModelForCausalLM.from_config(config, attn_implementation="seqpack")
        fields = {"input_ids": fields["input_ids"], "output_attentions": True, "use_cache": False}
    elif case == "kept weights":  # Falcon's attention keeps the flag (attentions came back None; review)
        net = AutoModelForCausalLM.from_config(FalconConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                                                            num_attention_heads=4),
                                               attn_implementation="seqpack")
        fields = {"input_ids": fields["input_ids"], "output_attentions": True, "use_cache": False}
    elif case == "alibi":
        net = AutoModelForCausalLM.from_config(FalconConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                                                            num_attention_heads=4, alibi=True),
                                               attn_implementation="seqpack")
        fields = {"input_ids": fields["input_ids"], "use_cache": False}
    else:
        net = model("llama")
        fields["softcap"] = 30.0
    with pytest.raises(InvalidInputError, match=message):
        net(**fields)


def test_models_it_cannot_run_in_are_refused_by_name():
    """Bloom and MPT compute attention in their own code: Bloom read the mask hook's None
    as no mask at all (a future token changed earlier logits) and MPT failed inside
    transformers. DeepSeek-V3's value heads are narrower than its query heads: the error
    read like a caller's shape mistake."""
    from transformers import AutoModelForCausalLM, BloomConfig, DeepseekV3Config, MptConfig

    sph.register()
    ids = torch.tensor([[0, 50, 60, 70, 80]])
    own = "models compute attention in their own code, not through transformers' AttentionInterface"
    for config in (BloomConfig(vocab_size=300, hidden_size=64, n_layer=2, n_head=4),
                   MptConfig(vocab_size=300, d_model=64, n_layers=2, n_heads=4)):
        net = AutoModelForCausalLM.from_config(config, attn_implementation="seqpack")
        with pytest.raises(InvalidInputError, match=rf"^{config.model_type} {own}"):
            net(input_ids=ids, use_cache=False)
    config = DeepseekV3Config(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                              kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2, use_cache=False)
    net = AutoModelForCausalLM.from_config(config, attn_implementation="seqpack")
    with pytest.raises(InvalidInputError, match=r"query, key and value heads of one size; this model's are 24, 24 "
                                                 r"and 16 \(multi-head latent attention"):
        net(input_ids=ids, use_cache=False)


def test_a_window_every_segment_fits_in_is_no_error():
    batch, _ = packed(lengths=(5, 3, 9, 12))
    net = model("qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=0)
    reference = model("qwen2", attention="sdpa", use_sliding_window=True, sliding_window=12, max_window_layers=0)
    valid = torch.from_numpy(batch.token_valid.copy())
    with torch.no_grad():
        assert close(net(**sph.rows(batch)).logits[valid], reference(**sph.rows(batch)).logits[valid])


def local_model(kind, span, attention):
    """A tiny model whose local attention (a sliding window, or chunks) of ``span`` reaches
    the attention function only through transformers' mask, not as a keyword."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, use_cache=False)
    if kind == "qwen2_moe":
        net = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2, num_experts_per_tok=1,
            use_sliding_window=True, sliding_window=span, max_window_layers=2, **common))
    else:
        net = Llama4ForCausalLM(Llama4TextConfig(intermediate_size_mlp=32, head_dim=8, num_local_experts=2,
                                                 attention_chunk_size=span, **common))
    net.set_attn_implementation(attention)
    return net.eval()


@pytest.mark.parametrize("kind", ["qwen2_moe", "llama4"])
def test_local_attention_known_only_to_the_mask_is_checked(kind):
    """A sliding window or attention chunk shorter than a segment is an error; one every
    segment fits in changes nothing, and the logits equal sdpa's."""
    sph.register()
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with pytest.raises(InvalidInputError, match="a segment of 12 tokens exceeds the sliding window .* of 4"):
        local_model(kind, 4, "seqpack")(input_ids=ids)
    with torch.no_grad():
        ours = local_model(kind, 16, "seqpack")(input_ids=ids).logits
        theirs = local_model(kind, 16, "sdpa")(input_ids=ids).logits
    assert close(ours, theirs)


def test_llama4_query_temperature_of_a_later_column_is_refused():
    """Llama 4 scales its layers without rotary embeddings by a temperature of the row's
    column: an example packed past the first floor_scale columns got another one than
    alone, silently (review). Within them, packed rows equal each example alone."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    sph.register()

    def build(attention):
        torch.manual_seed(0)
        net = Llama4ForCausalLM(Llama4TextConfig(
            vocab_size=300, hidden_size=32, intermediate_size=32, intermediate_size_mlp=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, attention_chunk_size=64,
            no_rope_layers=[1, 0], floor_scale=8, attn_scale=0.5, use_cache=False)).double()
        net.set_attn_implementation(attention)
        return net.eval()

    net, reference = build("seqpack"), build("sdpa")
    batch, _ = packed(lengths=(3, 4, 9))
    with pytest.raises(InvalidInputError, match=r"\(attn_temperature_tuning, floor_scale 8\): the sequence at row 0, "
                                                r"column \d+ would get another one than alone; keep each row under 7"):
        net(**sph.rows(batch))
    batch, docs = packed(lengths=(3, 2))   # every cell within the first 7 columns
    with torch.no_grad():
        found = cells_of(batch, net(**sph.rows(batch)).logits, docs)
        alone = [reference(input_ids=torch.from_numpy(doc[None, :-1])).logits[0] for doc in docs]
    assert all(close(a, b) for a, b in zip(found, alone))


def test_models_that_number_positions_otherwise_are_refused():
    """RoBERTa's family counts the positions it makes from padding_idx + 1, and the CSM depth
    decoder replaces the position_ids it is given with the row's columns: both gave packed
    results other than alone, silently (review)."""
    from transformers import CsmDepthDecoderConfig, CsmDepthDecoderForCausalLM, RobertaConfig, RobertaForCausalLM

    sph.register()
    batch, _ = packed(lengths=(14, 12, 11), rows_per_batch=1)
    common = dict(vocab_size=300, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  use_cache=False)
    roberta = RobertaForCausalLM(RobertaConfig(max_position_embeddings=64, is_decoder=True, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0, **common)).eval()
    depth = CsmDepthDecoderForCausalLM(CsmDepthDecoderConfig(num_codebooks=41, backbone_hidden_size=32,
                                                             num_key_value_heads=2, **common)).eval()
    for net, message in [(roberta, r"numbers its positions from padding_idx \+ 1 \(RoBERTa's convention"),
                         (depth, "the CSM depth decoder replaces the position_ids it is given with the row's columns")]:
        net.set_attn_implementation("seqpack")
        for layout in (sph.rows, sph.flat):
            fields = {k: v for k, v in layout(batch).items() if k not in ("labels", "shift_labels")}
            with pytest.raises(InvalidInputError, match=message):
                net(**fields)


@pytest.mark.slow
def test_padded_batch_with_a_right_padded_attention_mask():
    """transformers' usual padded batch (attention_mask, no position_ids) is honored, not ignored."""
    docs = [np.array([0, 5, 6, 7, 1]), np.array([0, 9, 1])]
    net = model("llama", torch.float64)
    ids = torch.tensor([[0, 5, 6, 7], [0, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        padded = net(input_ids=ids, attention_mask=mask).logits
        for row, doc in enumerate(docs):
            alone = net(input_ids=torch.from_numpy(doc[None, :-1])).logits[0]
            assert close(padded[row, :len(doc) - 1], alone)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_in_float32_and_returned_in_its_dtype(dtype):
    batch, _ = packed(lengths=(5, 3, 9, 12))
    valid = torch.from_numpy(batch.token_valid.copy())
    ours, reference = model("llama", dtype), model("llama", dtype, attention="sdpa")
    out = ours(**sph.rows(batch))
    out.loss.backward()
    want = reference(**sph.rows(batch))
    assert out.logits.dtype == dtype
    assert all(p.grad.dtype == dtype and torch.isfinite(p.grad).all() for p in ours.parameters())
    difference = (out.logits[valid].float() - want.logits[valid].float()).abs().max()
    assert difference <= 0.02 * want.logits[valid].float().abs().max()


def test_double_backward_is_an_error_and_gradient_checkpointing_runs():
    """Differentiating the gradients again (a gradient penalty) is refused by name; gradient
    checkpointing, which recomputes the forward inside the backward, gives the gradients of
    the plain step bit for bit."""
    batch, _ = packed(seed=3)
    plain, want = packed_step(model("llama", torch.float64), batch)
    net = model("llama", torch.float64)
    enable = getattr(net, "activation_checkpointing_enable", None) or net.gradient_checkpointing_enable  # renamed in 5.x
    enable()
    net.train()
    out, grads = packed_step(net, batch)
    assert torch.equal(out.logits, plain.logits)
    for name, gradient in grads.items():
        assert torch.equal(gradient, want[name]), name
    net = model("llama", torch.float64)
    loss = net(**sph.rows(batch)).loss
    with pytest.raises(InvalidInputError, match="differentiable once"):
        torch.autograd.grad(loss, list(net.parameters()), create_graph=True)


# --- keywords and arguments the attention hook refuses ---------------------------------


def paligemma(attention):
    """A tiny PaliGemma whose Gemma text model is causal, so only token_type_ids' prefix block
    (transformers' block_sequence_ids) makes part of the mask bidirectional."""
    from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

    sph.register()
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)
    text = GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, use_bidirectional_attention=False)
    torch.manual_seed(0)
    net = PaliGemmaForConditionalGeneration(PaliGemmaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=63, vocab_size=64,
        projection_dim=32)).eval()
    net.set_attn_implementation(attention)
    return net


# Regression: a token_type_ids prefix (bidirectional block) was computed as plain causal attention.
def test_a_bidirectional_block_in_the_mask_is_an_error():
    """PaliGemma's prefix (token_type_ids 0) attends bidirectionally through block_sequence_ids,
    which reach the mask function without use_vmap: seqpack used to compute plain causal
    attention there. Blocks of one token change nothing and are still computed."""
    ids = torch.randint(1, 60, (1, 8), generator=torch.Generator().manual_seed(0))
    ours, theirs = paligemma("seqpack"), paligemma("sdpa")
    for prefix in ("00001111", "10101010"):
        token_type_ids = torch.tensor([[int(c) for c in prefix]])
        with pytest.raises(InvalidInputError, match="bidirectionally \\(block_sequence_ids"):
            ours(input_ids=ids, token_type_ids=token_type_ids, use_cache=False)
    for prefix in ("11111111", "01111111"):
        token_type_ids = torch.tensor([[int(c) for c in prefix]])
        with torch.no_grad():
            got = ours(input_ids=ids, token_type_ids=token_type_ids, use_cache=False).logits
            want = theirs(input_ids=ids, token_type_ids=token_type_ids, use_cache=False).logits
        assert torch.allclose(got, want, atol=1e-5), prefix


# Regression: sparse key or block selections were ignored and every key attended to.
def test_sparse_key_and_block_selections_are_an_error():
    """A sparse-attention model hands the attention function the keys (``indices``) or blocks
    (``block_indices``) each query may read; seqpack used to attend to every key instead."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    sph.register()
    config = MiniMaxM3VLTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, index_n_heads=2, index_head_dim=8, index_block_size=2,
        index_topk_blocks=1, index_local_blocks=1, layer_types=["minimax_m3_sparse"], mlp_layer_types=["dense"],
        use_cache=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    net = MiniMaxM3VLForCausalLM(config).eval()
    net.set_attn_implementation("seqpack")
    with pytest.raises(InvalidInputError, match="block-sparse attention .*block_indices"):
        net(input_ids=torch.randint(1, 60, (1, 12), generator=torch.Generator().manual_seed(1)))
    query = torch.randn(1, 2, 4, 8)
    with pytest.raises(InvalidInputError, match="sparse attention over selected keys \\(indices"):
        sph.seqpack_attention(torch.nn.Module(), query, query, query, None,
                              indices=torch.zeros(1, 4, 2, dtype=torch.int32))


# Regression: segment, position and padding keywords that disagree were resolved silently.
@pytest.mark.parametrize("kwargs, mask, message", [
    # offsets that end before the valid cells: cells 5..7 used to join the sequence at 3
    ({"cu_seq_lens_q": torch.tensor([0, 3, 5]), "valid_lengths": torch.tensor([8])}, None,
     "cell 5 of row 0 is valid .* but in no sequence of cu_seq_lens_q"),
    ({"cu_seq_lens_q": torch.tensor([0, 3, 5])}, torch.tensor([[1] * 7 + [0]]),
     "cell 5 of row 0 is valid"),
    # positions restarting inside one sequence: the model's RoPE and the segments disagree
    ({"cu_seq_lens_q": torch.tensor([0, 8]), "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])}, None,
     "position_ids\\[0, 4\\] = 0 does not continue 3 inside one sequence of cu_seq_lens_q"),
    ({"seq_idx": torch.zeros(1, 8, dtype=torch.int32), "position_ids": torch.tensor([[0, 1, 2, 3, 7, 8, 9, 10]])},
     None, "position_ids\\[0, 4\\] = 7 does not continue 3 inside one sequence of seq_idx"),
    # two padding descriptions: valid_lengths used to win silently
    ({"valid_lengths": torch.tensor([8])}, torch.tensor([[1] * 5 + [0] * 3]),
     "valid_lengths\\[0\\] = 8 but attention_mask row 0 has 5 valid cells"),
    # cu_seq_lens_k alone used to be ignored
    ({"cu_seq_lens_k": torch.tensor([0, 3, 8])}, None, "cu_seq_lens_k was given without cu_seq_lens_q"),
])
def test_segment_position_and_padding_keywords_that_disagree_are_an_error(kwargs, mask, message):
    with pytest.raises(InvalidInputError, match=message):
        attention_module.layout(1, 8, mask, kwargs)


# Regression: the passing twins of the disagreeing keywords (offsets, positions, padding).
def test_segment_position_and_padding_keywords_that_agree_are_accepted():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    agreeing = [
        # positions continuing across a boundary of the offsets change nothing (RoPE is relative)
        ({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "position_ids": torch.arange(8)[None]}, None, [8]),
        ({"cu_seq_lens_q": cu, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}, None, [8]),
        # padding covered by the offsets (flash-attention style) or restarting positions is skipped
        ({"cu_seq_lens_q": cu, "valid_lengths": torch.tensor([5])}, None, [5]),
        ({"position_ids": torch.tensor([[0, 1, 0, 1, 2, 0, 1, 2]]), "valid_lengths": torch.tensor([5])},
         torch.tensor([[1] * 5 + [0] * 3]), [5]),
        ({"seq_idx": torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]]), "position_ids": torch.tensor([[4, 5, 6, 0, 1, 0, 9, 9]]),
          "valid_lengths": torch.tensor([6])}, None, [6]),
    ]
    for kwargs, mask, lengths in agreeing:
        assert attention_module.layout(1, 8, mask, kwargs)[0].tolist() == lengths, kwargs


# Regression: positions restarting inside one of flat()'s sequences were used silently.
def test_flat_with_positions_that_contradict_its_offsets_is_an_error():
    """flat()'s keywords give the sdpa logits; the same offsets with other positions raise."""
    batch, _ = packed(lengths=(5, 3, 9))
    net = model("llama", torch.float64)
    fields = sph.flat(batch)
    with torch.no_grad():
        net(**fields)
    fields["position_ids"] = torch.arange(fields["position_ids"].shape[1])[None] % 4
    with pytest.raises(InvalidInputError, match="does not continue .* cu_seq_lens_q"):
        net(**fields)


# Regression: valid_lengths silently won over an attention_mask that disagreed.
def test_rows_with_an_attention_mask_that_disagrees_with_valid_lengths_is_an_error():
    batch, _ = packed(lengths=(5, 3, 9, 30))
    assert (batch.valid_lengths < CAPACITY).any()
    fields = sph.rows(batch)
    net = model("llama", torch.float64)
    agreeing = (torch.arange(CAPACITY)[None] < fields["valid_lengths"][:, None]).long()
    with torch.no_grad():
        assert close(net(**fields, attention_mask=agreeing).logits, net(**fields).logits)
    shorter = agreeing.clone()
    shorter[:, 3:] = 0
    with pytest.raises(InvalidInputError, match="valid_lengths\\[0\\] = .* but attention_mask row 0 has 3"):
        net(**fields, attention_mask=shorter)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
     "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
], ids=["dynamic", "longrope"])
def test_rotary_frequencies_taken_from_the_longest_sequence_are_refused_beside_shorter_ones(rope):
    """transformers picks these frequencies from the forward's largest position: an example
    packed beside one past the threshold got other frequencies than alone, and its NLL
    differed by nats, silently (review)."""
    net = model(dtype=torch.float64, max_position_embeddings=16, rope_parameters=rope).eval()
    batch, _ = packed(lengths=(3, 30, 9))
    message = rf"rope_type '{rope['rope_type']}'\) takes its frequencies from the forward's largest position, "
    with pytest.raises(InvalidInputError, match=message + r"3\d positions, past 16; a sequence of \d+ here"):
        sph.evaluate(net, [batch])
    with pytest.raises(InvalidInputError, match=message):
        net(**sph.rows(batch))
    # Every sequence within 16 positions: the padding-free layout gives what each gets alone.
    # (rows() would not: its padding cells count on past 16, and are refused like a sequence.)
    batch, docs = packed(lengths=(3, 14, 9, 15, 2))
    with pytest.raises(InvalidInputError, match=message + r"37 positions, .* the padding's positions reach 37: "
                                                          r"give the batch as seqpack.hf.flat\(batch\)"):
        net(**sph.rows(batch))
    with torch.no_grad():
        alone = [torch.log_softmax(net(input_ids=torch.from_numpy(doc[None, :-1])).logits[0], -1)
                 .gather(1, torch.from_numpy(doc[1:, None])).sum().neg() for doc in docs]
    packed_sums = torch.from_numpy(sph.evaluate(net, [batch]).nll_sums)
    assert close(packed_sums, torch.stack(alone))
    # Sequences all past the threshold at one length (dynamic), or all past it (longrope), get
    # what each gets alone; a dynamic one was refused for no reason (review).
    for lengths in ((30,), (30, 30)) + (((30, 21),) if rope["rope_type"] == "longrope" else ()):
        batch, docs = packed(lengths=lengths)
        with torch.no_grad():
            sums = torch.from_numpy(sph.evaluate(net, [batch]).nll_sums)
            alone = [torch.log_softmax(net(input_ids=torch.from_numpy(doc[None, :-1])).logits[0], -1)
                     .gather(1, torch.from_numpy(doc[1:, None])).sum().neg() for doc in docs]
        assert close(sums, torch.stack(alone)), lengths


def test_under_autocast_query_key_and_value_of_mixed_dtypes_run_in_its_dtype():
    """Under autocast, float32 rotary tables leave a model's queries and keys float32 beside
    bfloat16 values; SDPA, an autocast op, runs them in bfloat16. The dtype check added
    this session refused every float32 model trained under autocast (review)."""
    net, reference = model(), model(attention="sdpa")
    batch, _ = packed()
    fields = sph.flat(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = net(**fields), reference(**fields)
        ours.loss.backward()
    assert (ours.logits - theirs.logits).abs().max() < 0.02
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
    query = torch.randn(1, 2, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output, _ = sph.seqpack_attention(torch.nn.Module(), query, query, query.bfloat16(), None)
    assert output.dtype == torch.bfloat16


# From the eee632d contract fuzz: bad attention-hook arguments were foreign errors or taken as numbers.
def test_the_attention_hook_checks_its_arguments_before_using_them():
    """Each was an IndexError, AttributeError or ValueError, or (a string or bool scaling)
    silently taken as a number."""
    query = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))

    def hook(*tensors, mask=None, **kwargs):
        return sph.seqpack_attention(torch.nn.Module(), *tensors, mask, **kwargs)[0]

    cases = [
        ((query[0, 0], query, query), {}, r"query must be a \[B, heads, T, D\] tensor, got shape \(4, 8\)"),
        ((query, query.numpy(), query), {}, r"key must be a \[B, heads, T, D\] tensor, got ndarray"),
        ((query, query, query), {"mask": np.ones((1, 4))}, "attention_mask must be a tensor or None, not ndarray"),
        ((query, query, query), {"mask": torch.ones(1, 1, 4, 4)}, r"4-D attention mask \(attention_mask has shape"),
        ((query, query, query), {"scaling": "0.5"}, "scaling must be a real number or None, got str"),
        ((query, query, query), {"scaling": True}, "scaling must be a real number or None, got bool"),
        ((query, query, query), {"scaling": float("nan")}, "scaling must be finite, got nan"),
        ((query, query, query), {"scaling": 10**400}, "scaling must be finite"),
        ((query, query, query), {"sliding_window": "4"}, "sliding_window must be an int, got str"),
        ((query, query, query), {"sliding_window": 4.0}, "sliding_window must be an int, got float"),
        # mixed dtypes: a 2-byte one was widened with the rest and computed (review), float64 named k and q
        ((query.bfloat16(), query, query), {}, "query, key and value must share a dtype, got torch.bfloat16, "
                                               "torch.float32 and torch.float32"),
        ((query, query.half(), query.bfloat16()), {}, "must share a dtype, got torch.float32, torch.float16"),
        ((query, query.double(), query), {}, "must share a dtype, got torch.float32, torch.float64"),
    ]
    for tensors, kwargs, message in cases:
        with pytest.raises(InvalidInputError, match=message):
            hook(*tensors, **kwargs)
    with pytest.raises(InvalidInputError, match="exceeds the sliding window .* of 3"):
        hook(query, query, query, sliding_window=np.int64(3))
    assert hook(query, query, query, scaling=np.float32(0.5), sliding_window=np.int64(4)).equal(
        hook(query, query, query, scaling=0.5))
    for dtype in (torch.bfloat16, torch.float16, torch.int64):   # a bfloat16 mask raised numpy's TypeError
        assert hook(query, query, query, mask=torch.ones(1, 4, dtype=dtype)).equal(hook(query, query, query))


def test_models_that_mix_positions_outside_attention_are_refused():
    """LFM2's convolutions and GraniteMoeHybrid's Mamba layers ran across a packed row's
    examples (their NLL differed from each example alone by 1.7e-4 and 0.21) with nothing
    refused (review)."""
    from transformers import GraniteMoeHybridConfig, Lfm2Config

    sph.register()
    batch, _ = packed(lengths=(5, 3, 9, 12))
    fields = sph.rows(batch)
    lfm2 = Lfm2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    granite = GraniteMoeHybridConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32,
                                     mamba_d_state=16, layer_types=["mamba", "attention"])
    for config, kind in ((lfm2, "conv"), (granite, "linear_attention")):
        net = AutoModelForCausalLM.from_config(config, attn_implementation="seqpack")
        with pytest.raises(InvalidInputError, match=rf"has '{kind}' layers, which mix positions outside attention"):
            net(**fields)
        with pytest.raises(InvalidInputError, match=rf"has '{kind}' layers|mixes positions outside attention"):
            attention_module.check_runs_attention_functions(net)
    # A model whose layers are only attention passes, with or without transformers' backend flag (Falcon lacks it).
    falcon = AutoModelForCausalLM.from_config(FalconConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                                                           num_attention_heads=4), attn_implementation="seqpack")
    attention_module.check_runs_attention_functions(falcon)
    attention_module.check_runs_attention_functions(model("llama"))


def test_a_model_that_reads_the_mask_before_attention_is_refused():
    # Doge turns the mask into its own dynamic mask before attention: an AttributeError on
    # seqpack's LayerMask escaped from the model and from evaluate (review).
    from transformers import DogeConfig

    sph.register()
    batch, _ = packed(lengths=(6, 9, 4))
    doge = AutoModelForCausalLM.from_config(
        DogeConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2), attn_implementation="seqpack")
    message = r"this model reads the attention mask's 'dtype' in its own code before attention"
    with pytest.raises(InvalidInputError, match=message):
        doge(**sph.rows(batch))
    with pytest.raises(InvalidInputError, match=message):
        sph.evaluate(doge, [batch])
    # DeepSeek-V3.2's indexer subscripts the mask (a TypeError from the model and from evaluate; review)
    from transformers import DeepseekV32Config

    v32 = AutoModelForCausalLM.from_config(
        DeepseekV32Config(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                          kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=4,
                          num_experts_per_tok=2, first_k_dense_replace=1, use_cache=False),
        attn_implementation="seqpack")
    for call in (lambda: v32(**sph.rows(batch)), lambda: sph.evaluate(v32, [batch]),
                 lambda: v32(**sph.rows(packed(lengths=(40,))[0]))):
        with pytest.raises(InvalidInputError, match=r"this model's indexer \(sparse attention, as in DeepSeek-V3.2\)"):
            call()
    with pytest.raises(InvalidInputError, match="reads the attention mask's cells in its own code"):
        attention_module.LayerMask(None)[:, 0]


def test_a_model_that_drops_the_rows_positions_is_refused_on_packed_rows():
    # Qwen2-VL turns 2-D position_ids into multimodal rotary positions and hands None to its mask and
    # attention: the examples of a rows() batch attended to each other, silently (review). flat() is right.
    from transformers import AutoModelForImageTextToText, Qwen2VLConfig

    sph.register()
    batch, documents = packed(lengths=(6, 9, 4, 12))
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, use_cache=False,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, in_channels=3, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=298, video_token_id=299,
                           vision_start_token_id=297)
    torch.manual_seed(0)
    ours = AutoModelForImageTextToText.from_config(config, attn_implementation="seqpack").double().eval()
    with pytest.raises(InvalidInputError, match=r"hands neither its attention nor its mask the batch's position_ids"):
        ours(**sph.rows(batch))
    fields = sph.flat(batch)
    alone = copy.deepcopy(ours)
    alone.set_attn_implementation("sdpa")
    with torch.no_grad():
        logits = ours(**fields).logits[0]
        offsets = fields["cu_seq_lens_q"].tolist()
        order = sorted(batch.occurrences, key=lambda o: (o.row, o.columns.start))
        for start, stop, occurrence in zip(offsets, offsets[1:], order):
            expected = alone(input_ids=torch.from_numpy(documents[occurrence.ordinal][None])).logits[0]
            assert close(logits[start:stop], expected)
