"""Outcome-contract fuzz cases of the integrations (test family 19), run in a subprocess by
``test_contract.py`` like ``contract_cases.py``, whose check, reference verdicts and case
counting they share.

Covered: the numpy exports (``seqpack.position_ids`` ... ``max_seqlen``) and their
``seqpack.torch`` twins, ``seqpack.torch.range_attention`` (forward and backward),
``token_weighted_loss``, ``loss_sum`` and ``step_target_count``, and ``seqpack.hf``'s
``flat``, ``rows``, ``num_items_in_batch`` and the attention hook ``seqpack_attention``
called directly. The oracles are plain: the batch fields ``contract_cases`` derives by the
packing rule, float64 attention with an explicit mask, PyTorch SDPA with a dense boolean
block-causal mask, float64 log-softmax, transformers' own ``DataCollatorWithFlattening``
and Trainer's item-count rule.

This file is not named ``test_*.py``: run directly, a crash would take the whole test
session down with it.
"""

from __future__ import annotations

import itertools
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import seqpack as sp
from contract_cases import (  # noqa: F401 (count_cases and report_case_counts: autouse fixtures)
    ARRAY_LAYOUTS, BINDING, DEFAULT_MEMORY_BYTES, INT_TYPES, POLICIES, Invalid, arranged,
    assert_close, check, contract, count_cases, is_int, packing_reference, padding_reference, report_case_counts,
    table_arguments, table_reference,
)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import seqpack.hf as sph  # noqa: E402
import seqpack.torch as spt  # noqa: E402
from seqpack.torch.objective import loss_sum  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402

IGNORE = -100
TORCH_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
HALF = (torch.float16, torch.bfloat16)
FLOAT_TYPES = (torch.float64,) * 4 + (torch.float32, torch.float32, torch.float16, torch.bfloat16)


# --- batches and their reference fields ---------------------------------------------------


@st.composite
def batch_cases(draw):
    """``(batch, fields, sources)``: a padded or packed batch of a random table, the fields
    ``contract_cases`` derives for it by the rule, and the examples' source tokens."""
    options = draw(table_arguments(valid_only=True))
    table = sp.ExampleTable.from_arrays(binding=BINDING, **options)
    sources = table_reference(**options)
    rows_per_batch = draw(st.integers(1, 3))
    if draw(st.booleans()):
        epoch = sp.pad(table, sp.PadConfig(rows_per_batch=rows_per_batch), partition=sp.Partition.TRAIN,
                       binding=BINDING)
        expected = padding_reference(sources, {"rows_per_batch": rows_per_batch, "max_cells": None,
                                               "max_width": None, "max_memory_bytes": DEFAULT_MEMORY_BYTES})
    else:
        capacity, policy = draw(st.integers(11, 16)), draw(st.sampled_from(POLICIES))
        epoch = sp.pack(table, sp.PackConfig(capacity, rows_per_batch=rows_per_batch), partition=sp.Partition.TRAIN,
                        binding=BINDING, policy=policy)
        expected = packing_reference(sources, {"capacity": capacity, "rows_per_batch": rows_per_batch,
                                               "max_cells": capacity * rows_per_batch,
                                               "max_memory_bytes": DEFAULT_MEMORY_BYTES}, policy)
    number = draw(st.integers(0, len(epoch) - 1))
    return epoch.batches[number], expected[number], sources


def documents_of(fields) -> list[tuple[int, int, range]]:
    """``(ordinal, row, columns)`` of the batch's examples in row-major order."""
    return [(ordinal, row, columns) for ordinal, row, columns, _ in fields["occurrences"]]


def loss_mask(fields) -> np.ndarray:
    return np.array(fields["loss_mask"], dtype=bool)


def shift_labels(fields) -> np.ndarray:
    return np.where(loss_mask(fields), np.array(fields["targets"]), IGNORE)



# --- 1. the exports -----------------------------------------------------------------------

EXPORTS = ("position_ids", "document_ids", "seq_lens", "cu_seqlens", "max_seqlen")


def exports_reference(fields, name):
    """The export ``name`` of a batch with ``fields``, by the docstrings of seqpack.layout.exports."""
    documents = documents_of(fields)
    if name == "position_ids":
        return np.array(fields["positions"], dtype=np.int64)
    if name == "document_ids":
        ids = np.full(np.shape(fields["positions"]), -1, dtype=np.int32)
        for index, (_, row, columns) in enumerate(documents):
            ids[row, columns.start : columns.stop] = index
        return ids
    lengths = [len(columns) for _, _, columns in documents]
    if name == "seq_lens":
        return np.array(lengths, dtype=np.int32)
    if name == "cu_seqlens":
        return np.array([0, *itertools.accumulate(lengths)], dtype=np.int32)
    return max(lengths, default=0)


def device_reference(device):
    """A ``torch.device``, a string or an index (not a bool) of a device PyTorch can reach."""
    if device is None:
        return
    if not (isinstance(device, (str, torch.device)) or is_int(device)):
        raise Invalid(f"device {device!r}", names=("device",))
    try:
        torch.zeros(0).to(torch.device(int(device) if is_int(device) else device))
    except (RuntimeError, AssertionError):
        raise Invalid(f"device {device!r} is not available", names=("device",)) from None


def compare_export(batch, name, torch_api):
    def compare(result, expected):
        if name == "max_seqlen":
            assert type(result) is int and result == expected, f"max_seqlen {result!r} != {expected}"
            return
        if torch_api:
            assert isinstance(result, torch.Tensor) and result.device.type == "cpu"
            result = result.numpy()
        assert result.dtype == expected.dtype, f"{name} has dtype {result.dtype}, expected {expected.dtype}"
        assert result.shape == expected.shape and (result == expected).all(), f"{name}: {result} != {expected}"
        assert not any(np.shares_memory(result, getattr(batch, field)) for field in ("positions", "segments"))
    return compare


@contract(250)
@given(batch_cases(), st.sampled_from(EXPORTS), st.booleans(), st.integers(0, 15),
       st.sampled_from([None] * 6 + ["cpu", torch.device("cpu"), "cuda", "nonsense", 3.5, True, np.int64(0)]))
def test_exports(case, name, torch_api, odd, device):
    batch, fields, _ = case
    given_batch = [None, "batch", np.zeros((2, 3), np.int32), fields][odd] if odd < 4 else batch
    module = spt if torch_api else sp
    options = {"device": device} if torch_api and name != "max_seqlen" else {}

    def reference():
        if given_batch is not batch:
            raise Invalid("not a batch")
        if options:
            device_reference(device)
        return exports_reference(fields, name)

    check(lambda: getattr(module, name)(given_batch, **options), reference, compare_export(batch, name, torch_api))


# --- 2. seqpack.torch.range_attention ---------------------------------------------------


def allowed_keys(lengths, starts, rows: int, width: int):
    """``[rows, T, T]`` permission and ``[rows, T]`` activity: valid query ``t`` sees ``starts[r][t] .. t``."""
    mask = np.zeros((rows, width, width), dtype=bool)
    active = np.zeros((rows, width), dtype=bool)
    for r in range(rows):
        for t in range(lengths[r]):
            mask[r, t, starts[r][t] : t + 1] = True
            active[r, t] = True
    return mask, active


def dense_attention(q, k, v, mask, active, scale, dout=None):
    """float64 ``(out, (dq, dk, dv))`` of masked attention with grouped heads; inactive
    cells are never read (zeroed first), their outputs are 0."""
    live = torch.from_numpy(active)[:, None, :, None]
    q, k, v = (torch.where(live, x.detach().double(), 0.0).requires_grad_() for x in (q, k, v))
    group = q.shape[1] // max(k.shape[1], 1)
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    # Inactive queries see themselves only, so no row is empty; their outputs are zeroed.
    seen = torch.from_numpy(mask | np.eye(mask.shape[-1], dtype=bool)[None])[:, None]
    scores = (q @ keys.transpose(-1, -2) * scale).masked_fill(~seen, -math.inf)
    out = torch.where(live, torch.softmax(scores, dim=-1) @ values, 0.0)
    if dout is None:
        return out.detach(), None
    return out.detach(), torch.autograd.grad(out, (q, k, v), dout.double())


def tolerance_dtype(dtype):
    return np.float64 if dtype == torch.float64 else np.float32


def assert_tensor_close(name, actual, expected, dtype):
    assert actual.dtype == dtype, f"{name} has dtype {actual.dtype}, expected {dtype}"
    actual, expected = actual.detach().double().numpy(), expected.numpy()
    if dtype in HALF:  # computed in float32, rounded once to 8 or 11 significant bits
        limit = 1e-2 * (1 + np.abs(expected).max(initial=0))
        bad = np.argwhere(~(np.abs(actual - expected) <= limit))
        assert bad.size == 0, f"{name} differs at {tuple(bad[0])}: {actual[tuple(bad[0])]} vs {expected[tuple(bad[0])]}"
        return
    assert_close(name, actual, expected, tolerance_dtype(dtype))


def scale_reference(scale, head_dim: int, compute, name="scale"):
    """The score factor: None gives ``1/sqrt(D)``; else a finite real number (not a bool,
    not a tensor) that stays finite in the dtype the kernels compute in."""
    if scale is None:
        return 1 / math.sqrt(head_dim)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise Invalid(f"{name} {scale!r}", names=(name,))
    try:
        value = float(scale)
    except OverflowError:
        value = math.inf
    with np.errstate(over="ignore"):
        if not math.isfinite(value) or not np.isfinite(np.float64(value).astype(compute)):
            raise Invalid(f"{name} {scale!r}", names=(name,))
    return value


def layout_ints(value, name, shape):
    """A layout argument as a nested list of ints of ``shape``, or Invalid."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise Invalid(f"{name} of dtype {value.dtype}", names=(name,))
        value = value.numpy()
    array = np.asarray(value)
    if array.shape != shape:
        raise Invalid(f"{name} has shape {array.shape}", names=(name,))
    if array.size and array.dtype.kind not in "iu":
        raise Invalid(f"{name} of dtype {array.dtype}", names=(name,))
    return array.astype(object).tolist()


def torch_attention_reference(arguments):
    q, k, v = (arguments[n] for n in "qkv")
    for name in "qkv":
        tensor = arguments[name]
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() != 4:
            raise Invalid(f"{name} is not a 4-D floating tensor", names=(name,))
    if not q.dtype == k.dtype == v.dtype:
        raise Invalid("dtypes differ")
    rows, heads, width, head_dim = q.shape
    if head_dim < 1 or k.shape != v.shape or k.shape[:1] + k.shape[2:] != q.shape[:1] + q.shape[2:]:
        raise Invalid("shapes")
    if k.shape[1] == 0 or heads % k.shape[1]:
        raise Invalid("query heads not a multiple of key/value heads")
    given = arguments.get("valid_lengths")
    lengths = [width] * rows if given is None else layout_ints(given, "valid_lengths", (rows,))
    if any(not 0 <= length <= width for length in lengths):
        raise Invalid("a valid length outside [0, T]", names=("valid_lengths",))
    if ("segment_starts" in arguments) == ("position_ids" in arguments):
        raise Invalid("exactly one of segment_starts and position_ids")
    if "segment_starts" in arguments:
        starts = layout_ints(arguments["segment_starts"], "segment_starts", (rows, width))
        for r, t in itertools.product(range(rows), range(width)):
            start = starts[r][t]
            if t < lengths[r] and not (start == t or (t and start == starts[r][t - 1] and 0 <= start < t)):
                raise Invalid("a query that neither opens nor continues a segment")
    else:
        positions = layout_ints(arguments["position_ids"], "position_ids", (rows, width))
        starts = [[0] * width for _ in range(rows)]
        for r in range(rows):
            for t in range(lengths[r]):
                if positions[r][t] != 0 and (t == 0 or positions[r][t] != positions[r][t - 1] + 1):
                    raise Invalid("a position neither 0 nor the previous plus 1", names=("position_ids",))
                starts[r][t] = t - positions[r][t]
    compute = np.float64 if q.dtype == torch.float64 else np.float32
    scale = scale_reference(arguments.get("scale"), head_dim, compute)
    mask, active = allowed_keys(lengths, starts, rows, width)
    return dense_attention(q, k, v, mask, active, scale, arguments.get("dout"))


@st.composite
def segmented(draw, rows: int, width: int, all_valid: bool):
    """Valid lengths and segment starts (lists) of a random layout."""
    lengths, starts = [], []
    for _ in range(rows):
        length = width if all_valid else draw(st.integers(0, width))
        row, column = list(range(width)), 0
        while column < length:
            size = draw(st.integers(1, length - column))
            row[column : column + size] = [column] * size
            column += size
        lengths.append(length)
        starts.append(row)
    return lengths, starts


def layout_form(draw, values: list, odd: bool):
    """``values`` as a tensor of an integer dtype that holds them, a numpy array or a list;
    with ``odd`` sometimes a float or bool tensor or the wrong shape."""
    flat = np.array(values, dtype=np.int64)
    form = draw(st.sampled_from(["tensor"] * 4 + ["numpy", "list"] + (["float", "bool", "shape"] if odd else [])))
    if form == "float":
        return torch.from_numpy(flat.astype(np.float64))
    if form == "bool":
        return torch.from_numpy(flat != 0)
    if form == "shape":
        return torch.from_numpy(flat[..., :-1] if flat.ndim and flat.shape[-1] else flat[None])
    fitting = [t for t in TORCH_INTS if flat.size == 0 or (torch.iinfo(t).min <= flat.min()
                                                              and flat.max() <= torch.iinfo(t).max)]
    if form == "tensor":
        tensor = torch.from_numpy(flat).to(draw(st.sampled_from(fitting)))
        return tensor.t().contiguous().t() if tensor.dim() == 2 and draw(st.booleans()) else tensor
    if form == "numpy":
        numpy_types = [t for t in INT_TYPES if flat.size == 0 or (np.iinfo(t).min <= flat.min()
                                                                  and flat.max() <= np.iinfo(t).max)]
        return arranged(flat.astype(draw(st.sampled_from(numpy_types))), draw(ARRAY_LAYOUTS))
    return flat.tolist()


def attention_storage(rng, shape, dtype, layout: str) -> torch.Tensor:
    """A ``[B, H, T, D]`` tensor in ``layout``: contiguous, a view of ``[B, T, H, D]`` storage
    (transformers' projections), every other element of a wider tensor, or broadcast over heads."""
    rows, heads, width, head_dim = shape
    values = torch.from_numpy(rng.standard_normal(shape))
    if layout == "cells":
        return values.transpose(1, 2).contiguous().to(dtype).transpose(1, 2)
    if layout == "strided":
        wide = torch.zeros((rows, heads, width, 2 * head_dim), dtype=dtype)
        wide[..., ::2] = values.to(dtype)
        return wide[..., ::2]
    if layout == "expanded" and heads:
        return values[:, :1].to(dtype).expand(shape)
    return values.to(dtype)


def poison(tensor: torch.Tensor, lengths) -> None:
    """NaN in every cell past its row's valid length (never read by a valid query)."""
    with torch.no_grad():
        for r, length in enumerate(lengths):
            tensor[r, :, length:] = math.nan


ATTENTION_FAULTS = ("heads", "dtype", "mixed", "shape", "layout", "position", "start", "both", "neither",
                    "length", "scale", "not a tensor")


@st.composite
def torch_attention_arguments(draw):
    fault = draw(st.sampled_from((None,) * 8 + ATTENTION_FAULTS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows, width, head_dim = draw(st.integers(0, 3)), draw(st.integers(1, 7)), draw(st.sampled_from([1, 3, 4, 8]))
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    heads = kv_heads * draw(st.integers(1, 3)) + (draw(st.integers(1, kv_heads)) if fault == "heads" and kv_heads > 1
                                                  else 0)
    dtype = draw(st.sampled_from(FLOAT_TYPES))
    if fault == "dtype":
        dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.complex64, torch.bool]))
    lengths, starts = draw(segmented(rows, width, all_valid=draw(st.integers(0, 4)) == 0))
    arguments = {}
    for name in "qkv":
        shape = (rows, heads if name == "q" else kv_heads, width, head_dim)
        if fault == "shape" and name == draw(st.sampled_from("kv")):
            shape = shape[:3] + (head_dim + 1,) if draw(st.booleans()) else (rows + 1,) + shape[1:]
        layout = draw(st.sampled_from(["c", "c", "cells", "strided", "expanded"]))
        arguments[name] = attention_storage(rng, shape, dtype, layout)
    if fault == "mixed":
        name = draw(st.sampled_from("kv"))
        arguments[name] = arguments[name].to(torch.float32 if dtype == torch.float64 else torch.float64)
    if fault == "not a tensor":
        arguments["v"] = arguments["v"].numpy() if dtype not in HALF else arguments["v"].tolist()
    valid_given = fault == "length" or min(lengths, default=width) < width or draw(st.booleans())
    if fault == "length" and rows:
        lengths[draw(st.integers(0, rows - 1))] = draw(st.sampled_from([-1, width + 1, 2**40]))
    if valid_given:
        arguments["valid_lengths"] = layout_form(draw, lengths, odd=fault == "layout")
        if dtype.is_floating_point and not fault and draw(st.booleans()):
            for name in "qkv":  # NaN where no valid query reads
                if arguments[name].stride(1) and arguments[name].dim() == 4:
                    poison(arguments[name], lengths)
    junk = rng.integers(-3, width + 3, size=(rows, width))
    valid = np.arange(width)[None, :] < np.array(lengths, dtype=np.int64).reshape(rows, 1).clip(0, width)
    use_positions = fault == "position" or (fault != "start" and draw(st.booleans()))
    if use_positions or fault == "both":
        positions = np.where(valid, np.arange(width)[None, :] - np.array(starts, dtype=np.int64).reshape(rows, width),
                             junk)
        if fault == "position" and rows:
            r = draw(st.integers(0, rows - 1))
            t = draw(st.integers(0, width - 1))
            lengths_r = max(lengths[r], t + 1) if 0 <= lengths[r] <= width else width
            if "valid_lengths" not in arguments or lengths_r != lengths[r]:
                lengths[r] = lengths_r
                arguments["valid_lengths"] = torch.tensor(lengths)
            positions[r, t] = draw(st.sampled_from([-1, positions[r, t] + 2, 2**40, positions[r, t] + 1 if t else 1]))
        arguments["position_ids"] = layout_form(draw, positions.tolist(), odd=fault == "layout")
    if not use_positions or fault == "both":
        given_starts = np.where(valid, np.array(starts, dtype=np.int64).reshape(rows, width), junk)
        if fault == "start" and rows:
            r, t = draw(st.integers(0, rows - 1)), draw(st.integers(0, width - 1))
            if 0 <= lengths[r] <= width:
                lengths[r] = max(lengths[r], t + 1)
                arguments["valid_lengths"] = torch.tensor(lengths)
            given_starts[r, t] = draw(st.sampled_from([-1, t + 1, max(t - 1, 0), 2**40]))
        arguments["segment_starts"] = layout_form(draw, given_starts.tolist(), odd=fault == "layout")
    if fault == "neither":
        arguments.pop("segment_starts", None)
        arguments.pop("position_ids", None)
    scales = [None] * 4 + [0.5, 2, np.float32(0.25), np.int64(1), np.float64(-1.5)]
    if fault == "scale":
        scales = [True, np.bool_(False), "0.5", torch.tensor(0.5), math.inf, math.nan, 1e39, 10**400, [0.5]]
    arguments["scale"] = draw(st.sampled_from(scales))
    if draw(st.integers(0, 2)) == 0:  # backward too
        for name in "qkv":
            if isinstance(arguments[name], torch.Tensor) and arguments[name].is_floating_point():
                arguments[name].requires_grad_()
        arguments["dout"] = torch.from_numpy(rng.standard_normal((rows, heads, width, head_dim))).to(
            dtype if dtype.is_floating_point else torch.float64)
    return arguments


def compare_torch_attention(arguments):
    q = arguments["q"]

    def compare(result, expected):
        out, grads = result
        want, want_grads = expected
        assert_tensor_close("out", out, want, q.dtype)
        assert not out.isnan().any(), "NaN in the output"
        for name, grad, wanted in zip("qkv", grads or (), want_grads or ()):
            assert_tensor_close(f"d{name}", grad, wanted, q.dtype)
    return compare


def torch_attention_call(arguments):
    keywords = {n: arguments[n] for n in ("segment_starts", "valid_lengths", "position_ids", "scale")
                if n in arguments}
    out = spt.range_attention(arguments["q"], arguments["k"], arguments["v"], **keywords)
    if "dout" not in arguments:
        return out, None
    return out, torch.autograd.grad(out, [arguments[n] for n in "qkv"], arguments["dout"])


@contract(350)
@given(torch_attention_arguments())
def test_torch_range_attention(arguments):
    check(lambda: torch_attention_call(arguments), lambda: torch_attention_reference(arguments),
          compare_torch_attention(arguments))


# --- 3. the token-weighted objective ------------------------------------------------------


ABSENT = object()  # no denominator: the case calls loss_sum
BATCH = object()  # stands for the case's batch among the drawn targets


def targets_reference(target, fields):
    """The targets (``IGNORE`` where not eligible) a loss call reads, as an int64 array, or Invalid."""
    if target is BATCH:
        return shift_labels(fields)
    if isinstance(target, dict):
        target = target.get("shift_labels")
    if (not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex()
            or target.dtype == torch.bool):
        raise Invalid("targets that are not an integer tensor")
    return target.numpy().astype(np.int64)


def loss_reference(logits, target, fields, denominator):
    """``(loss_sum, count)`` by float64 log-softmax, divided by the denominator rule."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise Invalid("logits must be a floating tensor")
    targets = targets_reference(target, fields)
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != targets.shape:
        raise Invalid("logits shape", names=("logits",))
    values = logits.detach().double().numpy().reshape(-1, logits.shape[-1])
    flat = targets.reshape(-1)
    cells = np.flatnonzero(flat != IGNORE)
    if any(not 0 <= flat[c] < logits.shape[-1] for c in cells):
        raise Invalid("a target outside the vocabulary")
    total = 0.0
    for c in cells:
        row = values[c]
        total += row.max() + math.log(np.exp(row - row.max()).sum()) - row[flat[c]]
    if denominator is ABSENT:
        return total, len(cells)
    if denominator is None:
        if not cells.size:
            raise Invalid("no eligible target")
        return total / len(cells), None
    if isinstance(denominator, torch.Tensor) and denominator.is_floating_point() and denominator.numel() == 1 \
            and float(denominator).is_integer():
        denominator = int(denominator.item())  # Trainer's num_items_in_batch (transformers 5)
    if isinstance(denominator, torch.Tensor) and not denominator.is_floating_point() and \
            denominator.dtype != torch.bool and denominator.numel() == 1:
        denominator = int(denominator.item())
    if not is_int(denominator) or denominator < max(len(cells), 1):
        raise Invalid(f"denominator {denominator!r}", names=("denominator",))
    return total / int(denominator), None


def compare_loss(dtype):
    def compare(result, expected):
        value, count = result
        wanted, wanted_count = expected
        assert count == wanted_count, f"count {count} != {wanted_count}"  # None: token_weighted_loss
        assert isinstance(value, torch.Tensor) and value.dim() == 0
        if dtype == torch.float64:
            assert_close("loss", value.item(), wanted)
        else:
            assert abs(value.item() - wanted) <= 1e-4 * (1 + abs(wanted)), f"loss {value.item()} != {wanted}"
    return compare


@st.composite
def loss_arguments(draw):
    batch, fields, _ = draw(batch_cases())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    vocabulary = 266
    form = draw(st.sampled_from(["float"] * 6 + ["int", "complex", "numpy", "cells", "vocabulary", "strided"]))
    logits = torch.from_numpy(rng.standard_normal(batch.shape + (vocabulary,)) * 3)
    if draw(st.booleans()):  # excluded cells are never read
        logits[torch.from_numpy(~loss_mask(fields))] = math.nan
    dtype = draw(st.sampled_from(FLOAT_TYPES))
    logits = {"int": lambda: logits.nan_to_num().long(), "complex": lambda: logits.to(torch.complex128),
              "numpy": lambda: logits.numpy(), "cells": lambda: logits[:, :-1].to(dtype),
              "vocabulary": lambda: logits[..., :-1].to(dtype),
              "strided": lambda: logits.to(dtype).transpose(0, 1).contiguous().transpose(0, 1),
              }.get(form, lambda: logits.to(dtype))()
    labels = shift_labels(fields)
    target = draw(st.sampled_from([BATCH] * 3 + ["dict", "labels", "labels", "none eligible", "out of vocabulary",
                                                   "float", "bool", "numpy", "no key", "epoch"]))
    if target in ("labels", "dict", "none eligible", "out of vocabulary"):
        if target == "none eligible":
            labels = np.full_like(labels, IGNORE)
        if target == "out of vocabulary":
            labels[np.unravel_index(int(np.flatnonzero(labels != IGNORE)[0]), labels.shape)] = draw(
                st.sampled_from([vocabulary, -1, 2**20]))
        fitting = [t for t in TORCH_INTS if torch.iinfo(t).min <= labels.min() and labels.max() <= torch.iinfo(t).max]
        tensor = torch.from_numpy(labels).to(draw(st.sampled_from(fitting)))
        target = {"shift_labels": tensor} if target == "dict" else tensor
    elif target in ("float", "bool", "numpy", "no key", "epoch"):
        target = {"float": torch.from_numpy(labels).double(), "bool": torch.from_numpy(labels > 0), "numpy": labels,
                  "no key": {"labels": torch.from_numpy(labels)}, "epoch": [batch]}[target]
    denominator = draw(st.sampled_from(
        [None] * 6 + [ABSENT] * 2 + [int(loss_mask(fields).sum()), int(loss_mask(fields).sum()) + 5,
                                        int(loss_mask(fields).sum()) - 1, 0, -3, True, 2.0, np.int8(100),
                                        np.uint64(2**64 - 1), torch.tensor(500), torch.tensor([[200]]),
                                        torch.tensor(7.0), torch.tensor(7.5), torch.tensor([1, 2]), "9"]))
    return logits, target, fields, denominator, batch


@contract(250)
@given(loss_arguments())
def test_token_weighted_loss_and_loss_sum(arguments):
    logits, target, fields, denominator, batch = arguments
    given_target = batch if target is BATCH else target
    dtype = logits.dtype if isinstance(logits, torch.Tensor) else None

    def call():
        if denominator is ABSENT:
            return loss_sum(logits, given_target)
        return spt.token_weighted_loss(logits, given_target, denominator=denominator), None

    check(call, lambda: loss_reference(logits, target, fields, denominator), compare_loss(dtype))


def count_reference(item, fields_of):
    """Eligible targets of one micro-batch (``step_target_count``'s docstring), or Invalid."""
    if isinstance(item, sp.PaddedBatch | sp.PackedBatch):
        return int(loss_mask(fields_of[id(item)]).sum())
    if isinstance(item, torch.Tensor) and item.dim() == 0 and item.is_floating_point():
        # Trainer's num_items_in_batch (transformers 5): a float tensor of the count
        if not float(item).is_integer():
            raise Invalid("a fractional count")
        item = int(item)
    if isinstance(item, torch.Tensor) and item.dim() == 0 and not item.is_complex() and item.dtype != torch.bool:
        item = int(item)
    if is_int(item):
        if item < 0:
            raise Invalid("a negative count")
        return int(item)
    return int((targets_reference(item, None) != IGNORE).sum())


@st.composite
def micro_batch_lists(draw, form, odd: list):
    """``(items, container, fields_of)``: up to three batches, each as ``form(draw, batch,
    fields)`` gives it, and up to two ``odd`` items, in a random order; the container they
    are passed in (or a lone micro-batch, a count, None); each batch's reference fields by id."""
    cases = draw(st.lists(batch_cases(), min_size=0, max_size=3))
    items = [form(draw, batch, fields) for batch, fields, _ in cases]
    items = draw(st.permutations(items + draw(st.lists(st.sampled_from(odd), max_size=2))))
    container = draw(st.sampled_from(["list"] * 5 + ["tuple", "generator", "lone", "int", "none"]))
    return items, container, {id(batch): fields for batch, fields, _ in cases}


def count_form(draw, batch, fields):
    labels = torch.from_numpy(shift_labels(fields))
    return draw(st.sampled_from([batch, batch, spt.tensors(batch), labels, labels.to(torch.int16)]))


COUNT_ODD = [5, np.int32(7), np.uint64(3), torch.tensor(4), torch.tensor(9, dtype=torch.int8), -1, True, 2.0,
             None, torch.tensor(2.0), torch.tensor(2.5), torch.tensor(-3.0), torch.tensor(float("nan")),
             torch.tensor(True), {"labels": torch.tensor([1])}, "3"]


def container_of(items, container):
    if container == "tuple":
        return tuple(items)
    if container == "generator":
        return (item for item in items)
    if container == "lone":  # one micro-batch
        return next((item for item in items if isinstance(item, dict | sp.PaddedBatch | sp.PackedBatch)), {})
    return {"int": 12, "none": None}.get(container, items)


def count_case(function, arguments, count_one, *, positive=False) -> None:
    """``function(batches)`` against the sum of ``count_one(item, fields_of)`` over the items
    (which must be positive with ``positive``)."""
    items, container, fields_of = arguments

    def reference():
        if container in ("lone", "int", "none"):
            raise Invalid("not a sequence of micro-batches", names=("batches",))
        total = sum(count_one(item, fields_of) for item in items)
        if positive and total == 0:
            raise Invalid("no eligible target in the window")
        return total

    def compare(result, expected):
        assert type(result) is int and result == expected, f"{result!r} != {expected}"

    check(lambda: function(container_of(items, container)), reference, compare)


@contract(150)
@given(micro_batch_lists(count_form, COUNT_ODD))
def test_step_target_count(arguments):
    count_case(spt.step_target_count, arguments, count_reference)


# --- 4. seqpack.hf: flat, rows and num_items_in_batch ----------------------------------


def flat_reference(fields, sources):
    """transformers' own collator on the batch's examples' token ranges, row-major."""
    features = [{"input_ids": list(sources[ordinal])} for ordinal, _, _ in documents_of(fields)]
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)


def compare_collated(result, expected):
    assert sorted(result) == sorted(expected), f"keys {sorted(result)} != {sorted(expected)}"
    for key, wanted in expected.items():
        got = result[key]
        if isinstance(wanted, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == wanted.dtype, f"{key}: {got!r} vs {wanted!r}"
            assert got.shape == wanted.shape and torch.equal(got, wanted), f"{key}: {got} != {wanted}"
        else:
            assert type(got) is type(wanted) and got == wanted, f"{key}: {got!r} != {wanted!r}"


def rows_reference(fields):
    """:func:`seqpack.hf.rows` by its docstring, from the rule's fields."""
    labels = shift_labels(fields)
    lengths = np.array(fields["valid_lengths"], dtype=np.int64)
    columns = np.arange(labels.shape[1])
    padding = columns[None, :] >= lengths[:, None]
    shifted = np.full_like(labels, IGNORE)
    shifted[:, 1:] = labels[:, :-1]
    return {
        "input_ids": torch.from_numpy(np.where(fields["token_valid"], fields["inputs"], 0).astype(np.int64)),
        "position_ids": torch.from_numpy(np.where(padding, columns[None, :] - lengths[:, None],
                                                  fields["positions"]).astype(np.int64)),
        "shift_labels": torch.from_numpy(labels.astype(np.int64)),
        "labels": torch.from_numpy(shifted.astype(np.int64)),
        "valid_lengths": torch.from_numpy(lengths),
        "use_cache": False,
    }


def compare_fresh(batch, compare):
    """``compare``, then: writing into every returned tensor leaves the batch as it was."""
    def run(result, expected):
        compare(result, expected)
        before = {name: getattr(batch, name).copy() for name in ("inputs", "targets", "positions", "valid_lengths")}
        for value in result.values():
            if isinstance(value, torch.Tensor):
                value.fill_(3)
        for name, values in before.items():
            assert (getattr(batch, name) == values).all(), f"writing the result changed the batch's {name}"
    return run


@contract(200)
@given(batch_cases(), st.sampled_from(["flat", "rows"]), st.integers(0, 7))
def test_hf_flat_and_rows(case, name, odd):
    batch, fields, sources = case
    given_batch = batch if odd else None
    if odd == 1:
        given_batch = fields

    def reference():
        if given_batch is not batch:
            raise Invalid("not a batch")
        return flat_reference(fields, sources) if name == "flat" else rows_reference(fields)

    check(lambda: getattr(sph, name)(given_batch), reference, compare_fresh(batch, compare_collated))


def trainer_count(item, fields_of):
    """Trainer's rule: ``shift_labels`` != -100 when present, else ``labels[..., 1:]`` != -100."""
    if isinstance(item, sp.PaddedBatch | sp.PackedBatch):
        return int(loss_mask(fields_of[id(item)]).sum())
    if not isinstance(item, dict):
        raise Invalid("not a batch or a dict")
    key = "shift_labels" if "shift_labels" in item else "labels" if "labels" in item else None
    if key is None:
        raise Invalid("no labels")
    labels = item[key]
    if isinstance(labels, torch.Tensor):
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise Invalid("labels not integers", names=(key,))
        labels = labels.numpy()
    try:
        array = np.asarray(labels)
    except ValueError:
        raise Invalid("ragged labels", names=(key,)) from None
    if array.size and array.dtype.kind not in "iu":
        raise Invalid("labels not integers", names=(key,))
    if array.size and array.max() > 2**63 - 1:
        raise Invalid("a label past int64", names=(key,))
    if key == "labels":
        if array.ndim == 0:
            raise Invalid("a single label", names=(key,))
        array = array[..., 1:]
    return int((array.astype(np.int64) != IGNORE).sum())


def trainer_form(draw, batch, fields):
    """A batch as itself, :func:`seqpack.hf.rows` or ``flat``, or a dict of its shifted labels."""
    labels = rows_reference(fields)["labels"]
    form = draw(st.sampled_from(["batch", "rows", "flat", "labels list", "labels numpy", "labels int32"]))
    if form == "batch":
        return batch
    if form in ("rows", "flat"):
        return getattr(sph, form)(batch)
    if form == "labels list":
        return {"labels": labels.tolist()}
    if form == "labels numpy":
        return {"labels": arranged(labels.numpy().astype(np.int16), draw(ARRAY_LAYOUTS))}
    return {"labels": labels.int(), "input_ids": labels}


TRAINER_ODD = [{"labels": [[1, 2], [3]]}, {"labels": torch.tensor(5)}, {"labels": torch.tensor([[0.0, 1.0]])},
               {"shift_labels": np.array([True, False])}, {"input_ids": torch.tensor([[1, 2]])}, 5, None,
               {"shift_labels": torch.tensor([[1, -100, 7]], dtype=torch.int8)}, {"labels": [-100, 4, -100, 2]},
               {"labels": np.array([[2**63, 1]], dtype=np.uint64)}]


@contract(150)
@given(micro_batch_lists(trainer_form, TRAINER_ODD))
def test_hf_num_items_in_batch(arguments):
    count_case(sph.num_items_in_batch, arguments, trainer_count, positive=True)


# --- 5. seqpack.hf.seqpack_attention called directly -----------------------------------


def per_cell_reference(name, value, rows, width):
    """``[rows, T]`` (a ``[1, T]`` or ``[T]`` value broadcast over the rows) as lists of ints, or Invalid."""
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.dtype == torch.bool):
        raise Invalid(f"{name} of dtype {value.dtype}", names=(name,))
    array = np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value)
    if array.size and array.dtype.kind not in "iu":
        raise Invalid(f"{name} of dtype {array.dtype}", names=(name,))
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or array.shape[1] != width or array.shape[0] not in (1, rows):
        raise Invalid(f"{name} has shape {array.shape}", names=(name,))
    return np.broadcast_to(array.astype(object), (rows, width)).tolist()


def hf_layout_reference(rows, width, mask, kwargs):
    """``(lengths, starts)`` by the rules of seqpack.hf.attention's module docstring, or Invalid."""
    if kwargs.get("cu_seq_lens_k") is not None and kwargs.get("cu_seq_lens_q") is None:
        raise Invalid("cu_seq_lens_k without cu_seq_lens_q")
    opens = [[t == 0 for t in range(width)] for _ in range(rows)]
    covered = source = None
    if kwargs.get("cu_seq_lens_q") is not None:
        source = "cu_seq_lens_q"
        cu = layout_ints(kwargs["cu_seq_lens_q"], source, tuple(np.shape(kwargs["cu_seq_lens_q"])))
        if kwargs.get("cu_seq_lens_k") is not None and layout_ints(
                kwargs["cu_seq_lens_k"], "cu_seq_lens_k", tuple(np.shape(kwargs["cu_seq_lens_k"]))) != cu:
            raise Invalid("cu_seq_lens_k differs")
        if (np.ndim(kwargs["cu_seq_lens_q"]) != 1 or not cu or cu[0] != 0 or cu != sorted(cu)
                or cu[-1] > rows * width):
            raise Invalid("bad offsets", names=(source,))
        for first, stop in itertools.pairwise(cu):
            if stop > first:
                if first // width != (stop - 1) // width:
                    raise Invalid("a sequence across rows", names=(source,))
                opens[first // width][first % width] = True
        covered = cu[-1]
    elif kwargs.get("seq_idx") is not None:
        source = "seq_idx"
        index = per_cell_reference(source, kwargs["seq_idx"], rows, width)
        opens = [[t == 0 or index[r][t] != index[r][t - 1] for t in range(width)] for r in range(rows)]
    elif kwargs.get("position_ids") is not None:
        positions = per_cell_reference("position_ids", kwargs["position_ids"], rows, width)
        opens = [[t == 0 or positions[r][t] != positions[r][t - 1] + 1 for t in range(width)] for r in range(rows)]
    unpadded = None
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise Invalid("an attention mask that is not a 2-D tensor", names=("attention_mask",))
        if tuple(mask.shape) != (rows, width):
            raise Invalid("attention_mask shape", names=("attention_mask",))
        cells = mask.bool().tolist()
        unpadded = [sum(row) for row in cells]
        if any(row != [t < n for t in range(width)] for row, n in zip(cells, unpadded)):
            raise Invalid("not right-padded", names=("attention_mask",))
    if kwargs.get("valid_lengths") is not None:
        lengths = layout_ints(kwargs["valid_lengths"], "valid_lengths", (rows,))
        if any(not 0 <= n <= width for n in lengths) or (unpadded is not None and lengths != unpadded):
            raise Invalid("bad valid_lengths", names=("valid_lengths",))
    elif unpadded is not None:
        lengths = unpadded
    elif covered is not None:
        lengths = [min(max(covered - r * width, 0), width) for r in range(rows)]
    else:
        lengths = [width] * rows
    if covered is not None and any(r * width + lengths[r] > covered for r in range(rows) if lengths[r]):
        raise Invalid("a valid cell in no sequence")
    if source is not None and kwargs.get("position_ids") is not None:
        positions = per_cell_reference("position_ids", kwargs["position_ids"], rows, width)
        for r in range(rows):
            for t in range(1, lengths[r]):
                if not opens[r][t] and positions[r][t] != positions[r][t - 1] + 1:
                    raise Invalid("positions restart inside a sequence", names=("position_ids",))
    starts = [list(itertools.accumulate((t if opens[r][t] else 0 for t in range(width)), max)) for r in range(rows)]
    return lengths, starts


def window_reference(window, lengths, starts):
    if window is None:
        return
    if not is_int(window):
        raise Invalid(f"sliding_window {window!r}", names=("sliding_window",))
    longest = max((t - starts[r][t] + 1 for r in range(len(lengths)) for t in range(lengths[r])), default=0)
    if longest > window:
        raise Invalid("a segment longer than the window")


def sdpa_reference(query, key, value, lengths, starts, scale):
    """PyTorch SDPA in float64 with an explicit boolean block-causal mask; rows of inactive
    queries are left out of the comparison (SDPA gives NaN for them)."""
    rows, heads, width, _ = query.shape
    mask, active = allowed_keys(lengths, starts, rows, width)
    mask |= ~active[:, :, None] & np.eye(width, dtype=bool)[None]  # SDPA needs a key in every row
    group = heads // key.shape[1]
    live = torch.from_numpy(active)[:, None, :, None]
    query, key, value = (torch.where(live, x.detach().double(), 0.0) for x in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
        attn_mask=torch.from_numpy(mask)[:, None], scale=scale)
    return out.transpose(1, 2), torch.from_numpy(active)  # [B, T, H, D], [B, T]


def hf_attention_reference(arguments):
    query, key, value, mask, kwargs = (arguments[n] for n in ("query", "key", "value", "mask", "kwargs"))
    if arguments["dropout"]:
        raise Invalid("dropout")
    if kwargs.get("use_cache") or kwargs.get("output_attentions") or kwargs.get("is_causal") is False:
        raise Invalid("a cache, attention weights or bidirectional attention")
    if any(kwargs.get(n) is not None for n in ("softcap", "s_aux", "position_bias")):
        raise Invalid("an unsupported feature")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 or not tensor.is_floating_point():
            raise Invalid(f"{name} is not a 4-D floating tensor", names=(name,))
    if not query.dtype == key.dtype == value.dtype:
        raise Invalid("dtypes differ")
    rows, heads, width, head_dim = query.shape
    if key.shape != value.shape or key.shape[:1] + key.shape[2:] != query.shape[:1] + query.shape[2:] or \
            heads % key.shape[1] or head_dim < 1:
        raise Invalid("shapes")
    lengths, starts = hf_layout_reference(rows, width, mask, kwargs)
    window_reference(kwargs.get("sliding_window"), lengths, starts)
    compute = np.float64 if query.dtype == torch.float64 else np.float32
    scale = scale_reference(arguments["scaling"], head_dim, compute, "scaling")
    return sdpa_reference(query, key, value, lengths, starts, scale)


def offsets_of(lengths, starts, width, cover_padding: bool) -> list[int]:
    """flash-attention offsets over the flattened cells: each valid segment, and (with
    ``cover_padding``) each row's padding as a sequence of its own."""
    cu = [0]
    for r, length in enumerate(lengths):
        if r and cu[-1] < r * width:
            cu.append(r * width)  # the previous row's uncovered padding as an empty-of-meaning sequence
        for t in range(length):
            if starts[r][t] == t and t:
                cu.append(r * width + t)
        if length:
            cu.append(r * width + length)
        if cover_padding and length < width:
            cu.append((r + 1) * width)
    return cu


HF_FAULTS = ("dropout", "cache", "weights", "bidirectional", "softcap", "dtype", "mixed", "heads", "rank",
             "not a tensor", "numpy mask", "mask 4-D", "mask shape", "left padding", "valid_lengths",
             "cu crossing", "cu order", "cu past end", "cu_k", "cu_k alone", "cu short", "positions",
             "seq_idx shape", "scaling", "window", "window type")


@st.composite
def hf_attention_arguments(draw):
    fault = draw(st.sampled_from((None,) * 12 + HF_FAULTS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows, width, head_dim = draw(st.integers(1, 3)), draw(st.integers(1, 7)), draw(st.sampled_from([1, 4, 8]))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.integers(1, 3)) + (1 if fault == "heads" and kv_heads == 2 else 0)
    dtype = torch.int64 if fault == "dtype" else draw(st.sampled_from(FLOAT_TYPES))
    lengths, starts = draw(segmented(rows, width, all_valid=draw(st.integers(0, 3)) == 0))
    source = draw(st.sampled_from(["cu", "seq_idx", "position_ids", "none"]))
    if source == "none":  # one segment per row
        starts = [[0] * width for _ in range(rows)]
    padding = draw(st.sampled_from(["valid_lengths", "mask", "both", "cu end", "none"]))
    if padding == "none" or (padding == "cu end" and source != "cu"):
        lengths = [width] * rows
    elif padding == "cu end":  # the offsets end inside the last row; the rows before it are full
        lengths = [width] * (rows - 1) + lengths[-1:]
        starts = [list(range(width)) if r < rows - 1 else starts[r] for r in range(rows)]
    kwargs = {}
    columns = np.arange(width)
    valid = columns[None, :] < np.array(lengths)[:, None]
    start_array = np.array(starts, dtype=np.int64).reshape(rows, width)
    segment_index = np.cumsum(np.where(valid, start_array == columns[None, :], 0), axis=1)
    positions = np.where(valid, columns[None, :] - start_array, columns[None, :] - np.array(lengths)[:, None])
    if source == "cu":
        cu = offsets_of(lengths, starts, width, cover_padding=padding != "cu end" and draw(st.booleans()))
        if fault == "cu crossing" and width > 1 and rows > 1:
            cu = [0, width + 1] + [c for c in cu if c > width + 1]
        elif fault == "cu order" and len(cu) > 2:
            cu[1], cu[2] = cu[2], cu[1] if cu[1] != cu[2] else cu[1] + 1
        elif fault == "cu past end":
            cu.append(rows * width + 1)
        elif fault == "cu short" and sum(lengths) and padding != "cu end":
            cu = cu[:-1] if cu[-1] > 0 and len(cu) > 1 else cu
        kwargs["cu_seq_lens_q"] = layout_form(draw, cu, odd=False)
        if fault == "cu_k":
            kwargs["cu_seq_lens_k"] = torch.tensor(cu[:-1] + [cu[-1] + 1])
        elif draw(st.booleans()):
            kwargs["cu_seq_lens_k"] = torch.tensor(cu, dtype=torch.int32)
        if draw(st.integers(0, 2)) == 0 or fault == "positions":
            kwargs["position_ids"] = torch.from_numpy(positions)
    elif source == "seq_idx":
        index = np.where(valid, segment_index, -1)
        if fault == "seq_idx shape":
            index = index[:, :-1] if draw(st.booleans()) else np.concatenate([index, index])
        elif rows == 1 and draw(st.booleans()):
            index = index[0]
        kwargs["seq_idx"] = layout_form(draw, index.tolist(), odd=False)
        if draw(st.integers(0, 2)) == 0 or fault == "positions":
            kwargs["position_ids"] = torch.from_numpy(positions)
    elif source == "position_ids":
        kwargs["position_ids"] = layout_form(draw, (positions[0] if rows == 1 and draw(st.booleans())
                                                    else positions).tolist(), odd=False)
    if fault == "positions" and "position_ids" in kwargs and isinstance(kwargs["position_ids"], torch.Tensor):
        broken = kwargs["position_ids"].clone().reshape(-1, width)
        broken[0, -1] += 3
        kwargs["position_ids"] = broken
    if fault == "cu_k alone":
        kwargs["cu_seq_lens_k"] = torch.tensor([0, rows * width])
    lengths_tensor = torch.tensor(lengths)
    mask = None
    if padding in ("valid_lengths", "both") or fault == "valid_lengths":
        kwargs["valid_lengths"] = layout_form(draw, lengths, odd=False)
        if fault == "valid_lengths":
            kwargs["valid_lengths"] = torch.tensor([draw(st.sampled_from([-1, width + 1, max(lengths[0] - 1, 0)]))]
                                                   + lengths[1:])
    if padding in ("mask", "both") or fault in ("numpy mask", "mask 4-D", "mask shape", "left padding"):
        mask = (torch.arange(width)[None, :] < lengths_tensor[:, None]).to(
            draw(st.sampled_from([torch.bool, torch.int64, torch.int32])))
        if fault == "numpy mask":
            mask = mask.numpy()
        elif fault == "mask 4-D":
            mask = mask[:, None, None, :]
        elif fault == "mask shape":
            mask = mask[:, :-1] if width > 1 else torch.cat([mask, mask])
        elif fault == "left padding" and width > 1:
            mask = mask.flip(-1)
            if (mask == mask.flip(-1)).all():
                mask[0, 0], mask[0, -1] = 0, 1
    shapes = {"query": (rows, heads, width, head_dim), "key": (rows, kv_heads, width, head_dim)}
    tensors = {}
    for name in ("query", "key", "value"):
        layout = draw(st.sampled_from(["cells"] * 3 + ["c", "strided", "expanded"]))
        tensors[name] = attention_storage(rng, shapes.get(name, shapes["key"]), dtype, layout)
    if dtype.is_floating_point and not fault and draw(st.booleans()):
        for name in ("key", "value", "query"):
            if tensors[name].stride(1):
                poison(tensors[name], lengths)
    if fault == "mixed":
        tensors["value"] = tensors["value"].to(torch.float32 if dtype == torch.float64 else torch.float64)
    elif fault == "rank":
        tensors["query"] = tensors["query"][0] if draw(st.booleans()) else tensors["query"][0, 0]
    elif fault == "not a tensor":
        tensors["key"] = tensors["key"].numpy() if dtype not in HALF else tensors["key"].tolist()
    extra = {"cache": {"use_cache": True}, "weights": {"output_attentions": True},
             "bidirectional": {"is_causal": False}, "softcap": {"softcap": 30.0}}.get(fault, {})
    kwargs.update(extra)
    if fault in ("window", "window type") or draw(st.integers(0, 4)) == 0:
        longest = max((t - starts[r][t] + 1 for r in range(rows) for t in range(lengths[r])), default=0)
        kwargs["sliding_window"] = draw(st.sampled_from(
            [longest - 1] if fault == "window" and longest > 1 else
            ["4", 4.0, True] if fault == "window type" else [longest, longest + 2, np.int64(width), 2**40]))
    scalings = [None] * 4 + [0.5, np.float32(0.3), 2]
    if fault == "scaling":
        scalings = ["abc", "0.5", True, torch.tensor(0.5), math.nan, [1.0]]
    return {"query": tensors["query"], "key": tensors["key"], "value": tensors["value"], "mask": mask,
            "kwargs": kwargs, "dropout": 0.1 if fault == "dropout" else draw(st.sampled_from([0.0, 0])),
            "scaling": draw(st.sampled_from(scalings)), "backward": draw(st.integers(0, 3)) == 0}


def hf_attention_call(arguments):
    query, key, value = (arguments[n] for n in ("query", "key", "value"))
    leaves = [t for t in (query, key, value) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if arguments["backward"]:
        for tensor in leaves:
            tensor.requires_grad_()
    out, weights = sph.seqpack_attention(torch.nn.Module(), query, key, value, arguments["mask"],
                                         scaling=arguments["scaling"], dropout=arguments["dropout"],
                                         **arguments["kwargs"])
    assert weights is None
    if arguments["backward"]:
        (out.float() * 0.5).sum().backward()  # every valid query's output enters
    return out


def compare_hf_attention(arguments):
    query = arguments["query"]

    def compare(out, expected):
        want, active = expected
        assert out.dtype == query.dtype and out.shape == want.shape, f"{out.dtype} {tuple(out.shape)}"
        cells = active[:, :, None, None].expand(want.shape)
        got = out.detach().double()
        assert_tensor_close("output", got[cells].to(out.dtype), want[cells], query.dtype)
        assert (got[~cells] == 0).all(), "an inactive query's output is not 0"
        if arguments["backward"]:
            for name in ("query", "key", "value"):
                grad = arguments[name].grad
                assert grad is not None and not grad.isnan().any(), f"{name}: NaN or no gradient"
                live = active[:, None, :, None].expand(grad.shape)
                assert (grad[~live] == 0).all(), f"{name}: gradient at an inactive cell"
    return compare


@contract(400)
@given(hf_attention_arguments())
def test_hf_seqpack_attention(arguments):
    check(lambda: hf_attention_call(arguments), lambda: hf_attention_reference(arguments),
          compare_hf_attention(arguments))
