"""Per-occurrence log-probabilities: one number per example occurrence, where the loss
(:mod:`seqpack.torch.objective`) gives one per batch.

An occurrence is one placement of an example in a batch (a packed row holds several);
occurrences come in row-major order of their cells. Four inputs describe the same cells
and give the same results: a padded or packed batch, its :func:`~seqpack.torch.tensors`
dict, and its ``seqpack.hf.rows`` and ``seqpack.hf.flat`` dicts (recognized by their keys:
this layer does not import ``seqpack.hf``). The loss's rules hold here too: only eligible
logit rows are read, so NaN anywhere else reaches no result and no gradient; bfloat16 and
float16 logits are read in float32; and the results are bitwise the same on every run and
at every thread count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidInputError
from ..layout.batch import BatchLayout
from .attention import check_first_order
from .tensors import IGNORE_INDEX, _described, _signed, batch_tensors, is_integer_tensor, shared_tensor

#: Elements of one block of eligible logit rows (16 MiB in float32): rows are read a block at a time.
BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class SequenceLogprobs:
    """Each occurrence's summed log-probability of its supervised targets, in occurrence order.

    ``sums`` ``[n]``: the sum of ``log p(target)`` (natural log) over the occurrence's
    supervised targets, minus its negative log-likelihood, differentiable with respect to
    the logits (float32 for half-precision logits, else the logits' dtype); ``counts``
    ``[n]`` int64: its supervised targets (0 gives a sum of 0). ``ordinals`` ``[n]`` int64
    and ``example_ids`` name each occurrence's example when the input is a batch, and are
    None for a dict. Every tensor is on the logits' device.
    """

    sums: torch.Tensor
    counts: torch.Tensor
    ordinals: torch.Tensor | None
    example_ids: tuple[str, ...] | None


@dataclass(frozen=True)
class _Targets:
    """One input's eligible cells, in occurrence order, and the occurrences they belong to:
    the validated record the rest of this module trusts (every tensor int64 on the CPU)."""

    what: str                    # the input, as errors name it
    shape: tuple[int, int]       # the leading dimensions its logits must have
    rows: torch.Tensor           # [E] first logits index of each eligible cell
    columns: torch.Tensor        # [E] second logits index
    gold: torch.Tensor           # [E] its target
    counts: torch.Tensor         # [n] eligible cells per occurrence (consecutive runs of the above)
    ordinals: torch.Tensor | None = None
    example_ids: tuple[str, ...] | None = None


def token_logprobs(logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, offsets)``: ``log p`` of every supervised target, in occurrence order.

    ``values`` ``[N]`` is differentiable with respect to ``logits`` (float32 for
    half-precision logits, else their dtype); occurrence ``k``'s targets are
    ``values[offsets[k]:offsets[k + 1]]`` in column order (``offsets`` int64 ``[n + 1]``).
    ``logits`` and ``batch`` as :func:`sequence_logprobs` takes them.
    """
    targets = _targets(batch)
    logits = _checked_logits(logits, targets)
    counts = targets.counts.to(logits.device)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=logits.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return _gold_logprobs(logits, targets), offsets


def sequence_logprobs(logits: torch.Tensor, batch) -> SequenceLogprobs:
    """Each occurrence's summed ``log p(target)`` over its supervised targets.

    ``batch`` and the ``logits`` it takes:

    * a padded or packed batch, or its :func:`~seqpack.torch.tensors` dict: ``[rows, T, V]``
      over its cells; targets where ``loss_mask`` (``shift_labels`` not -100);
    * its ``seqpack.hf.rows`` dict: ``[rows, T, V]``; targets ``shift_labels``; an occurrence
      starts wherever ``position_ids`` restarts at 0 inside a row's ``valid_lengths``;
    * its ``seqpack.hf.flat`` dict (or any ``DataCollatorWithFlattening`` output): ``[1, N, V]``;
      the sequences of ``cu_seq_lens_q``, else the runs of ``seq_idx``, else (a dict without
      ``shift_labels``) a new sequence wherever ``position_ids`` is not the previous one plus 1;
      the target of position ``i`` is ``labels[0, i + 1]`` and a sequence's last position has none.

    For one batch, all four give the same results; a dict's other keys (``pair_ids``,
    ``use_cache``...) are not read. Only eligible logit rows are read.
    Memory: beyond its ``[n]`` and ``[N]`` results, the forward pass holds one block of
    eligible rows at a time (log-softmaxed in place), at most ``min(BLOCK_ELEMENTS // V,
    cells // 3)`` rows (one row at least) in the compute dtype, so never more than one
    ``[cells, V]`` tensor's bytes in the logits' dtype; it keeps no copy of the rows for backward, which recomputes them a
    block at a time into the logits' gradient (an ``[rows, T, V]`` tensor, as any loss makes).
    Bitwise reproducible on the CPU at every thread count: each row reduces on one
    thread, each occurrence sums its targets in column order in float64 (``torch.segment_reduce``),
    then rounds the sum to the compute dtype once.

    Refused with :class:`~seqpack.InvalidInputError`: logits that are not a floating-point
    tensor or not of the shape above, a target outside the vocabulary, a dict none of these
    layouts or inconsistent with its own layout.
    """
    targets = _targets(batch)
    logits = _checked_logits(logits, targets)
    values = _gold_logprobs(logits, targets)
    counts = targets.counts.to(logits.device)
    if counts.numel():  # in float64: a float32 sum of 100k targets drifts by about 1e-5 relative
        sums = torch.segment_reduce(values.double(), "sum", lengths=counts).to(values.dtype)
    else:
        sums = values[:0]
    ordinals = None if targets.ordinals is None else targets.ordinals.to(logits.device)
    return SequenceLogprobs(sums, counts, ordinals, targets.example_ids)


def target_statistics(logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(entropy, mean_logit, is_top1)`` ``[N]`` of every supervised target, in
    :func:`token_logprobs`' order, without gradient: the entropy of its next-token
    distribution (natural log), the mean of its logits over the vocabulary, and whether
    the target is the most likely token (the first one, on ties). These are the per-token
    statistics TRL's fused LM head reports for its metrics. ``logits`` and ``batch`` as
    :func:`sequence_logprobs` takes them; logit rows are read a block at a time.
    """
    targets = _targets(batch)
    logits = _checked_logits(logits, targets).detach()
    rows, columns, gold = (t.to(logits.device) for t in (targets.rows, targets.columns, targets.gold))
    compute = _compute_dtype(logits)
    entropy = torch.empty(gold.numel(), dtype=compute, device=logits.device)          # [E]
    mean = torch.empty_like(entropy)
    top = torch.empty(gold.numel(), dtype=torch.bool, device=logits.device)
    buffer, blocks = _blocks(gold.numel(), logits, compute)
    for start, stop in blocks:
        block = _eligible_rows(logits, rows[start:stop], columns[start:stop], buffer)     # [k, V]
        mean[start:stop] = _row_sums(block) / block.shape[1]
        top[start:stop] = block.argmax(1) == gold[start:stop]
        entropy[start:stop] = _row_sums(torch.special.entr(block.softmax(1)))           # 0 log 0 = 0
    return entropy, mean, top


# --- the logits -------------------------------------------------------------------------


def _checked_logits(logits, targets: _Targets) -> torch.Tensor:
    """``logits``, once it is a floating-point ``shape + (V,)`` tensor whose vocabulary
    holds every target."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        found = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise InvalidInputError(f"logits must be a floating-point tensor, not {found}")
    if logits.dim() != 3 or tuple(logits.shape[:2]) != targets.shape:
        raise InvalidInputError(f"logits have shape {tuple(logits.shape)}; {targets.what} needs "
                                f"{targets.shape} + (vocabulary,)")
    classes = logits.shape[2]
    outside = torch.nonzero((targets.gold < 0) | (targets.gold >= classes))
    if outside.numel():
        bad = int(outside[0, 0])
        raise InvalidInputError(f"{targets.what}: row {int(targets.rows[bad])}, column {int(targets.columns[bad])} "
                                f"has target {int(targets.gold[bad])}, outside the vocabulary [0, {classes})")
    return logits


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """What the logits are read in: float32 for half precision, else their dtype."""
    return torch.float32 if logits.element_size() < 4 else logits.dtype


def _gold_logprobs(logits: torch.Tensor, targets: _Targets) -> torch.Tensor:
    device = logits.device
    return _GoldLogprobs.apply(logits, targets.rows.to(device), targets.columns.to(device), targets.gold.to(device))


def _blocks(count: int, logits: torch.Tensor, dtype: torch.dtype):
    """``(buffer, [(start, stop), ...])``: blocks of ``count`` eligible rows (see
    ``sequence_logprobs``' memory bound) and one ``[block, V]`` buffer of ``dtype`` that every
    block is read into in turn (one allocation, its pages touched once)."""
    rows, width, classes = logits.shape
    size = max(1, min(BLOCK_ELEMENTS // max(classes, 1), rows * width // 3))
    buffer = torch.empty((min(size, count), classes), dtype=dtype, device=logits.device)
    return buffer, [(start, min(start + size, count)) for start in range(0, count, size)]


def _row_sums(block: torch.Tensor) -> torch.Tensor:
    """``block.sum(1)`` ``[k]``, each row added in one fixed order: PyTorch splits a lone
    long row's sum across its threads, so a single row is summed as two identical rows."""
    if block.shape[0] == 1:
        return block.expand(2, -1).sum(1)[:1]
    return block.sum(1)


def _eligible_rows(logits: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``logits[rows, columns]`` ``[k, V]`` copied into the first ``k`` rows of ``buffer`` (in its
    dtype), which it returns: by ``index_select`` over the ``[rows * T, V]`` view where the logits'
    strides allow one (about four times faster than advanced indexing)."""
    batch_rows, width, classes = logits.shape
    block = buffer[:rows.numel()]
    if batch_rows <= 1 or logits.stride(0) == width * logits.stride(1):
        if logits.dtype == block.dtype:
            return torch.index_select(logits.view(-1, classes), 0, rows * width + columns, out=block)
        return block.copy_(logits.view(-1, classes).index_select(0, rows * width + columns))
    return block.copy_(logits[rows, columns])


class _GoldLogprobs(torch.autograd.Function):
    """``log_softmax(logits[rows, columns])[gold]`` ``[E]``, reading only those logit rows,
    a block at a time; backward recomputes each block's softmax. PyTorch's row softmax
    reduces each row on one thread in one order, so the bits do not depend on the thread
    count (a lone row included)."""

    @staticmethod
    def forward(ctx, logits, rows, columns, gold):
        compute = _compute_dtype(logits)
        values = torch.empty(gold.numel(), dtype=compute, device=logits.device)       # [E]
        buffer, blocks = _blocks(gold.numel(), logits, compute)
        for start, stop in blocks:
            block = _eligible_rows(logits, rows[start:stop], columns[start:stop], buffer)  # [k, V], a copy
            torch.log_softmax(block, 1, out=block)                                       # in place
            values[start:stop] = block.gather(1, gold[start:stop, None])[:, 0]
        ctx.save_for_backward(logits, rows, columns, gold)
        return values

    @staticmethod
    def backward(ctx, grad):
        # (once_differentiable would let create_graph=True through with the second-order terms zero)
        check_first_order("sequence_logprobs")
        with torch.no_grad():
            return _GoldLogprobs.gradient(ctx, grad)

    @staticmethod
    def gradient(ctx, grad):
        # d log p(gold) / d z = onehot(gold) - softmax(z), for each eligible row z.
        logits, rows, columns, gold = ctx.saved_tensors
        batch_rows, width, classes = logits.shape
        grad_logits = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)  # [rows, T, V]
        buffer, blocks = _blocks(gold.numel(), logits, grad.dtype)
        for start, stop in blocks:
            g = grad[start:stop, None]                                                   # [k, 1]
            block = _eligible_rows(logits, rows[start:stop], columns[start:stop], buffer)  # a copy
            torch.softmax(block, 1, out=block).mul_(-g)                                  # [k, V], in place
            block.scatter_add_(1, gold[start:stop, None], g)                             # + g at the gold column
            cells = rows[start:stop] * width + columns[start:stop]                       # distinct cells
            grad_logits.view(-1, classes).index_copy_(0, cells, block.to(logits.dtype))
        return grad_logits, None, None, None


# --- the four inputs ----------------------------------------------------------------------


def _targets(batch) -> _Targets:
    """The eligible cells and occurrences of a batch or one of its dicts."""
    if isinstance(batch, BatchLayout):
        return _batch_targets(batch)
    if isinstance(batch, Mapping):
        if "segments" in batch:
            fields = batch_tensors(batch)
            return _row_targets("the tensors() dict", fields["shift_labels"].long(), fields["positions"].long(),
                                fields["valid_lengths"])
        if "cu_seq_lens_q" in batch or "seq_idx" in batch:
            return _flat_targets(batch)
        if "position_ids" in batch and "shift_labels" not in batch and "labels" in batch:
            return _flat_targets(batch)  # DataCollatorWithFlattening's default output
        if "position_ids" in batch:
            what = "the rows() dict"
            labels = _entry(batch, "shift_labels", what, 2)
            return _row_targets(what, labels, _entry(batch, "position_ids", what, 2, labels.shape),
                                _entry(batch, "valid_lengths", what, 1, labels.shape[:1]))
        raise InvalidInputError(
            "expected a padded or packed batch or a dict of seqpack.torch.tensors(batch) (with segments), "
            "seqpack.hf.rows(batch) (with shift_labels and position_ids) or seqpack.hf.flat(batch) (labels with "
            f"cu_seq_lens_q, seq_idx or position_ids); this dict has {', '.join(map(repr, sorted(map(str, batch))))}"
        )
    raise InvalidInputError(f"expected a padded or packed batch or one of its dicts, not {type(batch).__name__}")


def _entry(batch: dict, name: str, what: str, dim: int, shape=None) -> torch.Tensor:
    """``batch[name]``, an integer tensor of ``dim`` dimensions (of ``shape`` when given), as
    int64 on the CPU."""
    if name not in batch:
        raise InvalidInputError(f"{what} lacks {name!r}")
    value = batch[name]
    if not (is_integer_tensor(value) and value.dim() == dim and (shape is None or value.shape == shape)):
        expected = f"of shape {tuple(shape)}" if shape is not None else f"of {dim} dimensions"
        raise InvalidInputError(f"{what}'s {name} must be an integer tensor {expected}, not {_described(value)}")
    return _signed(value.detach().cpu()).long()


def _batch_targets(batch: BatchLayout) -> _Targets:
    """A batch's cells: its occurrence records own its valid cells, in row-major order."""
    records = batch.occurrence_records                                                   # no object per occurrence
    lengths = torch.from_numpy((records["stop"] - records["start"]).astype(np.int64))
    token_valid, loss_mask = shared_tensor(batch.token_valid), shared_tensor(batch.loss_mask)
    owners = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)             # [valid cells]
    rows, columns = torch.nonzero(loss_mask, as_tuple=True)
    return _Targets(
        "the batch", tuple(batch.shape), rows, columns, shared_tensor(batch.targets)[loss_mask].long(),
        torch.bincount(owners[loss_mask[token_valid]], minlength=lengths.numel()),
        torch.from_numpy(records["ordinal"].astype(np.int64)), batch.example_ids,
    )


def _row_targets(what: str, labels: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> _Targets:
    """``[rows, T]`` cells: targets ``labels`` (-100 where none); an occurrence starts wherever
    ``positions`` is 0 inside a row's valid prefix of ``lengths`` cells."""
    width = labels.shape[1]
    row = _first((lengths < 0) | (lengths > width))
    if row is not None:
        raise InvalidInputError(f"{what}: row {row} has valid length {int(lengths[row])}, outside [0, {width}]")
    valid = torch.arange(width)[None, :] < lengths[:, None]                              # [rows, T]
    stray = _first((labels != IGNORE_INDEX) & ~valid)
    if stray is not None:
        row, column = stray
        raise InvalidInputError(f"{what}: row {row}, column {column} holds target {int(labels[row, column])} past "
                                f"the row's valid length {int(lengths[row])}")
    starts = valid & (positions == 0)
    row = _first(valid[:, 0] & ~starts[:, 0]) if width else None
    if row is not None:
        raise InvalidInputError(f"{what}: row {row} begins at position {int(positions[row, 0])}; a row's valid "
                                f"cells must begin a sequence at position 0")
    owners = torch.cumsum(starts[valid], 0) - 1                                         # [valid cells]
    eligible = valid & (labels != IGNORE_INDEX)
    rows, columns = torch.nonzero(eligible, as_tuple=True)
    counts = torch.bincount(owners[eligible[valid]], minlength=int(starts.sum()))
    return _Targets(what, tuple(labels.shape), rows, columns, labels[eligible], counts)


def _first(mask: torch.Tensor):
    """The index of ``mask``'s first True element in row-major order (an int, or a list for
    several dimensions), or None."""
    found = torch.nonzero(mask)
    if not found.numel():
        return None
    first = found[0].tolist()
    return first[0] if mask.dim() == 1 else first


def _flat_targets(batch: dict) -> _Targets:
    """``[1, N]`` sequences (see ``sequence_logprobs``): position ``i``'s target is
    ``labels[0, i + 1]`` within its sequence."""
    what = "the flat() dict"
    labels = _entry(batch, "labels", what, 2)
    if labels.shape[0] != 1:
        raise InvalidInputError(f"{what}'s labels have shape {tuple(labels.shape)}; a flattened batch is one "
                                f"[1, N] row")
    size = labels.shape[1]
    lengths = None
    if "cu_seq_lens_q" in batch:
        cu = _entry(batch, "cu_seq_lens_q", what, 1)
        if cu.numel() == 0 or int(cu[0]) != 0 or int(cu[-1]) != size or bool((cu[1:] <= cu[:-1]).any()):
            raise InvalidInputError(f"{what}'s cu_seq_lens_q must rise strictly from 0 to its {size} tokens, "
                                    f"not {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")
        lengths = cu.diff()
    if "seq_idx" in batch:
        seq_idx = _entry(batch, "seq_idx", what, 2, labels.shape)[0]
        changes = torch.nonzero(seq_idx[1:] != seq_idx[:-1]).flatten() + 1
        runs = torch.cat([changes, torch.tensor([size])]).diff(prepend=torch.zeros(1, dtype=torch.int64))
        runs = runs[runs > 0]  # no token, no sequence
        if lengths is not None and not torch.equal(runs, lengths):
            raise InvalidInputError(f"{what}'s seq_idx and cu_seq_lens_q describe different sequences")
        lengths = runs
    if lengths is None:  # position_ids alone, as transformers reads them
        positions = _entry(batch, "position_ids", what, 2, labels.shape)[0]
        starts = torch.ones(size, dtype=torch.bool)
        starts[1:] = positions[1:] != positions[:-1] + 1
        lengths = torch.nonzero(starts).flatten().diff(append=torch.tensor([size]))
    sequence = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)          # [N]
    following = torch.cat([labels[0, 1:], torch.tensor([IGNORE_INDEX])])[:size]         # labels[0, i + 1]
    eligible = following != IGNORE_INDEX
    eligible[torch.cumsum(lengths, 0) - 1] = False                                       # a sequence's last token
    columns = torch.nonzero(eligible).flatten()
    return _Targets(what, (1, size), torch.zeros_like(columns), columns, following[eligible],
                    torch.bincount(sequence[eligible], minlength=lengths.numel()))
