"""Inputs seqpack.hf once answered silently and wrongly; each is now a result equal to
transformers' own attention or an InvalidInputError naming what disagrees."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="seqpack.hf needs PyTorch: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")

from hf_cases import CAPACITY, close, documents, model, packed

import seqpack as sp
import seqpack.hf as sph
import seqpack.hf.attention as attention_module
from seqpack.errors import InvalidInputError


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


def test_num_items_in_batch_refuses_labels_that_are_not_integers_and_a_lone_batch():
    batch, _ = packed(lengths=(5, 3, 9))
    fields = sph.rows(batch)
    assert sph.num_items_in_batch([{"shift_labels": fields["shift_labels"].tolist()}]) == batch.target_count
    assert sph.num_items_in_batch([{"labels": [[-100, 5, -100, 7]]}]) == 2
    assert sph.num_items_in_batch([{"labels": np.array([[9, 5, 6]], dtype=np.int16)}]) == 2
    for labels, message in ((torch.tensor([[True, False, True]]), "labels must hold integers, got torch.bool"),
                            (torch.tensor([[5.0, 6.0, -100.0]]), "labels must hold integers, got torch.float32"),
                            (None, "labels must hold integers")):
        for key in ("labels", "shift_labels"):
            with pytest.raises(InvalidInputError, match=message):
                sph.num_items_in_batch([{key: labels}])
    for lone in (batch, fields):
        with pytest.raises(InvalidInputError, match="one micro-batch .* pass the list"):
            sph.num_items_in_batch(lone)


def test_packing_collator_refuses_input_ids_that_are_not_one_integer_sequence():
    collator = sph.PackingCollator(sp.PackConfig(capacity=CAPACITY, rows_per_batch=8),
                                   tokenizer_identity=sp.ByteTokenizer().identity)
    docs = documents(lengths=(5, 3))
    good = {"input_ids": docs[0].tolist()}
    cases = [
        ("abc", "shape \\(\\) and dtype <U3"),
        (7, "shape \\(\\) and dtype int64"),
        ([docs[1].tolist()], "shape \\(1, 4\\)"),
        (torch.from_numpy(docs[1][None]), "shape \\(1, 4\\)"),
        (np.ones(4, dtype=bool), "dtype bool"),
        (docs[1].astype(np.float64), "dtype float64"),
    ]
    for value, message in cases:
        with pytest.raises(InvalidInputError, match=f"feature 1: input_ids must be a 1-D sequence .*{message}"):
            collator([good, {"input_ids": value}])
    assert collator([good, {"input_ids": torch.from_numpy(docs[1]).int()}])["input_ids"].shape[1] == CAPACITY


def test_num_items_in_batch_refuses_what_is_not_a_list_of_micro_batches():
    """A count or None was a TypeError from iterating it."""
    for value, found in ((5, "int"), (None, "NoneType")):
        with pytest.raises(InvalidInputError, match=f"batches must be a list of the step's micro-batches, not {found}"):
            sph.num_items_in_batch(value)


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
    ]
    for tensors, kwargs, message in cases:
        with pytest.raises(InvalidInputError, match=message):
            hook(*tensors, **kwargs)
    with pytest.raises(InvalidInputError, match="exceeds the sliding window .* of 3"):
        hook(query, query, query, sliding_window=np.int64(3))
    assert hook(query, query, query, scaling=np.float32(0.5), sliding_window=np.int64(4)).equal(
        hook(query, query, query, scaling=0.5))
