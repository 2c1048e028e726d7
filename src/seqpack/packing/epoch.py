"""What padded and packed epochs share: their batches, in order, as a sequence."""

from __future__ import annotations

import numpy as np

from ..errors import InvalidInputError


class Epoch:
    """Every batch of one ``pad`` or ``pack`` call: ``len``, indexing and iteration go to
    ``batches``; ``memory_peak`` is the byte requirement checked against the budget."""

    def __init__(self, batches, memory_peak: int):
        self.batches = batches
        self.memory_peak = memory_peak

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)

    def __getitem__(self, index):
        check_index(index)
        return self.batches[index]

    @property
    def target_count(self) -> int:
        """Supervised targets of the whole epoch."""
        return sum(batch.target_count for batch in self.batches)


def check_index(index) -> None:
    """A bool is not a batch number (a list would take ``True`` as batch 1)."""
    if isinstance(index, (bool, np.bool_)):
        raise InvalidInputError(f"batch {index!r} is a bool, not a batch number")
