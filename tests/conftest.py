"""Shared test helpers."""

import signal

import pytest

from seqpack.layout.batch import BatchLayout

# A shell starts a background job with SIGINT ignored, and every process it starts inherits
# that: the tests that send SIGINT to a seqpack run expect a terminal user's Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def corrupted():
    """``corrupted(batch, field, index, value)``: a copy of ``batch`` with one cell of one field changed."""

    def make(batch, field, index, value):
        clone = BatchLayout.__new__(type(batch))
        clone.__dict__.update(batch.__dict__)
        array = getattr(batch, field).copy()
        array[index] = value
        setattr(clone, field, array)
        return clone

    return make


@pytest.fixture
def text(tmp_path):
    """A text file ``a.txt`` holding ``hello``: one short document for a reader or a pack."""
    path = tmp_path / "a.txt"
    path.write_text("hello")
    return path
