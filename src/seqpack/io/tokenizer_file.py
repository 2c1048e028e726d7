"""Tokenizers for corpora, and framing their documents.

Two tokenizers: seqpack's :class:`~seqpack.ByteTokenizer`, and any Hugging Face
``tokenizers`` JSON file (:class:`TokenizerFile`, the ``hf`` extra), bound by identity:
the SHA-256 of the file, its vocabulary size (added tokens included) and the BOS and
EOS IDs, so seqpack never decodes the user's text. Texts are encoded a chunk at a time
with the tokenizer's own parallelism (``encode_batch``); neither tokenizer truncates or
pads. Plain text is framed ``[BOS, content..., EOS]`` by seqpack (:func:`frame`; no BOS
for a tokenizer without one); fine-tuning records are encoded as TRL encodes them, with
the tokenizer's own special tokens (:mod:`seqpack.io.record_encoders`).
:mod:`seqpack.io.chunk_encoder` encodes and validates the readers' chunks.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import re
import threading
from itertools import chain
from pathlib import Path

import numpy as np

from .._arguments import INT32_MAX, shown
from ..data.tokenizer import TokenizerIdentity
from ..errors import InvalidInputError
from .publish import file_sha256
from .readers import input_path, missing_extra, not_a_file


def _refused(path, reason: str) -> InvalidInputError:
    """The error for the tokenizers file at ``path``: ``"path: reason"``, with ``path`` recorded."""
    return InvalidInputError(reason).within(path, path=path)


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
    as GPT-2's ``<|endoftext|>``; a string of digits is an ID). Without ``bos``, the BOS
    is the token the file's post-processor puts first (Llama's ``<s>``), or none (GPT-2
    and Qwen files add none: ``bos_id`` is then None and plain text is framed
    ``[content..., EOS]``). Truncation, padding and BPE dropout configured in the file are
    turned off (the tokens of a text are then one function of the file, as its identity
    says). ``identity`` is the :class:`~seqpack.TokenizerIdentity` that bindings and
    :class:`~seqpack.hf.PackingCollator` take.
    It pickles as its tokenizer's JSON (workers need not see the file); the copies
    unpickled in one process share one ``tokenizers.Tokenizer``.
    """

    def __init__(self, path, *, bos=None, eos):
        tokenizers = _tokenizers()
        self.path = input_path(path, "the tokenizer file")
        if self.path.is_dir():
            raise _refused(path, f"a directory, not a tokenizers JSON file (a model directory holds one as "
                                 f"{Path(path) / 'tokenizer.json'})")
        if not self.path.is_file():
            raise not_a_file(self.path, "no such tokenizer file")
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as error:  # tokenizers raises its own Exception subclasses
            raise _refused(path, f"not a tokenizers JSON file: {error}") from None
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        if getattr(self.tokenizer.model, "dropout", None) is not None:
            self.tokenizer.model.dropout = None  # a training-time augmentation: random merges
        # The highest ID + 1: a vocabulary's IDs may have gaps (get_vocab_size counts tokens).
        ids = self.tokenizer.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise _refused(path, "the tokenizer has an empty vocabulary")
        if max(ids) > INT32_MAX:
            raise _refused(path, f"token ID {max(ids)} does not fit int32 (a vocabulary holds at most 2**31 IDs)")
        self.vocabulary_size = max(ids) + 1
        #: The IDs that name a token, sorted, when some below the highest name none (else None).
        named = np.unique(np.fromiter(ids, dtype=np.int64))   # (two tokens may share an ID)
        self.known_ids = named if named.size < self.vocabulary_size else None
        self.bos_id = self._template_bos() if bos is None else self._token_id("bos", bos)
        self.eos_id = self._token_id("eos", eos)
        self.identity = TokenizerIdentity(self.vocabulary_size, self.bos_id, self.eos_id, file_sha256(self.path))

    def _token_id(self, name: str, value) -> int:
        """``value`` as an ID: an integer (numpy's too), a string of ASCII digits, or a token."""
        if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value):
            if len(value) > 20:  # (past 4300 digits, int() itself raises a ValueError)
                raise _refused(self.path, f"--{name} is a number of {len(value)} digits, not an ID in "
                                          f"[0, {self.vocabulary_size})")
            value = int(value)
        if isinstance(value, str):
            token = self.tokenizer.token_to_id(value)
            if token is None:
                raise _refused(self.path, f"--{name} token {value!r} is not in the vocabulary")
            return token
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
                or not 0 <= int(value) < self.vocabulary_size:
            raise _refused(self.path, f"--{name} {shown(value)} is not an ID in [0, {self.vocabulary_size})")
        if self.tokenizer.id_to_token(int(value)) is None:  # a gap in the file's IDs
            raise _refused(self.path, f"--{name} {int(value)} is not the ID of any token in the vocabulary")
        return int(value)

    def _template_bos(self) -> int | None:
        """:meth:`_post_processor_bos`, which must name a token of the vocabulary."""
        try:
            bos = self._post_processor_bos()
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise _refused(self.path, f"its post-processor's first special token cannot be read ({error!r}): "
                                      f"give --bos") from None
        if bos is not None and not (0 <= bos < self.vocabulary_size and self.tokenizer.id_to_token(bos) is not None):
            raise _refused(self.path, f"its post-processor puts ID {bos} first, which names no token of the "
                                      f"vocabulary: give --bos")
        return bos

    def _post_processor_bos(self) -> int | None:
        """The ID the post-processor puts before a text's tokens, if any: the leading
        special token of a ``TemplateProcessing`` (Llama's ``<s>``), the ``cls`` of a
        BERT or RoBERTa processor; GPT-2's and Qwen's ``ByteLevel`` add none."""
        processors = [json.loads(self.tokenizer.to_str()).get("post_processor")]
        while processors:
            processor = processors.pop(0)
            kind = processor.get("type") if isinstance(processor, dict) else None
            if kind == "Sequence":
                processors = list(processor.get("processors") or []) + processors
            elif kind == "TemplateProcessing":
                first = (processor.get("single") or [{}])[0]
                if "SpecialToken" in first:
                    token = processor["special_tokens"][first["SpecialToken"]["id"]]
                    return int(token["ids"][0]) if token["ids"] else None   # (no ID: it puts nothing first)
            elif kind in ("BertProcessing", "RobertaProcessing"):
                return int(processor["cls"][1])
        return None

    def token_text(self, token_id: int | None) -> str | None:
        """The text of a token (an added token's content), or None for None."""
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

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

    def encode(self, texts: list[str], *, special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """IDs of every text back to back (int64) and their offsets, in one parallel
        ``encode_batch_fast`` call; with ``special_tokens`` the post-processor's tokens are
        added (BOS, as ``tokenizer(text)`` adds them). A text the tokenizer cannot encode (a
        WordLevel or BPE whose unknown token is not in its vocabulary, say) is a
        :class:`TokenizerFailure` naming its index (None when each text alone encodes)."""
        try:
            encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=special_tokens)
        except Exception as error:  # tokenizers raises plain Exceptions
            for index, text in enumerate(texts):  # which text: the rare error path pays
                try:
                    self.tokenizer.encode(text, add_special_tokens=special_tokens)
                except Exception:
                    raise TokenizerFailure(index, f"the tokenizer failed: {error}") from None
            raise TokenizerFailure(None, f"the tokenizer failed on these texts together: {error}") from None
        offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encodings], out=offsets[1:])
        flat = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=int(offsets[-1]))
        return flat, offsets


class TokenizerFailure(InvalidInputError):
    """The tokenizers library could not encode text ``index`` of a batch (None: the batch)."""

    def __init__(self, index: int | None, message: str):
        super().__init__(message)
        self.index = index


def frame(content: np.ndarray, offsets: np.ndarray, bos: int | None, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """``[BOS, content..., EOS]`` for every document (``[content..., EOS]`` when ``bos``
    is None): int32 tokens and int64 offsets.

    ``content`` holds every document's IDs back to back (checked to fit int32 first).
    """
    added = 1 + (bos is not None)
    count = offsets.shape[0] - 1
    framed = offsets + added * np.arange(count + 1, dtype=np.int64)
    tokens = np.empty(int(framed[-1]), dtype=np.int32)
    inside = np.ones(tokens.shape[0], dtype=bool)
    if bos is not None:
        inside[framed[:-1]] = False
        tokens[framed[:-1]] = bos
    inside[framed[1:] - 1] = False
    tokens[inside] = content
    tokens[framed[1:] - 1] = eos
    return tokens, framed


def without_final(content: np.ndarray, offsets: np.ndarray, token: int,
                  where: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(content, offsets)`` with the last ID of each document ``where`` says dropped when
    it is ``token``: a text that ends with the EOS text gets no second one (TRL's
    ``add_eos`` rule, which compares the text), so framing it gives TRL's IDs."""
    starts, ends = offsets[:-1], offsets[1:]
    ending = where & (ends > starts) & (content[np.maximum(ends - 1, 0)] == token) if content.size else ends < starts
    if not ending.any():
        return content, offsets
    keep = np.ones(content.shape[0], dtype=bool)
    keep[ends[ending] - 1] = False
    dropped = np.zeros(offsets.shape[0], dtype=np.int64)
    np.cumsum(ending, out=dropped[1:])
    return content[keep], offsets - dropped


def frame_where(content: np.ndarray, offsets: np.ndarray, bos: int | None, eos: int, where: np.ndarray):
    """:func:`frame` for the documents ``where`` is True, the others as they are:
    ``(tokens, offsets, placed)``, ``placed[j]`` being where content ID ``j`` went."""
    lengths = np.diff(offsets)
    added = where.astype(np.int64) * (1 + (bos is not None))
    framed = np.zeros_like(offsets)
    np.cumsum(lengths + added, out=framed[1:])
    lead = where.astype(np.int64) * (bos is not None)
    placed = np.arange(content.shape[0], dtype=np.int64) + np.repeat(framed[:-1] - offsets[:-1] + lead, lengths)
    tokens = np.empty(int(framed[-1]), dtype=np.int32)
    tokens[placed] = content
    if bos is not None:
        tokens[framed[:-1][where]] = bos
    tokens[framed[1:][where] - 1] = eos
    return tokens, framed, placed
