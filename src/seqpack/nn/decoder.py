"""The reference decoder: one model for separate, padded and packed execution.

Architecture (pre-norm, no biases, weights stored ``[in, out]``)::

    x = embedding[inputs]                       PAD_CELL cells are zero rows
    for each block:
        h = x + Attention(RMSNorm(x; attn_norm))
        x = h + SwiGLU(RMSNorm(h; ffn_norm))
    logits = RMSNorm(x; final_norm) @ embedding.T   tied output

RMSNorm is ``x / sqrt(mean(x**2) + 1e-5) * gain``. Attention projects ``q, k, v = x @ wq,
x @ wk, x @ wv``, splits heads by contiguous column blocks, applies rotate-half rotary
embedding at each cell's local position (inactive cells skipped), scales scores by
``1/sqrt(head_dim)``, takes the range causal softmax (valid query ``t`` of row ``r`` sees
keys ``[segment_starts[r, t], t]``), mixes values, merges heads and projects with ``wo``.
SwiGLU is ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``.

Initialisation from ``numpy.random.default_rng(seed)``: parameters are drawn in
:meth:`Decoder.parameter_shapes` order, every matrix from ``normal(0, 0.02)``, every
norm gain set to ones (no draw).

A separate example is a one-row batch with starts 0; a padded batch has starts 0 and a
valid prefix per row; a packed batch adds per-query segment starts. All three run the
same :meth:`Decoder.forward_arrays`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._arguments import INT32_MAX, check_choice, check_int, integer_array, regular_array
from ..errors import CapacityError, InvalidInputError
from ..layout.fields import PAD_CELL
from ..packing import budget
from ..packing.config import DEFAULT_MEMORY_BYTES
from ..packing.packed import PackedBatch
from ..packing.padding import PaddedBatch
from . import ops as F
from .attention import causal_attention_with_ranges, fused_range_attention, segment_spans
from .autograd import Tensor
from .loss import MaskedLoss, masked_nll
from .softmax import causal_layout

RMS_EPS = 1e-5
INIT_STD = 0.02
ATTENTION_MODES = ("reference", "fused")


@dataclass(frozen=True)
class DecoderConfig:
    """Vocabulary size V, model width D, heads, feed-forward width F, layers, max positions."""

    vocabulary_size: int
    width: int
    heads: int
    ffn_width: int
    layers: int
    max_positions: int

    def __post_init__(self):
        for name in ("vocabulary_size", "width", "heads", "ffn_width", "layers", "max_positions"):
            object.__setattr__(self, name, check_int(f"decoder {name}", getattr(self, name), maximum=INT32_MAX))
        if self.width % self.heads or (self.width // self.heads) % 2:
            raise InvalidInputError(
                f"width {self.width} must split into {self.heads} heads of even size (rotary halves)"
            )

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @classmethod
    def small(cls, vocabulary_size: int = 266) -> DecoderConfig:
        """The chapters' smaller CPU profile: D 4, 2 heads, F 4, 1 layer, 4 positions."""
        return cls(vocabulary_size, width=4, heads=2, ffn_width=4, layers=1, max_positions=4)

    @classmethod
    def large(cls, vocabulary_size: int = 266) -> DecoderConfig:
        """The chapters' larger CPU profile: D 8, 2 heads, F 16, 2 layers, 16 positions."""
        return cls(vocabulary_size, width=8, heads=2, ffn_width=16, layers=2, max_positions=16)


@dataclass
class DecoderForward:
    """A forward pass: ``logits`` ``[rows, T, V]`` as an array, and the same on the tape."""

    logits: np.ndarray
    tensor: Tensor


class Decoder:
    """The reference decoder with seeded initialisation (see the module docstring).

    ``attention="fused"`` (the default) calls the edge-only range attention kernels;
    ``"reference"`` computes the chapters' dense score grids and the range causal
    softmax kernel. Both give the same results within float64 rounding. Parameters
    (float64) over ``max_memory_bytes`` (default 8 GiB) are a ``MemoryBudgetError``,
    raised before any is allocated.
    """

    def __init__(self, config: DecoderConfig, seed: int, attention: str = "fused", *,
                 max_memory_bytes: int = DEFAULT_MEMORY_BYTES):
        if not isinstance(config, DecoderConfig):
            raise InvalidInputError(f"config must be a DecoderConfig, not {type(config).__name__}")
        check_choice("attention", attention, ATTENTION_MODES)
        seed = check_int("seed", seed, minimum=0)
        self.config = config
        self.attention = attention
        budget.require(8 * self.parameter_count(), check_int("max_memory_bytes", max_memory_bytes),
                       "the decoder's float64 parameters")
        rng = np.random.default_rng(seed)
        self._parameters: dict[str, Tensor] = {}
        for name, shape in self.parameter_shapes().items():
            value = np.ones(shape) if name.endswith("norm") else rng.normal(0.0, INIT_STD, shape)
            self._parameters[name] = Tensor(value, requires_grad=True)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter name and shape, in initialisation order."""
        c = self.config
        width, ffn = c.width, c.ffn_width
        shapes = {"embedding": (c.vocabulary_size, width)}
        for i in range(c.layers):
            shapes[f"blocks.{i}.attn_norm"] = (width,)
            for name in ("wq", "wk", "wv", "wo"):
                shapes[f"blocks.{i}.{name}"] = (width, width)
            shapes[f"blocks.{i}.ffn_norm"] = (width,)
            shapes[f"blocks.{i}.w_gate"] = (width, ffn)
            shapes[f"blocks.{i}.w_up"] = (width, ffn)
            shapes[f"blocks.{i}.w_down"] = (ffn, width)
        shapes["final_norm"] = (width,)
        return shapes

    def parameter_count(self) -> int:
        """``V*D + D + layers * (2*D + 4*D*D + 3*D*F)``, from the config alone (the budget
        check runs on it before any parameter, or any per-layer list, exists)."""
        c = self.config
        per_layer = 2 * c.width + 4 * c.width**2 + 3 * c.width * c.ffn_width
        return c.vocabulary_size * c.width + c.width + c.layers * per_layer

    def named_parameters(self) -> dict[str, np.ndarray]:
        """Name to the live parameter array (writing into it changes the model)."""
        return {name: tensor.value for name, tensor in self._parameters.items()}

    # --- the one decoder ---

    def forward_embedded(self, x: Tensor, positions, valid_lengths, segment_starts) -> Tensor:
        """Logits ``[rows, T, V]`` from embedded inputs ``x`` ``[rows, T, D]`` on the tape.

        ``x`` may be any tensor, so a caller can take derivatives into the activations.
        Cells at or past a row's valid length are excluded first: whatever they hold
        (NaN included) becomes exact zeros, and their gradient is exactly zero.
        """
        if not isinstance(x, Tensor):
            raise InvalidInputError(f"x must be a seqpack.nn Tensor, not {type(x).__name__}")
        if len(x.shape) != 3 or x.shape[2] != self.config.width:
            raise InvalidInputError(f"x must be [rows, T, {self.config.width}] (the model's width), got shape "
                                    f"{tuple(x.shape)}")
        return self._decode(x, positions, *causal_layout(*x.shape[:2], valid_lengths, segment_starts))

    def _decode(self, x: Tensor, positions, lengths: np.ndarray, starts: np.ndarray) -> Tensor:
        """:meth:`forward_embedded` on a checked layout."""
        if self.attention == "reference":
            segment_spans(lengths, starts)   # the fused kernels' rule too: contiguous segments
        active = np.arange(x.shape[1]) < lengths[:, None]  # [rows, T]
        positions = self._check_positions(positions, active)
        p = self._parameters
        x = F.select_cells(x, active)
        for i in range(self.config.layers):
            normed = F.rmsnorm(x, p[f"blocks.{i}.attn_norm"], RMS_EPS)
            x = F.add(x, self._attention(i, normed, positions, active, lengths, starts))
            normed = F.rmsnorm(x, p[f"blocks.{i}.ffn_norm"], RMS_EPS)
            x = F.add(x, self._swiglu(i, normed))
        normed = F.rmsnorm(x, p["final_norm"], RMS_EPS)
        return F.matmul(normed, F.transpose(p["embedding"]))

    @staticmethod
    def _check_positions(positions, active: np.ndarray) -> np.ndarray:
        """Integer positions of the cells' shape ``[rows, T]`` (never floats, bools or broadcast);
        an inactive cell's value, even past int64, is never read."""
        given = regular_array("positions", positions)
        if given.shape != active.shape:
            raise InvalidInputError(f"positions has shape {given.shape}; expected {active.shape}")
        if given.dtype.kind in "iu":
            given = np.where(active, given, given.dtype.type(0))
        return integer_array("positions", given, np.int64)

    def _attention(self, i, x, positions, active, lengths, starts) -> Tensor:
        p, heads = self._parameters, self.config.heads
        q = F.rotary(F.split_heads(F.matmul(x, p[f"blocks.{i}.wq"]), heads), positions, active)
        k = F.rotary(F.split_heads(F.matmul(x, p[f"blocks.{i}.wk"]), heads), positions, active)
        v = F.split_heads(F.matmul(x, p[f"blocks.{i}.wv"]), heads)
        if self.attention == "fused" or not active.shape[1]:   # (no query: nothing for the dense grids)
            mixed = fused_range_attention(q, k, v, lengths, starts)
        else:
            mixed = causal_attention_with_ranges(q, k, v, lengths, starts)
        return F.matmul(F.merge_heads(mixed), p[f"blocks.{i}.wo"])

    def _swiglu(self, i, x) -> Tensor:
        p = self._parameters
        gate = F.silu(F.matmul(x, p[f"blocks.{i}.w_gate"]))
        return F.matmul(F.mul(gate, F.matmul(x, p[f"blocks.{i}.w_up"])), p[f"blocks.{i}.w_down"])

    def embed(self, inputs) -> Tensor:
        """Embedding rows ``[rows, T, D]`` of int ``inputs`` ``[rows, T]`` on the tape.

        Every ID must be PAD_CELL (a zero row, never looked up) or in ``[0, V)``; the
        check runs before any lookup.
        """
        return F.embedding(self._parameters["embedding"], self._inputs(inputs))

    @staticmethod
    def _inputs(inputs) -> np.ndarray:
        """``inputs`` as an integer array ``[rows, T]`` (its IDs checked by the lookup)."""
        return integer_array("inputs", inputs, np.int64, ndim=2)

    def masked_loss(self, logits: Tensor, targets, loss_mask) -> MaskedLoss:
        """The token-weighted loss of ``logits``; ``backward()`` gives every parameter's gradient."""
        return masked_nll(logits, targets, loss_mask, parameters=dict(self._parameters))

    def forward_arrays(self, inputs, positions, valid_lengths, segment_starts) -> DecoderForward:
        """Run the decoder on raw int arrays ``[rows, T]`` (plus ``valid_lengths`` ``[rows]``).

        Checks the width against ``max_positions`` and every token ID before any lookup;
        the valid cells of a row are its prefix.
        """
        return self._forward_arrays(inputs, positions, valid_lengths, segment_starts)[0]

    def _forward_arrays(self, inputs, positions, valid_lengths, segment_starts) -> tuple[DecoderForward, np.ndarray]:
        """:meth:`forward_arrays` and the rows' checked valid lengths."""
        inputs = self._inputs(inputs)
        self._check_width(inputs.shape[1])
        lengths, starts = causal_layout(*inputs.shape, valid_lengths, segment_starts)
        padded = (inputs == PAD_CELL) & (np.arange(inputs.shape[1]) < lengths[:, None])
        if padded.any():
            row, column = (int(i) for i in np.argwhere(padded)[0])
            raise InvalidInputError(f"row {row} cell {column} holds PAD_CELL inside the row's valid length "
                                    f"{int(lengths[row])}: padding is never an input")
        logits = self._decode(self.embed(inputs), positions, lengths, starts)
        return DecoderForward(logits=logits.value, tensor=logits), lengths

    def loss_arrays(self, inputs, positions, valid_lengths, segment_starts, targets, loss_mask) -> MaskedLoss:
        """The masked loss of :meth:`forward_arrays` over cells where ``loss_mask`` is true;
        a true cell at or past its row's valid length (padding) is refused."""
        forward, lengths = self._forward_arrays(inputs, positions, valid_lengths, segment_starts)
        loss = self.masked_loss(forward.tensor, targets, loss_mask)
        rows, columns = np.divmod(loss.cells, forward.logits.shape[1])
        outside = columns >= lengths[rows]
        if outside.any():
            first = int(np.argmax(outside))
            raise InvalidInputError(f"row {int(rows[first])} cell {int(columns[first])} is a loss cell past the "
                                    f"row's valid length {int(lengths[rows[first]])}: padding is never a target")
        return loss

    def _check_width(self, width: int) -> None:
        if width > self.config.max_positions:
            raise CapacityError(
                f"a batch {width} columns wide exceeds the decoder's max_positions "
                f"{self.config.max_positions}",
                cells=width,
                maximum=self.config.max_positions,
            )

    # --- entry points ---

    def forward_separate(self, example) -> DecoderForward:
        """Logits ``[1, len, V]`` of one example run alone."""
        return self.forward_arrays(*self._separate_arrays(example)[:4])

    def loss_separate(self, example) -> MaskedLoss:
        """The example's own token-weighted loss over its supervised targets."""
        return self.loss_arrays(*self._separate_arrays(example))

    def forward_padded(self, batch) -> DecoderForward:
        """Logits ``[rows, T, V]`` of a padded batch: each row's valid prefix attends causally."""
        return self.forward_arrays(*self._batch_arrays(batch, PaddedBatch, "forward_padded")[:4])

    def loss_padded(self, batch) -> MaskedLoss:
        """A padded batch's token-weighted loss over its loss-eligible cells."""
        return self.loss_arrays(*self._batch_arrays(batch, PaddedBatch, "loss_padded"))

    def forward_packed(self, batch) -> DecoderForward:
        """Logits ``[rows, T, V]`` of a packed batch: the same blocks, with each query
        restricted to its own segment by its segment start."""
        return self.forward_arrays(*self._batch_arrays(batch, PackedBatch, "forward_packed")[:4])

    def loss_packed(self, batch) -> MaskedLoss:
        """A packed batch's token-weighted loss over its loss-eligible cells."""
        return self.loss_arrays(*self._batch_arrays(batch, PackedBatch, "loss_packed"))

    def _separate_arrays(self, example):
        self._check_vocabulary(example.binding.vocabulary_size, f"example {example.id!r}")
        inputs = np.asarray(example.inputs, dtype=np.int32)[None, :]
        length = inputs.shape[1]
        return (
            inputs,
            np.arange(length, dtype=np.int32)[None, :],
            np.array([length], dtype=np.int64),
            np.zeros((1, length), dtype=np.int32),
            np.asarray(example.targets, dtype=np.int32)[None, :],
            example.loss_mask[None, :],
        )

    def _batch_arrays(self, batch, kind, method: str):
        if not isinstance(batch, kind):
            raise InvalidInputError(f"{method} takes a {kind.__name__}, not {type(batch).__name__}")
        self._check_vocabulary(batch.binding.vocabulary_size, "the batch binding")
        return (
            batch.inputs,
            batch.positions,
            batch.valid_lengths,
            batch.segment_starts,
            batch.targets,
            batch.loss_mask,
        )

    def _check_vocabulary(self, vocabulary_size: int, what: str) -> None:
        if vocabulary_size != self.config.vocabulary_size:
            raise InvalidInputError(
                f"{what} has vocabulary size {vocabulary_size}; the decoder has "
                f"{self.config.vocabulary_size}"
            )
