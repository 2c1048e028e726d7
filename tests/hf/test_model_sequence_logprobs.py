"""Per-sequence log-probabilities of a transformers model on packed rows equal each example run
alone: a float64 Llama and Qwen2 with seqpack attention on the ``rows()`` and ``flat()`` layouts,
against sdpa on every example by itself, for each occurrence's sum, count, per-token values and
the gradients of the sums with respect to every parameter."""

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch", reason="seqpack.hf needs PyTorch: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="seqpack.hf needs transformers: pip install 'seqpack[hf]'")

import torch.nn.functional as F  # noqa: E402

import seqpack.hf as sph  # noqa: E402
import seqpack.torch as spt  # noqa: E402
from hf_cases import close, float64_norms, model, packed  # noqa: E402

MODEL_INPUTS = ("input_ids", "position_ids", "valid_lengths", "use_cache", "seq_idx", "cu_seq_lens_q",
                "cu_seq_lens_k", "max_length_q", "max_length_k")


def alone(net, document: np.ndarray) -> torch.Tensor:
    """log p of each target of ``document`` run by itself (every target supervised), in float64."""
    tokens = torch.from_numpy(document)[None, :]
    logits = net(input_ids=tokens[:, :-1], use_cache=False).logits[0]        # [n, V]
    return F.log_softmax(logits.double(), dim=-1).gather(1, tokens[0, 1:, None])[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", ["rows", "flat"])
def test_packed_sequence_logprobs_equal_each_example_alone(kind, layout, monkeypatch):
    float64_norms(monkeypatch)
    batch, documents = packed(policy="best-fit-decreasing")
    ours, reference = model(kind, torch.float64), model(kind, torch.float64, attention="sdpa")
    reference.load_state_dict(ours.state_dict())
    fields = {"rows": sph.rows, "flat": sph.flat}[layout](batch)
    logits = ours(**{key: value for key, value in fields.items() if key in MODEL_INPUTS}).logits
    scores = spt.sequence_logprobs(logits, fields)
    values, offsets = spt.token_logprobs(logits, fields)
    ordinals = batch.occurrence_records["ordinal"].tolist()        # the dicts' occurrences are the batch's
    assert sorted(ordinals) == list(range(len(documents)))
    weights = torch.linspace(0.5, 1.5, len(ordinals), dtype=torch.float64)
    (weights * scores.sums).sum().backward()

    expected_sum = 0.0
    for k, ordinal in enumerate(ordinals):
        wanted = alone(reference, documents[ordinal])
        assert int(scores.counts[k]) == wanted.numel() == len(documents[ordinal]) - 1
        assert close(values[offsets[k]:offsets[k + 1]], wanted)
        assert close(scores.sums[k], wanted.sum())
        expected_sum = expected_sum + weights[k] * wanted.sum()
    expected_sum.backward()
    for (name, parameter), (_, expected) in zip(ours.named_parameters(), reference.named_parameters()):
        assert parameter.grad is not None and close(parameter.grad, expected.grad), name
