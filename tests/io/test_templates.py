"""Chat templates rendered within limits of time and size (seqpack.io.templates), through
transformers' own apply_chat_template on a word-level tokenizer built here."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import random
import threading
import time
import tracemalloc

import pytest

pytest.importorskip("tokenizers", reason="the hf extra provides tokenizers: pip install 'seqpack[hf]'")
pytest.importorskip("transformers", reason="chat templates need the hf extra: pip install 'seqpack[hf]'")

from seqpack.errors import InvalidInputError
from seqpack.io.templates import TemplateLimitError, bounded_rendering

#: Two nested loops that write nothing: 10**10 iterations.
FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
#: 30 M characters in pieces of 1000.
HUGE = "{% for i in range(30000) %}{{ 'x' * 1000 }}{% endfor %}"
#: As long as each conversation's first message: 1000 characters per word.
LONG = "{% for word in messages[0]['content'].split() %}{{ 'x' * 1000 }}{% endfor %}"
#: A normal template, the assistant's turns marked for the mask.
CHAT = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }} : "
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }} {{ eos_token }}"
    "{% endgeneration %}{% else %}{{ message['content'] }}{% endif %} {% endfor %}"
)
#: ``n`` thousand loop iterations that write nothing.
SPIN = "{% for i in range(n) %}{% for j in range(1000) %}{% endfor %}{% endfor %}{{ bos_token }}"
WORDS = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":", "hi", "there", "be", "brief", "ok", "x"]
CONVERSATION = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hi"}]
CONVERSATIONS = [
    CONVERSATION,
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "ok"},
     {"role": "assistant", "content": "there there"}],
    [{"role": "user", "content": "ok"}, {"role": "assistant", "content": ""}],
]
MASKED = {"tokenize": True, "return_dict": True, "return_assistant_tokens_mask": True}


@pytest.fixture(scope="module")
def hf():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def render(hf, template, conversation=CONVERSATION, **options):
    return hf.apply_chat_template(conversation, chat_template=template, **options)


def stopped(hf, template, conversation=CONVERSATION, *, seconds=60.0, characters=10**9, **options):
    """The error and the seconds until it, rendering within a block."""
    start = time.monotonic()
    with pytest.raises(TemplateLimitError) as caught, bounded_rendering(template, seconds=seconds,
                                                                        characters=characters):
        render(hf, template, conversation, **options)
    return caught.value, time.monotonic() - start


def test_a_template_that_loops_forever_is_stopped_at_the_time_limit(hf):
    error, took = stopped(hf, FOREVER, seconds=0.5)
    assert took < 1.0
    assert (error.index, error.limit, error.maximum) == (0, "seconds", 0.5)
    assert str(error).startswith("rendering 0 of the chat template was still running after 0.")
    assert "the limit is 0.5 s (raise it with --template-seconds)" in str(error)


def test_a_template_that_writes_30_million_characters_is_stopped_at_the_character_limit(hf):
    tracemalloc.start()
    try:
        error, took = stopped(hf, HUGE, characters=1_000_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert took < 1.0 and peak < 20 << 20
    assert (error.index, error.limit, error.maximum) == (0, "characters", 1_000_000)
    assert str(error) == ("rendering 0 of the chat template wrote 1001000 characters and was stopped; the limit is "
                          "1000000 characters (raise it with --template-characters)")


def test_a_block_the_template_buffers_is_measured_before_it_is_joined(hf):
    block = "{% set s %}{% for i in range(30000) %}{{ 'x' * 1000 }}{% endfor %}{% endset %}{{ s | length }}"
    error, _ = stopped(hf, block, characters=1_000_000)
    assert error.limit == "characters"
    assert "built a block of 30000000 characters; the limit is 1000000" in str(error)


def test_the_error_names_the_conversation_of_a_batched_call(hf):
    batch = [[{"role": "user", "content": "x " * 10}]] * 2 + [[{"role": "user", "content": "x " * 2000}]]
    error, _ = stopped(hf, LONG, batch, characters=1_000_000)
    assert error.index == 2
    with pytest.raises(TemplateLimitError) as caught, bounded_rendering(LONG, seconds=60, characters=1_000_000):
        render(hf, LONG, batch[:2])
        render(hf, LONG, batch)  # renderings are counted from the start of the block
    assert caught.value.index == 4


def test_output_of_exactly_the_limit_passes(hf):
    with bounded_rendering(HUGE, seconds=60, characters=30_000_000):
        assert len(render(hf, HUGE, tokenize=False)) == 30_000_000
    error, _ = stopped(hf, HUGE, characters=29_999_999)
    assert "wrote 30000000 characters" in str(error)
    block = "{% set s %}{% for i in range(3) %}{{ 'x' * 10 }}{% endfor %}{% endset %}{{ s | length }}"
    with bounded_rendering(block, seconds=60, characters=30):
        assert render(hf, block, tokenize=False) == "30"
    assert "built a block of 30 characters" in str(stopped(hf, block, characters=29)[0])


def test_a_template_within_its_limits_renders_as_without_them(hf):
    before = render(hf, CHAT, CONVERSATIONS, **MASKED)
    text = render(hf, CHAT, CONVERSATIONS, tokenize=False)
    with bounded_rendering(CHAT, seconds=60, characters=1000):
        within = render(hf, CHAT, CONVERSATIONS, **MASKED)
        assert render(hf, CHAT, CONVERSATIONS, tokenize=False) == text
    after = render(hf, CHAT, CONVERSATIONS, **MASKED)
    assert before["input_ids"] == within["input_ids"] == after["input_ids"]
    assert before["assistant_masks"] == within["assistant_masks"] == after["assistant_masks"]
    assert any(map(any, before["assistant_masks"]))


def test_after_the_block_the_template_is_unbounded_again(hf):
    stopped(hf, HUGE, characters=1_000_000)
    assert len(render(hf, HUGE, tokenize=False)) == 30_000_000
    for _ in range(2):  # hooked once, however often bounded
        with bounded_rendering(HUGE, seconds=60, characters=10**9):
            pass
    from transformers.utils.chat_template_utils import _compile_jinja_template

    hooked = _compile_jinja_template(HUGE).root_render_func
    assert not hasattr(hooked.__wrapped__, "_seqpack_bounds")


def test_blocks_nest_and_the_innermost_limits_apply(hf):
    with bounded_rendering(HUGE, seconds=60, characters=10**9):
        with pytest.raises(TemplateLimitError, match="limit is 1000000 characters"):
            with bounded_rendering(HUGE, seconds=60, characters=1_000_000):
                render(hf, HUGE, tokenize=False)
        assert len(render(hf, HUGE, tokenize=False)) == 30_000_000


def test_limits_hold_in_a_worker_thread_and_only_there(hf):
    outcomes, entered, rendered = {}, threading.Event(), threading.Event()

    def worker():
        try:
            with bounded_rendering(HUGE, seconds=60, characters=1_000_000):
                entered.set()
                rendered.wait(30)
                render(hf, HUGE)
        except TemplateLimitError as error:
            outcomes["characters"] = error
        start = time.monotonic()
        try:
            with bounded_rendering(FOREVER, seconds=0.5, characters=10):
                render(hf, FOREVER)
        except TemplateLimitError as error:
            outcomes["seconds"] = error, time.monotonic() - start

    thread = threading.Thread(target=worker)
    thread.start()
    assert entered.wait(30)
    assert len(render(hf, HUGE, tokenize=False)) == 30_000_000  # the worker's block does not bound this thread
    rendered.set()
    thread.join(30)
    assert not thread.is_alive()
    assert outcomes["characters"].limit == "characters"
    error, took = outcomes["seconds"]
    assert error.limit == "seconds" and took < 1.0


def test_limits_hold_with_the_assistant_mask(hf):
    error, took = stopped(hf, "{% generation %}" + FOREVER + "{% endgeneration %}", seconds=0.5, **MASKED)
    assert error.limit == "seconds" and took < 1.0
    error, took = stopped(hf, "{% generation %}ok{% endgeneration %}" + HUGE, characters=1_000_000, **MASKED)
    assert error.limit == "characters" and took < 1.0
    inside = "{% generation %}" + HUGE + "{% endgeneration %}"
    assert "built a block of 30000000" in str(stopped(hf, inside, characters=1_000_000, **MASKED)[0])


@pytest.mark.slow
def test_no_exception_arrives_after_a_rendering_ends(hf):
    # renderings that end just before or just after their deadline race the watchdog
    render(hf, SPIN, tokenize=False, n=1)  # compiled, so the calls below time the loops alone

    def took(n):
        start = time.monotonic()
        render(hf, SPIN, tokenize=False, n=n)
        return time.monotonic() - start

    seconds = max(took(200) - took(100), 0.001)  # about the time 100 thousand iterations take
    randomly = random.Random(0)
    outcomes = {"passed": 0, "stopped": 0}
    for options in [{"tokenize": False}, MASKED] * 50:
        try:
            with bounded_rendering(SPIN, seconds=seconds, characters=100):
                render(hf, SPIN, n=randomly.randint(50, 150), **options)
            outcomes["passed"] += 1
        except TemplateLimitError as error:
            assert error.limit == "seconds"
            outcomes["stopped"] += 1
    until = time.monotonic() + 0.3
    while time.monotonic() < until:  # bytecode, where a stray exception would arrive
        sum(range(100))
    assert sum(outcomes.values()) == 100


@pytest.mark.parametrize("limits", [
    {"seconds": 0, "characters": 1}, {"seconds": -1.0, "characters": 1}, {"seconds": float("nan"), "characters": 1},
    {"seconds": float("inf"), "characters": 1}, {"seconds": True, "characters": 1}, {"seconds": None, "characters": 1},
    {"seconds": 1, "characters": 0}, {"seconds": 1, "characters": 1.5},
])
def test_limits_are_checked(limits):
    with pytest.raises(InvalidInputError), bounded_rendering(CHAT, **limits):
        pass


def test_a_template_that_does_not_compile_is_refused():
    with pytest.raises(InvalidInputError, match="does not compile"), bounded_rendering("{% for %}", seconds=1,
                                                                                        characters=1):
        pass
