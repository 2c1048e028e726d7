"""What padded and packed epochs share: their batches, in order, as a sequence."""

from __future__ import annotations

from .._arguments import batch_index, batch_range
from .._read_only import ReadOnlyArrays


class Epoch(ReadOnlyArrays):
    """Every batch of one ``pad`` or ``pack`` call: ``len``, indexing and iteration go to
    ``batches``; ``memory_peak`` is the byte requirement checked against the budget;
    ``pairs`` says whether the examples are preference pairs (every batch then holds
    whole pairs)."""

    def __init__(self, batches, memory_peak: int, pairs: bool = False):
        self.batches = batches
        self.memory_peak = memory_peak
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)

    def __getitem__(self, index):
        """``epoch[i]``: batch ``i`` (negative counts from the end); a slice gives a list."""
        if isinstance(index, slice):
            batch_range(index, len(self.batches), "this epoch")   # a zero step or bounds no integers: refused
            return self.batches[index]
        return self.batches[batch_index(index, len(self.batches), "this epoch")]

    @property
    def target_count(self) -> int:
        """Supervised targets of the whole epoch."""
        return sum(batch.target_count for batch in self.batches)

