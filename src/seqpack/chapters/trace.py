"""The decoder section of the chapter demo traces: separate, padded and packed execution compared.

``kind`` is ``"padded"`` (ch04: documents ``[0,99,1]`` and ``[0,100,101,102,1]`` in one
right-padded batch) or ``"packed"`` (ch05: ``[0,99,100,1]``, ``[0,101,1]``,
``[0,102,103,104,1]`` packed next-fit at capacity 6). The decoder section runs the larger
profile with seed 42 on each example alone, on the padded batch and (ch05) on the packed
batch, and compares every valid vocabulary logit and every parameter-gradient coordinate
with separate execution, whose gradients are combined by target counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.binding import BatchBinding
from ..nn.decoder import Decoder, DecoderConfig
from ..packing.packed import PackedBatch
from .fixtures import PACKED_CAPACITY, chapter_examples, packed_batch, padded_batch

DEMO_SEED = 42
ABSOLUTE_TOLERANCE = 1e-10
RELATIVE_TOLERANCE = 1e-9


@dataclass
class SeparateExecution:
    """Each example run alone: its logits, and the batch-level sum, count and combined gradient."""

    logits: list[np.ndarray]
    loss_sum: float
    count: int
    gradient: dict[str, np.ndarray]

    @classmethod
    def run(cls, decoder: Decoder, examples) -> SeparateExecution:
        """Run every example; combine mean gradients by target counts, dividing once."""
        logits, loss_sum, count, raw = [], 0.0, 0, {}
        for example in examples:
            logits.append(decoder.forward_separate(example).logits[0])
            loss = decoder.loss_separate(example)
            for name, gradient in loss.backward().items():
                raw[name] = raw.get(name, 0.0) + loss.count * gradient
            loss_sum += loss.loss_sum
            count += loss.count
        return cls(logits, loss_sum, count, {name: value / count for name, value in raw.items()})


@dataclass
class Comparison:
    """Every valid logit and gradient coordinate of a batch run against separate execution."""

    loss_sum: float
    logit_comparisons: int
    gradient_comparisons: int
    max_logit_difference: float
    max_gradient_difference: float
    failures: int

    @classmethod
    def run(cls, decoder: Decoder, separate: SeparateExecution, batch) -> Comparison:
        packed = isinstance(batch, PackedBatch)
        logits = (decoder.forward_packed if packed else decoder.forward_padded)(batch).logits
        loss = (decoder.loss_packed if packed else decoder.loss_padded)(batch)
        gradient = loss.backward()
        # ``batch`` holds every example once, so an occurrence's ordinal indexes ``separate``.
        pairs = [
            (logits[o.row, o.columns.start : o.columns.stop], separate.logits[o.ordinal])
            for o in batch.occurrences
        ]
        logit_a = np.concatenate([a.reshape(-1) for a, _ in pairs])
        logit_b = np.concatenate([b.reshape(-1) for _, b in pairs])
        grad_a = np.concatenate([gradient[name].reshape(-1) for name in sorted(gradient)])
        grad_b = np.concatenate([separate.gradient[name].reshape(-1) for name in sorted(gradient)])
        failures = int(np.count_nonzero(~within_tolerance(logit_a, logit_b)))
        failures += int(np.count_nonzero(~within_tolerance(grad_a, grad_b)))
        failures += int(not within_tolerance(loss.loss_sum, separate.loss_sum))
        return cls(
            loss_sum=loss.loss_sum,
            logit_comparisons=int(logit_a.size),
            gradient_comparisons=int(grad_a.size),
            max_logit_difference=float(np.max(np.abs(logit_a - logit_b))),
            max_gradient_difference=float(np.max(np.abs(grad_a - grad_b))),
            failures=failures,
        )


def within_tolerance(a, b):
    """The chapters' f64 rule: ``|a - b| <= 1e-10 + 1e-9 * max(|a|, |b|)`` (elementwise)."""
    a, b = np.asarray(a), np.asarray(b)
    return np.abs(a - b) <= ABSOLUTE_TOLERANCE + RELATIVE_TOLERANCE * np.maximum(np.abs(a), np.abs(b))


def decoder_section(kind: str) -> dict:
    """Model loss sums of separate, padded and (ch05) packed execution, seed 42, larger profile.

    The parameters come from numpy's ``default_rng(42)``, not the chapters' Rust generator,
    so the sums differ from the 50.551553 nats the chapter prints; what the chapter checks
    holds: the three sums agree, and every logit and gradient within the tolerance. The
    maximum differences are exact (the chapter displays them rounded to 12 places)."""
    binding = BatchBinding.fixture()
    examples = chapter_examples(kind, binding)
    decoder = Decoder(DecoderConfig.large(binding.vocabulary_size), DEMO_SEED)
    separate = SeparateExecution.run(decoder, examples)
    batches = {"padded": padded_batch(examples, binding)}
    if kind == "packed":
        batches["packed"] = packed_batch(examples, binding, PACKED_CAPACITY)
    comparisons = {name: Comparison.run(decoder, separate, batch) for name, batch in batches.items()}
    return {
        "seed": DEMO_SEED,
        "parameters_from": f"numpy.random.default_rng({DEMO_SEED}), not the chapters' Rust generator: the loss sums "
                           f"differ from the chapter's (50.551553 nats in ch05); what it checks holds",
        "parameter_count": decoder.parameter_count(),
        "valid_targets": separate.count,
        "loss_sum": {"separate": separate.loss_sum, **{name: c.loss_sum for name, c in comparisons.items()}},
        "logit_comparisons": sum(c.logit_comparisons for c in comparisons.values()),
        "gradient_comparisons": sum(c.gradient_comparisons for c in comparisons.values()),
        "max_abs_logit_difference": max(c.max_logit_difference for c in comparisons.values()),
        "max_abs_gradient_difference": max(c.max_gradient_difference for c in comparisons.values()),
        "comparisons_outside_tolerance": sum(c.failures for c in comparisons.values()),
    }
