"""The layout layer: a batch's stored fields, the fill, the batch view and its checks.

Padding and packing (``seqpack.packing``) only decide where each example goes; this
layer turns placements into cells with one kernel pass, exposes the permission
relation and verifies every invariant a trainer relies on.
"""

from .batch import BatchLayout, Occurrence
from .counts import LayoutCounts
from .fields import CELL_FIELDS, FLAG_FIELDS, NO_SEGMENT, PAD_CELL, FieldArrays, Placements
from .sources import ExampleList, ExampleSource

__all__ = [
    "CELL_FIELDS", "FLAG_FIELDS", "NO_SEGMENT", "PAD_CELL", "BatchLayout", "ExampleList", "ExampleSource",
    "FieldArrays", "LayoutCounts", "Occurrence", "Placements",
]
