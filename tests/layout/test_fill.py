"""The fill kernel's own guard: placements it would write outside its fields with are refused."""

import numpy as np
import pytest

import seqpack as sp


def test_the_fill_refuses_placements_outside_its_fields():
    # seqpack.layout.fields.fill_fields trusted placements: a start past the row wrote out of
    # bounds (garbage returned, or a segfault) (review).
    from seqpack.layout import FieldArrays, Placements
    from seqpack.layout.fields import fill_fields

    binding = sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="k")
    table = sp.ExampleTable.from_arrays(np.array([0, 5, 6, 7, 1]), [0, 5], binding)  # one example, 4 predictions
    one = lambda value: np.array([value], np.int64)  # noqa: E731
    for row, start, message in ((0, 1, r"columns \[1, 5\) is not inside the 1 x 4 fields"),
                                (0, 10**8, r"columns \[100000000, 100000004\)"), (1, 0, "at row 1"),
                                (0, -1, r"columns \[-1, 3\)")):
        placements = Placements(one(0), one(row), one(start), one(4), np.zeros(1, np.int32))
        with pytest.raises(sp.InvalidInputError, match=message):
            fill_fields(table, placements, FieldArrays.allocate(1, 4))
    fields = FieldArrays.allocate(1, 4)  # the exact fit
    fill_fields(table, Placements(one(0), one(0), one(0), one(4), np.zeros(1, np.int32)), fields)
    assert fields.cells[0, 0].tolist() == [0, 5, 6, 7]
    with pytest.raises(sp.InvalidInputError, match="one entry per occurrence"):
        fill_fields(table, Placements(one(0), np.zeros(2, np.int64), one(0), one(4), np.zeros(1, np.int32)), fields)
