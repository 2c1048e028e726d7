"""JSON traces of the spec chapters' fixtures, printed by ``seqpack demo``.

Every value is a JSON number, boolean, string or list; the traces are built
from the library's own objects, so they show what a user would get.
"""

from __future__ import annotations

from .._arguments import check_int
from ..data.binding import BatchBinding, Partition
from ..data.examples import SequenceExample
from ..data.windows import CausalWindowConfig, MiniBatchConfig, MiniBatchEpoch
from ..layout.batch import BatchLayout
from .fixtures import (
    DENSITY_DOCUMENTS,
    DOCUMENTS,
    PACKED_CAPACITY,
    chapter_batch,
    chapter_examples,
    examples_of,
    packed_batch,
    padded_batch,
)
from .probe import loss_probe_section
from .trace import decoder_section


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
    """ch04: two documents right-padded into one 2 x 4 batch, the loss probe, the decoder
    comparison, and the fixed-window contrast."""
    binding = BatchBinding.fixture()
    examples = chapter_examples("padded", binding)
    batch = chapter_batch("padded", binding)
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
        "loss_probe": loss_probe_section("padded"),
        "decoder": decoder_section("padded"),
        "fixed_window_contrast": {
            "context_length": 4,
            "stride": 4,
            "admitted_targets": sum(b.token_count for b in fixed.batches),
            "variable_example_targets": batch.target_count,
        },
    }


def edge_inventory(batch: BatchLayout, tile_width: int | None = None) -> list[list[int]]:
    """Every permitted ``[row, query, key]``, visited in query order or in square tiles."""
    rows, width = batch.shape
    tile = width if tile_width is None else check_int("tile_width", tile_width)
    edges = []
    for row in range(rows):
        for query_start in range(0, width, tile):
            for key_start in range(0, width, tile):
                for query in range(query_start, min(query_start + tile, width)):
                    for key in range(key_start, min(key_start + tile, width)):
                        if batch.allowed_key(row, query, key):
                            edges.append([row, query, key])
    return edges


def density_comparison(documents: dict, capacity: int, binding: BatchBinding) -> dict:
    """Padded and packed counts of the same examples, each layout in one batch."""
    examples = examples_of(documents, binding)
    return {
        "prediction_lengths": [len(example) for example in examples],
        "capacity": capacity,
        "padded": padded_batch(examples, binding).counts().as_dict(),
        "packed": packed_batch(examples, binding, capacity).counts().as_dict(),
    }


def packed_trace() -> dict:
    """ch05: three documents packed by next-fit at capacity 6, counts, the traversal check,
    the loss probe and the decoder comparison."""
    binding = BatchBinding.fixture()
    examples = chapter_examples("packed", binding)
    batch = chapter_batch("packed", binding)
    batch.verify()
    query_order = edge_inventory(batch)
    tiled = edge_inventory(batch, tile_width=2)
    return {
        "chapter": "ch05-packed-sequence-masks",
        "pad_cell": -1,
        "no_segment": -1,
        "vocabulary_size": binding.vocabulary_size,
        "capacity": PACKED_CAPACITY,
        "examples": example_section(examples),
        "shape": list(batch.shape),
        "rows": rows_section(batch),
        "occurrences": [
            {"ordinal": o.ordinal, "example": examples[o.ordinal].id, "row": o.row,
             "columns": [o.columns.start, o.columns.stop], "segment": o.segment}
            for o in batch.occurrences
        ],
        "cells": batch.cell_count,
        "valid_targets": batch.target_count,
        "density": [
            density_comparison(DOCUMENTS["packed"], PACKED_CAPACITY, binding),
            density_comparison(DENSITY_DOCUMENTS, 12, binding),
        ],
        "traversal": {
            "permitted_edges": len(query_order),
            "tile_width": 2,
            "query_order_equals_tiled": sorted(query_order) == sorted(tiled),
        },
        "loss_probe": loss_probe_section("packed"),
        "decoder": decoder_section("packed"),
    }
