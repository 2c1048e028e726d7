"""The segments and valid cells of a transformers attention call, from its keywords.

The rule (see :mod:`seqpack.hf.attention`): segments come from ``cu_seq_lens_q``, else
``seq_idx``, else ``position_ids`` (a new segment wherever a position is not the
previous one plus 1); valid cells from ``valid_lengths``, else a right-padded 2-D
``attention_mask``, else the end of ``cu_seq_lens_q``, else every cell. Descriptions that
disagree are an error; ranges the kernel checks (``valid_lengths`` within ``[0, T]``)
are left to it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import InvalidInputError
from ..torch.attention import int_array


def _per_cell(name: str, value, rows: int, width: int) -> np.ndarray:
    """A ``[rows, width]`` integer array (``[1, width]`` broadcast over the rows, as transformers does)."""
    array = int_array(name, value)
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] != width or array.shape[0] not in (1, rows):
        raise InvalidInputError(f"{name} has shape {array.shape}; expected ({rows}, {width})")
    return np.broadcast_to(array, (rows, width))


def _boundaries_from_offsets(cu: np.ndarray, rows: int, width: int) -> tuple[np.ndarray, int]:
    """Segment starts marked on ``[rows, width]`` from offsets over the flattened cells, and the covered count."""
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > rows * width:
        raise InvalidInputError(
            f"cu_seq_lens_q must rise from 0 to at most {rows * width} (rows x T), got {cu.tolist()}"
        )
    first, last = cu[:-1], cu[1:] - 1
    nonempty = last >= first
    crossing = nonempty & (first // max(width, 1) != last // max(width, 1))
    if crossing.any():
        index = int(np.argmax(crossing))
        raise InvalidInputError(
            f"sequence {index} of cu_seq_lens_q covers cells {first[index]}..{last[index]}, which cross a "
            f"row boundary (rows of {width} cells)"
        )
    marks = np.zeros(rows * width, dtype=bool)
    marks[first[nonempty]] = True
    return marks.reshape(rows, width), int(cu[-1])


def layout(rows: int, width: int, attention_mask, kwargs: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(valid_lengths [rows], segment_starts [rows, width])`` from the forward's keywords (see the module)."""
    columns = np.arange(width, dtype=np.int64)
    covered, source = None, None
    if kwargs.get("cu_seq_lens_q") is None and kwargs.get("cu_seq_lens_k") is not None:
        raise InvalidInputError("cu_seq_lens_k was given without cu_seq_lens_q: pass both (the same offsets)")
    if kwargs.get("cu_seq_lens_q") is not None:
        source = "cu_seq_lens_q"
        cu_q = int_array("cu_seq_lens_q", kwargs["cu_seq_lens_q"])
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and not np.array_equal(cu_q, int_array("cu_seq_lens_k", cu_k)):
            raise InvalidInputError("cu_seq_lens_k differs from cu_seq_lens_q: self-attention needs the same segments")
        marks, covered = _boundaries_from_offsets(cu_q, rows, width)
    elif kwargs.get("seq_idx") is not None:
        source = "seq_idx"
        index = _per_cell("seq_idx", kwargs["seq_idx"], rows, width)
        marks = np.ones((rows, width), dtype=bool)
        marks[:, 1:] = index[:, 1:] != index[:, :-1]
    elif kwargs.get("position_ids") is not None:
        positions = _per_cell("position_ids", kwargs["position_ids"], rows, width)
        marks = np.ones((rows, width), dtype=bool)
        marks[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    else:
        marks = np.zeros((rows, width), dtype=bool)
    if width:
        marks[:, 0] = True
    lengths = _valid_lengths(rows, width, attention_mask, kwargs.get("valid_lengths"), covered)
    valid = columns[None, :] < lengths[:, None]
    if covered is not None:
        outside = valid & (np.arange(rows, dtype=np.int64)[:, None] * width + columns[None, :] >= covered)
        if outside.any():
            row, column = (int(i) for i in np.argwhere(outside)[0])
            raise InvalidInputError(
                f"cell {column} of row {row} is valid (valid_lengths or attention_mask) but in no sequence of "
                f"cu_seq_lens_q, which ends at cell {covered} of the flattened rows"
            )
    if source is not None and kwargs.get("position_ids") is not None:
        # positions that restart inside one sequence: the segments and the model's positions disagree
        positions = _per_cell("position_ids", kwargs["position_ids"], rows, width)
        broken = valid[:, 1:] & ~marks[:, 1:] & (positions[:, 1:] != positions[:, :-1] + 1)
        if broken.any():
            row, column = (int(i) for i in np.argwhere(broken)[0])
            raise InvalidInputError(
                f"position_ids[{row}, {column + 1}] = {positions[row, column + 1]} does not continue "
                f"{positions[row, column]} inside one sequence of {source}: the segments and positions disagree"
            )
    starts = np.maximum.accumulate(np.where(marks, columns, 0), axis=1) if width else marks.astype(np.int64)
    return lengths, starts


def _valid_lengths(rows: int, width: int, attention_mask, given, covered) -> np.ndarray:
    unpadded = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise InvalidInputError(f"attention_mask must be a tensor or None, not {type(attention_mask).__name__}")
        if attention_mask.dim() != 2:
            raise InvalidInputError(
                f"seqpack attention takes no {attention_mask.dim()}-D attention mask (attention_mask has shape "
                f"{tuple(attention_mask.shape)}): describe the segments with position_ids, seq_idx or "
                f"cu_seq_lens_q and padding with valid_lengths"
            )
        mask = attention_mask.detach().cpu().to(torch.bool).numpy()   # (numpy holds no bfloat16)
        if mask.shape != (rows, width):
            raise InvalidInputError(f"attention_mask has shape {mask.shape}; expected ({rows}, {width})")
        unpadded = mask.sum(axis=1, dtype=np.int64)
        prefix = np.arange(width)[None, :] < unpadded[:, None]
        if not np.array_equal(mask, prefix):
            row = int(np.argmax((mask != prefix).any(axis=1)))
            raise InvalidInputError(
                f"attention_mask row {row} is not right-padded (ones, then zeros): seqpack attention "
                f"skips a suffix of padding"
            )
    if given is not None:
        lengths = int_array("valid_lengths", given, (rows,))  # its range is the kernel's check
        if unpadded is not None and not np.array_equal(lengths, unpadded):
            row = int(np.argmax(lengths != unpadded))
            raise InvalidInputError(
                f"valid_lengths[{row}] = {lengths[row]} but attention_mask row {row} has {unpadded[row]} "
                f"valid cells: the two padding descriptions disagree"
            )
    elif unpadded is not None:
        lengths = unpadded
    elif covered is not None:
        lengths = np.clip(covered - np.arange(rows, dtype=np.int64) * width, 0, width)
    else:
        lengths = np.full(rows, width, dtype=np.int64)
    return lengths


def segment_lengths(lengths: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The cells of each segment of the valid cells, row by row."""
    columns = np.arange(starts.shape[1])
    valid = columns[None, :] < lengths[:, None]
    last = valid.copy()   # a segment's last cell: the next one is invalid or starts another
    last[:, :-1] &= ~(valid[:, 1:] & (starts[:, 1:] == starts[:, :-1]))
    return (columns[None, :] - starts + 1)[last]


def check_window(window: int, lengths: np.ndarray, starts: np.ndarray) -> None:
    """A sliding window (or a chunk of positions) changes nothing while every segment fits
    in it; otherwise it is an error."""
    spans = segment_lengths(lengths, starts)
    longest = int(spans.max()) if spans.size else 0
    if longest > window:
        raise InvalidInputError(
            f"a segment of {longest} tokens exceeds the sliding window (or attention chunk) of {window}: "
            f"seqpack attention has no local attention"
        )
