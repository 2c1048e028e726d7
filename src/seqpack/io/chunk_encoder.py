"""Tokenizing chunks of documents into token arrays, validated under a binding.

Texts are encoded a chunk at a time with the tokenizer's own parallelism and framed
``[BOS, content..., EOS]`` (no BOS for a tokenizer without one); pre-tokenized documents
are framed too (or taken as already framed), unless they carry masks: TRL's prepared
records are taken as given, as their masks describe them. Prompt-completion records and
conversations are encoded as TRL encodes them (:mod:`seqpack.io.record_encoders`), and
preference records as its ``DPOTrainer`` does (:mod:`seqpack.io.preference_encoders`),
with their supervision, and taken as given. Every chunk is validated in one kernel pass, and
an error names the document's file and line (or row), and records them as its ``path``
and ``line``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._arguments import INT32_MAX, check_bool
from .._threads import kernel_threads
from ..data import _validate
from ..data.binding import BatchBinding
from ..data.supervision import target_counts, trl_fault, trl_supervised
from ..errors import InvalidInputError, SeqpackError, TokenizerError
from .tokenizer_file import TokenizerFailure, TokenizerFile, frame, frame_where, without_final
from .readers import PREFERENCE_IDS, DocumentChunk, Input
from .preference_encoders import encode_conversational_preference, encode_preference, encode_preference_ids
from .record_encoders import (
    RecordError,
    encode_conversational_prompt_completion,
    encode_conversations,
    encode_prompt_completion,
)
from .templates import TemplateLimits


def _document_of(offsets: np.ndarray, index: int) -> int:
    """The document whose tokens hold flat ``index`` (``offsets`` rise from 0)."""
    return int(np.searchsorted(offsets, index, side="right")) - 1


@dataclass(frozen=True)
class SupervisionOptions:
    """How records that carry supervision are encoded, as TRL's ``SFTConfig`` names it:
    ``completion_only_loss`` (prompt-completion records and ``completion_mask`` columns
    supervise the completion only), ``chat_template`` (the Jinja text that renders
    conversations), ``assistant_only_loss`` (supervise its ``{% generation %}`` spans only)
    and ``template_limits`` (the time and output each record's rendering may take).
    Preference records are supervised on their completions whatever the two losses say,
    as TRL's ``DPOConfig`` has neither."""

    completion_only_loss: bool = True
    chat_template: str | None = None
    assistant_only_loss: bool = False
    template_limits: TemplateLimits = TemplateLimits()

    def __post_init__(self):
        check_bool("completion_only_loss", self.completion_only_loss)
        check_bool("assistant_only_loss", self.assistant_only_loss)
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise InvalidInputError(f"chat_template must be the template's text, not {type(self.chat_template).__name__}")
        if self.assistant_only_loss and self.chat_template is None:
            raise InvalidInputError("assistant_only_loss needs a chat template (--chat-template FILE.jinja)")


@dataclass
class Encoded:
    """A chunk's valid documents: int32 ``tokens`` with int64 ``offsets``, each
    document's ``inputs`` and ``locations``, and how many empty documents were skipped.
    ``supervised`` (None: every target) is aligned with ``tokens``; ``supervision`` names
    what it came from (``"prompt-completion"``, ``"conversation"``, ``"preference"``... or
    mask columns);
    ``mismatched`` lists the documents whose prompt encoding is not a prefix of the joint
    one; ``as_given`` (bool per document, None: none) the documents taken as given, not framed.
    ``paired``: documents ``2p`` and ``2p + 1`` are preference pair ``p``'s chosen and
    rejected sequences (both of its record; none skipped, ``mismatched`` lists a pair's
    chosen document)."""

    tokens: np.ndarray
    offsets: np.ndarray
    inputs: np.ndarray
    locations: np.ndarray
    skipped: int
    supervised: np.ndarray | None = None
    supervision: tuple = ()
    mismatched: np.ndarray | None = None
    as_given: np.ndarray | None = None
    paired: bool = False


class ChunkEncoder:
    """Turns document chunks into validated framed tokens under ``binding``.

    ``tokenizer`` is the binding's ``ByteTokenizer`` or a :class:`TokenizerFile`;
    pre-tokenized documents without masks are framed with the binding's BOS and EOS
    unless ``framed`` (their IDs then already start with BOS and end with EOS); those
    with masks, and fine-tuning records, are taken as given. Documents with no content
    (no target, as given) are skipped and counted, except a preference pair's, which are
    never split (:attr:`Encoded.paired`); every other rule break is an error naming the
    document.
    """

    def __init__(self, binding: BatchBinding, tokenizer, inputs: list[Input], *, framed: bool = False,
                 threads: int | None = None, supervision: SupervisionOptions = SupervisionOptions()):
        self.binding = binding
        self.supervision = supervision
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

    def located(self, error: SeqpackError, input_index, location) -> SeqpackError:
        """``error`` named by the document at ``location`` of input ``input_index``
        (``"data.jsonl:7: message"``), which it records as its ``path`` and ``line``."""
        item, location = self.inputs[int(input_index)], int(location)
        return error.within(item.where(location), path=item.name, line=location if item.unit is not None else None)

    def refused(self, chunk: DocumentChunk, index: int, message: str) -> InvalidInputError:
        """The error for document ``index`` of ``chunk``, named by its place."""
        return self.located(InvalidInputError(message), chunk.inputs[index], chunk.locations[index])

    def encode(self, chunk: DocumentChunk) -> Encoded:
        if chunk.preference:
            return self._preference_records(chunk)
        if chunk.prompts is not None or chunk.conversations is not None:
            return self._supervised_records(chunk)
        binding = self.binding
        supervised, supervision, as_given = None, (), None
        if chunk.ids is not None:
            values, offsets = chunk.ids
            self._check_ids(chunk, values, offsets)
            if chunk.masks:
                supervised, supervision = self._masked(chunk, values, offsets)
                as_given = chunk.masked if chunk.masked is not None else np.ones(len(chunk), dtype=bool)
            if self.framed or (as_given is not None and as_given.all()):
                tokens = np.ascontiguousarray(values, dtype=np.int32)
            else:
                to_frame = np.ones(len(chunk), dtype=bool) if as_given is None else ~as_given
                tokens, offsets, placed = frame_where(values, offsets, binding.bos_id, binding.eos_id, to_frame)
                if supervised is not None:  # a framed record carries no mask: every target supervised
                    every = np.ones(tokens.shape[0], dtype=np.bool_)
                    every[placed] = supervised
                    supervised = every
        elif isinstance(self.tokenizer, TokenizerFile):
            texts = [self._text(chunk, i, t) for i, t in enumerate(chunk.text_list())]
            try:
                content, offsets = self.tokenizer.encode(texts)
            except TokenizerFailure as failure:
                if failure.index is not None:
                    raise self.refused(chunk, failure.index, str(failure)) from None
                every = f"{self.where(chunk, 0)} to {self.where(chunk, len(texts) - 1)}"
                error = InvalidInputError(str(failure)).within(every, path=self.inputs[int(chunk.inputs[0])].name)
                raise error from None
            eos_text = self.tokenizer.token_text(binding.eos_id)
            ending = np.fromiter((text.endswith(eos_text) for text in texts), dtype=bool, count=len(texts))
            content, offsets = without_final(content, offsets, binding.eos_id, ending)
            tokens, offsets = frame(content, offsets, binding.bos_id, binding.eos_id)
        elif not self.tokenizer.merges:  # bytes: ID = byte + 2, no merges to apply
            self._check_text_sizes(chunk)
            data, offsets = chunk.joined_bytes()
            tokens, offsets = frame(data.astype(np.int32) + 2, offsets, binding.bos_id, binding.eos_id)
        else:
            self._check_text_sizes(chunk)
            documents = [self.tokenizer.encode_document(t) for t in chunk.text_list()]
            offsets = np.zeros(len(documents) + 1, dtype=np.int64)
            np.cumsum([len(d) for d in documents], out=offsets[1:])
            tokens = np.concatenate(documents) if documents else np.zeros(0, np.int32)
        return self._validated(chunk, tokens, offsets, supervised, supervision, as_given=as_given)

    def _check_text_sizes(self, chunk: DocumentChunk) -> None:
        """Refuse a text past the binding's byte limit before it is encoded, which would hold
        its tokens whole first (a text's characters bound its UTF-8 bytes from below)."""
        limit = self.binding.limits.max_bytes
        sizes = np.diff(chunk.text_buffer[1]) if chunk.text_buffer is not None else \
            np.array([len(text) for text in chunk.texts], dtype=np.int64)
        over = np.flatnonzero(sizes > limit)
        if over.size:
            raise self.refused(chunk, int(over[0]), f"the document holds more than {limit} bytes, the binding's "
                                                    f"decode limit: refused before it is encoded")

    def _masked(self, chunk: DocumentChunk, values: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, tuple]:
        """TRL's rule for pre-tokenized records (:func:`~seqpack.data.supervision.trl_supervised`)
        on the chunk's mask columns; the first entry that breaks it is an error naming its record."""
        fault = trl_fault(values, offsets, chunk.masks)
        if fault is not None:
            name, at = fault
            document = _document_of(offsets, at)
            entry = f"{name}[{at - int(offsets[document])}] is {int(chunk.masks[name][at])}"
            if name == "labels":
                raise self.refused(chunk, document, f"{entry}, neither -100 nor its input_ids token {int(values[at])}: "
                                                    f"a packed document's targets are its own tokens")
            raise self.refused(chunk, document, f"{entry}; a mask holds 0 and 1")
        return trl_supervised(values, chunk.masks, completion_only_loss=self.supervision.completion_only_loss)

    def _check_ids(self, chunk: DocumentChunk, values: np.ndarray, offsets: np.ndarray, field: str = "") -> None:
        """Token IDs (one row per record of ``chunk``) are integers that fit int32 and, with
        a tokenizers file, name its tokens; the first that is not names its record (and
        ``field``, when given)."""
        named = f"field {field!r}: " if field else ""
        if values.size and values.dtype.kind not in "iu":
            raise self.refused(chunk, 0, f"{named}token IDs must be integers, not {values.dtype}")
        self._check_int32(chunk, values, offsets, named)
        if isinstance(self.tokenizer, TokenizerFile) and (bad := self.tokenizer.first_unknown(values)) >= 0:
            raise self.refused(chunk, _document_of(offsets, bad), f"{named}token ID {int(values[bad])} names no "
                               f"token of {self.tokenizer.path.name} (a gap in its IDs)")

    def _check_tokenized(self, chunk: DocumentChunk, what: str, rendered: str | None) -> None:
        """Records (``what``) need a tokenizers file, and records of messages (``rendered``:
        what they are, None for strings) a chat template."""
        if not isinstance(self.tokenizer, TokenizerFile):
            raise self.refused(chunk, 0, f"{what} need a tokenizers file (--tokenizer FILE), not the byte tokenizer")
        if rendered is not None and self.supervision.chat_template is None:
            raise self.refused(chunk, 0, f"{rendered} need a chat template: --chat-template FILE.jinja")

    def _preference_records(self, chunk: DocumentChunk) -> Encoded:
        """Preference records, encoded as TRL's ``DPOTrainer`` encodes them: two documents
        each (:attr:`Encoded.paired`), supervised on their completions."""
        options = self.supervision
        try:
            if chunk.pair_ids is not None:
                for field in PREFERENCE_IDS:
                    self._check_ids(chunk, *chunk.pair_ids[field], field)
                encoded = encode_preference_ids(*(chunk.pair_ids[field] for field in PREFERENCE_IDS))
                supervision = "preference IDs"
            else:
                self._check_tokenized(chunk, "preference records", "conversational preference records (lists "
                                      "of messages)" if chunk.conversational else None)
                if chunk.conversational:
                    encoded = encode_conversational_preference(
                        self.tokenizer, chunk.prompts, chunk.chosen, chunk.rejected,
                        chat_template=options.chat_template, tools=chunk.tools, template_kwargs=chunk.template_kwargs,
                        limits=options.template_limits)
                    supervision = "conversational preference"
                else:
                    encoded = encode_preference(self.tokenizer, chunk.prompts, chunk.chosen, chunk.rejected)
                    supervision = "preference"
        except RecordError as error:
            raise self.refused(chunk, error.index, error.detail) from None
        return self._validated(chunk, encoded.tokens, encoded.offsets, encoded.supervised, (supervision,),
                               encoded.mismatched, as_given=np.ones(2 * len(chunk), dtype=bool), paired=True)

    def _supervised_records(self, chunk: DocumentChunk) -> Encoded:
        """Prompt-completion records or conversations, encoded as TRL encodes them."""
        options = self.supervision
        rendered = "conversations (a 'messages' field)" if chunk.conversations is not None else \
            "conversational prompt-completion records (lists of messages)" if chunk.conversational else None
        self._check_tokenized(chunk, "prompt-completion records and conversations", rendered)
        template = {"chat_template": options.chat_template, "tools": chunk.tools,
                    "template_kwargs": chunk.template_kwargs, "limits": options.template_limits}
        try:
            if chunk.conversations is not None:
                encoded = encode_conversations(self.tokenizer, chunk.conversations,
                                               assistant_only_loss=options.assistant_only_loss, **template)
                supervision = ("conversation",)
            elif chunk.conversational:
                encoded = encode_conversational_prompt_completion(
                    self.tokenizer, chunk.prompts, chunk.completions, completion_only_loss=options.completion_only_loss,
                    assistant_only_loss=options.assistant_only_loss, **template)
                supervision = ("conversational prompt-completion",)
            else:
                encoded = encode_prompt_completion(self.tokenizer, chunk.prompts, chunk.completions,
                                                   completion_only_loss=options.completion_only_loss)
                supervision = ("prompt-completion",)
        except RecordError as error:
            raise self.refused(chunk, error.index, error.detail) from None
        return self._validated(chunk, encoded.tokens, encoded.offsets, encoded.supervised, supervision,
                               encoded.mismatched, as_given=np.ones(len(chunk), dtype=bool))

    def _text(self, chunk: DocumentChunk, index: int, text) -> str:
        if isinstance(text, str):
            return text
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.refused(chunk, index, f"not UTF-8 text (byte {error.start})") from None

    def _check_int32(self, chunk: DocumentChunk, values: np.ndarray, offsets: np.ndarray, named: str) -> None:
        if not values.size or np.can_cast(values.dtype, np.int32):
            return
        low, high = int(values.min()), int(values.max())
        if low >= -INT32_MAX - 1 and high <= INT32_MAX:
            return
        bad = np.flatnonzero((values < -INT32_MAX - 1) | (values > INT32_MAX))[0]
        raise self.refused(chunk, _document_of(offsets, bad), f"{named}token ID {int(values[bad])} does not fit int32")

    def _empty(self, tokens: np.ndarray, offsets: np.ndarray, given: np.ndarray) -> np.ndarray:
        """bool per document: framed without content, or as given with no target."""
        binding = self.binding
        lengths = np.diff(offsets)
        empty = given & (lengths == 0)
        single = np.flatnonzero(given & (lengths == 1))  # no target: skipped, if its ID is in the vocabulary
        empty[single] = (tokens[offsets[:-1][single]] >= 0) & (tokens[offsets[:-1][single]] < binding.vocabulary_size)
        bare = 1 + (binding.bos_id is not None)  # the tokens of a framed document without content
        maybe = np.flatnonzero(~given & (lengths == bare))
        frames = tokens[offsets[1:][maybe] - 1] == binding.eos_id
        if bare == 2:
            frames &= tokens[offsets[:-1][maybe]] == binding.bos_id
        empty[maybe[frames]] = True
        return empty

    def _validated(self, chunk: DocumentChunk, tokens: np.ndarray, offsets: np.ndarray, supervised=None,
                   supervision: tuple = (), mismatched=None, *, as_given: np.ndarray | None = None,
                   paired: bool = False) -> Encoded:
        """Skip empty documents (framed without content, or as given with no target; none
        when ``paired``: a pair's record is both its documents'), check the rest in one
        kernel pass, name the first bad one (or the first whose targets are all unsupervised)."""
        binding = self.binding
        inputs, locations = chunk.inputs, chunk.locations
        if paired:
            inputs, locations = np.repeat(inputs, 2), np.repeat(locations, 2)
        lengths = np.diff(offsets)
        given = np.zeros(lengths.shape[0], dtype=bool) if as_given is None else as_given
        empty = np.zeros(lengths.shape[0], dtype=bool) if paired else self._empty(tokens, offsets, given)
        skipped = int(empty.sum())
        if mismatched is not None:
            kept = np.flatnonzero(~empty)
            mismatched = np.searchsorted(kept, mismatched[~empty[mismatched]])  # as kept documents
        if skipped:
            keep = ~empty
            tokens = tokens[np.repeat(keep, lengths)]
            if supervised is not None:
                supervised = supervised[np.repeat(keep, lengths)]
            offsets = np.concatenate(([0], np.cumsum(lengths[keep])))
            inputs, locations, given = inputs[keep], locations[keep], given[keep]
        encoded = Encoded(tokens, offsets, inputs, locations, skipped, supervised, supervision, mismatched,
                          given if given.any() else None, paired)
        if offsets.shape[0] == 1:
            return encoded
        pieces = binding.tokenizer.piece_lengths if binding.tokenizer is not None else np.zeros(0, np.int64)
        checked = np.empty_like(tokens)
        document, _ = _validate.first_bad_document(
            tokens, offsets, pieces, binding.vocabulary_size, binding.kernel_bos, binding.eos_id,
            given.astype(np.uint8) if given.any() else np.zeros(0, np.uint8),
            binding.limits.max_tokens, binding.limits.max_bytes, checked,
            self.validation_threads if tokens.shape[0] >= 1 << 20 else 1,
        )
        if document < 0:
            encoded.tokens = checked
            if supervised is not None:
                self._check_supervised(encoded)
            return encoded
        try:
            binding.validate_document(tokens[int(offsets[document]): int(offsets[document + 1])],
                                      as_given=bool(given[document]))
        except SeqpackError as error:
            if isinstance(error, TokenizerError) and error.position is not None and chunk.ids is not None \
                    and not self.framed and not given[document] and binding.bos_id is not None:
                error = type(error)(f"{error} (positions count the BOS seqpack put before the IDs: the IDs' own "
                                    f"index is one less)", error.position)
            raise self.located(error, inputs[document], locations[document]) from None
        where = self.inputs[int(inputs[document])].where(int(locations[document]))
        raise AssertionError(f"{where}: failed the bulk check but passed the per-document one")

    def _check_supervised(self, encoded: Encoded) -> None:
        """Every document needs a supervised target (TRL refuses an assistant-only
        example without one): the first that has none is an error naming it."""
        starts, ends = encoded.offsets[:-1], encoded.offsets[1:]
        none = np.flatnonzero(target_counts(encoded.supervised, starts, ends) == 0)
        if none.size:
            document = int(none[0])
            error = InvalidInputError(f"none of the document's {int(ends[document] - starts[document] - 1)} targets "
                                      f"is supervised ({', '.join(encoded.supervision)}): it would add nothing to "
                                      f"the loss")
            raise self.located(error, encoded.inputs[document], encoded.locations[document])
