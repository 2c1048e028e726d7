"""Prompt-completion records and conversations as framed documents with supervision: TRL's
and transformers' own masks as oracles, on a BPE trained here."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers", reason="the hf extra provides tokenizers: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="chat templates need the hf extra: pip install 'seqpack[hf]'")

import seqpack as sp
from seqpack.io.encoding import TokenizerFile
from seqpack.io.supervision import encode_conversations, encode_prompt_completion

CORPUS = [
    "Question: what is two plus two? Answer: four.",
    "hello world, hello there, world peace",
    "The quick brown fox jumps over the lazy dog.",
    "unbelievable understanding underneath",
    "Ünïcödé text survives",
    "ab ba aab abba  baab a.b ab. ba. aa bb",
] * 20

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
]

#: A chat template that writes BOS itself and ends every assistant turn with EOS, inside the generation span.
FRAMED_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{{ '\\n' }}{% endif %}{% endfor %}"
)
#: One that writes neither BOS nor EOS (seqpack adds both), with the whitespace-trimming marker spelling.
BARE_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}> "
    "{%- if message['role'] == 'assistant' %}{%- generation %} {{ message['content'] }}{%- endgeneration %}"
    "{% else %} {{ message['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello world"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the fox?"},
     {"role": "assistant", "content": "lazy dog"}, {"role": "user", "content": "ok"},
     {"role": "assistant", "content": "four."}],
    [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}],  # an empty answer
]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("bpe")
    corpus = root / "train.txt"
    corpus.write_text("\n".join(CORPUS))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(corpus)], trainer)
    path = root / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def bound(tokenizer_path):
    return TokenizerFile(tokenizer_path, bos="<|bos|>", eos="<|eos|>")


def documents(result):
    """``(tokens, supervised)`` of each document."""
    cuts = result.offsets[1:-1]
    return list(zip(np.split(result.tokens, cuts), np.split(result.supervised, cuts)))


def naive_trl_rule(bound, prompt, completion):
    """TRL 1.16's ``tokenize_fn`` for one record, written out: ``(ids, completion_mask, mismatched)``."""
    prompt_ids = bound.tokenizer.encode(prompt, add_special_tokens=False).ids
    ids = bound.tokenizer.encode(prompt + completion, add_special_tokens=False).ids + [bound.eos_id]
    prefix = 0
    while prefix < min(len(prompt_ids), len(ids)) and prompt_ids[prefix] == ids[prefix]:
        prefix += 1
    return ids, [0] * prefix + [1] * (len(ids) - prefix), prefix < len(prompt_ids)


def sft_trainer_dataset(bound, tmp_path, records, completion_only_loss):
    """TRL's own preparation of ``records``: the rows of a constructed ``SFTTrainer``'s train dataset."""
    pytest.importorskip("torch", reason="TRL needs PyTorch: pip install 'seqpack[hf]'")
    datasets = pytest.importorskip("datasets", reason="TRL's datasets come with the bench extra: "
                                                      "pip install 'seqpack[bench]'")
    trl = pytest.importorskip("trl", reason="the TRL oracle needs the bench extra: pip install 'seqpack[bench]'")
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    processing = PreTrainedTokenizerFast(tokenizer_object=bound.tokenizer, bos_token="<|bos|>",
                                         eos_token="<|eos|>", pad_token="<|pad|>")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=bound.vocabulary_size, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    args = trl.SFTConfig(output_dir=str(tmp_path), report_to=[], max_length=None,
                         completion_only_loss=completion_only_loss, use_cpu=True, bf16=False)
    trainer = trl.SFTTrainer(model=model, args=args, processing_class=processing,
                             train_dataset=datasets.Dataset.from_list(
                                 [{"prompt": p, "completion": c} for p, c in records]))
    return list(trainer.train_dataset)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's SFTConfig
@pytest.mark.parametrize("completion_only_loss", [True, False])
def test_prompt_completion_equals_trl_sft_trainer(bound, tmp_path, completion_only_loss):
    rows = sft_trainer_dataset(bound, tmp_path, RECORDS, completion_only_loss)
    result = encode_prompt_completion(bound, [p for p, _ in RECORDS], [c for _, c in RECORDS],
                                      completion_only_loss=completion_only_loss)
    assert result.tokens.dtype == np.int32 and result.offsets.dtype == np.int64
    assert result.supervised.dtype == np.bool_ and result.supervised.shape == result.tokens.shape
    assert len(rows) == len(RECORDS) == result.offsets.shape[0] - 1
    for index, (row, (tokens, supervised)) in enumerate(zip(rows, documents(result))):
        assert row["input_ids"][0] != bound.bos_id  # TRL adds no BOS: seqpack's is its own
        assert tokens[0] == bound.bos_id and not supervised[0], index
        assert tokens[1:].tolist() == row["input_ids"], index  # TRL's EOS text is seqpack's EOS
        assert supervised[1:].tolist() == [label != -100 for label in row["labels"]], index
        assert supervised[-1], index
    if completion_only_loss:
        from trl.data_utils import common_prefix_length

        expected = [i for i, (p, c) in enumerate(RECORDS)
                    if common_prefix_length(bound.tokenizer.encode(p).ids, rows[i]["input_ids"])
                    < len(bound.tokenizer.encode(p).ids)]
        assert result.mismatched.tolist() == expected
        assert {1, 2, 3} <= set(expected)  # the merging records do merge in this tokenizer
        assert result.mismatched.dtype == np.int64
    else:
        assert result.mismatched.size == 0


def test_prompt_completion_boundaries_by_hand(bound):
    def encode(text):
        return bound.tokenizer.encode(text, add_special_tokens=False).ids

    bos, eos = bound.bos_id, bound.eos_id
    prompts, completions = ["hello ", "", "the lazy dog", "", "four."], ["world", "hello", "", "", " four."]
    result = encode_prompt_completion(bound, prompts, completions)
    docs = documents(result)
    # "hello " + "world": the prompt's trailing space belongs to " world", so the completion starts there
    assert encode("hello ")[:-1] == encode("hello world")[:-1] and encode("hello ")[-1] != encode("hello world")[-1]
    assert docs[0][0].tolist() == [bos, *encode("hello world"), eos]
    assert docs[0][1].tolist() == [False] * len(encode("hello ")) + [True, True]
    assert docs[1][1].tolist() == [False] + [True] * (len(encode("hello")) + 1)  # empty prompt
    assert docs[2][1].tolist() == [False] * (len(encode("the lazy dog")) + 1) + [True]  # empty completion: EOS
    assert docs[3][0].tolist() == [bos, eos] and docs[3][1].tolist() == [False, True]  # nothing: still EOS
    assert docs[4][1].sum() == len(encode(" four.")) + 1
    assert result.mismatched.tolist() == [0]
    assert result.offsets.tolist() == np.cumsum([0] + [len(t) for t, _ in docs]).tolist()
    everything = encode_prompt_completion(bound, prompts, completions, completion_only_loss=False)
    np.testing.assert_array_equal(everything.tokens, result.tokens)
    assert everything.supervised.tolist() == [i not in result.offsets[:-1] for i in range(result.tokens.size)]
    empty = encode_prompt_completion(bound, [], [])
    assert (empty.tokens.size, empty.offsets.tolist(), empty.supervised.size, empty.mismatched.size) == (0, [0], 0, 0)


@settings(derandomize=True, max_examples=200, deadline=None, database=None)
@given(st.lists(st.tuples(st.text(alphabet="ab .é", max_size=8), st.text(alphabet="ab .é", max_size=8)),
                min_size=1, max_size=8))
def test_prompt_completion_equals_the_per_record_rule(bound, records):
    result = encode_prompt_completion(bound, [p for p, _ in records], [c for _, c in records])
    mismatched = []
    for index, ((prompt, completion), (tokens, supervised)) in enumerate(zip(records, documents(result))):
        ids, mask, merged = naive_trl_rule(bound, prompt, completion)
        assert tokens.tolist() == [bound.bos_id, *ids]
        assert supervised.tolist() == [False] + [bool(bit) for bit in mask]
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
    assert encode_prompt_completion(bound, ("a",), ("b",), completion_only_loss=np.True_).offsets.tolist() == [0, 3]


def transformers_rendering(bound, conversation, template):
    """transformers' own ``apply_chat_template`` of one conversation: ``(input_ids, assistant_masks, text)``."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=bound.tokenizer)
    names = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    out = hf.apply_chat_template(conversation, chat_template=template, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True, **names)
    text = hf.apply_chat_template(conversation, chat_template=template, tokenize=False, **names)
    return out["input_ids"], out["assistant_masks"], text


@pytest.mark.parametrize("template, added", [(FRAMED_TEMPLATE, (0, 1)), (BARE_TEMPLATE, (1, 1))])
def test_conversations_equal_transformers_assistant_mask(bound, template, added):
    result = encode_conversations(bound, CONVERSATIONS, chat_template=template)
    assert result.tokens.dtype == np.int32 and result.mismatched.size == 0
    everything = encode_conversations(bound, CONVERSATIONS, chat_template=template, assistant_only_loss=False)
    np.testing.assert_array_equal(everything.tokens, result.tokens)
    for index, conversation in enumerate(CONVERSATIONS):
        ids, mask, text = transformers_rendering(bound, conversation, template)
        tokens, supervised = documents(result)[index]
        assert ids == bound.tokenizer.encode(text, add_special_tokens=False).ids  # the binding's own encoding
        before, after = added if ids[-1] != bound.eos_id else (added[0], 0)
        assert tokens.tolist() == [bound.bos_id] * before + ids + [bound.eos_id] * after, index
        expected = [False] * before + [bool(bit) for bit in mask] + [False] * after
        expected[0] = False  # a document's first token is never a target
        assert supervised.tolist() == expected, index
        assert supervised.any(), index
        assert documents(everything)[index][1].tolist() == [False] + [True] * (tokens.size - 1)
    assert result.tokens[result.offsets[:-1]].tolist() == [bound.bos_id] * len(CONVERSATIONS)
    assert result.tokens[result.offsets[1:] - 1].tolist() == [bound.eos_id] * len(CONVERSATIONS)


def test_bos_and_eos_are_never_doubled(tmp_path, tokenizer_path):
    same = TokenizerFile(tokenizer_path, bos="<|eos|>", eos="<|eos|>")  # GPT-2's one <|endoftext|>
    one = [[{"role": "user", "content": "ab"}]]
    alone = encode_conversations(same, one, chat_template="{{ eos_token }}", assistant_only_loss=False)
    assert alone.tokens.tolist() == [same.eos_id, same.eos_id]  # one token is the BOS; an EOS follows it
    both = encode_conversations(same, one, chat_template="{{ eos_token }}ab{{ eos_token }}", assistant_only_loss=False)
    assert both.tokens.tolist() == [same.eos_id, *same.tokenizer.encode("ab").ids, same.eos_id]
    assert both.supervised.tolist() == [False] + [True] * (both.tokens.size - 1)


def test_conversation_refusals(bound):
    no_marker = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    with pytest.raises(sp.InvalidInputError, match=r"assistant_only_loss needs a chat template .* no generation"):
        encode_conversations(bound, CONVERSATIONS, chat_template=no_marker)
    assert encode_conversations(bound, CONVERSATIONS, chat_template=no_marker, assistant_only_loss=False).tokens.size
    no_assistant = [CONVERSATIONS[0], [{"role": "user", "content": "hello"}, {"role": "system", "content": "ab"}]]
    with pytest.raises(sp.InvalidInputError, match=r"conversation 1: no assistant token .*\(its roles: user, "
                                                   r"system\)$"):
        encode_conversations(bound, no_assistant, chat_template=FRAMED_TEMPLATE)
    never = ("{% for message in messages %}{% if message['role'] == 'tool' %}{% generation %}{{ message['content'] }}"
             "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %}{% endfor %}")
    with pytest.raises(sp.InvalidInputError,
                       match=r"conversation 0: no assistant token .*\(none of the 3 conversations has one"):
        encode_conversations(bound, CONVERSATIONS, chat_template=never)
    failing = ("{% if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}"
               "{% generation %}x{% endgeneration %}")
    with pytest.raises(sp.InvalidInputError, match=r"conversation 1: the chat template failed: too long"):
        encode_conversations(bound, CONVERSATIONS, chat_template=failing)
    cases = {
        r"conversation 1: a conversation is a non-empty list of messages": [CONVERSATIONS[0], []],
        r"conversation 0: message 1: a message is a dict with a str 'role'": [[{"role": "user"}, {"content": "x"}]],
        r"conversations must be a sequence of conversations": {"messages": CONVERSATIONS[0]},
    }
    for message, conversations in cases.items():
        with pytest.raises(sp.InvalidInputError, match=message):
            encode_conversations(bound, conversations, chat_template=FRAMED_TEMPLATE)
    with pytest.raises(sp.InvalidInputError, match="chat_template must be the template's text"):
        encode_conversations(bound, CONVERSATIONS, chat_template=None)
    empty = encode_conversations(bound, [], chat_template=FRAMED_TEMPLATE)
    assert (empty.tokens.size, empty.offsets.tolist()) == (0, [0])
