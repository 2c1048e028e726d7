"""Outcome-contract fuzz cases (test family 19), run in a subprocess by ``test_contract.py``.

The contract: every public call returns a correct result or raises a ``SeqpackError``
(a ``ValueError`` too when the caller's input is at fault); never another exception, a
crash or a hang. Each case draws valid and invalid arguments, asks a plain reference
what the call must do (return a value equal to the reference's, or reject), and checks
the library against it. A buffer given for an output that overlaps another argument
must be rejected by an ``InvalidInputError`` naming both arrays.

This file is not named ``test_*.py``: run directly, a crash would take the whole test
session down with it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import seqpack as sp
from seqpack.data import window_ranges
from seqpack.nn import range_softmax_backward, range_softmax_forward, sequence_logprobs
from reference import next_fit_placements

OUTCOMES = Counter()  # of the property running: "returned" and "rejected" cases
CASE_COUNTS: dict[str, Counter] = {}  # by property
INT_TYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
POLICIES = ("next-fit", "first-fit-decreasing", "best-fit-decreasing")
BEST_FIT_MAX_CAPACITY = 2**24
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
DEFAULT_MEMORY_BYTES = 8 * 2**30
MAX_THREADS = 1024
CELL_BYTES = 19  # four int32 fields and three bool flags per cell
BINDING = sp.BatchBinding.fixture()
OTHER_BINDING = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer.fixture(), split="contract-other")
VOCABULARY = 266  # the fixture binding's ids: BOS 0, EOS 1, content [2, 266)


def contract(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class CaseCountReport:
    """Ends the terminal summary with the number of cases run, in total and by property."""

    def pytest_terminal_summary(self, terminalreporter):
        total = sum(sum(counts.values()) for counts in CASE_COUNTS.values())
        terminalreporter.write_line(f"contract cases: {total}")
        for name, counts in CASE_COUNTS.items():
            terminalreporter.write_line(f"{name}: returned {counts['returned']}, rejected {counts['rejected']}")


@pytest.fixture(scope="module", autouse=True)
def report_case_counts(request):
    request.config.pluginmanager.register(CaseCountReport())


@pytest.fixture(autouse=True)
def count_cases(request):
    OUTCOMES.clear()
    yield
    CASE_COUNTS[request.node.name] = OUTCOMES.copy()


# --- the check ---------------------------------------------------------------------------


class Invalid(Exception):
    """A reference's verdict: the call must raise a SeqpackError that is also a ValueError.

    ``names``: the error must be an ``InvalidInputError`` whose message names each of them.
    """

    def __init__(self, reason: str, names: tuple[str, ...] = ()):
        super().__init__(reason)
        self.names = names


def check(call, reference, compare, *, may_reject: bool = False) -> None:
    """One case: ``reference()`` returns the expected result or raises :class:`Invalid`;
    ``call()`` must then return something ``compare(result, expected)`` accepts, or raise
    the error the verdict asks for. ``may_reject``: a SeqpackError is acceptable too, where
    the library may refuse what the reference computes (a small memory budget, more threads
    than a caller may ask for). Any other exception propagates."""
    try:
        expected = reference()
    except Invalid as verdict:
        expected = verdict
    try:
        result = call()
    except sp.SeqpackError as error:
        if not (isinstance(expected, Invalid) or may_reject):
            raise AssertionError(f"valid arguments rejected: {error!r}") from error
        assert isinstance(error, ValueError), f"{error!r} is the caller's fault but not a ValueError"
        for name in getattr(expected, "names", ()):
            assert isinstance(error, sp.InvalidInputError) and name in re.findall(r"\w+", str(error)), (
                f"{error!r} must be an InvalidInputError naming {expected.names}"
            )
        OUTCOMES["rejected"] += 1
        return
    if isinstance(expected, Invalid):
        raise AssertionError(f"invalid arguments accepted ({expected}); returned {result!r}")
    compare(result, expected)
    OUTCOMES["returned"] += 1


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def int_in(name: str, value, low: int, high: int | None = None) -> int:
    if not is_int(value) or value < low or (high is not None and value > high):
        raise Invalid(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return int(value)


def integer_array(value, name: str, ndim: int) -> np.ndarray:
    """``value`` as an object array of exact Python ints; empty arrays of any dtype count as integers."""
    try:
        array = np.asarray(value)
    except ValueError:
        raise Invalid(f"{name} is ragged") from None
    if array.ndim != ndim:
        raise Invalid(f"{name} must be {ndim}-D, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise Invalid(f"{name} has dtype {array.dtype}")
    return array.astype(object) if array.size else np.zeros(array.shape, dtype=object)


def assert_close(name, actual, expected, dtype=np.float64):
    """float64: ``1e-10 + 1e-9 * max(|a|, |b|)`` per entry; float32: 1e-4 of the array's scale."""
    actual, expected = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{name} has shape {actual.shape}, expected {expected.shape}"
    if dtype == np.float32:
        limit = 1e-4 * (1 + (np.abs(expected).max() if expected.size else 0))
    else:
        limit = 1e-10 + 1e-9 * np.maximum(np.abs(actual), np.abs(expected))
    bad = np.argwhere(~(np.abs(actual - expected) <= limit))
    assert bad.size == 0, f"{name} differs at {tuple(bad[0])}: {actual[tuple(bad[0])]} vs {expected[tuple(bad[0])]}"


# --- argument forms ----------------------------------------------------------------------


@st.composite
def int_like(draw, values, odd: bool = True):
    """An int from ``values`` as a Python int, a numpy scalar that holds it, or (with ``odd``)
    sometimes a float, str, bool or None."""
    value = draw(values)
    form = draw(st.sampled_from(["int"] * 4 + ["numpy"] * 3 + (["odd"] if odd else [])))
    if form == "numpy":
        fitting = [t for t in INT_TYPES if np.iinfo(t).min <= value <= np.iinfo(t).max]
        if fitting:
            return draw(st.sampled_from(fitting))(value)
    if form == "odd":
        return draw(st.sampled_from([float(value), str(value), bool(value % 2), np.bool_(value % 2), None]))
    return value


def arranged(array: np.ndarray, how: str):
    """The values of ``array`` in another layout: Fortran, strided, reversed, read-only, list."""
    if how == "list":
        return array.tolist()
    if how == "fortran":
        return np.asfortranarray(array)
    if array.ndim and how == "strided":
        spread = np.zeros(array.shape[:-1] + (2 * array.shape[-1],), array.dtype)
        spread[..., ::2] = array
        return spread[..., ::2]
    if array.ndim and how == "reversed":
        return np.flip(np.flip(array, -1).copy(), -1)
    if how == "readonly":
        array = array.copy()
        array.flags.writeable = False
    return array


ARRAY_LAYOUTS = st.sampled_from(["c", "c", "fortran", "strided", "reversed", "readonly"])


@st.composite
def integers_as(draw, values: list, odd: bool = True):
    """``values`` (Python ints) as a list, or an array of a random integer dtype that holds them
    (with ``odd``, sometimes bool, float or one more dimension), in a random layout."""
    form = draw(st.sampled_from(["list"] * 2 + ["int"] * 6 + (["bool", "float", "2-D"] if odd else [])))
    if form == "list":
        return list(values)
    if form in ("bool", "float"):
        return np.array(values, dtype=bool if form == "bool" else float)
    flat = np.array(values, dtype=object).reshape(-1).tolist()
    fitting = [t for t in INT_TYPES if all(np.iinfo(t).min <= v <= np.iinfo(t).max for v in flat)]
    array = np.array(values, dtype=draw(st.sampled_from(fitting)) if fitting else object)
    if form == "2-D":
        array = array.reshape(1, -1)
    return arranged(array, draw(ARRAY_LAYOUTS))


# --- 1. placement ------------------------------------------------------------------------


def decreasing_placements(lengths: list[int], capacity: int, best: bool) -> list[tuple[int, int]]:
    """``(row, start)`` of each example, longest first (ties in input order): the lowest-numbered
    row with room (first fit) or the row with the least room that fits, ties to the lowest (best fit)."""
    rooms, placements = [], [None] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fitting = [row for row, room in enumerate(rooms) if room >= lengths[i]]
        if not fitting:
            rooms.append(capacity)
            fitting = [len(rooms) - 1]
        row = min(fitting, key=lambda row: (rooms[row], row)) if best else fitting[0]
        placements[i] = (row, capacity - rooms[row])
        rooms[row] -= lengths[i]
    return placements


def placements_of(lengths: list[int], capacity: int, policy: str) -> list[tuple[int, int]]:
    if policy == "next-fit":
        return next_fit_placements(lengths, capacity)
    return decreasing_placements(lengths, capacity, best=policy == "best-fit-decreasing")


def place_reference(lengths, capacity, policy):
    capacity = int_in("capacity", capacity, 1, INT64_MAX)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise Invalid(f"unknown policy {policy!r}")
    if policy == "best-fit-decreasing" and capacity > BEST_FIT_MAX_CAPACITY:
        raise Invalid("capacity over the best-fit limit")
    values = integer_array(lengths, "lengths", 1).tolist()
    if any(not 1 <= v <= capacity for v in values):
        raise Invalid("a length outside [1, capacity]")
    return values, capacity, placements_of(values, capacity, policy), policy


def compare_placement(placement, expected):
    lengths, capacity, placements, policy = expected
    assert placement.rows.dtype == np.int64 and placement.starts.dtype == np.int64
    assert list(zip(placement.rows.tolist(), placement.starts.tolist())) == placements
    assert placement.row_count == (max((row for row, _ in placements), default=-1) + 1)
    # Valid on its own: rows numbered in the order opened, disjoint columns within capacity.
    visits = range(len(lengths)) if policy == "next-fit" else sorted(range(len(lengths)), key=lambda i: -lengths[i])
    opened = list(dict.fromkeys(placements[i][0] for i in visits))
    assert opened == list(range(len(opened)))
    spans = sorted((row, start, length) for length, (row, start) in zip(lengths, placements))
    assert all(0 <= start and start + length <= capacity for _, start, length in spans)
    assert all(a[0] != b[0] or a[1] + a[2] <= b[1] for a, b in itertools.pairwise(spans))


PLACE_FAULTS = ("capacity", "policy", "length", "form", "ragged")


@st.composite
def place_arguments(draw):
    fault = draw(st.sampled_from((None,) * 4 + PLACE_FAULTS))
    top = draw(st.integers(1, 40) | st.sampled_from([2**24, 2**24 + 1, INT32_MAX, INT64_MAX]))
    near = st.sampled_from([1, top // 3 + 1, max(top // 2, 1), max(top - 1, 1), top])
    values = draw(st.lists(st.integers(1, min(top, 40)) | near, max_size=24))
    capacity = draw(int_like(st.just(top), odd=False))
    if fault == "capacity":
        capacity = draw(int_like(st.sampled_from([0, -2, 2**63, 2**64, 2**70])) | int_like(st.just(top)))
    if fault == "length" and values:
        values[draw(st.integers(0, len(values) - 1))] = draw(st.sampled_from([0, -1, top + 1, 2**64]))
    lengths = draw(integers_as(values, odd=fault == "form") | st.sampled_from([[], np.zeros(0)]))
    if fault == "ragged":
        lengths = [[1], [1, 2]]
    policies = ("next_fit", "", None, 1, np.array(["next-fit", "x"])) if fault == "policy" else POLICIES
    return lengths, capacity, draw(st.sampled_from(policies))


@contract(600)
@given(place_arguments())
def test_place(arguments):
    lengths, capacity, policy = arguments
    check(lambda: sp.place(lengths, capacity, policy), lambda: place_reference(lengths, capacity, policy),
          compare_placement)


# --- 2. configurations -------------------------------------------------------------------

SIZE_VALUES = st.integers(-2, 40) | st.sampled_from([INT32_MAX, 2**31, INT64_MAX, 2**63, 2**64, 2**70])
OPTIONAL_SIZES = st.none() | int_like(SIZE_VALUES)


def pack_config_reference(capacity, rows_per_batch=8, max_cells=None, max_memory_bytes=DEFAULT_MEMORY_BYTES):
    capacity = int_in("capacity", capacity, 1, INT32_MAX)
    rows = int_in("rows_per_batch", rows_per_batch, 1, INT32_MAX)
    cells = rows * capacity if max_cells is None else int_in("max_cells", max_cells, 1)
    if cells < capacity:
        raise Invalid("max_cells below capacity")
    memory = int_in("max_memory_bytes", max_memory_bytes, 1)
    return {"capacity": capacity, "rows_per_batch": rows, "max_cells": cells, "max_memory_bytes": memory}


def pad_config_reference(rows_per_batch=8, max_cells=None, max_width=None, max_memory_bytes=DEFAULT_MEMORY_BYTES):
    return {
        "rows_per_batch": int_in("rows_per_batch", rows_per_batch, 1, INT32_MAX),
        "max_cells": None if max_cells is None else int_in("max_cells", max_cells, 1),
        "max_width": None if max_width is None else int_in("max_width", max_width, 1, INT32_MAX),
        "max_memory_bytes": int_in("max_memory_bytes", max_memory_bytes, 1),
    }


def compare_config(config, expected):
    for name, value in expected.items():
        held = getattr(config, name)
        # A Python int (PackConfig marks a derived max_cells by an int subclass), never a numpy integer.
        python_int = isinstance(held, int) and not isinstance(held, bool)
        assert held == value and (value is None or python_int), f"{name} holds {held!r}, expected {value!r}"


@st.composite
def config_options(draw, names):
    return {name: draw(OPTIONAL_SIZES if name in ("max_cells", "max_width") else int_like(SIZE_VALUES))
            for name in names if draw(st.booleans())}


@contract(300)
@given(int_like(SIZE_VALUES), config_options(("rows_per_batch", "max_cells", "max_memory_bytes")))
def test_pack_config(capacity, options):
    check(lambda: sp.PackConfig(capacity, **options), lambda: pack_config_reference(capacity, **options),
          compare_config)


@contract(200)
@given(config_options(("rows_per_batch", "max_cells", "max_width", "max_memory_bytes")))
def test_pad_config(options):
    check(lambda: sp.PadConfig(**options), lambda: pad_config_reference(**options), compare_config)


# --- 3. tables, padding and packing ------------------------------------------------------

TABLE_FAULTS = ("bos inside", "eos inside", "no bos", "no eos", "out of vocabulary", "negative", "over int32",
                "empty content", "offsets", "range", "ids", "documents without ranges", "dtype")


@st.composite
def table_arguments(draw, valid_only=False):
    """Keyword arguments of ``ExampleTable.from_arrays``: valid, or with one fault."""
    contents = draw(st.lists(st.lists(st.integers(2, VOCABULARY - 1), min_size=1, max_size=10),
                             min_size=1, max_size=5))
    documents = [[0, *content, 1] for content in contents]
    fault = None if valid_only else draw(st.sampled_from((None,) * len(TABLE_FAULTS) + TABLE_FAULTS))
    document = draw(st.integers(0, len(documents) - 1))
    tokens = documents[document]
    if fault == "empty content":
        documents[document] = [0, 1]
    elif fault in ("no bos", "no eos"):
        tokens[0 if fault == "no bos" else -1] = 7
    elif fault in TABLE_FAULTS[:7]:
        tokens[draw(st.integers(1, len(tokens) - 2))] = {
            "bos inside": 0, "eos inside": 1, "out of vocabulary": VOCABULARY, "negative": -1, "over int32": 2**31,
        }[fault]
    flat = [token for document in documents for token in document]
    offsets = [0, *np.cumsum([len(d) for d in documents]).tolist()]
    if fault == "offsets":
        offsets = draw(st.sampled_from([
            offsets[:1], [1, *offsets[1:]], offsets[:-1] + [offsets[-1] + 1], [0, *offsets[2:], offsets[-1]],
            offsets + [offsets[-1] - 1], [offsets],
        ]))
    arguments = {"token_ids": flat, "offsets": offsets}
    if fault == "range" or draw(st.booleans()):
        ranges, which = [], []
        for _ in range(draw(st.integers(1, 6))):
            document = draw(st.integers(0, len(documents) - 1))
            size = len(documents[document])
            start = draw(st.integers(0, size - 2))
            ranges.append([start, draw(st.integers(start + 2, size))])
            which.append(document)
        if fault == "range":
            index = draw(st.integers(0, len(ranges) - 1))
            bad = draw(st.sampled_from(["negative", "past end", "one token", "document", "shape"]))
            if bad == "negative":
                ranges[index][0] = -1
            elif bad == "past end":
                ranges[index][1] = len(documents[which[index]]) + 1
            elif bad == "one token":
                ranges[index][1] = ranges[index][0] + 1
            elif bad == "document":
                which[index] = draw(st.sampled_from([-1, len(documents)]))
            else:
                ranges = [r + [0] for r in ranges]
        arguments["ranges"] = ranges
        if which != list(range(len(documents))) or draw(st.booleans()):
            arguments["documents"] = which
    elif fault == "documents without ranges":
        arguments["documents"] = [0]
    if fault == "ids" or draw(st.booleans()):
        ids = [f"e{i}" for i in range(len(arguments.get("ranges", documents)))]
        if fault == "ids":
            ids = draw(st.sampled_from([ids[:-1], ids + ["extra"], [""] + ids[1:], [7] + ids[1:]]))
        arguments["ids"] = ids
    given = [name for name in ("token_ids", "offsets", "ranges", "documents") if name in arguments]
    odd = draw(st.sampled_from(given))
    for name in given:
        arguments[name] = draw(integers_as(arguments[name], odd=fault == "dtype" and name == odd))
    return arguments


def table_reference(token_ids, offsets, ranges=None, documents=None, ids=None):
    """The source tokens of every example of ``ExampleTable.from_arrays``, or Invalid."""
    tokens = integer_array(token_ids, "token_ids", 1).tolist()
    if any(not -(2**31) <= t <= INT32_MAX for t in tokens):
        raise Invalid("a token outside int32")
    bounds = integer_array(offsets, "offsets", 1).tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != len(tokens) or bounds != sorted(bounds):
        raise Invalid("bad offsets")
    texts = [tokens[a:b] for a, b in itertools.pairwise(bounds)]
    for text in texts:
        inside = text[1:-1]
        if (len(text) < 3 or text[0] != 0 or text[-1] != 1
                or any(not 2 <= t < VOCABULARY for t in inside)):
            raise Invalid("a document that is not [BOS, content..., EOS]")
    if ranges is None:
        if documents is not None:
            raise Invalid("documents without ranges")
        sources = texts
    else:
        spans = integer_array(ranges, "ranges", 2)
        if spans.shape[1:] != (2,):
            raise Invalid("ranges must be [n, 2]")
        which = list(range(len(texts))) if documents is None else integer_array(documents, "documents", 1).tolist()
        if len(which) != len(spans):
            raise Invalid("one document per range")
        sources = []
        for (start, stop), document in zip(spans.tolist(), which):
            if not 0 <= document < len(texts) or not 0 <= start <= stop - 2 or stop > len(texts[document]):
                raise Invalid("a bad range")
            sources.append(texts[document][start:stop])
    if not sources:
        raise Invalid("no examples")
    if ids is not None and (len(ids) != len(sources) or not all(isinstance(i, str) and i for i in ids)):
        raise Invalid("bad ids")
    return sources


def compare_table(table, sources):
    assert len(table) == len(sources)
    assert table.lengths.tolist() == [len(s) - 1 for s in sources]
    for ordinal, source in enumerate(sources):
        assert table.example(ordinal).source_tokens.tolist() == source


FIELD_PADDING = {"inputs": -1, "targets": -1, "positions": 0, "segments": -1, "segment_starts": 0,
                 "token_valid": False, "target_valid": False, "loss_mask": False}
FIELDS = (*FIELD_PADDING, "valid_lengths")


def expected_batches(sources, placements, rows_per_batch, widths):
    """Every field of every batch, cell by cell: example ``i``'s source tokens from
    ``placements[i] = (row, start)`` on, segment ``i``, positions from 0."""
    row_count = max(row for row, _ in placements) + 1
    batches = []
    for number, width in enumerate(widths):
        first = number * rows_per_batch
        rows = min(rows_per_batch, row_count - first)
        fields = {name: [[fill] * width for _ in range(rows)] for name, fill in FIELD_PADDING.items()}
        fields["valid_lengths"] = [0] * rows
        occurrences = []
        for ordinal, (source, (row, start)) in enumerate(zip(sources, placements)):
            if not first <= row < first + rows:
                continue
            local = row - first
            for j in range(len(source) - 1):
                for name, value in (("inputs", source[j]), ("targets", source[j + 1]), ("positions", j),
                                    ("segments", ordinal), ("segment_starts", start), ("token_valid", True),
                                    ("target_valid", True), ("loss_mask", True)):
                    fields[name][local][start + j] = value
            stop = start + len(source) - 1
            fields["valid_lengths"][local] = max(fields["valid_lengths"][local], stop)
            occurrences.append((ordinal, local, range(start, stop), ordinal))
        fields["occurrences"] = sorted(occurrences, key=lambda o: (o[1], o[2].start))
        batches.append(fields)
    return batches


def compare_batches(batches, expected):
    batches = list(batches)
    assert len(batches) == len(expected), f"{len(batches)} batches, expected {len(expected)}"
    for number, (batch, fields) in enumerate(zip(batches, expected)):
        batch.verify()
        for name, value in fields.items():
            held = batch.occurrences if name == "occurrences" else getattr(batch, name).tolist()
            assert held == value, f"batch {number} {name}: {held} != {value}"


def packing_reference(sources, config, policy):
    lengths = [len(s) - 1 for s in sources]
    capacity, per_batch = config["capacity"], config["rows_per_batch"]
    if policy not in POLICIES or (policy == "best-fit-decreasing" and capacity > BEST_FIT_MAX_CAPACITY):
        raise Invalid("bad policy")
    if max(lengths) > capacity:
        raise Invalid("an example longer than the capacity")
    placements = placements_of(lengths, capacity, policy)
    row_count = max(row for row, _ in placements) + 1
    if min(per_batch, row_count) * capacity > config["max_cells"]:
        raise Invalid("a batch over max_cells")
    if min(per_batch, row_count) * capacity * CELL_BYTES > config["max_memory_bytes"]:
        raise Invalid("one batch's fields alone exceed max_memory_bytes")
    return expected_batches(sources, placements, per_batch, [capacity] * -(-row_count // per_batch))


def padding_reference(sources, config):
    lengths = [len(s) - 1 for s in sources]
    per_batch = config["rows_per_batch"]
    if config["max_width"] is not None and max(lengths) > config["max_width"]:
        raise Invalid("an example over max_width")
    widths = [max(lengths[i : i + per_batch]) for i in range(0, len(lengths), per_batch)]
    cells = [min(per_batch, len(lengths) - i * per_batch) * w for i, w in enumerate(widths)]
    if config["max_cells"] is not None and max(cells) > config["max_cells"]:
        raise Invalid("a batch over max_cells")
    if max(cells) * CELL_BYTES > config["max_memory_bytes"]:
        raise Invalid("one batch's fields alone exceed max_memory_bytes")
    return expected_batches(sources, [(i, 0) for i in range(len(sources))], per_batch, widths)


@st.composite
def packing_arguments(draw):
    table_options = draw(table_arguments())
    api = draw(st.sampled_from(["pack", "pack", "plan", "stream", "pad"]))
    sizes = st.integers(1, 3) | st.sampled_from([2**62, 2**63, 2**64])
    options = {"rows_per_batch": draw(int_like(sizes))}
    if draw(st.integers(0, 3)) == 0:
        options["max_cells"] = draw(int_like(st.integers(1, 40) | st.just(2**64)))
    if draw(st.integers(0, 4)) == 0:
        options["max_memory_bytes"] = draw(st.integers(1, 40_000))
    if api == "pad":
        if draw(st.booleans()):
            options["max_width"] = draw(int_like(st.integers(1, 12)))
    else:
        options["capacity"] = draw(int_like(st.integers(1, 14) | st.just(INT32_MAX)))
    extra = {
        "policy": draw(st.sampled_from(POLICIES * 4 + ("first-fit",))),
        "partition": draw(st.sampled_from([sp.Partition.TRAIN] * 8 + [sp.Partition.TEST, "train"])),
        "binding": draw(st.sampled_from([BINDING] * 8 + [OTHER_BINDING, None])),
        "as_list": draw(st.integers(0, 3)) == 0,
        "reuse_buffers": draw(st.booleans()),
        "chunks": draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=3)),
    }
    return table_options, api, options, extra


def packing_call(api, table, examples, cuts, options, extra):
    """Build the config, then pad, pack, plan (building every batch) or stream (table chunks)."""
    where = {"partition": extra["partition"], "binding": extra["binding"]}
    if api == "pad":
        return sp.pad(examples, sp.PadConfig(**options), **where)
    config = sp.PackConfig(**options)
    if api == "stream":
        return list(sp.stream([table.chunk(a, b) for a, b in cuts], config, **where))
    if api == "pack":
        return sp.pack(examples, config, **where, policy=extra["policy"])
    planned = sp.plan(examples, config, **where, policy=extra["policy"])
    # A reused batch is valid until the next is requested: keep a copy of its fields.
    built = [{name: getattr(batch, name).tolist() for name in FIELDS}
             for batch in planned.batches(reuse_buffers=extra["reuse_buffers"])]
    return planned, built


def packing_expectation(api, sources, streamed, options, extra):
    partition, binding = extra["partition"], extra["binding"]
    if not (isinstance(partition, sp.Partition) and isinstance(binding, sp.BatchBinding)):
        raise Invalid("partition and binding of the wrong types")
    if api == "pad":
        config = pad_config_reference(**options)
    else:
        config = pack_config_reference(**options)
    if api == "stream" and not streamed:
        return []
    if partition is not sp.Partition.TRAIN or binding is not BINDING:
        raise Invalid("examples of another partition or binding")
    if api == "pad":
        return padding_reference(sources, config)
    if api == "stream":
        return packing_reference(streamed, config, "next-fit")
    return packing_reference(sources, config, extra["policy"])


def compare_packing(api):
    def compare(result, expected):
        if api == "plan":
            planned, built = result
            compare_batches([planned.batch(i) for i in range(len(planned))], expected)
            assert built == [{name: fields[name] for name in FIELDS} for fields in expected]
            assert planned.batch_targets().tolist() == [sum(map(sum, f["loss_mask"])) for f in expected]
            return
        compare_batches(result, expected)
        if api == "pack":
            assert result.fields["inputs"].tolist() == [row for f in expected for row in f["inputs"]]
    return compare


@contract(700)
@given(packing_arguments())
def test_tables_and_packing(arguments):
    table_options, api, options, extra = arguments
    made = {}

    def build():
        made["table"] = sp.ExampleTable.from_arrays(binding=BINDING, **table_options)
        return made["table"]

    check(build, lambda: table_reference(**table_options), compare_table)
    if not made:
        return
    table, sources = made["table"], table_reference(**table_options)
    examples = [table.example(i) for i in range(len(table))] if extra["as_list"] else table
    cuts = [(min(a, b, len(table)), min(max(a, b), len(table))) for a, b in extra["chunks"]]
    streamed = [source for a, b in cuts for source in sources[a:b]]
    check(lambda: packing_call(api, table, examples, cuts, options, extra),
          lambda: packing_expectation(api, sources, streamed, options, extra), compare_packing(api),
          may_reject="max_memory_bytes" in options)


# --- 4. range attention ------------------------------------------------------------------

FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def layout_reference(valid_lengths, segment_starts, rows: int, width: int):
    """The ``[rows, T, T]`` permission and ``[rows, T]`` activity of a layout, or Invalid."""
    lengths = integer_array(valid_lengths, "valid_lengths", 1)
    starts = integer_array(segment_starts, "segment_starts", 2)
    if lengths.shape != (rows,) or starts.shape != (rows, width):
        raise Invalid("layout shapes")
    mask = np.zeros((rows, width, width), dtype=bool)
    active = np.zeros((rows, width), dtype=bool)
    for r, length in enumerate(lengths.tolist()):
        if not 0 <= length <= width:
            raise Invalid("a valid length outside [0, T]")
        for t in range(length):
            start = starts[r, t]
            if not (start == t or (t and start == starts[r, t - 1] and 0 <= start < t)):
                raise Invalid("a query that neither opens nor continues a segment")
            mask[r, t, start : t + 1] = True
            active[r, t] = True
    return mask, active


def dense_attention(q, k, v, mask, active):
    """``(out, lse, probabilities)`` of the rule in float64; inactive cells never read."""
    live = active[:, None, :, None]
    q, k, v = (np.where(live, np.real(x).astype(np.float64), 0) for x in (q, k, v))
    scores = np.einsum("rhtd,rhsd->rhts", q, k) / math.sqrt(max(q.shape[-1], 1))
    scores = np.where(mask[:, None], scores, -np.inf)
    with np.errstate(invalid="ignore"):
        top = np.where(active[:, None], scores.max(axis=-1, initial=-np.inf), 0)
        weights = np.where(mask[:, None], np.exp(scores - top[..., None]), 0)
    total = np.where(active[:, None], weights.sum(axis=-1), 1)
    probabilities = weights / total[..., None]
    return probabilities @ v, np.where(active[:, None], top + np.log(total), 0), probabilities


def dense_attention_backward(q, k, v, dout, mask, active):
    """``(dq, dk, dv)`` of ``sum(out * dout)`` through :func:`dense_attention`."""
    live = active[:, None, :, None]
    q, k, dout = (np.where(live, np.real(x).astype(np.float64), 0) for x in (q, k, dout))
    _, _, p = dense_attention(q, k, v, mask, active)
    scale = 1 / math.sqrt(q.shape[-1])
    dp = dout @ np.swapaxes(np.where(live, np.real(v).astype(np.float64), 0), -1, -2)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    return ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, np.swapaxes(p, -1, -2) @ dout


def threads_reference(threads):
    if threads is not None and not (is_int(threads) and threads >= 1):
        raise Invalid("threads must be an int >= 1")


def over_thread_cap(threads) -> bool:
    """More threads than a caller may ask for: a call may refuse them or use fewer."""
    return is_int(threads) and threads > MAX_THREADS


def buffers_reference(arrays: dict, outputs: dict, dtype):
    """Each given output buffer must be a writeable C-contiguous array of its shape and dtype,
    sharing no memory with any other argument."""
    for name, shape in outputs.items():
        given = arrays.get(name)
        if given is not None and not (isinstance(given, np.ndarray) and given.shape == shape
                                      and given.dtype == dtype and given.flags.c_contiguous
                                      and given.flags.writeable):
            raise Invalid(f"a bad {name} buffer")
    for name in outputs:
        for other, array in arrays.items():
            if (other != name and isinstance(arrays.get(name), np.ndarray) and isinstance(array, np.ndarray)
                    and np.shares_memory(arrays[name], array)):
                raise Invalid(f"{name} overlaps {other}", names=(name, other))


def real_inputs(arrays: dict, names, shape_of: dict):
    """The common float dtype of ``names``, after their dtype and shape checks."""
    dtype = np.asarray(arrays["q"]).dtype
    if dtype not in FLOATS:
        raise Invalid("q must be float32 or float64")
    shape = np.shape(arrays["q"])
    if len(shape) != 4 or shape[3] < 1:
        raise Invalid("q must be [rows, heads, T, head_dim] with head_dim >= 1")
    for name in names:
        if np.asarray(arrays[name]).dtype != dtype or np.shape(arrays[name]) != shape_of.get(name, shape):
            raise Invalid(f"{name} differs from q")
    return dtype, shape


def attention_reference(arrays, threads, backward):
    inputs = ("q", "k", "v", "out", "lse", "dout") if backward else ("q", "k", "v")
    shape = np.shape(arrays["q"])
    dtype, shape = real_inputs(arrays, inputs, {"lse": shape[:3]})
    mask, active = layout_reference(arrays["valid_lengths"], arrays["segment_starts"], *shape[0:3:2])
    threads_reference(threads)
    names = ("dq", "dk", "dv") if backward else ("out", "lse")
    buffers_reference({n: a for n, a in arrays.items() if n in inputs + names},
                      {n: shape[:3] if n == "lse" else shape for n in names}, dtype)
    q, k, v = (np.asarray(arrays[n]).copy() for n in "qkv")
    if backward:
        return dtype, dense_attention_backward(q, k, v, np.asarray(arrays["dout"]).copy(), mask, active)
    return dtype, dense_attention(q, k, v, mask, active)[:2]


@st.composite
def layouts(draw, rng, rows: int, width: int, broken: bool):
    """Lengths and segment starts of any integer dtypes (junk at inactive queries); ``broken``:
    with one fault."""
    lengths, starts = [], rng.integers(-3, width + 4, size=(rows, width))
    for r in range(rows):
        length = draw(st.integers(0, width))
        column = 0
        while column < length:
            size = draw(st.integers(1, length - column))
            starts[r, column : column + size] = column
            column += size
        lengths.append(length)
    lengths = np.array(lengths)
    fault = draw(st.sampled_from(["length", "start", "shape", "float"])) if broken else None
    if fault == "length" and rows:
        lengths[draw(st.integers(0, rows - 1))] = draw(st.sampled_from([-1, width + 1]))
    elif fault == "start" and rows and width:
        row, column = draw(st.integers(0, rows - 1)), draw(st.integers(0, width - 1))
        lengths[row] = max(lengths[row], column + 1)
        starts[row, column] = draw(st.sampled_from([-1, column + 1, max(column - 1, 0), 2**40]))
    elif fault == "shape":
        starts = starts[:, :-1] if width else starts[:-1]
    dtypes = [t for t in INT_TYPES if np.iinfo(t).min <= min(starts.min(initial=0), lengths.min(initial=0))
              and max(starts.max(initial=0), lengths.max(initial=0)) <= np.iinfo(t).max]
    lengths = lengths.astype(np.float64 if fault == "float" and rows else draw(st.sampled_from(dtypes)))
    starts = starts.astype(draw(st.sampled_from(dtypes)))
    return arranged(lengths, draw(ARRAY_LAYOUTS)), arranged(starts, draw(ARRAY_LAYOUTS))


def rehome(arrays: dict, buffer: str, victim: str, shape, fraction: float) -> None:
    """Make ``arrays[buffer]`` a C-contiguous array of ``shape`` that overlaps ``arrays[victim]``."""
    original = np.asarray(arrays[victim])
    size = math.prod(shape)
    if original.size == 0 or size == 0:
        return
    if original.shape == tuple(shape) and fraction == 0:
        arrays[victim] = arrays[buffer] = np.ascontiguousarray(original).copy()
        return
    base = np.empty(original.size + size, dtype=original.dtype)
    base[: original.size] = original.reshape(-1)
    arrays[victim] = base[: original.size].reshape(original.shape)
    shift = int(fraction * (original.size - 1))
    arrays[buffer] = base[shift : shift + size].reshape(shape)


ATTENTION_FAULTS = ("dtype", "head_dim", "layout", "mismatch", "buffer", "threads", "alias")


@st.composite
def attention_arguments(draw, backward):
    fault = draw(st.sampled_from((None,) * 5 + ATTENTION_FAULTS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    least = int(fault == "alias")  # empty arrays overlap nothing
    rows, heads = draw(st.sampled_from([0, 1, 2, 2, 3])), draw(st.sampled_from([0, 1, 2, 2]))
    rows, heads, width = max(rows, least), max(heads, least), max(draw(st.sampled_from([0, 1, 2, 3, 5, 8, 9])), least)
    head_dim = 0 if fault == "head_dim" else draw(st.sampled_from([1, 2, 3, 5]))
    dtypes = [np.float16, np.int32, np.complex128, np.bool_] if fault == "dtype" else [np.float64, np.float32]
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    shape = (rows, heads, width, head_dim)
    arrays = {}
    arrays["valid_lengths"], arrays["segment_starts"] = draw(layouts(rng, rows, width, broken=fault == "layout"))
    inputs = ("q", "k", "v", "dout") if backward else ("q", "k", "v")
    for name in inputs:
        arrays[name] = (rng.standard_normal(shape) * draw(st.sampled_from([1, 4]))).astype(dtype)
    try:
        mask, active = layout_reference(arrays["valid_lengths"], arrays["segment_starts"], rows, width)
    except Invalid:
        mask, active = np.zeros((rows, width, width), bool), np.zeros((rows, width), bool)
    if backward:
        out, lse, _ = dense_attention(arrays["q"], arrays["k"], arrays["v"], mask, active)
        arrays["out"], arrays["lse"] = out.astype(dtype), lse.astype(dtype)
    if dtype.kind == "f" and draw(st.booleans()):  # inactive queries' cells are never read
        for name in inputs:
            arrays[name][~np.broadcast_to(active[:, None, :, None], shape)] = np.nan
    if fault == "mismatch":
        name = draw(st.sampled_from(inputs[1:] + (("out", "lse") if backward else ())))
        other = np.float32 if dtype == np.float64 else np.float64
        arrays[name] = draw(st.sampled_from([arrays[name].astype(other), arrays[name].reshape(-1),
                                             arrays[name][:, :, :-1] if width else arrays[name][:-1]]))
    for name in inputs + (("out", "lse") if backward else ()):
        arrays[name] = arranged(arrays[name], draw(ARRAY_LAYOUTS))
    outputs = {"dq": shape, "dk": shape, "dv": shape} if backward else {"out": shape, "lse": shape[:3]}
    for name, out_shape in outputs.items():
        if draw(st.booleans()):
            arrays[name] = np.full(out_shape, 7, dtype=dtype)
    if fault == "buffer":
        name = draw(st.sampled_from(list(outputs)))
        buffer = np.full(outputs[name], 7, dtype=dtype)
        arrays[name] = draw(st.sampled_from([buffer.reshape(-1), buffer.astype(np.complex64),
                                             arranged(buffer, "strided"), arranged(buffer, "readonly"),
                                             buffer.tolist()]))
    if fault == "alias":
        buffer = draw(st.sampled_from(list(outputs)))
        victim = draw(st.sampled_from([n for n in inputs + tuple(outputs) + (("out", "lse") if backward else ())
                                       if n != buffer and isinstance(arrays.get(n), np.ndarray)]))
        rehome(arrays, buffer, victim, outputs[buffer], draw(st.sampled_from([0, 0, 0.5, 1])))
    threads = draw(st.sampled_from([0, -1, True, 2.0, "2", 2**40, np.uint64(2**64 - 1)] if fault == "threads"
                                   else [None] * 4 + [1, 2, np.int32(2), MAX_THREADS]))
    return arrays, threads


def compare_attention(arrays, names):
    def compare(result, expected):
        dtype, values = expected
        for name, actual, wanted in zip(names, result, values):
            assert actual.dtype == dtype, f"{name} has dtype {actual.dtype}"
            assert_close(name, actual, wanted, dtype)
            if isinstance(arrays.get(name), np.ndarray):
                assert actual is arrays[name], f"{name} is not the buffer given"
    return compare


def attention_call(function, arrays, positional, names, threads):
    return function(*(arrays[n] for n in positional), threads=threads,
                    **{n: arrays[n] for n in names if n in arrays})


@contract(500)
@given(attention_arguments(backward=False))
def test_range_attention_forward(arguments):
    arrays, threads = arguments
    positional = ("q", "k", "v", "valid_lengths", "segment_starts")
    check(lambda: attention_call(sp.range_attention_forward, arrays, positional, ("out", "lse"), threads),
          lambda: attention_reference(arrays, threads, backward=False), compare_attention(arrays, ("out", "lse")),
          may_reject=over_thread_cap(threads))


@contract(400)
@given(attention_arguments(backward=True))
def test_range_attention_backward(arguments):
    arrays, threads = arguments
    positional = ("q", "k", "v", "out", "lse", "dout", "valid_lengths", "segment_starts")
    check(lambda: attention_call(sp.range_attention_backward, arrays, positional, ("dq", "dk", "dv"), threads),
          lambda: attention_reference(arrays, threads, backward=True), compare_attention(arrays, ("dq", "dk", "dv")),
          may_reject=over_thread_cap(threads))


# --- 5. range softmax --------------------------------------------------------------------


def softmax_layout(lengths, starts, lead, width):
    """Per-grid lengths and per-query starts (lists of Python ints) of a softmax call, or Invalid."""
    grids = math.prod(lead)
    if lengths is None:
        lengths = [width] * grids
    else:
        if np.shape(lengths) not in (lead, (grids,)):
            raise Invalid("lengths of the wrong shape")
        lengths = integer_array(lengths, "lengths", np.ndim(lengths)).reshape(grids).tolist()
    if any(not 0 <= length <= width for length in lengths):
        raise Invalid("a length outside [0, T]")
    if starts is None:
        return lengths, [[0] * width for _ in range(grids)]
    if np.shape(starts) not in (lead + (width,), (grids, width)):
        raise Invalid("starts of the wrong shape")
    starts = integer_array(starts, "starts", np.ndim(starts)).reshape(grids, width).tolist()
    for grid, length in enumerate(lengths):
        if any(not 0 <= starts[grid][t] <= t for t in range(length)):
            raise Invalid("a start outside [0, query]")
    return lengths, starts


def real_scores(scores, name):
    try:
        array = np.asarray(scores)
    except ValueError:
        raise Invalid(f"{name} is ragged") from None
    if array.dtype.kind not in "iuf":
        raise Invalid(f"{name} must hold real numbers, got {array.dtype}")
    if array.ndim < 2 or array.shape[-1] != array.shape[-2] or array.shape[-1] == 0:
        raise Invalid(f"{name} must be [..., T, T] with T > 0")
    return array.astype(np.float64)


def softmax_reference(arguments, backward):
    """The range softmax (or its score gradient) of every grid, by the rule, or Invalid."""
    p = real_scores(arguments["scores"], "scores")
    width, lead = p.shape[-1], p.shape[:-2]
    if backward:
        dp = real_scores(arguments["dprobabilities"], "dprobabilities")
        if dp.shape != p.shape:
            raise Invalid("dprobabilities differs from probabilities")
        dp = dp.reshape(-1, width, width)
    lengths, starts = softmax_layout(arguments.get("lengths"), arguments.get("starts"), lead, width)
    out = arguments.get("out")
    if out is not None and not (isinstance(out, np.ndarray) and out.dtype == np.float64 and out.shape == p.shape
                                and out.flags.c_contiguous and out.flags.writeable):
        raise Invalid("a bad out buffer")
    p = p.reshape(-1, width, width)
    expected = np.zeros_like(p)
    for grid, length in enumerate(lengths):
        for t in range(length):
            keys = slice(starts[grid][t], t + 1)
            if backward:
                row, upstream = p[grid, t, keys], dp[grid, t, keys]
                expected[grid, t, keys] = row * (upstream - row @ upstream)
            else:
                weights = np.exp(p[grid, t, keys] - p[grid, t, keys].max())
                expected[grid, t, keys] = weights / weights.sum()
    return expected.reshape(np.shape(arguments["scores"]))


SOFTMAX_FAULTS = ("dtype", "nonsquare", "length", "start", "float", "shape", "dprobabilities", "out")


@st.composite
def softmax_arguments(draw, backward):
    fault = draw(st.sampled_from((None,) * 5 + SOFTMAX_FAULTS + ("alias",)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lead = draw(st.sampled_from([(), (1,), (3,), (2, 3), (0,)]))
    width = draw(st.sampled_from([0, 1, 2, 3, 5] if fault == "nonsquare" else [1, 2, 3, 5]))
    dtypes = [np.complex128] if fault == "dtype" else [np.float64] * 4 + [np.float32, np.float16, np.int32]
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    shape = lead + (width, width + (fault == "nonsquare"))
    grids = math.prod(lead)
    arguments = {"scores": (rng.standard_normal(shape) * 3).astype(dtype)}
    if backward:
        wrong = [shape[::-1], (2,), shape[:-1]] if fault == "dprobabilities" else [shape]
        arguments["dprobabilities"] = rng.standard_normal(draw(st.sampled_from(wrong)))
    give_lengths, give_starts = draw(st.booleans()), draw(st.booleans())
    lengths = rng.integers(0, width + 1, size=grids) if give_lengths else np.full(grids, width)
    starts = np.array([[rng.integers(0, t + 1) if give_starts else 0 for t in range(width)]
                       for _ in range(grids)], dtype=np.int64).reshape(grids, width)
    valid = np.arange(width) < lengths[:, None]
    if dtype.kind == "f" and not fault:  # entries outside a valid query's range are never read
        keys = np.arange(width)
        outside = ~(valid[:, :, None] & (keys >= starts[:, :, None]) & (keys <= keys[:, None]))
        for name in ("scores", "dprobabilities") if backward else ("scores",):
            arguments[name].reshape(grids, width, width)[outside] = np.nan
    starts = np.where(valid, starts, rng.integers(-3, 2**40, size=starts.shape))
    if fault == "length" and grids:
        lengths[0], give_lengths = draw(st.sampled_from([-1, width + 1])), True
    elif fault == "start" and grids:
        lengths[0], starts[0, width - 1], give_starts = width, draw(st.sampled_from([-1, width])), True
    if give_lengths:
        lengths = lengths.reshape(lead) if draw(st.booleans()) else lengths
        arguments["lengths"] = lengths.astype(np.float64 if fault == "float" and grids else draw(st.sampled_from(
            [np.int64, np.int32, np.uint16] if lengths.min(initial=0) >= 0 else [np.int64])))
    if give_starts or fault == "shape":
        starts = starts.reshape(lead + (width,)) if draw(st.booleans()) else starts
        arguments["starts"] = starts[..., :-1] if fault == "shape" else starts
    if fault == "alias" and arguments["scores"].dtype == np.float64:
        victim = draw(st.sampled_from(["scores", "dprobabilities"] if backward else ["scores"]))
        rehome(arguments, "out", victim, shape, draw(st.sampled_from([0, 0.5, 1])))
    else:
        arguments["scores"] = arranged(arguments["scores"], draw(ARRAY_LAYOUTS))
        buffer = np.full(shape, 7.0)
        forms = [buffer.reshape(-1), buffer.astype(np.float32), arranged(buffer, "strided"), buffer.tolist()]
        arguments["out"] = draw(st.sampled_from(forms if fault == "out" else [None, None, buffer]))
    return arguments


def compare_softmax(arguments):
    def compare(result, expected):
        assert result.dtype == np.float64
        assert_close("softmax", result, expected)
        if isinstance(arguments.get("out"), np.ndarray):
            assert np.shares_memory(result, arguments["out"]) or not result.size
            assert_close("out", arguments["out"], expected)
    return compare


def softmax_case(arguments, backward):
    function = range_softmax_backward if backward else range_softmax_forward
    leading = ("scores", "dprobabilities") if backward else ("scores",)
    keywords = {n: arguments[n] for n in ("lengths", "starts", "out") if n in arguments}
    # An out buffer overlapping the inputs: the result they held before the call, or a refusal.
    aliased = isinstance(arguments.get("out"), np.ndarray) and any(
        isinstance(arguments[n], np.ndarray) and np.shares_memory(arguments["out"], arguments[n]) for n in leading)
    originals = {n: np.array(arguments[n], copy=True) if isinstance(arguments[n], np.ndarray) else arguments[n]
                 for n in leading}
    check(lambda: function(*(arguments[n] for n in leading), **keywords),
          lambda: softmax_reference({**arguments, **originals}, backward), compare_softmax(arguments),
          may_reject=aliased)


@contract(400)
@given(softmax_arguments(backward=False))
def test_range_softmax_forward(arguments):
    softmax_case(arguments, backward=False)


@contract(300)
@given(softmax_arguments(backward=True))
def test_range_softmax_backward(arguments):
    softmax_case(arguments, backward=True)


# --- 6. masked loss ----------------------------------------------------------------------


def loss_reference(logits, batch, binding):
    if binding is not None and binding != BINDING:
        raise Invalid("a different binding")
    if not isinstance(batch, (sp.PackedBatch, sp.PaddedBatch)):
        raise Invalid("not a batch")
    array = np.asarray(logits)
    if array.dtype.kind not in "iuf":
        raise Invalid("logits must be real")
    if array.shape != batch.shape + (VOCABULARY,):
        raise Invalid("logits shape")
    rows, columns = np.nonzero(batch.loss_mask)
    chosen = array[rows, columns].astype(np.float64)  # [eligible, V]
    top = chosen.max(axis=-1)
    gold = chosen[np.arange(len(rows)), batch.targets[rows, columns]]
    nll = top + np.log(np.exp(chosen - top[:, None]).sum(axis=-1)) - gold
    return nll.sum() / len(rows), nll.sum(), len(rows)


def compare_loss(loss, expected):
    mean, total, count = expected
    assert loss.count == count
    assert_close("mean", loss.mean, mean)
    assert_close("loss_sum", loss.loss_sum, total)


@st.composite
def loss_arguments(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    table = sp.ExampleTable.from_arrays(binding=BINDING, **draw(table_arguments(valid_only=True)))
    if draw(st.booleans()):
        epoch = sp.pad(table, sp.PadConfig(rows_per_batch=draw(st.integers(1, 3))), partition=sp.Partition.TRAIN,
                       binding=BINDING)
    else:
        epoch = sp.pack(table, sp.PackConfig(draw(st.integers(11, 16)), rows_per_batch=draw(st.integers(1, 3))),
                        partition=sp.Partition.TRAIN, binding=BINDING,
                        policy=draw(st.sampled_from(POLICIES)))
    batch = epoch.batches[draw(st.integers(0, len(epoch) - 1))]
    shape = batch.shape + (VOCABULARY,)
    form = draw(st.sampled_from(["float64"] * 5 + ["float32", "float16", "int", "complex", "vocabulary", "cells",
                                                    "flat"]))
    logits = rng.standard_normal(shape) * 3
    if draw(st.booleans()):  # excluded cells are never read
        logits[~batch.loss_mask] = np.nan
    logits = {"float32": logits.astype(np.float32), "float16": logits.astype(np.float16),
              "int": np.nan_to_num(logits).astype(np.int16), "complex": logits + 1j,
              "vocabulary": logits[..., :-1], "cells": logits[:, :-1], "flat": logits.reshape(-1, VOCABULARY),
              }.get(form, logits)
    logits = arranged(logits, draw(ARRAY_LAYOUTS))
    target = draw(st.sampled_from([batch] * 8 + [epoch, None]))
    binding = draw(st.sampled_from([None] * 4 + [BINDING, OTHER_BINDING]))
    return logits, target, binding


@contract(250)
@given(loss_arguments())
def test_masked_loss(arguments):
    logits, batch, binding = arguments
    options = {} if binding is None else {"binding": binding}
    check(lambda: sp.masked_loss(logits, batch, **options), lambda: loss_reference(logits, batch, binding),
          compare_loss)


def sequence_reference(logits, batch, binding, weights):
    """Each occurrence's summed log p over its supervised targets, in float64, and the gradient of
    ``weights @ sums``; the masked loss's refusals (every example has a supervised target)."""
    loss_reference(logits, batch, binding)
    array = np.asarray(logits).astype(np.float64)
    sums, counts, gradient = [], [], np.zeros(array.shape)
    for k, occurrence in enumerate(batch.occurrences):
        columns = [c for c in occurrence.columns if batch.loss_mask[occurrence.row, c]]
        chosen = array[occurrence.row, columns]  # [m, V]
        top = chosen.max(axis=-1, keepdims=True)
        log_p = chosen - top - np.log(np.exp(chosen - top).sum(axis=-1, keepdims=True))
        gold = batch.targets[occurrence.row, columns]
        sums.append(log_p[np.arange(len(columns)), gold].sum())
        counts.append(len(columns))
        onehot = np.zeros_like(log_p)
        onehot[np.arange(len(columns)), gold] = 1.0
        gradient[occurrence.row, columns] = weights[k] * (onehot - np.exp(log_p))
    return np.array(sums), counts, gradient


def compare_sequences(result, expected):
    (scores, gradient), (sums, counts, expected_gradient) = result, expected
    assert scores.counts.tolist() == counts
    assert_close("sums", scores.sums, sums)
    assert gradient.dtype in (np.float32, np.float64)
    assert_close("gradient", gradient, expected_gradient, gradient.dtype)


@contract(150)
@given(loss_arguments(), st.integers(0, 2**32 - 1))
def test_sequence_logprobs(arguments, seed):
    logits, batch, binding = arguments
    options = {} if binding is None else {"binding": binding}
    count = len(batch.occurrences) if isinstance(batch, (sp.PackedBatch, sp.PaddedBatch)) else 1
    weights = np.random.default_rng(seed).normal(size=count)

    def call():
        scores = sequence_logprobs(logits, batch, **options)
        return scores, scores.gradient(weights)

    check(call, lambda: sequence_reference(logits, batch, binding, weights), compare_sequences)


# --- 7. document windows -----------------------------------------------------------------


def window_reference(lengths, capacity):
    """``(documents, ranges)`` by the docstring: ``[s, min(s + capacity + 1, n))`` for
    ``s = 0, capacity, ...`` while ``s + 1 < n``, in int64; at most 2**31 ranges (a table's
    example limit) and a capacity of at most 2**31 - 1."""
    capacity = int_in("capacity", capacity, 1, INT32_MAX)
    values = integer_array(lengths, "lengths", 1).tolist()
    if max(values, default=0) > INT64_MAX:
        raise Invalid("a range bound past int64")
    if min(values, default=0) < 0:
        raise Invalid("a negative length")
    if sum(max(0, -(-(n - 1) // capacity)) for n in values) > 2**31:
        raise Invalid("more ranges than a table holds")
    documents, ranges = [], []
    for document, n in enumerate(values):
        for start in range(0, max(n - 1, 0), capacity):
            documents.append(document)
            ranges.append([start, min(start + capacity + 1, n)])
    return documents, ranges


def compare_windows(result, expected):
    documents, ranges = result
    assert documents.dtype == np.int64 and ranges.dtype == np.int64
    assert (documents.tolist(), ranges.reshape(-1, 2).tolist()) == expected


@st.composite
def window_arguments(draw):
    capacity = draw(int_like(st.integers(-1, 12) | st.sampled_from([2**62, INT64_MAX, 2**63, 2**70])))
    values = draw(st.lists(st.integers(-2, 40) | st.sampled_from([2**40, 2**62, INT64_MAX, 2**63, 2**64 - 1]),
                           max_size=6))
    lengths = draw(integers_as(values) | st.sampled_from([[], np.zeros(0), [[1], [2, 3]]]))
    return lengths, capacity


@contract(400)
@given(window_arguments())
def test_window_ranges(arguments):
    lengths, capacity = arguments
    # A negative token count gives no range by the docstring's rule; refusing it is fine too.
    negative = isinstance(lengths, np.ndarray) and lengths.dtype.kind == "i" and bool((lengths < 0).any()) or (
        isinstance(lengths, list) and any(isinstance(v, int) and v < 0 for v in lengths))
    check(lambda: window_ranges(lengths, capacity), lambda: window_reference(lengths, capacity), compare_windows,
          may_reject=negative)
