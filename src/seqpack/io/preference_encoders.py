"""Preference pairs (TRL's DPO records) as documents with a supervision array, encoded
exactly as TRL 1.16's ``DPOTrainer._prepare_dataset`` encodes them.

Record ``p`` is two documents: ``2p`` (prompt + chosen) then ``2p + 1`` (prompt +
rejected), each supervised on its completion only (TRL's ``completion_mask``; a
document's first token is never a target):

- strings: the EOS text is appended to chosen and rejected unless they end with it;
  the pair's cut is the shorter of the common prefixes of ``tokenizer(prompt)`` with
  ``tokenizer(prompt + chosen)`` and with ``tokenizer(prompt + rejected)``. TRL's
  ``prompt_ids`` are the prompt's first ``cut`` tokens, which begin both joint
  encodings, and each completion's IDs the rest of its joint encoding: so each document
  is its joint encoding, supervised from the cut on.
- lists of messages: the same, the prompt rendered by the chat template with
  ``add_generation_prompt=True`` and the joint conversations without, with the record's
  ``tools`` and ``chat_template_kwargs``; no EOS added (the template writes it).
- implicit prompt (chosen and rejected alone): the prompt is their shared beginning,
  cut as TRL's ``extract_prompt`` cuts it (:func:`extract_prompt`).
- pre-tokenized (``prompt_ids``, ``chosen_ids``, ``rejected_ids``): document ``2p`` is
  ``prompt_ids + chosen_ids``, supervised on ``chosen_ids``, as TRL's
  ``DataCollatorForPreference`` joins them.

A pair whose cut falls inside its prompt (tokens merged across the boundary, or a
template that renders the prompt alone differently) is mismatched: its chosen document
is listed in ``mismatched`` (TRL warns once), and the end of its prompt is in neither
document. A pair is never split: a completion without a token is an error naming the
record.

Lengths: ``DPOConfig`` defaults to ``max_length=1024`` with ``truncation_mode="keep_start"``,
so TRL drops a record whose prompt alone has 1024 tokens or more, and its collator keeps
the first 1024 tokens of each sequence. seqpack never truncates or drops a pair: one
longer than a row is refused when packed. Give TRL ``max_length=None`` for the same
sequences.
"""

from __future__ import annotations

import numpy as np

from .record_encoders import (
    RecordError,
    SupervisedDocuments,
    check_conversations,
    check_counts,
    check_template,
    check_texts,
    common_prefix,
    encode_texts,
    flat_ids,
    no_documents,
    per_record,
    positions_within,
    render_conversations,
    supervised_from,
)
from .templates import TemplateLimits
from .tokenizer_file import TokenizerFile

#: A pair's completions, in the order of its documents.
SIDES = ("chosen", "rejected")


def extract_prompt(chosen, rejected) -> tuple:
    """``(prompt, chosen, rejected)`` of a record whose prompt is implicit (two non-empty
    strings, or lists of messages), cut where TRL 1.16's ``extract_prompt`` cuts: at the
    first position where they differ, or one earlier when chosen has a space there
    (the space goes with the completions); when one begins the other, before their last
    shared item. TRL's corner is kept too: when their first characters differ and chosen
    ends with a space, the cut is before chosen's last character."""
    shared = min(len(chosen), len(rejected))
    same = _common_length(chosen, rejected, shared)
    if same == shared:  # TRL's loop ends on the last position it compared
        cut = shared - 1
    elif chosen[same - 1] == " ":  # at 0 this reads chosen[-1]: TRL's index turns negative
        cut = same - 1
    else:
        cut = same
    return chosen[:cut], chosen[cut:], rejected[cut:]


def _common_length(first, second, limit: int) -> int:
    """The length of the common prefix of two sequences of at least ``limit`` items,
    found by bisection on slices (C comparisons, not a Python step per character)."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _extracted(chosen: list, rejected: list, *, messages: bool) -> tuple[list, list, list]:
    """Each record's prompt, chosen and rejected by :func:`extract_prompt`. An empty
    chosen or rejected (TRL fails on it) and, for messages, an empty prompt (nothing
    for the template to render) are errors naming the record."""
    extracted = []
    for index, pair in enumerate(zip(chosen, rejected)):
        for side, value in zip(SIDES, pair):
            if not value:
                raise RecordError("record", index, f"its {side} is empty: with no prompt given, the prompt is "
                                                   f"the shared beginning of chosen and rejected")
        prompt, first, second = extract_prompt(*pair)
        if messages and not prompt:
            raise RecordError("record", index, f"its chosen and rejected conversations ({len(pair[0])} and "
                                               f"{len(pair[1])} messages) leave no prompt: TRL's extract_prompt "
                                               f"takes their shared leading messages, never all of the shorter")
        extracted.append((prompt, first, second))
    return tuple(list(column) for column in zip(*extracted)) if extracted else ([], [], [])


def encode_preference(tokenizer: TokenizerFile, prompts, chosen, rejected) -> SupervisedDocuments:
    """Preference records of strings as TRL 1.16's ``DPOTrainer`` encodes them (see the
    module): documents ``2p`` (``tokenizer(prompt + chosen + EOS text)``) and ``2p + 1``
    (the same with rejected), the EOS text added unless the completion ends with it, each
    supervised from the pair's cut on. ``prompts`` None: each prompt is implicit
    (:func:`extract_prompt`). Texts are encoded in three ``encode_batch_fast`` calls.

    Refused (:class:`InvalidInputError`): a tokenizer that is not a :class:`TokenizerFile`;
    columns of different lengths; a value that is not a ``str``, an empty chosen or
    rejected with an implicit prompt, a text the tokenizer cannot encode, a completion
    left without a token (each named by record).
    """
    columns = {"chosen": chosen, "rejected": rejected}
    if prompts is not None:
        columns = {"prompts": prompts, **columns}
    *given, chosen, rejected = check_texts(tokenizer, columns)
    prompts, chosen, rejected = (given[0], chosen, rejected) if given else \
        _extracted(chosen, rejected, messages=False)
    eos = tokenizer.token_text(tokenizer.eos_id)
    encoded = [encode_texts(tokenizer, prompts, "prompt")]
    for side, completions in zip(SIDES, (chosen, rejected)):
        joint = [prompt + (text if text.endswith(eos) else text + eos) for prompt, text in zip(prompts, completions)]
        encoded.append(encode_texts(tokenizer, joint, f"prompt + {side}"))
    return _cut(*encoded)


def encode_conversational_preference(tokenizer: TokenizerFile, prompts, chosen, rejected, *, chat_template: str,
                                     tools=None, template_kwargs=None,
                                     limits: TemplateLimits = TemplateLimits()) -> SupervisedDocuments:
    """Preference records of messages as TRL 1.16's ``DPOTrainer`` encodes them (see the
    module): documents ``2p`` (prompt + chosen messages) and ``2p + 1`` (prompt +
    rejected) rendered and tokenized by ``chat_template``, each supervised from the
    pair's cut on, where the prompt is rendered with ``add_generation_prompt=True``.
    ``prompts`` None: each prompt is implicit (:func:`extract_prompt`). ``tools`` and
    ``template_kwargs`` (None, or one entry per record) go to the template as TRL passes
    them.

    Refused (:class:`InvalidInputError`): as
    :func:`~seqpack.io.record_encoders.encode_conversations` refuses a tokenizer, a
    template, a conversation or its rendering (named by record and by what was rendered:
    ``prompt``, ``prompt + chosen``, ``prompt + rejected``); columns of different
    lengths; with an implicit prompt, chosen and rejected that share no leading message;
    a completion left without a token.
    """
    check_template(tokenizer, chat_template, False)
    columns = {"chosen": chosen, "rejected": rejected}
    if prompts is not None:
        columns = {"prompts": prompts, **columns}
    for name, values in columns.items():
        try:
            columns[name] = check_conversations(values, name)
        except RecordError as error:
            raise RecordError("record", error.index, f"its {name.removesuffix('s')}: {error.detail}") from None
    check_counts(columns)
    *given, chosen, rejected = columns.values()
    prompts, chosen, rejected = (given[0], chosen, rejected) if given else \
        _extracted(chosen, rejected, messages=True)
    if not chosen:
        return no_documents()
    template = (chat_template, limits, per_record(tools, len(chosen), "tools"),
                per_record(template_kwargs, len(chosen), "template_kwargs"))
    rendered = [_rendered(tokenizer, prompts, "prompt", *template, generation_prompt=True)]
    for side, completions in zip(SIDES, (chosen, rejected)):
        joint = [list(prompt) + list(messages) for prompt, messages in zip(prompts, completions)]
        rendered.append(_rendered(tokenizer, joint, f"prompt + {side}", *template))
    return _cut(*rendered)


def encode_preference_ids(prompt_ids: tuple, chosen_ids: tuple, rejected_ids: tuple) -> SupervisedDocuments:
    """Pre-tokenized preference records as TRL 1.16's ``DataCollatorForPreference`` joins
    them: document ``2p`` is ``prompt_ids + chosen_ids`` and ``2p + 1`` ``prompt_ids +
    rejected_ids``, each supervised on its completion. Each argument is ``(values,
    offsets)``: flat integer IDs (already checked to fit int32) and int64 offsets, one row
    per record. Refused (:class:`InvalidInputError`): rows of different counts; an empty
    ``chosen_ids`` or ``rejected_ids`` (named by record: a pair is never skipped)."""
    rows = {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
    check_counts({name: offsets[1:] for name, (_, offsets) in rows.items()})
    for side in SIDES:
        empty = np.flatnonzero(np.diff(rows[f"{side}_ids"][1]) == 0)
        if empty.size:
            raise RecordError("record", int(empty[0]), f"field '{side}_ids' is empty: each completion needs a token")
    tokens, offsets = _documents(chosen_ids, rejected_ids, prompt_ids)
    starts = np.repeat(np.diff(prompt_ids[1]), 2)
    return SupervisedDocuments(tokens, offsets, supervised_from(offsets, starts), np.zeros(0, np.int64))


def _rendered(tokenizer, conversations: list, what: str, chat_template: str, limits: TemplateLimits, tools: list,
              options: list, *, generation_prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The conversations rendered and tokenized (flat with offsets); a failure names the
    record and ``what`` was rendered."""
    try:
        ids, _ = render_conversations(tokenizer, conversations, chat_template, limits, tools, options,
                                      generation_prompt=generation_prompt)
    except RecordError as error:
        raise RecordError("record", error.index, f"its {what}: {error.detail}") from None
    return flat_ids(ids)


def _cut(prompt: tuple, chosen: tuple, rejected: tuple) -> SupervisedDocuments:
    """Each pair's two joint encodings (``chosen`` and ``rejected``, flat with offsets) as
    its documents, supervised from the pair's cut on: the shorter common prefix of each
    with the ``prompt`` encoding (TRL's ``prompt_len``)."""
    cut = np.minimum(common_prefix(*prompt, *chosen), common_prefix(*prompt, *rejected))
    tokens, offsets = _documents(chosen, rejected)
    starts = np.repeat(cut, 2)
    empty = np.flatnonzero(np.diff(offsets) <= starts)
    if empty.size:
        document = int(empty[0])
        raise RecordError("record", document // 2, f"its {SIDES[document % 2]} completion has no token: its "
                                                   f"{int(offsets[document + 1] - offsets[document])} tokens all "
                                                   f"begin the prompt's encoding")
    mismatched = 2 * np.flatnonzero(cut < np.diff(prompt[1])).astype(np.int64)
    return SupervisedDocuments(tokens, offsets, supervised_from(offsets, starts), mismatched)


def _documents(chosen: tuple, rejected: tuple, prompt: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Documents ``2p`` (row ``p`` of ``prompt``, when given, then row ``p`` of ``chosen``)
    and ``2p + 1`` (the same with ``rejected``), each argument flat values with offsets,
    as int32 values back to back with int64 offsets."""
    parts = [chosen, rejected] + ([prompt] if prompt is not None else [])
    values = [np.asarray(part[0]).astype(np.int32, copy=False) for part in parts]
    bases = np.cumsum([0] + [array.shape[0] for array in values[:-1]])
    starts = [base + offsets[:-1] for base, (_, offsets) in zip(bases, parts)]
    lengths = [np.diff(offsets) for _, offsets in parts]
    order = (2, 0, 2, 1) if prompt is not None else (0, 1)  # each pair's pieces, in the order of its documents
    piece_starts = np.stack([starts[i] for i in order], axis=1).ravel()
    piece_lengths = np.stack([lengths[i] for i in order], axis=1).ravel()
    tokens = np.concatenate(values)[np.repeat(piece_starts, piece_lengths) + positions_within(piece_lengths)]
    document_lengths = piece_lengths.reshape(-1, len(order) // 2).sum(axis=1)
    offsets = np.zeros(document_lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(document_lengths, out=offsets[1:])
    return tokens, offsets
