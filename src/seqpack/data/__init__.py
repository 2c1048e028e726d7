"""The data layer: tokenizers, bindings, documents, examples and columnar tables.

Everything a batch is made from, validated where it enters: a document is framed
``[BOS, content..., EOS]`` under a :class:`BatchBinding`, an example is the shifted
pair of one source range of a document, and an :class:`ExampleTable` holds millions
of examples as flat arrays. :mod:`seqpack.data.corpus` reads a real corpus that every
Python install has.
"""

from .binding import DEFAULT_LIMITS, BatchBinding, Partition, SplitReceipt, split_digest
from .documents import BatchDocument
from .examples import SequenceExample
from .table import ExampleTable
from .tokenizer import ByteTokenizer, DecodeLimits, TokenizerIdentity
from .windows import (
    BatchOrder,
    CausalWindow,
    CausalWindowConfig,
    MiniBatch,
    MiniBatchConfig,
    MiniBatchEpoch,
    window_ranges,
)
from . import corpus

__all__ = [
    "DEFAULT_LIMITS", "BatchBinding", "BatchDocument", "BatchOrder", "ByteTokenizer", "CausalWindow",
    "CausalWindowConfig", "DecodeLimits", "ExampleTable", "MiniBatch", "MiniBatchConfig", "MiniBatchEpoch",
    "Partition", "SequenceExample", "SplitReceipt", "TokenizerIdentity", "corpus", "split_digest",
    "window_ranges",
]
