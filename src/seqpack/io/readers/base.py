"""What every reader shares: the :class:`Input` record naming an input, the
:class:`DocumentChunk` every reader yields (bounded by ``CHUNK_BYTES`` of input and
``CHUNK_DOCUMENTS`` documents), the :class:`Reader` protocol, and the path checks and
errors that name a bad input. It imports no other module of the package.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ...errors import InvalidInputError, SeqpackError

#: Input bytes a chunk holds (about; one document may exceed it).
CHUNK_BYTES = 8 << 20
#: Documents a chunk holds at most.
CHUNK_DOCUMENTS = 4096


def missing_extra(what: str, extra: str, *more: str) -> InvalidInputError:
    """The error (kind ``"missing-extra"``) for ``what`` without the packages ``extra`` (and
    the ``more`` extras) install: one message naming every one."""
    extras = (extra, *more)
    names = " and ".join(map(repr, extras)) + (" extras" if more else " extra")
    return InvalidInputError(f"{what} needs the {names}: pip install 'seqpack[{','.join(extras)}]'",
                             kind="missing-extra")


def input_path(value, name: str | None = None) -> Path:
    """``value`` (a ``str`` or ``os.PathLike``) as a ``Path``; anything else is an
    :class:`InvalidInputError` (naming the argument ``name`` when given)."""
    if not isinstance(value, (str, os.PathLike)):
        argument = f" for {name}" if name else ""
        raise InvalidInputError(f"expected a path (str or os.PathLike){argument}, got {type(value).__name__}")
    return Path(value)


#: What a path is when resolving it meets a symbolic link that loops (``ELOOP``).
LINK_LOOP = "a symbolic link that loops (it points, directly or through others, back to itself)"


def link_loop(path) -> str | None:
    """What is wrong when resolving ``path`` meets a symbolic link that loops (the path
    itself, or a directory on its way), else ``None``. ``Path.exists`` says ``False`` for
    such a path, as for a missing one."""
    try:
        os.stat(path)
        return None
    except OSError as error:
        if error.errno != errno.ELOOP:
            return None
    try:
        os.lstat(path)
    except OSError:  # a directory on the way loops, not the last name
        return f"its path goes through {LINK_LOOP}"
    return LINK_LOOP


def not_a_file(path, what: str = "no such file") -> InvalidInputError:
    """The error for an input path that is not a regular file: missing (``what``), a
    symbolic link that loops, or a pipe, a device or a socket (``/dev/stdin``,
    ``<(...)``), which seqpack cannot read twice or seek in."""
    path = Path(path)
    if (loop := link_loop(path)) is not None:
        what = loop
    elif path.exists():
        what = "not a regular file (a pipe, a device or a socket): write the data to a file first"
    return InvalidInputError(what).within(path, path=path)


def cannot_read(path, error: OSError) -> InvalidInputError:
    """The one-line error for a file or directory that cannot be read."""
    return InvalidInputError(f"{path}: cannot read: {error.strerror or error}")


@dataclass(frozen=True)
class Input:
    """One input: its name (a path, or a description of an in-memory table), the unit
    that locates a document in it (``"line"`` 1-based, ``"row"`` and ``"sequence"``
    0-based, or ``None`` for a file that is one document), and ``within``: the input
    directory it was found in, for a file found by walking one."""

    name: str
    kind: str
    unit: str | None
    within: str | None = None

    def __post_init__(self):
        for name in (self.name, self.within):
            if name is not None and any(0xD800 <= ord(c) <= 0xDFFF for c in name):
                from ..render import printable

                raise InvalidInputError(f"{printable(name)}: the name holds a byte that is not UTF-8; a packed "
                                        f"dataset's manifest names its inputs in UTF-8: rename it")

    def where(self, location: int) -> str:
        """``path:line``, ``name row 12``, ``name sequence 3`` or the file's name."""
        if self.unit is None:
            return self.name
        if self.unit == "line":
            return f"{self.name}:{location}"
        return f"{self.name} {self.unit} {location}"

    def error(self, location: int, message: str) -> InvalidInputError:
        """An :class:`InvalidInputError` of ``message`` at ``location``: named by :meth:`where`
        before the message, with this input as its ``path`` and ``location`` as its ``line``."""
        return self.located(InvalidInputError(message).within(self.where(location)), location)

    def located(self, error: SeqpackError, location: int) -> SeqpackError:
        """``error`` (whose message names :meth:`where`) with this input as its ``path`` and
        ``location`` as its ``line``, unless it names a path already."""
        if error.path is None:
            error.path, error.line = self.name, int(location) if self.unit is not None else None
        return error


#: The :class:`DocumentChunk` field holding each record field's values, by the record field's name.
RECORD_FIELD_ATTRIBUTES = {"prompt": "prompts", "completion": "completions", "chosen": "chosen",
                           "rejected": "rejected", "messages": "conversations"}


@dataclass
class DocumentChunk:
    """Consecutive documents of one input.

    Exactly one of ``texts`` (a list of ``str`` or ``bytes``), ``text_buffer`` (UTF-8
    bytes as a uint8 array and int64 offsets), ``ids`` (flat integer IDs and int64
    offsets, one document each), ``prompts`` with ``completions`` (prompt-completion
    records: lists of ``str``, or with ``conversational`` lists of messages),
    ``conversations`` (lists of messages, every key kept), ``chosen`` with ``rejected``
    (preference records, each a pair of documents: ``str``, or with ``conversational``
    lists of messages; with ``prompts`` beside them, or without when the prompt is
    implicit, the pair's shared beginning) or ``pair_ids`` (pre-tokenized preference
    records: ``"prompt_ids"``, ``"chosen_ids"`` and ``"rejected_ids"``, each flat integer
    IDs and int64 offsets, one row per record) is set (``conversational`` is also set
    with ``conversations``). With ``ids``, ``masks``
    holds the records' supervision fields found by name, each flat integer values aligned
    with the IDs: ``completion_mask`` and ``assistant_masks`` (1 = supervised), ``labels``
    (-100 = unsupervised); a record without one of them holds 1s (its own IDs for
    ``labels``) there, and ``masked`` (bool per document; None: all) says which records carry any.
    Beside messages, ``tools`` and ``template_kwargs`` (None, or one entry per record) are
    what each record gives its chat template.
    ``inputs`` and ``locations`` (int64) name each record's input (an index into the
    readers' inputs) and its place there; ``nbytes`` counts the input bytes read.
    """

    inputs: np.ndarray
    locations: np.ndarray
    nbytes: int
    texts: list | None = None
    text_buffer: tuple[np.ndarray, np.ndarray] | None = None
    ids: tuple[np.ndarray, np.ndarray] | None = None
    masks: dict[str, np.ndarray] | None = None
    masked: np.ndarray | None = None
    prompts: list | None = None
    completions: list | None = None
    conversational: bool = False
    conversations: list | None = None
    chosen: list | None = None
    rejected: list | None = None
    pair_ids: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
    tools: list | None = None
    template_kwargs: list | None = None

    @classmethod
    def of_records(cls, inputs: np.ndarray, locations: np.ndarray, nbytes: int, values: dict, *,
                   conversational: bool = False, tools: list | None = None,
                   template_kwargs: list | None = None) -> DocumentChunk:
        """The chunk of records whose ``values`` are lists by record field name (``prompt``,
        ``completion``, ``chosen``, ``rejected``, ``messages``; see :data:`RECORD_FIELD_ATTRIBUTES`)."""
        return cls(inputs, locations, nbytes, conversational=conversational, tools=tools,
                   template_kwargs=template_kwargs,
                   **{RECORD_FIELD_ATTRIBUTES[field]: list(column) for field, column in values.items()})

    @property
    def preference(self) -> bool:
        """Whether each record is a preference pair (two documents: prompt + chosen, prompt + rejected)."""
        return self.chosen is not None or self.pair_ids is not None

    def __len__(self) -> int:
        return int(self.locations.shape[0])

    def text_list(self) -> list:
        """The texts as a list (``str`` or ``bytes``)."""
        if self.texts is not None:
            return self.texts
        data, offsets = self.text_buffer
        raw = data.tobytes()
        bounds = offsets.tolist()
        return [raw[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def joined_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """The texts' UTF-8 bytes back to back (uint8) with int64 offsets."""
        if self.text_buffer is not None:
            return self.text_buffer
        encoded = [t.encode("utf-8") if isinstance(t, str) else t for t in self.texts]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in encoded], out=offsets[1:])
        return np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets


class RecordReader:
    """What a reader of records (JSONL, Arrow) says of them, from its ``record_fields``:
    ``record_kind`` (``"text"``, ``"ids"``, ``"prompt-completion"``, ``"conversational
    prompt-completion"``, ``"conversation"`` or a preference kind, one of
    :data:`~.records.PREFERENCE_KINDS`: every record of an input is of one kind)."""

    @property
    def record_kind(self) -> str:
        return self.record_fields.kind


class Reader(Protocol):
    """Documents chunk by chunk: ``inputs`` lists what the reader reads, and
    ``chunks(first_input)`` yields chunks whose input indices count from ``first_input``."""

    inputs: list[Input]

    def chunks(self, first_input: int) -> Iterator[DocumentChunk]: ...


def check_fields(name: str, text_field: str | None, ids_field: str | None) -> None:
    """A text field and an IDs field together are an error: one of them would be ignored.
    Each given field is a name (a str)."""
    for option, field in (("text_field", text_field), ("ids_field", ids_field)):
        if field is not None and not isinstance(field, str):
            raise InvalidInputError(f"{name}: {option} must be a field name (a str), not {type(field).__name__}")
    if text_field is not None and ids_field is not None:
        raise InvalidInputError(f"{name}: give a text field ({text_field!r}) or an IDs field ({ids_field!r}), "
                                f"not both")

