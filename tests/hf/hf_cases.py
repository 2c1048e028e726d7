"""Tiny transformers models (random weights from a config, no hub) and packed batches for the HF tests."""

from __future__ import annotations

import os

import numpy as np

import seqpack as sp

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Predictions per example: one-token-content examples, a row filled exactly, lengths around powers of two.
LENGTHS = (2, 17, 5, 3, 31, 2, 9, 24, 40, 7)
CAPACITY = 40


def documents(lengths=LENGTHS, seed=0):
    """Framed ByteTokenizer documents with ``lengths`` predictions each (``length + 1`` tokens)."""
    rng = np.random.default_rng(seed)
    return [np.concatenate([[0], rng.integers(2, 258, size=length - 1), [1]]).astype(np.int64)
            for length in lengths]


def binding():
    return sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="hf-tests")


def table(docs, bind):
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([d.size for d in docs], out=offsets[1:])
    return sp.ExampleTable.from_arrays(np.concatenate(docs), offsets, bind)


def packed(lengths=LENGTHS, policy="best-fit-decreasing", rows_per_batch=8, seed=0):
    """``(batch, documents)``: the documents packed into one batch of rows of ``CAPACITY``."""
    docs, bind = documents(lengths, seed), binding()
    epoch = sp.pack(table(docs, bind), sp.PackConfig(capacity=CAPACITY, rows_per_batch=rows_per_batch),
                    partition=sp.Partition.TRAIN, binding=bind, policy=policy)
    assert len(epoch.batches) == 1
    return epoch.batches[0], docs


def model(kind="llama", dtype=None, attention="seqpack", seed=0, **overrides):
    """A 2-layer model (hidden 64, 4 query heads, 2 key/value heads) with random weights."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    import seqpack.hf

    seqpack.hf.register()
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "mistral": (MistralConfig, MistralForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    settings = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "use_cache": False}
    settings.update(overrides)
    torch.manual_seed(seed)
    built = model_class(config_class(**settings))
    built.set_attn_implementation(attention)
    return built.to(dtype) if dtype is not None else built


def float64_norms(monkeypatch):
    """Make transformers' RMS norms keep float64 (they round to float32 inside), so a float64
    comparison is not limited by float32 roundings the norms would hide or create."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    for norm in (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm):
        monkeypatch.setattr(norm, "forward", forward)


def close(a, b):
    """``|a - b| <= 1e-10 + 1e-9 * max(|a|, |b|)`` everywhere (float64), or 1e-5 relative for float32."""
    import torch

    a, b = a.detach(), b.detach()
    if a.dtype == torch.float64:
        bound = 1e-10 + 1e-9 * torch.maximum(a.abs(), b.abs())
    else:
        bound = 1e-6 + 1e-5 * torch.maximum(a.abs(), b.abs()).max()
    return bool(((a - b).abs() <= bound).all())
