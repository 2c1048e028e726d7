"""A real PyTorch decoder trained on packed batches equals running every example alone.

The model (written here, nanoGPT-style): token embedding, rotary positions at each
cell's local position, grouped-query attention (4 query heads, 2 key/value heads),
SwiGLU, RMS norms, an output tied to the embedding; float64. One training step over a
packed plan (``IterableBatchDataset``, ``range_attention``, ``LossAccumulator``) gives
every valid logit, the loss sum and every parameter gradient of the separate runs
(plain SDPA with ``is_causal`` on each example alone) within ``1e-10 + 1e-9 * max``.
"""

from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="seqpack.torch needs PyTorch: pip install 'seqpack[torch]'")
import torch.nn.functional as F  # noqa: E402

import seqpack.torch as st  # noqa: E402

from packed_cases import packed_plan, padded_epoch, random_predictions  # noqa: E402


@dataclass
class Config:
    vocabulary: int = 266
    width: int = 32
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 48
    layers: int = 2
    max_positions: int = 64


def rotate(x, positions):
    """Rotary embedding of ``x`` ``[B, H, T, D]`` at int ``positions`` ``[B, T]`` (half-split pairs)."""
    half = x.shape[-1] // 2
    frequencies = 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half)
    angles = positions[:, None, :, None].to(x.dtype) * frequencies  # [B, 1, T, half]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * angles.cos() - second * angles.sin(), first * angles.sin() + second * angles.cos()], -1)


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class Attention(torch.nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        head_dim = config.width // config.heads
        self.wq = torch.nn.Linear(config.width, config.heads * head_dim, bias=False)
        self.wk = torch.nn.Linear(config.width, config.kv_heads * head_dim, bias=False)
        self.wv = torch.nn.Linear(config.width, config.kv_heads * head_dim, bias=False)
        self.wo = torch.nn.Linear(config.heads * head_dim, config.width, bias=False)

    def forward(self, x, positions, valid_lengths):
        batch, width = x.shape[:2]
        split = lambda t, heads: t.view(batch, width, heads, -1).transpose(1, 2)  # noqa: E731 (strided views)
        q = rotate(split(self.wq(x), self.config.heads), positions)
        k = rotate(split(self.wk(x), self.config.kv_heads), positions)
        v = split(self.wv(x), self.config.kv_heads)
        if valid_lengths is None:  # one example alone: plain causal attention
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = st.range_attention(q, k, v, position_ids=positions, valid_lengths=valid_lengths)
        return self.wo(out.transpose(1, 2).reshape(batch, width, -1))


class Block(torch.nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.attention_norm = torch.nn.Parameter(torch.ones(config.width))
        self.attention = Attention(config)
        self.ffn_norm = torch.nn.Parameter(torch.ones(config.width))
        self.w1 = torch.nn.Linear(config.width, config.ffn, bias=False)
        self.w3 = torch.nn.Linear(config.width, config.ffn, bias=False)
        self.w2 = torch.nn.Linear(config.ffn, config.width, bias=False)

    def forward(self, x, positions, valid_lengths):
        x = x + self.attention(rms_norm(x, self.attention_norm), positions, valid_lengths)
        h = rms_norm(x, self.ffn_norm)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(torch.nn.Module):
    def __init__(self, config: Config, seed: int):
        super().__init__()
        self.embedding = torch.nn.Embedding(config.vocabulary, config.width)
        self.blocks = torch.nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = torch.nn.Parameter(torch.ones(config.width))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, parameter in self.named_parameters():
                scale = 0.2 if name.endswith("norm") else 0.3
                parameter.copy_((name.endswith("norm")) + scale * torch.randn(parameter.shape, generator=generator))
        self.double()

    def forward(self, input_ids, positions, valid_lengths=None):
        x = self.embedding(input_ids)
        for block in self.blocks:
            x = block(x, positions, valid_lengths)
        return rms_norm(x, self.norm) @ self.embedding.weight.T  # tied output


def within(a, b):
    return bool(torch.all((a - b).abs() <= 1e-10 + 1e-9 * torch.maximum(a.abs(), b.abs())))


def separate_step(model, examples):
    """Every example alone; the loss sum divided once by the total count."""
    model.zero_grad()
    logits, sums, count = [], [], 0
    for example in examples:
        tokens = torch.from_numpy(np.asarray(example.source_tokens, dtype=np.int64))
        inputs, targets = tokens[:-1][None], tokens[1:]
        out = model(inputs, torch.arange(inputs.shape[1])[None])[0]
        logits.append(out.detach())
        sums.append(F.cross_entropy(out, targets, reduction="sum"))
        count += targets.numel()
    total = torch.stack(sums).sum()
    (total / count).backward()
    return logits, total.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def packed_step(model, batches, dataset, row_positions=False):
    """One optimizer step over ``batches``, whose tensors ``dataset`` yields in the same order.

    ``row_positions`` (the negative control) hands the model column indices instead of
    local positions: one segment per row, the bug of unreset positions.
    """
    model.zero_grad()
    accumulator = st.LossAccumulator(batches)
    logits = {}
    for batch, fields in zip(batches, dataset):
        positions = torch.arange(batch.shape[1]).expand(batch.shape) if row_positions else fields["positions"]
        out = model(fields["input_ids"], positions, fields["valid_lengths"])
        accumulator(out, fields).backward()
        for occurrence in batch.occurrences:
            logits[occurrence.ordinal] = out.detach()[occurrence.row, occurrence.columns.start:occurrence.columns.stop]
    return logits, accumulator.loss_sum, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_a_packed_training_step_equals_every_example_alone(seed):
    rng = np.random.default_rng(seed)
    predictions = random_predictions(rng, 12, 20)
    model = Decoder(Config(), seed)
    plan = packed_plan(predictions, 24, 2, seed)
    batches = list(plan)
    examples = dict(sorted((o.ordinal, e) for b in batches for o, e in zip(b.occurrences, b.examples)))
    assert any(np.bincount([o.row for o in b.occurrences]).max() > 1 for b in batches)  # rows are shared

    separate_logits, separate_sum, separate_grads = separate_step(model, examples.values())
    padded = padded_epoch(predictions, 3, seed)
    for batches, dataset in ((batches, st.IterableBatchDataset(plan, shuffle=False)),
                             (list(padded), st.BatchDataset(padded))):
        logits, loss_sum, grads = packed_step(model, batches, dataset)
        assert sorted(logits) == list(range(len(examples)))
        for ordinal, expected in enumerate(separate_logits):
            assert within(logits[ordinal], expected), ordinal
        assert abs(loss_sum - separate_sum) <= 1e-10 + 1e-9 * abs(separate_sum)
        assert grads.keys() == separate_grads.keys() and len(grads) == 2 + 2 * 9
        for name, grad in grads.items():
            assert grad.abs().max() > 0 and within(grad, separate_grads[name]), name
    logits, _, _ = packed_step(model, list(plan), st.IterableBatchDataset(plan, shuffle=False), row_positions=True)
    assert not all(within(logits[ordinal], expected) for ordinal, expected in enumerate(separate_logits))
