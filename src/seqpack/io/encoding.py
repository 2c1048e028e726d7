"""Tokenizing chunks of documents into framed token arrays, validated under a binding.

Two tokenizers: seqpack's :class:`~seqpack.ByteTokenizer`, and any Hugging Face
``tokenizers`` JSON file (:class:`TokenizerFile`, the ``hf`` extra), bound by identity:
the SHA-256 of the file, its vocabulary size (added tokens included) and the BOS and
EOS IDs, so seqpack never decodes the user's text. Texts are encoded a chunk at a time
with the tokenizer's own parallelism (``encode_batch``); neither tokenizer adds special
tokens, truncates or pads: seqpack frames every document ``[BOS, content..., EOS]``
itself. Pre-tokenized documents are framed the same way (or taken as already framed).
Every chunk is validated in one kernel pass, and an error names the document's file and
line (or row).
"""

from __future__ import annotations

import hashlib
import numbers
import re
import threading
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from .._limits import INT32_MAX, check_bool, kernel_threads
from ..data import _validate
from ..data.binding import BatchBinding
from ..data.tokenizer import TokenizerIdentity
from ..errors import InvalidInputError, SeqpackError
from .readers import DocumentChunk, Input, missing_extra, not_a_file


def file_sha256(path) -> str:
    """Lowercase hex SHA-256 of a file's bytes, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _tokenizers():
    """The ``tokenizers`` module (the ``hf`` extra), or an error naming the extra."""
    try:
        import tokenizers
    except ImportError:
        raise missing_extra("a tokenizers JSON file", "hf") from None
    return tokenizers


#: Tokenizers unpickled in this process, by the SHA-256 of their JSON: the most recent few
#: (threads that unpickle at once take turns).
_UNPICKLED: dict[str, object] = {}
_UNPICKLED_KEPT = 4
_UNPICKLED_LOCK = threading.Lock()


def _unpickled_tokenizer(json_text: str):
    """The ``tokenizers.Tokenizer`` of ``json_text``, built once per process.

    A worker that runs one task per shard unpickles the task's tokenizer every time.
    Building a fresh ``Tokenizer`` each time made the same shards take about 1.5x the
    CPU time in Ray's workers; in a plain process that did the same, the slowdown
    stayed for the rest of the process, and with jemalloc preloaded it did not appear
    (glibc's heap, most likely). So the copies of one tokenizer in a process share one
    instance, which encoding only reads.
    """
    key = hashlib.sha256(json_text.encode()).hexdigest()
    with _UNPICKLED_LOCK:
        tokenizer = _UNPICKLED.pop(key, None)
        if tokenizer is None:
            tokenizer = _tokenizers().Tokenizer.from_str(json_text)
        _UNPICKLED[key] = tokenizer  # most recent last
        while len(_UNPICKLED) > _UNPICKLED_KEPT:
            del _UNPICKLED[next(iter(_UNPICKLED))]
    return tokenizer


def _restore_tokenizer_file(state: dict, json_text: str) -> "TokenizerFile":
    restored = TokenizerFile.__new__(TokenizerFile)
    restored.__dict__.update(state, tokenizer=_unpickled_tokenizer(json_text))
    return restored


class TokenizerFile:
    """A Hugging Face ``tokenizers`` JSON file, bound by identity.

    ``bos`` and ``eos`` are IDs or token strings of the vocabulary (they may be equal,
    as GPT-2's ``<|endoftext|>``; a string of digits is an ID). Truncation, padding and
    BPE dropout configured in the file are turned off (the tokens of a text are then one
    function of the file, as its identity says), and no special tokens are added:
    seqpack frames each document itself.
    It pickles as its tokenizer's JSON (workers need not see the file); the copies
    unpickled in one process share one ``tokenizers.Tokenizer``.
    """

    def __init__(self, path, *, bos, eos):
        tokenizers = _tokenizers()
        self.path = Path(path)
        if self.path.is_dir():
            raise InvalidInputError(f"{path}: a directory, not a tokenizers JSON file (a model directory holds "
                                    f"one as {Path(path) / 'tokenizer.json'})")
        if not self.path.is_file():
            raise not_a_file(self.path, "no such tokenizer file")
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as error:  # tokenizers raises its own Exception subclasses
            raise InvalidInputError(f"{path}: not a tokenizers JSON file: {error}") from None
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        if getattr(self.tokenizer.model, "dropout", None) is not None:
            self.tokenizer.model.dropout = None  # a training-time augmentation: random merges
        # The highest ID + 1: a vocabulary's IDs may have gaps (get_vocab_size counts tokens).
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise InvalidInputError(f"{path}: the tokenizer has an empty vocabulary")
        if max(ids) > INT32_MAX:
            raise InvalidInputError(f"{path}: token ID {max(ids)} does not fit int32 (a vocabulary holds at most "
                                    f"2**31 IDs)")
        self.vocabulary_size = max(ids) + 1
        #: The IDs that name a token, sorted, when some below the highest name none (else None).
        self.known_ids = np.sort(np.fromiter(ids, dtype=np.int64)) if len(ids) < self.vocabulary_size else None
        self.bos_id = self._token_id("bos", bos)
        self.eos_id = self._token_id("eos", eos)
        self.identity = TokenizerIdentity(self.vocabulary_size, self.bos_id, self.eos_id, file_sha256(self.path))

    def _token_id(self, name: str, value) -> int:
        """``value`` as an ID: an integer (numpy's too), a string of ASCII digits, or a token."""
        if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value):
            value = int(value)
        if isinstance(value, str):
            token = self.tokenizer.token_to_id(value)
            if token is None:
                raise InvalidInputError(f"{self.path}: --{name} token {value!r} is not in the vocabulary")
            return token
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
                or not 0 <= int(value) < self.vocabulary_size:
            raise InvalidInputError(f"{self.path}: --{name} {value!r} is not an ID in [0, {self.vocabulary_size})")
        if self.tokenizer.id_to_token(int(value)) is None:  # a gap in the file's IDs
            raise InvalidInputError(f"{self.path}: --{name} {int(value)} is not the ID of any token in the vocabulary")
        return int(value)

    def __reduce__(self):
        state = {name: value for name, value in vars(self).items() if name != "tokenizer"}
        return _restore_tokenizer_file, (state, self.tokenizer.to_str())

    def first_unknown(self, values: np.ndarray) -> int:
        """The index of the first of ``values`` in ``[0, vocabulary_size)`` that names no
        token (a gap in the file's IDs), or -1."""
        if self.known_ids is None or not values.size:
            return -1
        inside = (values >= 0) & (values < self.vocabulary_size)
        found = self.known_ids[np.searchsorted(self.known_ids, values).clip(max=self.known_ids.shape[0] - 1)]
        unknown = np.flatnonzero(inside & (found != values))
        return int(unknown[0]) if unknown.size else -1

    def describe(self) -> dict:
        """The tokenizer as the manifest records it."""
        return {"kind": "tokenizers", "file": self.path.name, "vocabulary_size": self.vocabulary_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id, "digest": self.identity.digest}

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Content IDs of every text back to back (int64) and their offsets, in one
        parallel ``encode_batch_fast`` call. A text the tokenizer cannot encode (a
        WordLevel or BPE whose unknown token is not in its vocabulary, say) is a
        :class:`TokenizerFailure` naming its index (None when each text alone encodes)."""
        try:
            encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        except Exception as error:  # tokenizers raises plain Exceptions
            for index, text in enumerate(texts):  # which text: the rare error path pays
                try:
                    self.tokenizer.encode(text, add_special_tokens=False)
                except Exception:
                    raise TokenizerFailure(index, f"the tokenizer failed: {error}") from None
            raise TokenizerFailure(None, f"the tokenizer failed on these texts together: {error}") from None
        offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encodings], out=offsets[1:])
        flat = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=int(offsets[-1]))
        return flat, offsets


def _document_of(offsets: np.ndarray, index: int) -> int:
    """The document whose tokens hold flat ``index`` (``offsets`` rise from 0)."""
    return int(np.searchsorted(offsets, index, side="right")) - 1


class TokenizerFailure(InvalidInputError):
    """The tokenizers library could not encode text ``index`` of a batch (None: the batch)."""

    def __init__(self, index: int | None, message: str):
        super().__init__(message)
        self.index = index


def frame(content: np.ndarray, offsets: np.ndarray, bos: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """``[BOS, content..., EOS]`` for every document: int32 tokens and int64 offsets.

    ``content`` holds every document's IDs back to back (checked to fit int32 first).
    """
    count = offsets.shape[0] - 1
    framed = offsets + 2 * np.arange(count + 1, dtype=np.int64)
    tokens = np.empty(int(framed[-1]), dtype=np.int32)
    inside = np.ones(tokens.shape[0], dtype=bool)
    inside[framed[:-1]] = False
    inside[framed[1:] - 1] = False
    tokens[inside] = content
    tokens[framed[:-1]] = bos
    tokens[framed[1:] - 1] = eos
    return tokens, framed


@dataclass
class Encoded:
    """A chunk's valid documents: framed int32 ``tokens`` with int64 ``offsets``, each
    document's ``inputs`` and ``locations``, and how many empty documents were skipped."""

    tokens: np.ndarray
    offsets: np.ndarray
    inputs: np.ndarray
    locations: np.ndarray
    skipped: int


class ChunkEncoder:
    """Turns document chunks into validated framed tokens under ``binding``.

    ``tokenizer`` is the binding's ``ByteTokenizer`` or a :class:`TokenizerFile`;
    pre-tokenized chunks are framed with the binding's BOS and EOS unless ``framed``
    (their IDs then already start with BOS and end with EOS). Documents with no content
    are skipped and counted; every other rule break is an error naming the document.
    """

    def __init__(self, binding: BatchBinding, tokenizer, inputs: list[Input], *, framed: bool = False,
                 threads: int | None = None):
        self.binding = binding
        self.tokenizer = tokenizer
        self.inputs = inputs
        self.framed = check_bool("framed", framed)
        self.threads = kernel_threads(threads)
        # With two threads or more, one reads the next chunk ahead (see ``read_ahead``) and
        # the validation kernel takes the rest: at most ``threads`` cores are busy.
        self.read_ahead = self.threads > 1
        self.validation_threads = self.threads - 1 if self.read_ahead else 1

    def where(self, chunk: DocumentChunk, index: int) -> str:
        return self.inputs[int(chunk.inputs[index])].where(int(chunk.locations[index]))

    def encode(self, chunk: DocumentChunk) -> Encoded:
        binding = self.binding
        if chunk.ids is not None:
            values, offsets = chunk.ids
            if values.size and values.dtype.kind not in "iu":
                raise InvalidInputError(f"{self.where(chunk, 0)}: token IDs must be integers, not {values.dtype}")
            self._check_int32(chunk, values, offsets)
            if isinstance(self.tokenizer, TokenizerFile) and (bad := self.tokenizer.first_unknown(values)) >= 0:
                raise InvalidInputError(f"{self.where(chunk, _document_of(offsets, bad))}: token ID {int(values[bad])} "
                                        f"names no token of {self.tokenizer.path.name} (a gap in its IDs)")
            if self.framed:
                tokens = np.ascontiguousarray(values, dtype=np.int32)
            else:
                tokens, offsets = frame(values, offsets, binding.bos_id, binding.eos_id)
        elif isinstance(self.tokenizer, TokenizerFile):
            texts = [self._text(chunk, i, t) for i, t in enumerate(chunk.text_list())]
            try:
                content, offsets = self.tokenizer.encode(texts)
            except TokenizerFailure as failure:
                where = (self.where(chunk, failure.index) if failure.index is not None
                         else f"{self.where(chunk, 0)} to {self.where(chunk, len(texts) - 1)}")
                raise InvalidInputError(f"{where}: {failure}") from None
            tokens, offsets = frame(content, offsets, binding.bos_id, binding.eos_id)
        elif not self.tokenizer.merges:  # bytes: ID = byte + 2, no merges to apply
            data, offsets = chunk.joined_bytes()
            tokens, offsets = frame(data.astype(np.int32) + 2, offsets, binding.bos_id, binding.eos_id)
        else:
            documents = [self.tokenizer.encode_document(t) for t in chunk.text_list()]
            offsets = np.zeros(len(documents) + 1, dtype=np.int64)
            np.cumsum([len(d) for d in documents], out=offsets[1:])
            tokens = np.concatenate(documents) if documents else np.zeros(0, np.int32)
        return self._validated(chunk, tokens, offsets)

    def _text(self, chunk: DocumentChunk, index: int, text) -> str:
        if isinstance(text, str):
            return text
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidInputError(f"{self.where(chunk, index)}: not UTF-8 text (byte {error.start})") from None

    def _check_int32(self, chunk: DocumentChunk, values: np.ndarray, offsets: np.ndarray) -> None:
        if not values.size or np.can_cast(values.dtype, np.int32):
            return
        low, high = int(values.min()), int(values.max())
        if low >= -INT32_MAX - 1 and high <= INT32_MAX:
            return
        bad = np.flatnonzero((values < -INT32_MAX - 1) | (values > INT32_MAX))[0]
        raise InvalidInputError(f"{self.where(chunk, _document_of(offsets, bad))}: token ID {int(values[bad])} "
                                f"does not fit int32")

    def _validated(self, chunk: DocumentChunk, tokens: np.ndarray, offsets: np.ndarray) -> Encoded:
        """Skip empty documents, check the rest in one kernel pass, name the first bad one."""
        binding = self.binding
        inputs, locations = chunk.inputs, chunk.locations
        lengths = np.diff(offsets)
        pairs = offsets[:-1][lengths == 2]
        empty = np.zeros(lengths.shape[0], dtype=bool)
        empty[lengths == 2] = (tokens[pairs] == binding.bos_id) & (tokens[pairs + 1] == binding.eos_id)
        skipped = int(empty.sum())
        if skipped:  # [BOS, EOS]: no content, so no example
            keep = ~empty
            tokens = tokens[np.repeat(keep, lengths)]
            offsets = np.concatenate(([0], np.cumsum(lengths[keep])))
            inputs, locations = inputs[keep], locations[keep]
        if offsets.shape[0] == 1:
            return Encoded(tokens, offsets, inputs, locations, skipped)
        pieces = binding.tokenizer.piece_lengths if binding.tokenizer is not None else np.zeros(0, np.int64)
        checked = np.empty_like(tokens)
        document, _ = _validate.first_bad_document(
            tokens, offsets, pieces, binding.vocabulary_size, binding.bos_id, binding.eos_id,
            binding.limits.max_tokens, binding.limits.max_bytes, checked,
            self.validation_threads if tokens.shape[0] >= 1 << 20 else 1,
        )
        if document < 0:
            return Encoded(checked, offsets, inputs, locations, skipped)
        where = self.inputs[int(inputs[document])].where(int(locations[document]))
        try:
            binding.validate_document(tokens[int(offsets[document]): int(offsets[document + 1])])
        except SeqpackError as error:
            message = f"{where}: {error}"
            if chunk.ids is not None and not self.framed and "position" in message:
                message += " (positions count the BOS seqpack put before the IDs: the IDs' own index is one less)"
            raise type(error)(message) from None
        raise AssertionError(f"{where}: failed the bulk check but passed the per-document one")
