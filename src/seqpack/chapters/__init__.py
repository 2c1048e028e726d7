"""The spec chapters' fixtures and the JSON traces ``seqpack demo`` prints.

ch04 right-pads ``short`` and ``long``; ch05 packs A, B and C next-fit at capacity 6.
:mod:`.probe` is the constructed loss probe, :mod:`.trace` the comparison of separate,
padded and packed decoder execution, :mod:`.demo` the traces themselves.
"""

from .demo import packed_trace, padded_trace
from .fixtures import PACKED_CAPACITY, chapter_batch, chapter_examples, packed_batch, padded_batch
from .probe import constructed_logits, gold_probabilities, loss_probe

__all__ = [
    "PACKED_CAPACITY", "chapter_batch", "chapter_examples", "constructed_logits", "gold_probabilities",
    "loss_probe", "packed_batch", "packed_trace", "padded_batch", "padded_trace",
]
