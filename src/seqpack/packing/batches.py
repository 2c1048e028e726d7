"""The protocol of packed batches built on demand, which plans and datasets on disk follow."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np

from ..data.binding import BatchBinding, Partition
from .config import PackConfig
from .packed import PackedBatch
from .report import EfficiencyReport


@runtime_checkable
class PackedBatches(Protocol):
    """Packed batches built on demand: what ``seqpack.plan`` returns and ``open_dataset`` opens.

    ``len()`` batches; ``batch(i)`` (also ``[i]``) builds batch ``i``; iteration and
    ``batches(reuse_buffers=...)`` build them in order; ``batch_rows(i)`` its rows;
    ``batch_targets()`` every batch's supervised targets (loss denominators) and
    ``batch_pairs()`` its preference pairs, without building any; ``report()`` the
    efficiency report; ``config``, ``policy``, ``partition``, ``binding``, ``row_count``,
    ``batch_count``, ``occurrence_count`` and ``pairs`` (the examples are preference
    pairs, ``2p`` chosen and ``2p + 1`` rejected, each pair in one row) describe it.
    ``isinstance(x, PackedBatches)`` checks that these names exist (a plan passes too).
    """

    config: PackConfig
    policy: str
    partition: Partition
    binding: BatchBinding
    row_count: int
    batch_count: int
    occurrence_count: int
    pairs: bool

    def __len__(self) -> int: ...

    def batch(self, number: int) -> PackedBatch: ...

    def __getitem__(self, number: int) -> PackedBatch: ...

    def batches(self, reuse_buffers: bool = False) -> Iterator[PackedBatch]: ...

    def __iter__(self) -> Iterator[PackedBatch]: ...

    def batch_rows(self, number: int) -> int: ...

    def batch_targets(self) -> np.ndarray: ...

    def batch_pairs(self) -> np.ndarray: ...

    def report(self) -> EfficiencyReport: ...
