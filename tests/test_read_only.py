"""Arrays documented read-only stay read-only in pickled and copied objects.

numpy unpickles arrays writable, and copy.deepcopy restores objects the same way: a
copy sent to a data-loader worker or a Ray task accepted writes its original refused
(review). Each object here is checked as built, pickled at every protocol, and copied.
"""

import copy
import pickle

import numpy as np
import pytest

import seqpack as sp
from seqpack.data.windows import CausalWindowConfig, MiniBatchConfig, MiniBatchEpoch
from seqpack.nn import sequence_logprobs

BINDING = sp.BatchBinding.fixture()
TEXTS = [b"hello world", b"abc def", b"xyz"]


def writable_arrays(value, seen=None, path="") -> list[str]:
    """Where a writable numpy array sits in ``value``: its attributes, slots, tuples, lists
    and dicts, at any depth (another object's own attributes included)."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (str, bytes, int, float, type)):
        return []
    seen.add(id(value))
    if isinstance(value, np.ndarray):
        return [path] if value.flags.writeable else []
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (tuple, list)):
        items = enumerate(value)
    else:
        names = list(getattr(value, "__dict__", {}))
        names += [name for cls in type(value).__mro__ for name in getattr(cls, "__slots__", ())
                  if hasattr(value, name)]
        items = ((name, getattr(value, name)) for name in names if name not in getattr(value, "_writable", ()))
    found = []
    for key, item in items:
        found += writable_arrays(item, seen, f"{path}.{key}")
    return found


def objects():
    table = sp.ExampleTable.from_texts(TEXTS, BINDING, capacity=16)
    config = sp.PackConfig(16, 1)
    epoch = sp.pack(table, config, partition=sp.Partition.TRAIN, binding=BINDING)
    batch = epoch.batches[0]
    found = {
        "ExampleTable": table,
        "SequenceExample": table.example(0),
        "BatchDocument": table.example(0).document,
        "PackedEpoch": epoch,
        "PaddedEpoch": sp.pad(table, sp.PadConfig(2), partition=sp.Partition.TRAIN, binding=BINDING),
        "PackedBatch": batch,
        "Placement": sp.place([3, 5, 2], 8, "best-fit-decreasing"),
        "OccurrenceLogprobs": sequence_logprobs(np.zeros((*batch.shape, BINDING.vocabulary_size)), batch),
        "ByteTokenizer": sp.ByteTokenizer(),
    }
    windows = CausalWindowConfig(4, 2)
    found["CausalWindow"] = next(windows.windows(np.arange(40)))
    documents = [table.example(i).document for i in range(len(TEXTS))]
    found["MiniBatch"] = MiniBatchEpoch.build(sp.Partition.TRAIN, documents, windows, MiniBatchConfig(2)).batches[0]
    return found


@pytest.mark.parametrize("name", list(objects()))
def test_copies_keep_arrays_read_only(name):
    original = objects()[name]
    if name == "PackedEpoch":
        original.batches[1]   # one batch built before the copy, the others after
    writable = set(writable_arrays(original))   # (private working arrays at most)
    copies = [pickle.loads(pickle.dumps(original, protocol)) for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1)]
    copies += [copy.deepcopy(original), copy.copy(original)]
    for copied in copies:
        if name == "PackedEpoch":
            assert all(not b.inputs.flags.writeable for b in copied.batches)   # built after the copy too
        assert set(writable_arrays(copied)) <= writable, name


def test_a_shallow_copy_leaves_the_callers_arrays_as_they_are():
    """copy.copy froze the arrays it shares with the original: a caller's own (review)."""
    from seqpack.data.windows import CausalWindow

    inputs, targets = np.arange(4, dtype=np.int32), np.arange(1, 5, dtype=np.int32)
    window = CausalWindow(inputs, targets)
    shallow = copy.copy(window)
    assert shallow.inputs is inputs and inputs.flags.writeable and targets.flags.writeable


def test_a_copy_of_logprobs_leaves_the_callers_logits_writable():
    table = sp.ExampleTable.from_texts(TEXTS, BINDING, capacity=16)
    batch = sp.pack(table, sp.PackConfig(16, 1), partition=sp.Partition.TRAIN, binding=BINDING).batches[0]
    logits = np.zeros((*batch.shape, BINDING.vocabulary_size))
    result = sequence_logprobs(logits, batch)
    shallow = copy.copy(result)
    assert logits.flags.writeable
    assert np.array_equal(shallow.gradient(np.ones(len(result))), result.gradient(np.ones(len(result))))


def test_an_evaluation_copy_keeps_its_arrays_read_only():
    pytest.importorskip("torch", reason="seqpack.hf needs the hf extra: pip install 'seqpack[hf]'")
    pytest.importorskip("transformers", reason="seqpack.hf needs the hf extra: pip install 'seqpack[hf]'")
    from seqpack.hf import Evaluation

    evaluation = Evaluation(np.arange(2), ("a", "b"), np.array([1, 2]), np.array([0.5, 1.0]))
    for copied in (pickle.loads(pickle.dumps(evaluation)), copy.deepcopy(evaluation)):
        assert writable_arrays(copied) == []
