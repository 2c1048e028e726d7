"""Supervised fine-tuning records as documents with a supervision array, encoded
exactly as TRL 1.16's ``SFTTrainer`` encodes them, so that a user's IDs and masks do
not change when seqpack packs them:

- prompt-completion: the EOS text is appended to the completion unless it ends with
  it; the document is ``tokenizer(prompt + completion)`` with the tokenizer's own special
  tokens (a BOS where its post-processor adds one, none for GPT-2- or Qwen-style files),
  and the completion begins at the common prefix of ``tokenizer(prompt)`` and that joint
  encoding (TRL's ``common_prefix_length``): a token merged across the boundary is the
  completion's.
- conversations: rendered and tokenized by transformers' ``apply_chat_template``, with
  the record's ``tools`` and ``chat_template_kwargs``; the template alone decides BOS
  and every EOS (one per turn, say). The assistant mask (the template's
  ``{% generation %}`` spans) is the supervision under ``assistant_only_loss``.
- conversational prompt-completion: the prompt rendered with
  ``add_generation_prompt=True``, the joint conversation without; the completion begins
  at their common prefix.

Documents are taken as given (no BOS or EOS added; an EOS inside is content).
``supervised[j]`` says whether token ``j``, as a target, counts in the loss (the
``supervised`` array of :meth:`seqpack.ExampleTable.from_arrays`); a document's first
token is never a target, so its value is always False. Rendering is bounded per record
(:mod:`seqpack.io.templates`). The helpers without a leading underscore are shared with
:mod:`seqpack.io.preference_encoders` (TRL's ``DPOTrainer`` records).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import chain

import numpy as np

from .._arguments import check_bool
from ..data.supervision import target_counts
from ..errors import InvalidInputError
from .tokenizer_file import TokenizerFailure, TokenizerFile
from .readers import missing_extra
from .templates import TemplateLimitError, TemplateLimits, bounded_rendering

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
    """Documents as given and their supervision.

    ``tokens`` int32 ``[N]`` and ``offsets`` int64 ``[documents + 1]`` (one per record, or
    two per preference pair); ``supervised`` bool ``[N]``; ``mismatched`` int64: the
    documents (of a pair, its first) whose prompt encoding is not a prefix of their joint
    encoding (TRL warns once about them).
    """

    tokens: np.ndarray
    offsets: np.ndarray
    supervised: np.ndarray
    mismatched: np.ndarray


def encode_prompt_completion(tokenizer: TokenizerFile, prompts, completions, *,
                             completion_only_loss: bool = True) -> SupervisedDocuments:
    """Each record as ``tokenizer(prompt + completion + EOS text)`` (no EOS text added when
    the completion ends with it), supervised from the completion's first token on, TRL
    1.16's rule. With ``completion_only_loss=False`` every target is supervised. Texts
    are encoded in two ``encode_batch_fast`` calls (joint texts, prompts).

    Refused (:class:`InvalidInputError`): a tokenizer that is not a
    :class:`TokenizerFile`; prompts and completions of different lengths; a prompt or
    completion that is not a ``str`` (named by record); a text the tokenizer cannot
    encode (named by record).
    """
    prompts, completions = check_texts(tokenizer, {"prompts": prompts, "completions": completions})
    completion_only_loss = check_bool("completion_only_loss", completion_only_loss)
    eos = tokenizer.token_text(tokenizer.eos_id)
    joint = [prompt + (completion if completion.endswith(eos) else completion + eos)
             for prompt, completion in zip(prompts, completions)]
    tokens, offsets = encode_texts(tokenizer, joint, "prompt + completion")
    if completion_only_loss:
        prompt_ids, prompt_offsets = encode_texts(tokenizer, prompts, "prompt")
        return _completion_supervised(tokens, offsets, prompt_ids, prompt_offsets)
    return _supervised_everywhere(tokens, offsets)


def encode_conversations(tokenizer: TokenizerFile, conversations, *, chat_template: str,
                         assistant_only_loss: bool = True, tools=None, template_kwargs=None,
                         limits: TemplateLimits = TemplateLimits()) -> SupervisedDocuments:
    """Each conversation rendered and tokenized by transformers'
    ``apply_chat_template(chat_template)`` as it is, supervised on the assistant mask
    (``assistant_only_loss``) or everywhere. ``tools`` and ``template_kwargs`` (None, or
    one entry per conversation: its tools and its ``chat_template_kwargs``) go to the
    template as TRL passes them. The template sees ``bos_token`` and ``eos_token`` as the
    tokenizer's.

    Refused (:class:`InvalidInputError`): a tokenizer that is not a
    :class:`TokenizerFile`; a template that is not a non-empty ``str``; a conversation
    that is not a non-empty list of messages (dicts with a ``str`` ``"role"``), named
    by index; a conversation the template or the tokenizer fails on, or whose rendering
    passes ``limits`` (named); under ``assistant_only_loss``, a template without
    ``{% generation %}`` and a conversation with no supervised assistant token (named by
    index).
    """
    check_template(tokenizer, chat_template, assistant_only_loss)
    conversations = check_conversations(conversations, "conversations")
    if not conversations:
        return no_documents()
    ids, masks = render_conversations(tokenizer, conversations, chat_template, limits, tools, template_kwargs,
                         assistant_masks=assistant_only_loss)
    tokens, offsets = flat_ids(ids)
    if not assistant_only_loss:
        return _supervised_everywhere(tokens, offsets)
    supervised = np.fromiter(chain.from_iterable(masks), dtype=bool, count=tokens.shape[0])
    _no_first_targets(supervised, offsets)
    _check_assistant_tokens(supervised, offsets, conversations)
    return SupervisedDocuments(tokens, offsets, supervised, np.zeros(0, np.int64))


def encode_conversational_prompt_completion(
        tokenizer: TokenizerFile, prompts, completions, *, chat_template: str, completion_only_loss: bool = True,
        assistant_only_loss: bool = False, tools=None, template_kwargs=None,
        limits: TemplateLimits = TemplateLimits()) -> SupervisedDocuments:
    """Conversational prompt-completion records (prompt and completion are lists of
    messages) as TRL 1.16 encodes them: the document is the joint conversation rendered
    by ``chat_template``; the completion begins at the common prefix of the prompt
    rendered with ``add_generation_prompt=True`` and that document. ``completion_only_loss``
    supervises the completion only, ``assistant_only_loss`` the template's generation
    spans only (both: their intersection). Refused: as :func:`encode_conversations`, and
    a record with no supervised target (named)."""
    check_template(tokenizer, chat_template, assistant_only_loss)
    completion_only_loss = check_bool("completion_only_loss", completion_only_loss)
    prompts = check_conversations(prompts, "prompts")
    completions = check_conversations(completions, "completions")
    check_counts({"prompts": prompts, "completions": completions})
    if not prompts:
        return no_documents()
    joint = [list(prompt) + list(completion) for prompt, completion in zip(prompts, completions)]
    ids, masks = render_conversations(tokenizer, joint, chat_template, limits, tools, template_kwargs,
                         assistant_masks=assistant_only_loss)
    tokens, offsets = flat_ids(ids)
    if completion_only_loss:
        prompt_ids, prompt_offsets = flat_ids(render_conversations(tokenizer, prompts, chat_template, limits, tools,
                                                                   template_kwargs, generation_prompt=True)[0])
        result = _completion_supervised(tokens, offsets, prompt_ids, prompt_offsets)
    else:
        result = _supervised_everywhere(tokens, offsets)
    if assistant_only_loss:
        np.logical_and(result.supervised, np.fromiter(chain.from_iterable(masks), dtype=bool, count=tokens.shape[0]),
                       out=result.supervised)
        _check_assistant_tokens(result.supervised, offsets, joint)
    return result


def check_tokenizer(tokenizer) -> None:
    if not isinstance(tokenizer, TokenizerFile):
        raise InvalidInputError(f"tokenizer must be a seqpack.io.TokenizerFile, not {type(tokenizer).__name__}")


def check_template(tokenizer, chat_template, assistant_only_loss) -> None:
    check_tokenizer(tokenizer)
    assistant_only_loss = check_bool("assistant_only_loss", assistant_only_loss)
    if not isinstance(chat_template, str) or not chat_template.strip():
        raise InvalidInputError(f"chat_template must be the template's text (a non-empty str), "
                                f"not {chat_template!r:.60}")
    if assistant_only_loss and not GENERATION_MARKER.search(chat_template):
        raise InvalidInputError("assistant_only_loss needs a chat template that marks the assistant's tokens with "
                                "{% generation %} ... {% endgeneration %}; this template has no generation block")


def check_texts(tokenizer, columns: dict) -> list[list[str]]:
    """``columns`` (``{plural name: one str per record}``, such as ``prompts`` and
    ``completions``) as lists of equal length, for a :class:`TokenizerFile`; a value that
    is not a ``str`` (a subclass is read as one) is named by record."""
    check_tokenizer(tokenizer)
    texts = {name: _sequence(name, values, "str") for name, values in columns.items()}
    check_counts(texts)
    for name, values in texts.items():
        if not set(map(type, values)) <= {str}:
            index = next((i for i, text in enumerate(values) if not isinstance(text, str)), None)
            if index is not None:
                raise RecordError("record", index, f"the {name.removesuffix('s')} must be a str, not "
                                                   f"{type(values[index]).__name__}")
            texts[name] = [str(text) for text in values]   # a str subclass (numpy's str_) as a plain str
    return list(texts.values())


def check_counts(columns: dict) -> None:
    """Every column (``{plural name: values}``) has one value per record."""
    counts = [f"{len(values)} {name}" for name, values in columns.items()]
    if len({len(values) for values in columns.values()}) > 1:
        raise InvalidInputError(f"{', '.join(counts[:-1])} but {counts[-1]}: one of each per record")


def _sequence(name: str, values, what: str) -> list:
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise InvalidInputError(f"{name} must be a sequence of {what}, one per record, not {type(values).__name__}")
    return list(values)


def encode_texts(tokenizer: TokenizerFile, texts: list[str], what: str) -> tuple[np.ndarray, np.ndarray]:
    """``tokenizer(text)`` of every text (special tokens added), as int32 with offsets."""
    try:
        ids, offsets = tokenizer.encode(texts, special_tokens=True)
    except TokenizerFailure as failure:
        if failure.index is not None:
            raise RecordError("record", failure.index, f"its {what}: {failure}") from None
        raise InvalidInputError(f"the records' {what} texts: {failure}") from None
    return ids.astype(np.int32), offsets


def flat_ids(ids: list) -> tuple[np.ndarray, np.ndarray]:
    """Lists of IDs as int32 values back to back with int64 offsets."""
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(row) for row in ids], out=offsets[1:])
    return np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(offsets[-1])), offsets


def positions_within(lengths: np.ndarray) -> np.ndarray:
    """Each flat entry's position inside its segment, for segments of ``lengths``."""
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if ends.size else 0
    return np.arange(total, dtype=np.int64) - np.repeat(ends - lengths, lengths)


def common_prefix(ids: np.ndarray, offsets: np.ndarray, other: np.ndarray, other_offsets: np.ndarray) -> np.ndarray:
    """Per record, the common prefix length of ``ids`` and ``other`` (both flat with
    offsets), compared over the first ``min`` of their lengths in one vectorized pass."""
    compared = np.minimum(np.diff(offsets), np.diff(other_offsets))
    step = positions_within(compared)
    record = np.repeat(np.arange(compared.shape[0]), compared)
    differ = ids[offsets[:-1][record] + step] != other[other_offsets[:-1][record] + step]
    prefix = compared.astype(np.int64)
    where = np.flatnonzero(differ)
    if where.size:
        records = record[where]
        first = np.concatenate(([True], records[1:] != records[:-1]))  # ``where`` rises: first per record
        prefix[records[first]] = step[where[first]]
    return prefix


def _completion_supervised(tokens, offsets, prompt_ids, prompt_offsets) -> SupervisedDocuments:
    """TRL's completion mask: ``[0] * common prefix + [1] * rest`` of each document."""
    prefix = common_prefix(prompt_ids, prompt_offsets, tokens, offsets)
    mismatched = np.flatnonzero(prefix < np.diff(prompt_offsets)).astype(np.int64)
    return SupervisedDocuments(tokens, offsets, supervised_from(offsets, prefix), mismatched)


def supervised_from(offsets: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """bool per token: each document's tokens from position ``starts[d]`` on, but never
    its first token (no target)."""
    lengths = np.diff(offsets)
    supervised = positions_within(lengths) >= np.repeat(starts, lengths)
    supervised[offsets[:-1][lengths > 0]] = False
    return supervised


def _supervised_everywhere(tokens, offsets) -> SupervisedDocuments:
    supervised = np.ones(tokens.shape[0], dtype=bool)
    _no_first_targets(supervised, offsets)
    return SupervisedDocuments(tokens, offsets, supervised, np.zeros(0, np.int64))


def _no_first_targets(supervised: np.ndarray, offsets: np.ndarray) -> None:
    """A document's first token is no target (an empty document has none)."""
    supervised[offsets[:-1][np.diff(offsets) > 0]] = False


def _check_assistant_tokens(supervised: np.ndarray, offsets: np.ndarray, conversations: list) -> None:
    """Under ``assistant_only_loss`` every record needs an assistant token (TRL raises too)."""
    unsupervised = np.flatnonzero(target_counts(supervised, offsets[:-1], offsets[1:]) == 0)
    if unsupervised.size:
        index = int(unsupervised[0])
        every = (f" (none of the {len(conversations)} conversations has one: does the template's "
                 f"{{% generation %}} block enclose the assistant messages?)"
                 if unsupervised.size == len(conversations) > 1 else "")
        roles = ", ".join(str(message["role"]) for message in conversations[index])
        raise RecordError("conversation", index, f"no assistant token to supervise under "
                          f"assistant_only_loss (its roles: {roles}){every}")


def check_conversations(values, name: str) -> list:
    """``values`` (named ``name``) as a list of conversations: non-empty lists of dicts
    with a ``str`` ``"role"``; a bad one is named by index."""
    conversations = _sequence(name, values, "conversations (lists of messages)")
    for index, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise RecordError("conversation", index, f"a conversation is a non-empty list of messages, "
                                                     f"not {conversation!r:.60}")
        for position, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                hint = (" (ShareGPT's 'from'/'value' messages need renaming to 'role'/'content' first)"
                        if isinstance(message, dict) and "from" in message and "value" in message else "")
                raise RecordError("conversation", index, f"message {position}: a message is a dict with a "
                                                         f"str 'role', not {message!r:.60}{hint}")
    return conversations


def per_record(values, count: int, name: str) -> list:
    """``values`` (None, or one entry per record) as a list of ``count`` entries."""
    if values is None:
        return [None] * count
    values = list(values)
    if len(values) != count:
        raise InvalidInputError(f"{name} has {len(values)} entries for {count} records")
    return values


def render_conversations(tokenizer: TokenizerFile, conversations: list, chat_template: str, limits: TemplateLimits,
            tools=None, template_kwargs=None, *, assistant_masks: bool = False, generation_prompt: bool = False):
    """``(input_ids, assistant_masks or None)`` lists, as TRL's ``_tokenize`` gets them from
    ``apply_chat_template``: one batched call when no record has tools or template
    options, else a call per record (their options differ)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise missing_extra("rendering conversations with a chat template", "hf") from None
    count = len(conversations)
    tools, options = per_record(tools, count, "tools"), per_record(template_kwargs, count, "template_kwargs")
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer, bos_token=tokenizer.token_text(tokenizer.bos_id),
                                 eos_token=tokenizer.token_text(tokenizer.eos_id))

    def render(batch, tools_of, options_of, **rendering):
        # TRL's call: a record's chat_template_kwargs override chat_template and tools; what the
        # call sets itself (a prompt's generation prompt, tokenizing) fails in TRL when set twice.
        arguments = {"chat_template": chat_template, "tools": tools_of, **(options_of or {})}
        if generation_prompt:
            rendering["add_generation_prompt"] = True
        twice = sorted(rendering.keys() & arguments.keys())
        if twice:
            raise ValueError(f"chat_template_kwargs sets {', '.join(twice)}, which TRL's own call sets too (TRL "
                             f"fails on this record)")
        with bounded_rendering(chat_template, seconds=limits.seconds, characters=limits.characters):
            return hf.apply_chat_template(batch, **arguments, **rendering)

    full = {"tokenize": True, "return_dict": True, "return_assistant_tokens_mask": assistant_masks}
    if all(t is None for t in tools) and not any(options):
        groups = [(list(range(count)), None, None)]
    else:
        groups = [([index], tools[index], options[index]) for index in range(count)]
    ids, masks = [], []
    for indices, tools_of, options_of in groups:
        batch = [conversations[index] for index in indices]
        try:
            out = render(batch, tools_of, options_of, **full)
        except TemplateLimitError as error:
            raise RecordError("conversation", indices[error.index], f"the chat template {error.detail}") from None
        except Exception as error:  # jinja2, transformers and tokenizers raise many kinds
            raise _which_failed(render, batch, indices, tools_of, options_of, full, error) from None
        ids.extend(out["input_ids"])
        masks.extend(out.get("assistant_masks") or [])
    return ids, (masks if assistant_masks else None)


def _which_failed(render, batch, indices, tools_of, options_of, full, error) -> InvalidInputError:
    """The conversation a failed call failed on, and whether the template or the
    tokenizer failed (the rare error path renders each alone)."""
    for position, conversation in enumerate(batch):
        index = indices[position]
        try:
            render([conversation], tools_of, options_of, tokenize=False)
        except TemplateLimitError as limit:
            return RecordError("conversation", index, f"the chat template {limit.detail}")
        except Exception as own:
            return RecordError("conversation", index, f"the chat template failed: {own}")
        try:
            render([conversation], tools_of, options_of, **full)
        except Exception as own:
            return RecordError("conversation", index, f"the tokenizer failed on its rendered text: {own}")
    return InvalidInputError(f"the chat template failed on these conversations together: {error}")


def no_documents() -> SupervisedDocuments:
    nothing = np.zeros(0, dtype=np.int64)
    return SupervisedDocuments(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, bool), nothing)
