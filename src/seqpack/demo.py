"""JSON traces of the spec chapters' fixtures, printed by ``seqpack demo``.

Every value is a JSON number, boolean, string or list; the traces are built
from the library's own objects, so they show what a user would get.
"""

from __future__ import annotations

from .batch import BatchLayout, VariableBatch, VariableBatchConfig
from .binding import BatchBinding, Partition
from .documents import BatchDocument
from .examples import SequenceExample
from .windows import CausalWindowConfig, MiniBatchConfig, MiniBatchEpoch

#: ch04's two documents: "a" and "bcd", framed by BOS 0 and EOS 1.
PADDED_DOCUMENTS = (("short", (0, 99, 1)), ("long", (0, 100, 101, 102, 1)))


def fixture_examples(documents, binding: BatchBinding) -> list[SequenceExample]:
    """One full-document example per ``(source_id, token_ids)`` pair, named after it."""
    return [
        SequenceExample.from_document(name, BatchDocument(name, tokens), binding)
        for name, tokens in documents
    ]


def example_section(examples: list[SequenceExample]) -> list[dict]:
    return [
        {
            "id": example.id,
            "document": example.document.token_ids.tolist(),
            "token_count": len(example.document),
            "source_range": [example.source_range.start, example.source_range.stop],
            "inputs": example.inputs.tolist(),
            "targets": example.targets.tolist(),
            "predictions": len(example),
        }
        for example in examples
    ]


def rows_section(batch: BatchLayout) -> list[dict]:
    """Every field of every row, with its allowed-key lists."""
    return [
        {
            "row": row,
            "inputs": batch.inputs[row].tolist(),
            "targets": batch.targets[row].tolist(),
            "positions": batch.positions[row].tolist(),
            "segments": batch.segments[row].tolist(),
            "input_exists": batch.token_valid[row].tolist(),
            "target_exists": batch.target_valid[row].tolist(),
            "target_supervised": batch.loss_mask[row].tolist(),
            "valid_length": int(batch.valid_lengths[row]),
            "segment_starts": batch.segment_starts[row].tolist(),
            "allowed_keys": batch.allowed_keys(row),
        }
        for row in range(batch.shape[0])
    ]


def padded_trace() -> dict:
    """ch04: two documents right-padded into one 2 x 4 batch, and the fixed-window contrast."""
    binding = BatchBinding.fixture()
    examples = fixture_examples(PADDED_DOCUMENTS, binding)
    batch = VariableBatch.build(Partition.TRAIN, examples, binding, VariableBatchConfig(2, 8))
    batch.verify()
    fixed = MiniBatchEpoch.build(
        Partition.TRAIN,
        [example.document for example in examples],
        CausalWindowConfig(4, 4),
        MiniBatchConfig(2),
    )
    return {
        "chapter": "ch04-padded-variable-batches",
        "pad_cell": -1,
        "no_segment": -1,
        "vocabulary_size": binding.vocabulary_size,
        "examples": example_section(examples),
        "shape": list(batch.shape),
        "rows": rows_section(batch),
        "cells": batch.cell_count,
        "valid_targets": batch.target_count,
        "fixed_window_contrast": {
            "context_length": 4,
            "stride": 4,
            "admitted_targets": sum(b.token_count for b in fixed.batches),
            "variable_example_targets": batch.target_count,
        },
    }
