"""Corpus readers: documents from text files, JSONL, Parquet/Arrow, ``datasets.save_to_disk``
directories, in-memory tables and Megatron datasets.

Every reader yields :class:`DocumentChunk` objects of bounded size (about
``CHUNK_BYTES`` of input), in input order, each naming where its documents came from
(file and line, row, or sequence), so that any later error names the document's place in
its input. Text arrives as raw bytes or ``str``; pre-tokenized documents as one flat ID
array with offsets (and their supervision masks aligned with it), read from Arrow list
columns and Megatron ``.bin`` files through their flat values (no Python loop per token);
supervised fine-tuning records as prompt-completion pairs or conversations, and
preference pairs (TRL 1.16's formats, each record's kind by :mod:`.records`); a reader's
``record_kind`` says which it reads. pyarrow is imported only by the readers that need it
(the ``corpus`` extra).

The modules, each importing only those above it: :mod:`.base` (the records, the
protocol, path checks and errors), :mod:`.sniff` (formats known by their bytes and
suffixes), :mod:`.walk` (directories), one module per format (:mod:`.text`,
:mod:`.records` (the record kinds' rule), :mod:`.jsonl`, :mod:`.arrow`, :mod:`.hf_disk` for
``save_to_disk`` directories, :mod:`.megatron`), :mod:`.dispatch` (:func:`reader_for`)
and :mod:`.readahead` (:func:`read_ahead`). This package re-exports what other modules use. Each
format module binds ``CHUNK_BYTES`` and ``CHUNK_DOCUMENTS`` from :mod:`.base` by name:
to change them for a format, patch that format's module.
"""

from .arrow import ArrowBatches, import_pyarrow, open_parquet, record_chunks, record_columns
from .base import CHUNK_BYTES, CHUNK_DOCUMENTS, DocumentChunk, Input, Reader, input_path, missing_extra, not_a_file
from .dispatch import reader_for
from .hf_disk import SavedDataset
from .jsonl import JsonLines
from .megatron import MEGATRON_DTYPES, MEGATRON_HEADER, Megatron
from .readahead import Exclusive, read_ahead
from .records import MASK_COLUMNS, PREFERENCE_IDS, RecordFields
from .sniff import MEGATRON_MAGIC
from .text import TextFiles

__all__ = [
    "CHUNK_BYTES", "CHUNK_DOCUMENTS", "MASK_COLUMNS", "MEGATRON_DTYPES", "MEGATRON_HEADER", "MEGATRON_MAGIC",
    "PREFERENCE_IDS",
    "ArrowBatches", "DocumentChunk", "Exclusive", "Input", "JsonLines", "Megatron", "Reader", "RecordFields",
    "SavedDataset", "TextFiles", "import_pyarrow", "input_path", "missing_extra", "not_a_file",
    "open_parquet", "read_ahead", "reader_for", "record_chunks", "record_columns",
]
