"""Padding and packing configurations: validated once, when built, and trusted below.

Both speak the same words: ``rows_per_batch`` rows per batch (one model call, at most
2**31 - 1),
``max_cells`` cells per batch, ``max_memory_bytes`` for everything the layout holds at
its peak (field arrays included). Every size is normalized to a Python ``int`` here
(numpy integers included, bool rejected), so no later product can overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._arguments import DEFAULT_MEMORY_BYTES, INT32_MAX, check_int, check_optional_int
from ..errors import InvalidInputError


@dataclass(frozen=True)
class PadConfig:
    """Right-padding: ``rows_per_batch`` consecutive examples per batch, each batch as wide
    as its longest example.

    ``max_cells`` (default: no limit) caps ``rows * width`` of every batch and
    ``max_width`` (default: no limit) the predictions of any example;
    ``max_memory_bytes`` (default 8 GiB) caps the bytes of the whole padded epoch.
    """

    rows_per_batch: int = 8
    max_cells: int | None = None
    max_width: int | None = None
    max_memory_bytes: int = DEFAULT_MEMORY_BYTES

    def __post_init__(self):
        object.__setattr__(self, "rows_per_batch", check_int("rows_per_batch", self.rows_per_batch,
                                                             maximum=INT32_MAX))
        object.__setattr__(self, "max_cells", check_optional_int("max_cells", self.max_cells))
        object.__setattr__(self, "max_width", check_optional_int("max_width", self.max_width, maximum=INT32_MAX))
        object.__setattr__(self, "max_memory_bytes", check_int("max_memory_bytes", self.max_memory_bytes))


class _FullBatch(int):
    """A ``max_cells`` that ``PackConfig`` derived (``rows_per_batch * capacity``): an int
    that ``dataclasses.replace`` hands back, so the copy derives its own."""

    __slots__ = ()


@dataclass(frozen=True)
class PackConfig:
    """Packing: rows of exactly ``capacity`` columns (predictions), ``rows_per_batch`` rows
    per batch.

    ``max_cells`` defaults to ``rows_per_batch * capacity`` (a full batch) and must
    admit at least one row; ``max_memory_bytes`` (default 8 GiB) caps everything
    packing holds at its peak: the plan, the field arrays of the batches it builds at
    once, their records and temporaries (see :mod:`seqpack.packing.budget`).

    A default ``max_cells`` stays the default in a copy made by ``dataclasses.replace``:
    derived again from the copy's capacity and rows, unless the copy is given a
    ``max_cells`` (any int, the old default's value too). A given ``max_cells`` is kept.
    """

    capacity: int
    rows_per_batch: int = 8
    max_cells: int | None = None
    max_memory_bytes: int = DEFAULT_MEMORY_BYTES

    def __post_init__(self):
        capacity = check_int("capacity", self.capacity, maximum=INT32_MAX)
        rows = check_int("rows_per_batch", self.rows_per_batch, maximum=INT32_MAX)
        # replace() passes the old max_cells on: a derived one is derived again.
        derived = self.max_cells is None or isinstance(self.max_cells, _FullBatch)
        cells = None if derived else check_optional_int("max_cells", self.max_cells)
        object.__setattr__(self, "capacity", capacity)
        object.__setattr__(self, "rows_per_batch", rows)
        object.__setattr__(self, "max_cells", _FullBatch(rows * capacity) if derived else cells)
        object.__setattr__(self, "max_memory_bytes", check_int("max_memory_bytes", self.max_memory_bytes))
        if self.max_cells < capacity:
            raise InvalidInputError(
                f"max_cells {self.max_cells} is below capacity {capacity}: no row would fit"
            )
