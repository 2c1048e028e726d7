"""Prompt-completion records and conversations as documents with supervision, exactly as
TRL 1.16's ``SFTTrainer`` prepares them: TRL and transformers are the oracles, on BPEs
trained here with a BOS-adding post-processor (Llama-style) and without (Qwen-style)."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers", reason="the hf extra provides tokenizers: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="chat templates need the hf extra: pip install 'seqpack[hf]'")

import seqpack as sp
from seqpack.io.tokenizer_file import TokenizerFile
from seqpack.io.record_encoders import (
    TemplateLimits,
    encode_conversational_prompt_completion,
    encode_conversations,
    encode_prompt_completion,
)

from helpers import CONVERSATIONS, TEMPLATES, TOOL_CALL, TOOLS, train_chat_bpe, trl_rows

#: Prompt-completion records, each with why it is here.
RECORDS = [
    ("Question: what is two plus two? Answer:", " four."),  # a clean boundary
    ("hello wor", "ld"),  # the prompt ends mid-word: its last token merges into the completion's
    ("hello ", "world"),  # the prompt's trailing space joins the completion's first word
    ("a", "b"),  # the whole prompt merges away
    ("unbeliev", "able understanding"),
    ("x ", " y"),  # whitespace runs split by lookahead
    ("Ün", "ïcödé"),
    ("", "the quick fox"),  # empty prompt: all of it is the completion
    ("the lazy dog", ""),  # empty completion: EOS is the only target
    ("", ""),  # nothing but the EOS
    ("hello", " world<|eos|>"),  # TRL's own convention: the EOS text is already there, none is added
    ("a<|eos|>b", "c<|eos|>d"),  # EOS inside the prompt and the completion: content
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    return {"llama": train_chat_bpe(root, "llama", True), "qwen": train_chat_bpe(root, "qwen", False)}


@pytest.fixture(scope="module", params=["llama", "qwen"])
def bound(request, paths):
    """A tokenizer whose post-processor adds BOS, and one that adds none (``bos`` left to the file)."""
    tokenizer = TokenizerFile(paths[request.param], eos="<|eos|>")
    assert (tokenizer.bos_id is None) == (request.param == "qwen")
    return tokenizer


def documents(result):
    """``(tokens, supervised)`` of each document."""
    cuts = result.offsets[1:-1]
    return list(zip(np.split(result.tokens, cuts), np.split(result.supervised, cuts)))


def assert_equals_trl(result, rows):
    """seqpack's documents are TRL's ``input_ids``, supervised where TRL's label is not -100."""
    assert result.tokens.dtype == np.int32 and result.offsets.dtype == np.int64
    assert result.supervised.dtype == np.bool_ and result.supervised.shape == result.tokens.shape
    assert len(rows) == result.offsets.shape[0] - 1
    for index, (row, (tokens, supervised)) in enumerate(zip(rows, documents(result))):
        assert tokens.tolist() == row["input_ids"], index
        assert not supervised[0], index  # the first token is no target
        assert supervised[1:].tolist() == [label != -100 for label in row["labels"][1:]], index


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's SFTConfig
@pytest.mark.parametrize("completion_only_loss", [True, False])
def test_prompt_completion_equals_trl_sft_trainer(bound, tmp_path, completion_only_loss):
    # A tokenizer without BOS gets none (TRL adds none), and an EOS at the end of a completion or
    # inside it is content, not refused.
    records = [{"prompt": p, "completion": c} for p, c in RECORDS]
    rows = trl_rows(bound, tmp_path, records, completion_only_loss=completion_only_loss)
    result = encode_prompt_completion(bound, [p for p, _ in RECORDS], [c for _, c in RECORDS],
                                      completion_only_loss=completion_only_loss)
    assert_equals_trl(result, rows)
    starts = result.tokens[result.offsets[:-1]]
    assert (starts == bound.bos_id).all() if bound.bos_id is not None else starts[:2].tolist() == [
        bound.tokenizer.encode(p).ids[0] for p, _ in RECORDS[:2]]  # no BOS: the prompt's first token
    assert (result.tokens[result.offsets[1:] - 1] == bound.eos_id).all()  # one EOS at the end, never two
    if completion_only_loss:
        from trl.data_utils import common_prefix_length

        expected = [i for i, (p, _) in enumerate(RECORDS)
                    if common_prefix_length(bound.tokenizer.encode(p).ids, rows[i]["input_ids"])
                    < len(bound.tokenizer.encode(p).ids)]
        assert result.mismatched.tolist() == expected and {1, 2, 3} <= set(expected)
    else:
        assert result.mismatched.size == 0


def naive_trl_rule(bound, prompt, completion):
    """TRL 1.16's ``tokenize_fn`` for one record, written out: ``(ids, completion_mask, mismatched)``."""
    eos = bound.token_text(bound.eos_id)
    prompt_ids = bound.tokenizer.encode(prompt).ids
    ids = bound.tokenizer.encode(prompt + (completion if completion.endswith(eos) else completion + eos)).ids
    prefix = 0
    while prefix < min(len(prompt_ids), len(ids)) and prompt_ids[prefix] == ids[prefix]:
        prefix += 1
    return ids, [0] * prefix + [1] * (len(ids) - prefix), prefix < len(prompt_ids)


@settings(derandomize=True, max_examples=150, deadline=None, database=None)
@given(st.lists(st.tuples(st.text(alphabet="ab .é", max_size=8),
                          st.text(alphabet="ab .é", max_size=8) | st.just("a<|eos|>")), min_size=1, max_size=8))
def test_prompt_completion_equals_the_per_record_rule(bound, records):
    result = encode_prompt_completion(bound, [p for p, _ in records], [c for _, c in records])
    mismatched = []
    for index, ((prompt, completion), (tokens, supervised)) in enumerate(zip(records, documents(result))):
        ids, mask, merged = naive_trl_rule(bound, prompt, completion)
        assert tokens.tolist() == ids
        assert supervised.tolist() == [False] + [bool(bit) for bit in mask[1:]]
        mismatched += [index] * merged
    assert result.mismatched.tolist() == mismatched


def test_prompt_completion_refusals(bound):
    cases = {
        "2 prompts but 1 completions": (bound, ["a", "b"], ["c"]),
        r"record 1: the completion must be a str, not bytes": (bound, ["a", "b"], ["c", b"d"]),
        r"record 0: the prompt must be a str, not NoneType": (bound, [None], ["c"]),
        "prompts must be a sequence of str": (bound, "ab", ["c", "d"]),
        "tokenizer must be a seqpack.io.TokenizerFile, not ByteTokenizer": (sp.ByteTokenizer(), ["a"], ["b"]),
    }
    for message, args in cases.items():
        with pytest.raises(sp.InvalidInputError, match=message):
            encode_prompt_completion(*args)
    with pytest.raises(sp.InvalidInputError, match="completion_only_loss must be a bool, got int"):
        encode_prompt_completion(bound, ["a"], ["b"], completion_only_loss=1)
    one = encode_prompt_completion(bound, ("a",), ("b",), completion_only_loss=np.True_)
    assert one.offsets.tolist() == [0, 2 + (bound.bos_id is not None)]
    # numpy's str_ is a str: a StopIteration escaped (review)
    numpy_texts = encode_prompt_completion(bound, np.array(["a", "hello "]), np.array(["b", "world"]))
    plain = encode_prompt_completion(bound, ["a", "hello "], ["b", "world"])
    assert numpy_texts.tokens.tolist() == plain.tokens.tolist()
    assert numpy_texts.offsets.tolist() == plain.offsets.tolist()
    empty = encode_prompt_completion(bound, [], [])
    assert (empty.tokens.size, empty.offsets.tolist(), empty.supervised.size, empty.mismatched.size) == (0, [0], 0, 0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("assistant_only_loss", [True, False])
def test_conversations_with_an_eos_per_turn_equal_trl(bound, tmp_path, name, assistant_only_loss):
    # A template that ends each turn with EOS is taken, not refused ("control token 2 (EOS) ... inside").
    eos = "<|im_end|>" if name == "chatml" else "<|eos|>"
    tokenizer = TokenizerFile(bound.path, eos=eos)
    conversations = [TOOL_CALL, TOOL_CALL[:2]] if name == "tools" else CONVERSATIONS
    tools = [TOOLS, None] if name == "tools" else None
    records = [{"messages": c, **({"tools": json.dumps(t) if t else None} if tools else {})}
               for c, t in zip(conversations, tools or [None] * len(conversations))]
    rows = trl_rows(tokenizer, tmp_path, records, template=TEMPLATES[name], eos=eos,
                    assistant_only_loss=assistant_only_loss)
    result = encode_conversations(tokenizer, conversations, chat_template=TEMPLATES[name], tools=tools,
                                  assistant_only_loss=assistant_only_loss)
    assert_equals_trl(result, rows)
    inside = np.isin(result.tokens, [tokenizer.eos_id] + ([tokenizer.bos_id] if name == "llama2" else []))
    inside[result.offsets[1:] - 1] = False
    assert inside.any()  # the EOS of an earlier turn (a BOS of a later one) is content, as TRL has it
    if name == "tools":
        text = tokenizer.tokenizer.decode(documents(result)[0][0].tolist(), skip_special_tokens=False)
        assert '"get_weather"' in text and '"Paris"' in text and "(get_weather)" in text and "tools: " in text


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("assistant_only_loss, completion_only_loss", [(False, True), (True, True), (False, False)])
def test_conversational_prompt_completion_equals_trl(bound, tmp_path, assistant_only_loss, completion_only_loss):
    # Prompt and completion as lists of messages are taken, not refused ("field 'prompt' is not a string").
    template = TEMPLATES["zephyr"]
    prompts = [c[:-1] for c in CONVERSATIONS]
    completions = [c[-1:] for c in CONVERSATIONS]
    records = [{"prompt": p, "completion": c} for p, c in zip(prompts, completions)]
    rows = trl_rows(bound, tmp_path, records, template=template, assistant_only_loss=assistant_only_loss,
                    completion_only_loss=completion_only_loss)
    result = encode_conversational_prompt_completion(
        bound, prompts, completions, chat_template=template, assistant_only_loss=assistant_only_loss,
        completion_only_loss=completion_only_loss)
    assert_equals_trl(result, rows)
    if completion_only_loss:  # the prompt's turns, their EOS included, are not supervised
        first = documents(result)[1]
        assert not first[1][: int(np.flatnonzero(first[1])[0])].any() and first[1].sum() < first[0].size // 2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_a_records_template_options_override_as_in_trl(bound, tmp_path):
    # TRL merges chat_template_kwargs into its call, so a record's add_generation_prompt renders a
    # conversation's generation prompt; seqpack failed with "the chat template failed: ..." (review).
    template = TEMPLATES["zephyr"]
    options = [{"add_generation_prompt": True}, {}]
    records = [{"messages": c, "chat_template_kwargs": o} for c, o in zip(CONVERSATIONS, options)]
    rows = trl_rows(bound, tmp_path, records, template=template)
    result = encode_conversations(bound, CONVERSATIONS[:2], chat_template=template, template_kwargs=options,
                                  assistant_only_loss=False)
    assert_equals_trl(result, rows)
    plain = encode_conversations(bound, CONVERSATIONS[:1], chat_template=template, assistant_only_loss=False)
    assert documents(result)[0][0].size > documents(plain)[0][0].size   # the generation prompt is there
    # A prompt's own call sets add_generation_prompt: twice is TRL's TypeError, and seqpack's refusal.
    with pytest.raises(sp.InvalidInputError, match=r"^conversation 0: the chat template failed: chat_template_kwargs "
                                                   r"sets add_generation_prompt, which TRL's own call sets too"):
        encode_conversational_prompt_completion(bound, [CONVERSATIONS[0][:-1]], [CONVERSATIONS[0][-1:]],
                                                chat_template=template, template_kwargs=options[:1])


def test_conversation_refusals_and_limits(bound):
    template = TEMPLATES["zephyr"]
    no_marker = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    with pytest.raises(sp.InvalidInputError, match=r"assistant_only_loss needs a chat template .* no generation"):
        encode_conversations(bound, CONVERSATIONS, chat_template=no_marker)
    assert encode_conversations(bound, CONVERSATIONS, chat_template=no_marker, assistant_only_loss=False).tokens.size
    no_assistant = [CONVERSATIONS[0], [{"role": "user", "content": "hello"}, {"role": "system", "content": "ab"}]]
    with pytest.raises(sp.InvalidInputError, match=r"conversation 1: no assistant token .*\(its roles: user, "
                                                   r"system\)$"):
        encode_conversations(bound, no_assistant, chat_template=template)
    never = ("{% for message in messages %}{% if message['role'] == 'tool' %}{% generation %}{{ message['content'] }}"
             "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}{% endfor %}")
    with pytest.raises(sp.InvalidInputError,
                       match=r"conversation 0: no assistant token .*\(none of the 3 conversations has one"):
        encode_conversations(bound, CONVERSATIONS, chat_template=never)
    # A last conversation that renders to no token is refused by name (it raised IndexError; review).
    only_assistant = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
                      "{{ message['content'] }}{% endgeneration %}{% endif %}{% endfor %}")
    with pytest.raises(sp.InvalidInputError, match=r"conversation 1: no assistant token .*\(its roles: user\)$"):
        encode_conversations(bound, [CONVERSATIONS[0], [{"role": "user", "content": "hello"}]],
                             chat_template=only_assistant)
    failing = ("{% if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}"
               "{% generation %}x{% endgeneration %}")
    with pytest.raises(sp.InvalidInputError, match=r"conversation 1: the chat template failed: too long"):
        encode_conversations(bound, CONVERSATIONS, chat_template=failing)
    # A tokenizer failure after rendering names the record.
    unknown = "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"
    odd = [[{"role": "user", "content": "ab"}], [{"role": "user", "content": "ab\ud800"}]]
    with pytest.raises(sp.InvalidInputError, match=r"^conversation 1: the (tokenizer|chat template) failed"):
        encode_conversations(bound, odd, chat_template=unknown)
    # Templates are bounded in time and size (unbounded, nested loops ran until Ctrl-C; 30 M characters took 13 GB).
    loops = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
             "{% generation %}x{% endgeneration %}")
    with pytest.raises(sp.InvalidInputError, match=r"^conversation 0: .* the limit is 0.3 s \(raise it with --templ"):
        encode_conversations(bound, CONVERSATIONS[:1], chat_template=loops, limits=TemplateLimits(0.3, 1000))
    huge = ("{% if messages[0]['content'] != 'a' %}{% for i in range(30000) %}{{ 'x' * 1000 }}{% endfor %}"
            "{% endif %}{% generation %}x{% endgeneration %}")  # 30 M characters for the third conversation only
    with pytest.raises(sp.InvalidInputError, match=r"^conversation 2: .* the limit is 100000 characters"):
        encode_conversations(bound, [[{"role": "user", "content": "a"}]] * 2 + [CONVERSATIONS[0]],
                             chat_template=huge, limits=TemplateLimits(5, 100_000))
    exact = "{{ 'x' * 99999 }}{% generation %}y{% endgeneration %}"  # the exact twin: 100,000 characters
    assert encode_conversations(bound, CONVERSATIONS[:1], chat_template=exact,
                                limits=TemplateLimits(5, 100_000)).tokens.size
    with pytest.raises(sp.InvalidInputError, match="template time limit must be a positive number"):
        TemplateLimits(0, 10)
    cases = {
        r"conversation 1: a conversation is a non-empty list of messages": [CONVERSATIONS[0], []],
        r"conversation 0: message 1: a message is a dict with a str 'role'": [[{"role": "user"}, {"content": "x"}]],
        r"message 0: .*\(ShareGPT's 'from'/'value' messages need renaming to 'role'/'content' first\)":
            [[{"from": "human", "value": "x"}]],
        r"conversations must be a sequence of conversations": {"messages": CONVERSATIONS[0]},
    }
    for message, conversations in cases.items():
        with pytest.raises(sp.InvalidInputError, match=message):
            encode_conversations(bound, conversations, chat_template=template)
    with pytest.raises(sp.InvalidInputError, match="chat_template must be the template's text"):
        encode_conversations(bound, CONVERSATIONS, chat_template=None)
    empty = encode_conversations(bound, [], chat_template=template)
    assert (empty.tokens.size, empty.offsets.tolist()) == (0, [0])


def test_the_bos_comes_from_the_post_processor_unless_given(paths):
    llama, qwen = (TokenizerFile(paths[name], eos="<|eos|>") for name in ("llama", "qwen"))
    assert llama.bos_id == llama.tokenizer.token_to_id("<|bos|>") and qwen.bos_id is None
    assert qwen.describe()["bos_id"] is None and qwen.identity.bos_id is None
    given_bos = TokenizerFile(paths["qwen"], bos="<|bos|>", eos="<|eos|>")  # plain text then starts with it
    assert given_bos.bos_id == llama.bos_id and given_bos.identity != qwen.identity
