"""Which reader reads a path: by what is there (a ``save_to_disk`` directory, another
directory, a Megatron prefix) and by its suffix, in any case. The one module that knows
every format.
"""

from __future__ import annotations

from .arrow import ArrowBatches
from .base import Reader, input_path
from .hf_disk import SavedDataset, is_saved_dataset
from .jsonl import JsonLines
from .megatron import Megatron, megatron_file
from .sniff import JSONL_SUFFIXES, MEGATRON_PARTNERS
from .text import TextFiles


def reader_for(path, *, text_field=None, ids_field=None, pattern=None) -> Reader:
    """The reader of one input path, by its kind: a directory written by ``datasets``'
    ``save_to_disk`` is that dataset, another directory or other file is text,
    ``.jsonl``/``.ndjson``/``.json`` JSON lines, ``.parquet`` Parquet, ``.arrow``/``.arrows``/``.feather`` Arrow,
    ``.idx``/``.bin`` a Megatron dataset (the other file must be beside it), and a path
    that does not exist but names ``PATH.idx`` or ``PATH.bin`` a Megatron prefix;
    suffixes match in any case."""
    path = input_path(path)
    suffix = path.suffix.lower()
    if path.is_dir():
        if is_saved_dataset(path):
            return SavedDataset(path, text_field=text_field, ids_field=ids_field)
        return TextFiles([path], pattern)
    if not path.exists() and any(megatron_file(path, end).is_file() for end in MEGATRON_PARTNERS):
        return Megatron(path)
    if suffix in (*JSONL_SUFFIXES, ".json"):
        return JsonLines(path, text_field=text_field, ids_field=ids_field)
    if suffix in (".parquet", ".arrow", ".arrows", ".feather"):
        return ArrowBatches(path, text_field=text_field, ids_field=ids_field)
    if suffix in MEGATRON_PARTNERS:
        return Megatron(path)
    return TextFiles([path], pattern)

