"""The packing layer: where each example goes (padding or packing), within every limit.

``pad`` right-pads consecutive examples; ``pack`` places whole examples into shared
rows (next-fit by default; first-fit and best-fit-decreasing on request) and builds
every batch at once, ``plan`` builds them on demand (a :class:`PackedBatches`, as a
dataset on disk is) and ``stream`` packs as it reads. With ``pairs=True`` each takes
examples ``2p`` and ``2p + 1`` as a preference pair and keeps the two in one row (one batch).
:mod:`seqpack.packing.budget` counts every byte before anything large is allocated.
"""

from .batches import PackedBatches
from .budget import placement_bytes
from .config import DEFAULT_MEMORY_BYTES, PackConfig, PadConfig
from .packed import PackedBatch, PackedEpoch
from .padding import PaddedBatch, PaddedEpoch, pad
from .placement import POLICIES, Placement, lower_bound_rows, place, real_target_fraction
from .planning import PackingPlan, efficiency_report, pack, plan
from .report import EfficiencyReport
from .streaming import stream

__all__ = [
    "DEFAULT_MEMORY_BYTES", "POLICIES", "EfficiencyReport", "PackConfig", "PackedBatch", "PackedBatches", "PackedEpoch",
    "PackingPlan", "PadConfig", "PaddedBatch", "PaddedEpoch", "Placement", "efficiency_report",
    "lower_bound_rows", "pack", "pad", "place", "placement_bytes", "plan", "real_target_fraction", "stream",
]
