"""Fixtures of the padding and packing tests."""

import pytest

from seqpack.layout.batch import BatchLayout


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
