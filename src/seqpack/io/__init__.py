"""The corpus layer: from files on disk to a packed dataset on disk, and back as lazy batches.

Readers (:mod:`seqpack.io.readers`) stream documents from text files, JSONL,
Parquet/Arrow, in-memory tables and Megatron datasets; :mod:`seqpack.io.tokenizer_file`
tokenizes them (the byte tokenizer, or a Hugging Face ``tokenizers`` file bound by
identity); :func:`pack_corpus` writes the packed dataset crash-safely, in one part or
one per shard (:mod:`seqpack.io.job` runs it; :mod:`seqpack.io.format` documents the
files, :mod:`seqpack.io.publish` how they are published); :func:`open_dataset` opens
it as lazy batches with a plan's interface; :func:`verify_dataset` checks it;
:mod:`seqpack.io.stats` and :mod:`seqpack.io.render` report and draw it.
"""

from ..packing.batches import PackedBatches
from .dataset import PackedDataset, open_dataset
from .tokenizer_file import TokenizerFile
from .readers import ArrowBatches, JsonLines, Megatron, TextFiles, reader_for
from .templates import TemplateLimits
from .verify import verify_dataset
from .job import PackJob, pack_corpus

__all__ = [
    "ArrowBatches", "JsonLines", "Megatron", "PackJob", "PackedBatches", "PackedDataset", "TemplateLimits", "TextFiles",
    "TokenizerFile",
    "open_dataset", "pack_corpus", "reader_for", "verify_dataset",
]
