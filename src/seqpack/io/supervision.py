"""Supervised fine-tuning records as framed documents with a supervision array.

Two record kinds, each encoded the way TRL 1.16's ``SFTTrainer`` encodes it, so a
user's masks do not change when seqpack packs them:

- prompt-completion: the document is ``[BOS] + encode(prompt + completion) + [EOS]``,
  and the completion begins at the common prefix of ``encode(prompt)`` and the joint
  encoding (TRL's ``common_prefix_length``): a token merged across the boundary is the
  completion's.
- conversations: rendered and tokenized by transformers' ``apply_chat_template``; the
  assistant mask (the template's ``{% generation %}`` spans) is the supervision.

``supervised[j]`` says whether token ``j``, as a target, counts in the loss (the
``supervised`` array of :meth:`seqpack.ExampleTable.from_arrays`); a document's first
token is never a target, so its value is always False.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import chain

import numpy as np

from .._limits import check_bool
from ..data.supervision import target_counts
from ..errors import InvalidInputError
from .encoding import TokenizerFailure, TokenizerFile, frame
from .readers import missing_extra

#: The statement transformers looks for to compute an assistant mask.
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class RecordError(InvalidInputError):
    """Record ``index`` of a call is at fault; ``detail`` says how (a reader names the record's
    file and line instead of its index)."""

    def __init__(self, kind: str, index: int, detail: str):
        super().__init__(f"{kind} {index}: {detail}")
        self.index, self.detail = index, detail


@dataclass(frozen=True)
class SupervisedDocuments:
    """Framed documents and their supervision.

    ``tokens`` int32 ``[N]`` and ``offsets`` int64 ``[records + 1]`` as
    :func:`~seqpack.io.encoding.frame` makes them; ``supervised`` bool ``[N]``;
    ``mismatched`` int64: the records whose prompt encoding is not a prefix of their
    joint encoding (TRL warns once about them; always empty for conversations).
    """

    tokens: np.ndarray
    offsets: np.ndarray
    supervised: np.ndarray
    mismatched: np.ndarray


def encode_prompt_completion(tokenizer: TokenizerFile, prompts, completions, *,
                             completion_only_loss: bool = True) -> SupervisedDocuments:
    """Each record as ``[BOS] + encode(prompt + completion) + [EOS]``, supervised from the
    completion's first token on (EOS included), TRL 1.16's rule.

    The completion begins at ``min(common prefix of encode(prompt) and the joint
    encoding, joint content length)``: the EOS is always a target, so every record has
    one. With ``completion_only_loss=False`` every token but BOS is supervised.
    Texts are encoded in two ``encode_batch_fast`` calls (joint texts, prompts).

    Refused (:class:`InvalidInputError`): a tokenizer that is not a
    :class:`TokenizerFile`; prompts and completions of different lengths; a prompt or
    completion that is not a ``str`` (named by record); a text the tokenizer cannot
    encode (named by record).
    """
    prompts, completions = _records(tokenizer, prompts, completions)
    completion_only_loss = check_bool("completion_only_loss", completion_only_loss)
    joint = [prompt + completion for prompt, completion in zip(prompts, completions)]
    content, content_offsets = _encode(tokenizer, joint, "prompt + completion")
    tokens, offsets = frame(content, content_offsets, tokenizer.bos_id, tokenizer.eos_id)
    count = len(prompts)
    if completion_only_loss:
        prompt_ids, prompt_offsets = _encode(tokenizer, prompts, "prompt")
        prompt_lengths = np.diff(prompt_offsets)
        prefix = _common_prefix(prompt_ids, prompt_offsets, content, content_offsets)
        mismatched = np.flatnonzero(prefix < prompt_lengths).astype(np.int64)
    else:
        prefix = np.zeros(count, dtype=np.int64)
        mismatched = np.zeros(0, dtype=np.int64)
    lengths = np.diff(offsets)
    supervised = _within(lengths) > np.repeat(prefix, lengths)  # position 0 is BOS
    return SupervisedDocuments(tokens, offsets, supervised, mismatched)


def encode_conversations(tokenizer: TokenizerFile, conversations, *, chat_template: str,
                         assistant_only_loss: bool = True) -> SupervisedDocuments:
    """Each conversation rendered by transformers' ``apply_chat_template(chat_template)``
    in one batched call, framed with BOS and EOS where the rendering lacks them (never
    doubled), supervised on the assistant mask (``assistant_only_loss``) or everywhere.

    The template sees ``bos_token`` and ``eos_token`` as the tokenizer's BOS and EOS. An
    added BOS or EOS is not supervised under ``assistant_only_loss`` (it is outside
    every generation span); the first token never is.

    Refused (:class:`InvalidInputError`): a tokenizer that is not a
    :class:`TokenizerFile`; a template that is not a non-empty ``str``; a conversation
    that is not a non-empty list of messages (dicts with a ``str`` ``"role"``), named
    by index; a conversation the template fails on (named); under
    ``assistant_only_loss``, a template without ``{% generation %}`` and a conversation
    with no supervised assistant token (named by index).
    """
    _check_tokenizer(tokenizer)
    assistant_only_loss = check_bool("assistant_only_loss", assistant_only_loss)
    conversations = _conversations(conversations)
    if not isinstance(chat_template, str) or not chat_template.strip():
        raise InvalidInputError(f"chat_template must be the template's text (a non-empty str), "
                                f"not {chat_template!r:.60}")
    if assistant_only_loss and not GENERATION_MARKER.search(chat_template):
        raise InvalidInputError("assistant_only_loss needs a chat template that marks the assistant's tokens with "
                                "{% generation %} ... {% endgeneration %}; this template has no generation block")
    if not conversations:
        return _empty()
    ids, masks = _render(tokenizer, conversations, chat_template, assistant_only_loss)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    rendered_offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=rendered_offsets[1:])
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(rendered_offsets[-1]))
    tokens, offsets, placed = _frame_where_missing(flat, rendered_offsets, tokenizer.bos_id, tokenizer.eos_id)
    if assistant_only_loss:
        supervised = np.zeros(tokens.shape[0], dtype=bool)
        supervised[placed] = np.fromiter(chain.from_iterable(masks), dtype=bool, count=flat.shape[0])
    else:
        supervised = np.ones(tokens.shape[0], dtype=bool)
    supervised[offsets[:-1]] = False
    if assistant_only_loss:
        unsupervised = np.flatnonzero(target_counts(supervised, offsets[:-1], offsets[1:]) == 0)
        if unsupervised.size:
            index = int(unsupervised[0])
            every = (f" (none of the {len(conversations)} conversations has one: does the template's "
                     f"{{% generation %}} block enclose the assistant messages?)"
                     if unsupervised.size == len(conversations) > 1 else "")
            roles = ", ".join(str(message["role"]) for message in conversations[index])
            raise RecordError("conversation", index, f"no assistant token to supervise under "
                              f"assistant_only_loss (its roles: {roles}){every}")
    return SupervisedDocuments(tokens, offsets, supervised, np.zeros(0, dtype=np.int64))


def _check_tokenizer(tokenizer) -> None:
    if not isinstance(tokenizer, TokenizerFile):
        raise InvalidInputError(f"tokenizer must be a seqpack.io.TokenizerFile, not {type(tokenizer).__name__}")


def _records(tokenizer, prompts, completions) -> tuple[list[str], list[str]]:
    _check_tokenizer(tokenizer)
    prompts, completions = _texts("prompts", prompts), _texts("completions", completions)
    if len(prompts) != len(completions):
        raise InvalidInputError(f"{len(prompts)} prompts but {len(completions)} completions: one of each per record")
    for name, texts in (("prompt", prompts), ("completion", completions)):
        if not set(map(type, texts)) <= {str}:
            index = next(i for i, text in enumerate(texts) if not isinstance(text, str))
            raise RecordError("record", index, f"the {name} must be a str, not {type(texts[index]).__name__}")
    return prompts, completions


def _texts(name: str, values) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise InvalidInputError(f"{name} must be a sequence of str (one per record), not {type(values).__name__}")
    return list(values)


def _encode(tokenizer: TokenizerFile, texts: list[str], what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        return tokenizer.encode(texts)
    except TokenizerFailure as failure:
        if failure.index is not None:
            raise RecordError("record", failure.index, f"its {what}: {failure}") from None
        raise InvalidInputError(f"the records' {what} texts: {failure}") from None


def _within(lengths: np.ndarray) -> np.ndarray:
    """Each flat entry's position inside its segment, for segments of ``lengths``."""
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    return np.arange(total, dtype=np.int64) - np.repeat(ends - lengths, lengths)


def _common_prefix(ids: np.ndarray, offsets: np.ndarray, other: np.ndarray, other_offsets: np.ndarray) -> np.ndarray:
    """Per record, the common prefix length of ``ids`` and ``other`` (both flat with
    offsets), compared over the first ``min`` of their lengths in one vectorized pass."""
    compared = np.minimum(np.diff(offsets), np.diff(other_offsets))
    step = _within(compared)
    record = np.repeat(np.arange(compared.shape[0]), compared)
    differ = ids[offsets[:-1][record] + step] != other[other_offsets[:-1][record] + step]
    prefix = compared.astype(np.int64)
    where = np.flatnonzero(differ)
    if where.size:
        records = record[where]
        first = np.concatenate(([True], records[1:] != records[:-1]))  # ``where`` rises: first per record
        prefix[records[first]] = step[where[first]]
    return prefix


def _conversations(values) -> list:
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise InvalidInputError(f"conversations must be a sequence of conversations (lists of messages), "
                                f"not {type(values).__name__}")
    conversations = list(values)
    for index, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise RecordError("conversation", index, f"a conversation is a non-empty list of messages, "
                                                     f"not {conversation!r:.60}")
        for position, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RecordError("conversation", index, f"message {position}: a message is a dict with a "
                                                         f"str 'role' (and its 'content'), not {message!r:.60}")
    return conversations


def _render(tokenizer: TokenizerFile, conversations: list, chat_template: str, assistant_only_loss: bool):
    """``(input_ids, assistant_masks or None)`` lists from one batched ``apply_chat_template``."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise missing_extra("rendering conversations with a chat template", "hf") from None
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer)
    names = {"bos_token": tokenizer.tokenizer.id_to_token(tokenizer.bos_id),
             "eos_token": tokenizer.tokenizer.id_to_token(tokenizer.eos_id)}

    def render(batch, **options):
        return hf.apply_chat_template(batch, chat_template=chat_template, **names, **options)

    try:
        out = render(conversations, tokenize=True, return_dict=True,
                     return_assistant_tokens_mask=assistant_only_loss)
    except Exception as error:  # jinja2 and transformers raise many kinds
        for index, conversation in enumerate(conversations):  # which one: the rare error path pays
            try:
                render([conversation], tokenize=False)
            except Exception as own:
                raise RecordError("conversation", index, f"the chat template failed: {own}") from None
        raise InvalidInputError(f"the chat template failed on these conversations: {error}") from None
    return out["input_ids"], out.get("assistant_masks")


def _frame_where_missing(flat: np.ndarray, offsets: np.ndarray, bos: int, eos: int):
    """``(tokens, offsets, placed)``: each rendered document with BOS put before it unless
    it starts with BOS, and EOS after it unless it ends with an EOS other than that BOS;
    ``placed`` is where each rendered token went."""
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    first = flat[np.minimum(offsets[:-1], max(flat.shape[0] - 1, 0))] if flat.size else np.zeros_like(lengths)
    last = flat[offsets[1:] - 1] if flat.size else np.zeros_like(lengths)
    has_bos = nonempty & (first == bos)
    has_eos = (lengths > has_bos) & (last == eos)
    add_bos, add_eos = ~has_bos, ~has_eos
    framed = np.zeros_like(offsets)
    np.cumsum(lengths + add_bos + add_eos, out=framed[1:])
    placed = np.arange(flat.shape[0], dtype=np.int64) + np.repeat(framed[:-1] - offsets[:-1] + add_bos, lengths)
    tokens = np.empty(int(framed[-1]), dtype=np.int32)
    tokens[placed] = flat
    tokens[framed[:-1][add_bos]] = bos
    tokens[framed[1:][add_eos] - 1] = eos
    return tokens, framed, placed


def _empty() -> SupervisedDocuments:
    nothing = np.zeros(0, dtype=np.int64)
    return SupervisedDocuments(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, bool), nothing)
