"""Benchmarks of the reference decoder's pieces, measured in one run of one process.

1. Range causal softmax forward+backward: the Cython kernel vs a numpy dense masked
   softmax on the same score grids (packed rows: lognormal example lengths, next-fit).
2. A decoder training step (loss forward + backward) on padded vs packed batches of the
   same examples, as time per real target.

Run ``python bench/bench_decoder.py`` for the ratio table, or
``pytest bench/bench_decoder.py`` for the pytest-benchmark versions (smaller sizes).
"""

from __future__ import annotations

import argparse
import os

# Pin BLAS to one thread unless the caller chose otherwise: every method here then runs
# single-threaded (the softmax kernel is), and a shared 2-core machine stays measurable.
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import statistics
import sys

import numpy as np
from timing import conditions, timings

from seqpack import (
    BatchBinding,
    BatchDocument,
    Decoder,
    DecoderConfig,
    PackConfig,
    PadConfig,
    Partition,
    SequenceExample,
    pack,
    pad,
)
from seqpack.packing import PackedBatch
from seqpack.nn.softmax import range_softmax_backward, range_softmax_forward
from seqpack.bench.measure import matmul_peak
from seqpack.bench.workloads import layout_from_segments, next_fit_segments

BINDING = BatchBinding.fixture()


def lognormal_lengths(count: int, median: float, sigma: float, low: int, high: int, seed: int = 0) -> np.ndarray:
    """Prediction counts ``round(lognormal)`` clipped to ``[low, high]``."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, count)), low, high).astype(int)


def dense_mask(valid: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Boolean ``[rows, T, T]`` permission: valid query t sees keys ``[start, t]``."""
    width = starts.shape[1]
    column = np.arange(width)
    query_valid = column[None, :] < valid[:, None]
    return (
        query_valid[:, :, None]
        & (column[None, None, :] >= starts[:, :, None])
        & (column[None, None, :] <= column[None, :, None])
    )


def numpy_softmax_forward(scores, mask):
    """Dense masked softmax; rows without a permitted key are zero."""
    masked = np.where(mask, scores, -np.inf)
    top = np.max(masked, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(masked - top)
    total = np.sum(weights, axis=-1, keepdims=True)
    return np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)


def numpy_softmax_backward(probabilities, upstream):
    return probabilities * (upstream - np.sum(probabilities * upstream, axis=-1, keepdims=True))


def softmax_grids(rows=4, heads=4, capacity=512, seed=0):
    """Score grids ``[rows*heads, T, T]`` with their per-grid layout and dense mask."""
    lengths = lognormal_lengths(10 * rows * capacity // 50, 50.0, 1.0, 2, capacity, seed)
    valid, starts = layout_from_segments(next_fit_segments(lengths, capacity, rows), capacity)
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(rows * heads, capacity, capacity))
    upstream = rng.normal(size=scores.shape)
    grid_valid = np.repeat(valid, heads)
    grid_starts = np.repeat(starts, heads, axis=0)
    mask = dense_mask(grid_valid, grid_starts)
    return scores, upstream, grid_valid, grid_starts, mask


def cython_softmax_step(scores, upstream, valid, starts):
    probabilities = range_softmax_forward(scores, valid, starts)
    return range_softmax_backward(probabilities, upstream, valid, starts)


def cython_softmax_step_into(scores, upstream, valid, starts, probabilities, dscores):
    range_softmax_forward(scores, valid, starts, out=probabilities)
    return range_softmax_backward(probabilities, upstream, valid, starts, out=dscores)


def numpy_softmax_step(scores, upstream, mask):
    return numpy_softmax_backward(numpy_softmax_forward(scores, mask), upstream)


def decoder_workload(count=96, max_positions=256, seed=0, attention="fused"):
    """Examples with lognormal prediction counts (median 40, sigma 0.8, at most 128) and a small decoder."""
    rng = np.random.default_rng(seed)
    examples = []
    for index, length in enumerate(lognormal_lengths(count, 40.0, 0.8, 2, min(128, max_positions), seed)):
        content = rng.integers(34, 129, size=length - 1).tolist()
        document = BatchDocument(f"d{index}", [0, *content, 1])
        examples.append(SequenceExample.from_document(f"e{index}", document, BINDING))
    config = DecoderConfig(BINDING.vocabulary_size, width=64, heads=4, ffn_width=256, layers=2,
                           max_positions=max_positions)
    return Decoder(config, seed, attention=attention), examples


def padded_batches(examples, rows=8):
    return pad(examples, PadConfig(rows_per_batch=rows), partition=Partition.TRAIN, binding=BINDING).batches


def packed_batches(examples, capacity, rows=4):
    config = PackConfig(capacity, rows_per_batch=rows)
    return pack(examples, config, partition=Partition.TRAIN, binding=BINDING).batches


def decoder_epoch(decoder, batches):
    for batch in batches:
        (decoder.loss_packed if isinstance(batch, PackedBatch) else decoder.loss_padded)(batch).backward()


def median_ms(function, repeats):
    times = timings(function, repeats)
    return 1e3 * statistics.median(times), 1e3 * min(times), 1e3 * max(times)


def _ms(timing):
    return f"{timing[0]:.2f} ({timing[1]:.2f}-{timing[2]:.2f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    print(conditions())
    peak, how = matmul_peak("float64")
    print(f"BLAS threads: OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}; float64 matmul peak in this run "
          f"{peak:.0f} GFLOP/s ({how})")
    print("range causal softmax forward+backward, float64 (median of 7, min-max)")
    print("| rows x heads | T | permitted | cython ms | cython, caller buffers ms | numpy dense ms "
          "| numpy / cython | numpy / cython buffers |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for rows, heads, capacity in [(4, 4, 512), (2, 2, 128), (8, 2, 64)]:
        scores, upstream, valid, starts, mask = softmax_grids(rows, heads, capacity)
        buffers = np.empty_like(scores), np.empty_like(scores)
        fast = median_ms(lambda: cython_softmax_step(scores, upstream, valid, starts), 7)
        reused = median_ms(lambda: cython_softmax_step_into(scores, upstream, valid, starts, *buffers), 7)
        slow = median_ms(lambda: numpy_softmax_step(scores, upstream, mask), 7)
        assert np.allclose(cython_softmax_step(scores, upstream, valid, starts), numpy_softmax_step(scores, upstream, mask))
        print(f"| {rows} x {heads} | {capacity} | {mask.mean():.1%} | {_ms(fast)} | {_ms(reused)} | {_ms(slow)} "
              f"| {slow[0] / fast[0]:.1f}x | {slow[0] / reused[0]:.1f}x |")

    _, examples = decoder_workload()
    targets = sum(len(example) for example in examples)
    print()
    print(f"decoder step (loss forward+backward), {len(examples)} examples, {targets} real targets, "
          "D 64, 4 heads, F 256, 2 layers (median of 3)")
    print("| attention | layout | calls | cells | real-target fraction | ms per epoch | us per real target "
          "| vs packed 256 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    layouts = {
        "padded, 8 rows per call": padded_batches(examples, 8),
        "packed, capacity 256, 4 rows": packed_batches(examples, 256, 4),
        "packed, capacity 128, 8 rows": packed_batches(examples, 128, 8),
    }
    for attention in ("reference", "fused"):
        decoder, _ = decoder_workload(attention=attention)
        results = {}
        for name, batches in layouts.items():
            cells = sum(batch.shape[0] * batch.shape[1] for batch in batches)
            results[name] = (median_ms(lambda: decoder_epoch(decoder, batches), 3)[0], len(batches), cells)
        packed_ms = results["packed, capacity 256, 4 rows"][0]
        for name, (ms, calls, cells) in results.items():
            print(f"| {attention} | {name} | {calls} | {cells} | {targets / cells:.1%} | {ms:.1f} "
                  f"| {1e3 * ms / targets:.1f} | {ms / packed_ms:.2f}x |")
    return 0


# --- pytest-benchmark versions (smaller sizes) ---


def _small_grids():
    return softmax_grids(rows=2, heads=2, capacity=128)


def test_range_softmax_cython(benchmark):
    scores, upstream, valid, starts, _ = _small_grids()
    benchmark(cython_softmax_step, scores, upstream, valid, starts)


def test_range_softmax_numpy_dense(benchmark):
    scores, upstream, _, _, mask = _small_grids()
    benchmark(numpy_softmax_step, scores, upstream, mask)


def test_decoder_step_padded(benchmark):
    decoder, examples = decoder_workload(count=24, max_positions=128)
    benchmark(decoder_epoch, decoder, padded_batches(examples, 8))


def test_decoder_step_packed(benchmark):
    decoder, examples = decoder_workload(count=24, max_positions=128)
    benchmark(decoder_epoch, decoder, packed_batches(examples, 128, 4))


if __name__ == "__main__":
    sys.exit(main())
