"""seqpack: pad and pack variable-length causal-LM examples without joining their contexts.

``seqpack.__all__`` is what a user needs; the layers hold the rest, each importable as
an attribute: :mod:`seqpack.data` (tokenizers, bindings, examples, tables, corpora),
:mod:`seqpack.layout` (fields, the batch view, verify), :mod:`seqpack.packing`
(padding, placement policies, plans, epochs, streams, the memory budget),
:mod:`seqpack.nn` (autograd tape, range attention, loss, decoder) and
:mod:`seqpack.chapters` (the spec's fixtures and demo traces).
"""

__version__ = "0.1.0"

from .errors import (
    BatchIndexError,
    BindingError,
    CapacityError,
    DecodeLimitError,
    InvalidInputError,
    MemoryBudgetError,
    SeqpackError,
    TokenizerError,
    VerificationError,
)
from .data import (
    BatchBinding,
    BatchDocument,
    ByteTokenizer,
    DecodeLimits,
    ExampleTable,
    Partition,
    SequenceExample,
    SplitReceipt,
    TokenizerIdentity,
)
from .layout import NO_SEGMENT, PAD_CELL
from .layout.exports import cu_seqlens, document_ids, max_seqlen, position_ids, seq_lens
from .packing import (
    EfficiencyReport,
    PackConfig,
    PackedBatch,
    PackedEpoch,
    PackingPlan,
    PadConfig,
    PaddedBatch,
    PaddedEpoch,
    pack,
    pad,
    place,
    plan,
    stream,
)
from .io import open_dataset
from .nn import Decoder, DecoderConfig, masked_loss, range_attention_backward, range_attention_forward
from . import chapters, data, io, layout, nn, packing  # noqa: F401 (the layers, as attributes)

__all__ = [
    # errors
    "SeqpackError", "InvalidInputError", "TokenizerError", "DecodeLimitError", "BindingError",
    "CapacityError", "MemoryBudgetError", "VerificationError", "BatchIndexError",
    # data
    "ByteTokenizer", "TokenizerIdentity", "DecodeLimits", "BatchBinding", "SplitReceipt", "Partition",
    "BatchDocument", "SequenceExample", "ExampleTable",
    # layout and packing
    "PAD_CELL", "NO_SEGMENT", "PadConfig", "PackConfig", "pad", "pack", "plan", "stream", "place",
    "PaddedBatch", "PackedBatch", "PaddedEpoch", "PackedEpoch", "PackingPlan", "EfficiencyReport",
    # corpora on disk
    "open_dataset",
    # a batch's metadata for other libraries (seqpack.torch has tensor variants)
    "position_ids", "document_ids", "seq_lens", "cu_seqlens", "max_seqlen",
    # models and kernels
    "masked_loss", "range_attention_forward", "range_attention_backward", "Decoder", "DecoderConfig",
]
