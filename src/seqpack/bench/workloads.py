"""The benchmark workloads: packed layouts with their q, k, v and upstream gradient.

  a  4 rows, capacity 2048, 8 heads, head_dim 64, float32 and float64: example token
     counts lognormal (median 250, sigma 1.0, ``numpy.random.default_rng(0)``),
     rounded and clipped to [2, capacity], predictions = tokens - 1, packed by next-fit
     until the next example would need a fifth row.
  b  2 rows, capacity 256, 2 heads, head_dim 16, float64, the same generator.
  c  the ch05 fixture shape: 2 rows of capacity 6 holding A (3), B (2) | C (4),
     2 heads of head_dim 4, float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInputError
from ..packing.placement import place

WORKLOADS = ("a", "b", "c")


@dataclass
class Workload:
    """A packed layout with its q, k, v and upstream gradient in one dtype."""

    name: str
    heads: int
    head_dim: int
    valid_lengths: np.ndarray  # [rows]
    segment_starts: np.ndarray  # [rows, T]
    segments: list  # per row, the segment lengths in order
    dtypes: tuple

    @property
    def shape(self):
        rows, width = self.segment_starts.shape
        return rows, self.heads, width, self.head_dim

    @property
    def edges(self) -> int:
        """Permitted (query, key) pairs over all rows and heads."""
        return self.heads * sum(n * (n + 1) // 2 for row in self.segments for n in row)

    @property
    def dense_cells(self) -> int:
        rows, heads, width, _ = self.shape
        return rows * heads * width * width

    def tensors(self, dtype):
        """q, k, v and the output's gradient (zero at padding queries: every method then
        gives the same gradients, whatever it does there)."""
        rng = np.random.default_rng(1)
        q, k, v, dout = (rng.standard_normal(self.shape).astype(dtype) for _ in range(4))
        padding = np.arange(self.shape[2])[None, :] >= self.valid_lengths[:, None]  # [rows, T]
        np.putmask(dout, np.broadcast_to(padding[:, None, :, None], dout.shape), 0)
        return [q, k, v, dout]


def layout_from_segments(segments, capacity):
    """Valid lengths and per-query starts of rows holding consecutive segments."""
    lengths = np.zeros(len(segments), dtype=np.int64)
    starts = np.zeros((len(segments), capacity), dtype=np.int64)
    for row, row_segments in enumerate(segments):
        column = 0
        for length in row_segments:
            starts[row, column : column + length] = column
            column += length
        lengths[row] = column
    return lengths, starts


def next_fit_segments(predictions, capacity: int, rows: int) -> list[list[int]]:
    """Segment lengths of the first ``rows`` rows that next-fit fills from ``predictions``."""
    predictions = np.asarray(predictions, dtype=np.int64)
    placement = place(predictions, capacity)
    keep = placement.rows < rows
    kept_rows, kept = placement.rows[keep], predictions[keep]
    return [kept[kept_rows == row].tolist() for row in range(rows)]


def next_fit_lognormal(rows: int, capacity: int, draws: int = 4096):
    """Segment lengths per row: lognormal token counts packed by next-fit into ``rows``."""
    rng = np.random.default_rng(0)
    tokens = np.clip(np.rint(rng.lognormal(math.log(250), 1.0, draws)), 2, capacity)
    return next_fit_segments(tokens - 1, capacity, rows)


def workload(name: str) -> Workload:
    if name == "a":
        segments, capacity, heads, head_dim = next_fit_lognormal(4, 2048), 2048, 8, 64
        dtypes = ("float32", "float64")
    elif name == "b":
        segments, capacity, heads, head_dim = next_fit_lognormal(2, 256), 256, 2, 16
        dtypes = ("float64",)
    elif name == "c":
        segments, capacity, heads, head_dim = [[3, 2], [4]], 6, 2, 4
        dtypes = ("float64",)
    else:
        raise InvalidInputError(f"unknown workload {name!r}; choose from a, b, c")
    lengths, starts = layout_from_segments(segments, capacity)
    return Workload(name, heads, head_dim, lengths, starts, segments, dtypes)
