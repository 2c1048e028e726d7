"""Separate = padded = packed: every valid logit, the raw loss sum, every gradient coordinate.

100 fixed seeds in each of the chapters' two profiles, for each attention mode: random
parameters, random example sets (one-prediction examples, interior ranges, duplicate
occurrences). Separate gradients are combined by target counts and divided once.
Tolerance: ``|a - b| <= 1e-10 + 1e-9 * max(|a|, |b|)``.
"""

import numpy as np
import pytest

from seqpack import BatchBinding, BatchDocument, Decoder, DecoderConfig, SequenceExample
from seqpack.chapters.fixtures import chapter_examples, packed_batch, padded_batch
from seqpack.chapters.trace import Comparison, SeparateExecution, within_tolerance

from helpers import randomize

BINDING = BatchBinding.fixture()
SEEDS = range(100)
PROFILES = {"small": DecoderConfig.small(), "large": DecoderConfig.large()}
ATTENTION = ["reference", "fused"]
PRINTABLE = (34, 129)  # token IDs of printable ASCII bytes (byte + 2)


def random_examples(rng, max_predictions):
    """2-6 examples of 1..max_predictions predictions; some ranges, some repeated occurrences."""
    examples = []
    for index in range(int(rng.integers(2, 7))):
        if examples and rng.random() < 0.2:
            examples.append(examples[int(rng.integers(len(examples)))])
            continue
        # Half the examples are short, so packed rows are often shared.
        longest = max_predictions if rng.random() < 0.5 else max(2, max_predictions // 3)
        predictions = int(rng.integers(1, longest + 1))
        content = rng.integers(*PRINTABLE, size=predictions + 2).tolist()
        document = BatchDocument(f"doc{index}", [0, *content, 1])
        if predictions == 1 or rng.random() < 0.5:
            start = int(rng.integers(0, len(document) - predictions))
            examples.append(SequenceExample.from_range(f"ex{index}", document, range(start, start + predictions + 1), BINDING))
        else:
            short = BatchDocument(f"doc{index}", [0, *content[: predictions - 1], 1])
            examples.append(SequenceExample.from_document(f"ex{index}", short, BINDING))
    return examples


@pytest.mark.slow
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_separate_padded_and_packed_agree_on_100_seeds(profile, attention):
    config = PROFILES[profile]
    totals = {"logits": 0, "gradients": 0, "one_prediction": 0, "duplicates": 0, "shared_rows": 0}
    for seed in SEEDS:
        rng = np.random.default_rng([seed, config.layers])
        decoder = Decoder(config, seed, attention=attention)
        randomize(decoder, rng)
        examples = random_examples(rng, config.max_positions)
        longest = max(len(example) for example in examples)
        capacity = int(rng.integers(longest, config.max_positions + 1))
        separate = SeparateExecution.run(decoder, examples)
        padded = padded_batch(examples, BINDING)
        packed = packed_batch(examples, BINDING, capacity)
        for batch in (padded, packed):
            comparison = Comparison.run(decoder, separate, batch)
            assert comparison.failures == 0, (seed, comparison)
            assert comparison.logit_comparisons == separate.count * config.vocabulary_size
            assert comparison.gradient_comparisons == decoder.parameter_count()
            totals["logits"] += comparison.logit_comparisons
            totals["gradients"] += comparison.gradient_comparisons
        totals["one_prediction"] += sum(len(example) == 1 for example in examples)
        totals["duplicates"] += len(examples) - len({id(example) for example in examples})
        totals["shared_rows"] += int(packed.shape[0] < len(examples))
    print(f"{profile}/{attention}: {totals}")
    # The random sets really contain the cases they are meant to cover.
    assert totals["one_prediction"] > 0 and totals["duplicates"] > 0 and totals["shared_rows"] > 50


@pytest.mark.parametrize("attention", ATTENTION)
def test_chapter_fixture_comparison_counts(attention):
    decoder = Decoder(DecoderConfig.large(), 42, attention=attention)
    examples = chapter_examples("packed", BINDING)
    separate = SeparateExecution.run(decoder, examples)
    for batch in (padded_batch(examples, BINDING), packed_batch(examples, BINDING, 6)):
        comparison = Comparison.run(decoder, separate, batch)
        assert (comparison.logit_comparisons, comparison.gradient_comparisons) == (2394, 3448)
        assert comparison.failures == 0
        assert within_tolerance(comparison.loss_sum, separate.loss_sum)


def test_duplicate_occurrences_in_one_row_give_the_same_logits():
    document = BatchDocument("d", [0, 99, 100, 101, 1])
    example = SequenceExample.from_document("e", document, BINDING)
    decoder = Decoder(DecoderConfig.large(), 4)
    randomize(decoder, np.random.default_rng(4))
    batch = packed_batch([example, example], BINDING, 8)
    assert batch.shape[0] == 1
    logits = decoder.forward_packed(batch).logits[0]
    assert within_tolerance(logits[:4], logits[4:]).all()


def test_comparison_detects_a_changed_parameter():
    """Negative control: the comparison machinery reports differences when there are some."""
    examples = chapter_examples("packed", BINDING)
    decoder = Decoder(DecoderConfig.large(), 42)
    separate = SeparateExecution.run(decoder, examples)
    decoder.named_parameters()["blocks.1.wv"][0, 0] += 1e-6
    comparison = Comparison.run(decoder, separate, packed_batch(examples, BINDING, 6))
    assert comparison.failures > 0 and comparison.max_logit_difference > 0
    assert not within_tolerance(1.0, 1.0 + 2e-9) and within_tolerance(1.0, 1.0 + 1e-9)
