"""seqpack: pad and pack variable-length causal-LM examples without joining their contexts.

``seqpack.__all__`` is what a user needs; the layers hold the rest, each importable as
an attribute: :mod:`seqpack.data` (tokenizers, bindings, examples, tables, corpora),
:mod:`seqpack.layout` (fields, the batch view, verify), :mod:`seqpack.packing`
(padding, placement policies, plans, epochs, streams, the memory budget),
:mod:`seqpack.nn` (autograd tape, range attention, loss, decoder) and
:mod:`seqpack.chapters` (the spec's fixtures and demo traces).

Every name is imported when first used (PEP 562), so ``import seqpack`` is cheap: the
command line starts (and handles a Ctrl-C) before numpy and the kernels load.
"""

__version__ = "0.1.0"

import importlib

#: Where each public name lives.
_HOMES = {
    "seqpack.errors": ("BatchIndexError", "BindingError", "CapacityError", "DecodeLimitError", "InvalidInputError",
                       "MemoryBudgetError", "SeqpackError", "TokenizerError", "VerificationError"),
    "seqpack.data": ("BatchBinding", "BatchDocument", "ByteTokenizer", "DecodeLimits", "ExampleTable", "Partition",
                     "SequenceExample", "SplitReceipt", "TokenizerIdentity"),
    "seqpack.layout": ("NO_SEGMENT", "PAD_CELL"),
    "seqpack.layout.exports": ("cu_seqlens", "document_ids", "max_seqlen", "position_ids", "seq_lens"),
    "seqpack.packing": ("EfficiencyReport", "PackConfig", "PackedBatch", "PackedEpoch", "PackingPlan", "PadConfig",
                        "PaddedBatch", "PaddedEpoch", "pack", "pad", "place", "plan", "stream"),
    "seqpack.io": ("open_dataset",),
    "seqpack.nn": ("Decoder", "DecoderConfig", "masked_loss", "range_attention_backward", "range_attention_forward"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
#: The layers, as attributes.
_LAYERS = ("chapters", "data", "io", "layout", "nn", "packing")


def __getattr__(name: str):
    if name in _HOME_OF:
        value = getattr(importlib.import_module(_HOME_OF[name]), name)
    elif name in _LAYERS:
        value = importlib.import_module(f"seqpack.{name}")
    else:
        raise AttributeError(f"module 'seqpack' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME_OF) | set(_LAYERS))


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
