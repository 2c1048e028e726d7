"""The error API: fields that callers branch on, context added with ``within``, and errors
that cross processes (pickled, or rebuilt from their class, ``str`` and ``vars``) unchanged."""

import pickle

import pytest

import seqpack as sp
from seqpack.errors import CapacityError, InvalidInputError, SeqpackError, TokenizerError, VerificationError
from seqpack.io.readers import missing_extra, not_a_file


def nested() -> CapacityError:
    """An error raised inside a record of a file inside a shard, named from the inside out."""
    error = CapacityError("the document has 9 predictions; capacity is 8", cells=9, maximum=8)
    return error.within("data.jsonl:7", path="data.jsonl", line=7).within("shard 1 of 2 (data.jsonl)")


def test_within_puts_each_label_before_the_message_and_keeps_the_innermost_place():
    error = nested()
    assert str(error) == "shard 1 of 2 (data.jsonl): data.jsonl:7: the document has 9 predictions; capacity is 8"
    assert error.context == ("shard 1 of 2 (data.jsonl)", "data.jsonl:7")
    assert error.message == "the document has 9 predictions; capacity is 8"
    assert (error.path, error.line, error.cells, error.maximum) == ("data.jsonl", 7, 9, 8)
    assert error.within("outer", path="other.jsonl", line=1) is error  # the innermost place stays
    assert (error.path, error.line) == ("data.jsonl", 7)


def test_fields_default_to_none_and_str_is_the_message():
    error = SeqpackError("plain")
    assert (str(error), error.kind, error.path, error.line, error.context) == ("plain", None, None, None, ())
    assert str(VerificationError("bad cell", 2, 3, kind="cell")) == "bad cell"
    assert TokenizerError("at position 4", 4, path="t.json").path == "t.json"


def test_every_error_pickles_with_its_fields_and_context():
    for error in (nested(), TokenizerError("m", 4).within("doc"), sp.MemoryBudgetError("m", 10, 5),
                  VerificationError("v", 1, 2).within("batch 0"), missing_extra("reading it", "corpus")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error) and vars(copy) == vars(error)


def test_an_error_rebuilt_from_its_class_str_and_vars_reads_the_same():
    # (as the Ray engine sends a worker's error: one label, not two)
    error = nested()
    kind, message, attributes = type(error), str(error), vars(error)
    rebuilt = kind.__new__(kind)
    rebuilt.args = (message,)
    rebuilt.__dict__.update(attributes)
    assert str(rebuilt) == str(error) and rebuilt.context == error.context
    assert str(rebuilt.within("again")) == f"again: {error}"


def test_callers_branch_on_kind_and_path_not_on_the_text(tmp_path):
    assert missing_extra("a tokenizers JSON file", "hf").kind == "missing-extra"
    missing = not_a_file(tmp_path / "nothing.json", "no such tokenizer file")
    assert str(missing) == f"{tmp_path / 'nothing.json'}: no such tokenizer file"
    assert (missing.path, missing.message, missing.kind) == (str(tmp_path / "nothing.json"), "no such tokenizer file",
                                                             None)
    assert isinstance(missing, InvalidInputError)


def test_every_error_builds_from_its_message_alone():
    """PyTorch's DataLoader re-raises a worker's error as ``type(error)(message)``: a
    CapacityError or MemoryBudgetError, which needed their limits too, came out as a plain
    RuntimeError (neither a SeqpackError nor a ValueError; review)."""
    import inspect

    from seqpack import errors

    classes = [cls for _, cls in inspect.getmembers(errors, inspect.isclass) if issubclass(cls, SeqpackError)]
    assert sp.CapacityError in classes and sp.MemoryBudgetError in classes
    for cls in classes:
        assert str(cls("the message")) == "the message"


def test_a_data_loader_worker_raises_the_capacity_error_itself():
    torch = pytest.importorskip("torch", reason="the torch extra has it: pip install 'seqpack[torch]'")

    class Refusing(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            raise CapacityError("batch 0 has 9 cells; max_cells is 8", cells=9, maximum=8)

    loader = torch.utils.data.DataLoader(Refusing(), num_workers=1, multiprocessing_context="fork")
    with pytest.raises(CapacityError, match="batch 0 has 9 cells; max_cells is 8") as raised:
        next(iter(loader))
    assert isinstance(raised.value, ValueError)
