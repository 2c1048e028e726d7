"""What a record of a structured input (JSONL, Parquet, Arrow) is, by TRL 1.16's rules.

A record's kind follows from its fields, in TRL's precedence: token IDs
(``input_ids``, with every mask field it carries; then a preference pair's
``prompt_ids``, ``chosen_ids`` and ``rejected_ids``), then ``prompt`` and ``completion``,
then a preference pair (TRL's DPO formats: ``prompt``, ``chosen`` and ``rejected``, or
``chosen`` and ``rejected`` alone, their prompt implicit), then ``messages``, then
``text``. Prompts, completions, chosen and rejected are strings, or lists of messages
(a conversational record, known by its ``prompt``, else its ``chosen``). A field named by
the user (``--text-field``, ``--ids-field``) decides instead. Messages keep every key
they have (a tool call's ``tool_calls``, a tool's ``name``), and a record's ``tools``
and ``chat_template_kwargs`` go to the chat template as TRL passes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...errors import InvalidInputError

#: The supervision fields read beside token IDs, by name: ``completion_mask`` and
#: ``assistant_masks`` (1 = supervised), ``labels`` (-100 = unsupervised).
MASK_COLUMNS = ("completion_mask", "assistant_masks", "labels")
#: The record kinds found by their field names, in TRL's order of precedence after token IDs.
KIND_FIELDS = {"prompt-completion": ("prompt", "completion"), "preference": ("prompt", "chosen", "rejected"),
               "implicit-prompt preference": ("chosen", "rejected"), "conversation": ("messages",),
               "text": ("text",)}
#: A pre-tokenized preference pair's fields (TRL's ``DataCollatorForPreference`` reads them);
#: ``chosen_ids`` and ``rejected_ids`` make the kind, and all three must be there.
PREFERENCE_IDS = ("prompt_ids", "chosen_ids", "rejected_ids")
#: Fields a conversation's record may carry for its chat template.
TEMPLATE_FIELDS = ("tools", "chat_template_kwargs")
#: The kinds whose strings may instead be lists of messages, by the field that tells.
MESSAGE_FIELD = {"prompt-completion": "prompt", "preference": "prompt", "implicit-prompt preference": "chosen"}
#: The record kinds of preference pairs (each record two documents: prompt + chosen, prompt + rejected).
PREFERENCE_KINDS = ("preference", "conversational preference", "implicit-prompt preference",
                    "conversational implicit-prompt preference", "preference-ids")
#: Fields that make a record something seqpack would misread, by name: the reason. Pack
#: ``seq_lengths`` rows and the contexts they join stay joined; an image the text refers to
#: would be dropped. ``seq_lengths`` is refused always; the images only under TRL's
#: precedence (a field named by the user reads that field alone).
REFUSED_FIELDS = {
    "seq_lengths": "the records are rows that TRL's pack_dataset already packed (each joins several "
                   "examples); pack the dataset before pack_dataset",
    "images": "a vision-language record (TRL reads it with a processor); seqpack packs text and token IDs: "
              "name the text or IDs field with --text-field or --ids-field to pack those alone",
    "image": "a vision-language record (TRL reads it with a processor); seqpack packs text and token IDs: "
             "name the text or IDs field with --text-field or --ids-field to pack those alone",
}
#: How errors name the kinds whose name is no phrase.
KIND_NAMES = {"ids": "token-ID", "preference-ids": "token-ID preference"}


@dataclass(frozen=True)
class RecordFields:
    """What a record (or an input's records) is: ``kind`` (``"text"``, ``"ids"``,
    ``"prompt-completion"``, ``"conversational prompt-completion"`` (lists of messages),
    ``"conversation"`` or one of :data:`PREFERENCE_KINDS`), ``fields`` (the text or IDs
    field, ``prompt`` and ``completion``, ``messages``, or a preference pair's),
    ``masks`` (the :data:`MASK_COLUMNS` beside the IDs, in that order) and ``extras``
    (the :data:`TEMPLATE_FIELDS` beside prompts, pairs and conversations)."""

    kind: str
    fields: tuple[str, ...]
    masks: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()

    @property
    def read(self) -> tuple[str, ...]:
        """Every field read: the record's own, its masks, then its template fields."""
        return self.fields + self.masks + self.extras

    @property
    def conversational(self) -> bool:
        """Whether the record is rendered by a chat template."""
        return self.kind == "conversation" or self.kind.startswith("conversational ")

    @property
    def preference(self) -> bool:
        """Whether each record is a preference pair (two documents)."""
        return self.kind in PREFERENCE_KINDS

    @property
    def message_field(self) -> str | None:
        """The field whose being a list of messages makes the record conversational."""
        return MESSAGE_FIELD.get(self.kind)

    @property
    def a_record(self) -> str:
        """The kind as errors name a record of it (``a token-ID record`` for ``ids``)."""
        name = KIND_NAMES.get(self.kind, self.kind)
        return f"{'an' if name[0] in 'aeiou' else 'a'} {name} record"

    def described(self) -> str:
        """``field 'text'`` or ``fields 'prompt' and 'completion'``."""
        names = " and ".join(map(repr, self.fields))
        return f"field{'s' if len(self.fields) > 1 else ''} {names}"

    def as_conversational(self) -> RecordFields:
        """The conversational kind of a prompt-completion or preference record."""
        return RecordFields(f"conversational {self.kind}", self.fields, self.masks, self.extras)


def find_record_fields(names, text_field: str | None, ids_field: str | None, *, where: str,
                       ids_default: str | None = "input_ids") -> RecordFields | None:
    """The fields of a record (or a table) whose field names are ``names``: ``ids_field``
    or ``text_field`` when given, else TRL's precedence (``ids_default`` with the mask
    fields there, :data:`PREFERENCE_IDS` when ``chosen_ids`` and ``rejected_ids`` are
    there, then :data:`KIND_FIELDS` in order); ``None`` when none is there. Whether the
    record is conversational is the caller's to tell (:meth:`RecordFields.as_conversational`).

    Refused (:class:`InvalidInputError`, naming ``where``: the record's or the input's
    place): a field of :data:`REFUSED_FIELDS`, with its reason."""
    names = set(names)
    for field, reason in REFUSED_FIELDS.items():
        if field in names and (field == "seq_lengths" or (text_field is None and ids_field is None)):
            raise InvalidInputError(f"{where}: field {field!r}: {reason}")
    masks = tuple(mask for mask in MASK_COLUMNS if mask in names)
    extras = tuple(extra for extra in TEMPLATE_FIELDS if extra in names)
    if ids_field is not None:
        return RecordFields("ids", (ids_field,), masks)
    if text_field is not None:
        return RecordFields("text", (text_field,))
    if ids_default is not None and ids_default in names:
        return RecordFields("ids", (ids_default,), masks)
    if names.issuperset(PREFERENCE_IDS[1:]):
        return RecordFields("preference-ids", PREFERENCE_IDS)
    for kind, fields in KIND_FIELDS.items():
        if names.issuperset(fields):
            return RecordFields(kind, fields, (), extras if kind != "text" else ())
    return None


def json_kind(value) -> str:
    """The JSON name of a parsed value's type (object, array, string, number...)."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    return "null" if value is None else "number"


def check_messages(value, field: str, where: str) -> list[dict]:
    """``value`` as a conversation: a non-empty list of messages, each an object with a
    string ``role``; every other key (content, tool calls, names) is the template's."""
    if not isinstance(value, list) or not value:
        what = "an empty array" if isinstance(value, list) else f"a JSON {json_kind(value)}"
        raise InvalidInputError(f"{where}: field {field!r} is {what}, not a non-empty list of messages")
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise InvalidInputError(f"{where}: {field}[{index}] is a JSON {json_kind(message)}, not an object "
                                    f"with a 'role'")
        if not isinstance(message.get("role"), str):
            what = "no 'role'" if message.get("role") is None else "a 'role' that is not a string"
            raise InvalidInputError(f"{where}: {field}[{index}] has {what}")
    return value


def template_fields(record: dict, where: str) -> tuple[list | None, dict]:
    """A record's ``tools`` (parsed when a JSON string, as TRL parses it; None when
    absent) and ``chat_template_kwargs`` (an object; empty when absent or null)."""
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as error:
            raise InvalidInputError(f"{where}: field 'tools' is a string but not JSON: {error}") from None
    if tools is not None and not isinstance(tools, list):
        raise InvalidInputError(f"{where}: field 'tools' is a JSON {json_kind(tools)}, not a list of tools")
    options = record.get("chat_template_kwargs")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise InvalidInputError(f"{where}: field 'chat_template_kwargs' is a JSON {json_kind(options)}, not an object")
    return tools, options
