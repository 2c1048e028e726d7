"""ByteTokenizer: exact encodings, merge ranks, bounded decoding and its errors."""

import hashlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import (
    BatchBinding,
    ByteTokenizer,
    DecodeLimitError,
    DecodeLimits,
    ExampleTable,
    InvalidInputError,
    TokenizerError,
    TokenizerIdentity,
)

FIXTURE = ByteTokenizer.fixture()
WIDE = DecodeLimits(max_tokens=10_000, max_bytes=10_000)


def reference_bpe(data: bytes, merges) -> list[int]:
    """Textbook BPE: repeatedly merge the lowest-ranked adjacent pair, left to right."""
    tokens = [b + 2 for b in data]
    rank = {pair: k for k, pair in enumerate(merges)}
    while True:
        ranked = [rank[p] for p in zip(tokens, tokens[1:]) if p in rank]
        if not ranked:
            return tokens
        best = min(ranked)
        left, right = merges[best]
        merged, i = [], 0
        while i < len(tokens):
            if i + 1 < len(tokens) and (tokens[i], tokens[i + 1]) == (left, right):
                merged.append(258 + best)
                i += 2
            else:
                merged.append(tokens[i])
                i += 1
        tokens = merged


def test_fixture_layout():
    assert FIXTURE.vocabulary_size == 266
    assert (FIXTURE.bos_id, FIXTURE.eos_id) == (0, 1)
    assert len(FIXTURE.merges) == 8
    assert [FIXTURE.token_bytes(i) for i in (0, 1, 2, 99, 257)] == [b"", b"", b"\x00", b"a", b"\xff"]
    assert FIXTURE.token_bytes(258) == b"e "
    assert FIXTURE.token_bytes(263) == b"the "


def test_exact_byte_encodings():
    assert FIXTURE.encode_document("a").tolist() == [0, 99, 1]
    assert FIXTURE.encode_document("abcd").tolist() == [0, 99, 100, 101, 102, 1]
    assert FIXTURE.encode_document("").tolist() == [0, 1]
    assert FIXTURE.encode_document(b"\x00\xff").tolist() == [0, 2, 257, 1]
    assert FIXTURE.encode_document("é").tolist() == [0, 0xC3 + 2, 0xA9 + 2, 1]
    assert FIXTURE.encode_document("a").dtype == np.int32


def test_merges_apply_by_rank_hand_worked():
    # "the thin ": rank 0 "e " -> 258, rank 1 "th" -> 259 (twice), rank 4 "in" -> 262,
    # rank 5 (259, 258) "the " -> 263.
    assert FIXTURE.encode_document("the thin ").tolist() == [0, 263, 259, 262, 34, 1]
    # " the ": "th" (rank 1) takes the t before " t" (rank 2) can, so the space stays alone.
    assert FIXTURE.encode_document(" the ").tolist() == [0, 34, 263, 1]
    # Four spaces: "  " twice (rank 6), then the pair of those (rank 7).
    assert FIXTURE.encode_document("    x").tolist() == [0, 265, 122, 1]
    # Overlapping "aaa" with a merge of (a, a): left to right, non-overlapping.
    aa = ByteTokenizer([(99, 99)])
    assert aa.encode_document("aaa").tolist() == [0, 258, 99, 1]
    assert aa.encode_document("aaaa").tolist() == [0, 258, 258, 1]


def test_rank_order_changes_the_encoding():
    th_first = ByteTokenizer([(118, 106), (34, 118)])
    space_t_first = ByteTokenizer([(34, 118), (118, 106)])
    assert th_first.encode_document(" th").tolist() == [0, 34, 258, 1]
    assert space_t_first.encode_document(" th").tolist() == [0, 258, 106, 1]


@settings(derandomize=True, max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("the sin hat  \n\té")), max_size=60) | st.text(max_size=40))
def test_round_trip_and_reference_bpe(text):
    ids = FIXTURE.encode_document(text)
    assert ids[0] == 0 and ids[-1] == 1
    assert ids[1:-1].tolist() == reference_bpe(text.encode(), FIXTURE.merges)
    assert FIXTURE.decode_document_bounded(ids, WIDE) == text.encode()


@settings(derandomize=True, max_examples=100, deadline=None)
@given(st.lists(st.integers(2, 265), max_size=50))
def test_decode_any_content_ids(content):
    ids = [0, *content, 1]
    expected = b"".join(FIXTURE.token_bytes(i) for i in content)
    assert FIXTURE.decode_document_bounded(ids, WIDE) == expected
    assert FIXTURE.check_document(np.array(ids, dtype=np.int64), WIDE) == len(expected)


def test_decode_unmerged_byte_tokens():
    assert FIXTURE.decode_document_bounded([0, 99, 100, 1], WIDE) == b"ab"
    assert FIXTURE.decode_document_bounded(np.array([0, 1], dtype=np.uint8), WIDE) == b""
    # The same text, merged or not, decodes identically.
    unmerged = [0, *(b + 2 for b in b"the "), 1]
    assert FIXTURE.decode_document_bounded(unmerged, WIDE) == b"the "
    assert FIXTURE.decode_document_bounded([0, 263, 1], WIDE) == b"the "


@pytest.mark.parametrize(
    "ids, position, match",
    [
        ([], None, "empty"),
        ([5, 99, 1], 0, "start with BOS 0; position 0 holds 5"),
        ([1, 99, 1], 0, "start with BOS"),
        ([0, 99, 100], 2, "end with EOS 1; position 2 holds 100"),
        ([0], 0, "no EOS"),
        ([1], 0, "start with BOS"),
        ([0, 99, 0, 1], 2, "control token 0 \\(BOS\\) at position 2"),
        ([0, 1, 99, 1], 1, "control token 1 \\(EOS\\) at position 1"),
        ([0, 99, -3, 1], 2, "token -3 at position 2 is negative"),
        ([0, 266, 1], 1, "token 266 at position 1 is out of vocabulary"),
        ([0, 99, 1, 300], 2, "control token 1"),  # first bad position wins
        ([-1, 99, 1], 0, "negative"),
    ],
)
def test_decode_errors_name_the_position(ids, position, match):
    with pytest.raises(TokenizerError, match=match) as caught:
        FIXTURE.decode_document_bounded(ids, WIDE)
    assert caught.value.position == position
    assert not isinstance(caught.value, DecodeLimitError)


def test_passing_twins_of_the_frame_errors():
    for ids in ([0, 99, 1], [0, 1], [0, 265, 2, 1]):
        FIXTURE.decode_document_bounded(ids, WIDE)


def test_token_limit_exact_and_one_over():
    ids = FIXTURE.encode_document("abc")  # 5 tokens
    assert FIXTURE.decode_document_bounded(ids, DecodeLimits(5, 100)) == b"abc"
    with pytest.raises(DecodeLimitError, match="5 tokens; the limit is 4") as caught:
        FIXTURE.decode_document_bounded(ids, DecodeLimits(4, 100))
    assert caught.value.position == 4


def test_byte_limit_exact_and_one_over():
    ids = [0, 99, 263, 100, 1]  # 1 + 4 + 1 = 6 bytes; token 263 crosses byte 3
    assert FIXTURE.decode_document_bounded(ids, DecodeLimits(100, 6)) == b"athe b"
    with pytest.raises(DecodeLimitError, match="6 bytes; the limit is 5") as caught:
        FIXTURE.decode_document_bounded(ids, DecodeLimits(100, 5))
    assert caught.value.position == 3
    with pytest.raises(DecodeLimitError) as caught:
        FIXTURE.decode_document_bounded(ids, DecodeLimits(100, 1))
    assert caught.value.position == 2
    assert isinstance(caught.value, TokenizerError)


def test_limits_and_non_integer_inputs_are_rejected():
    for bad in (0, -1, 1.5, True):
        problem = f"must be at least 1, got {bad}" if type(bad) is int else f"must be an int, got {type(bad).__name__}"
        with pytest.raises(InvalidInputError, match=f"^max_tokens {problem}$"):
            DecodeLimits(bad, 10)
        with pytest.raises(InvalidInputError, match=f"^max_bytes {problem}$"):
            DecodeLimits(10, bad)
    DecodeLimits(1, 1)  # the exact limit passes
    with pytest.raises(InvalidInputError, match="integers"):
        FIXTURE.decode_document_bounded(np.array([0.0, 1.0]), WIDE)
    with pytest.raises(InvalidInputError, match="1-D"):
        FIXTURE.decode_document_bounded(np.zeros((2, 2), dtype=np.int32), WIDE)
    with pytest.raises(InvalidInputError, match="str or bytes"):
        FIXTURE.encode_document(42)


def test_identity_digest_is_the_canonical_payload_hash():
    payload = {
        "kind": "seqpack-byte-bpe",
        "bos_id": 0,
        "eos_id": 1,
        "byte_offset": 2,
        "merges": [list(m) for m in FIXTURE.merges],
    }
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    assert FIXTURE.identity.digest == hashlib.sha256(canonical).hexdigest()
    assert ByteTokenizer.fixture().identity == FIXTURE.identity
    assert ByteTokenizer(FIXTURE.merges).identity == FIXTURE.identity
    assert ByteTokenizer(FIXTURE.merges[:7]).identity.digest != FIXTURE.identity.digest
    swapped = (FIXTURE.merges[1], FIXTURE.merges[0], *FIXTURE.merges[2:])
    assert ByteTokenizer(swapped).identity.digest != FIXTURE.identity.digest
    assert ByteTokenizer().identity.vocabulary_size == 258


@pytest.mark.parametrize(
    "merges, match",
    [
        ([(0, 99)], "content ID"),
        ([(99, 1)], "content ID"),
        ([(99, 258)], "content ID"),  # a merge may use only earlier merges
        ([(99, 100), (99, 100)], "repeats"),
        ([(99,)], "pair"),
        ([(99.0, 100)], "non-int"),
    ],
)
def test_bad_merges(merges, match):
    with pytest.raises(InvalidInputError, match=match):
        ByteTokenizer(merges)


def test_merges_whose_pieces_double_are_refused_before_they_are_built():
    # 48 integers asked for 2**24-byte pieces, and 34 merges would have asked 64 GB (review).
    doubling = [(2, 2)] + [(258 + i, 258 + i) for i in range(27)]
    with pytest.raises(InvalidInputError, match=r"the merges' pieces hold more than 268435456 bytes in all from "
                                                 r"merge 26 on; at most 268435456"):
        ByteTokenizer(doubling)
    ByteTokenizer(doubling[:20])
    # 80,000 doubling merges: the count stops at merge 26, where it had held every length as
    # an exact int of up to 80,000 bits (462 MiB), then failed to print their sum (a ValueError).
    doubling = [(2, 2)] + [(258 + i, 258 + i) for i in range(79_999)]
    with pytest.raises(InvalidInputError, match="from merge 26 on"):
        ByteTokenizer(doubling)


def test_merges_may_build_on_earlier_merges():
    assert ByteTokenizer([(99, 100), (258, 258)]).encode_document("abab").tolist() == [0, 259, 1]


def test_external_identity_validation():
    digest = "ab" * 32
    gpt2 = TokenizerIdentity.external(50257, 50256, 50256, digest)
    assert (gpt2.vocabulary_size, gpt2.bos_id, gpt2.eos_id) == (50257, 50256, 50256)
    assert TokenizerIdentity.external(32000, 1, 2, digest) != gpt2
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        TokenizerIdentity.external(50257, 50257, 50256, digest)
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        TokenizerIdentity.external(50257, 0, -1, digest)
    with pytest.raises(InvalidInputError, match="hex"):
        TokenizerIdentity.external(50257, 0, 1, "AB" * 32)
    with pytest.raises(InvalidInputError, match="hex"):
        TokenizerIdentity.external(50257, 0, 1, "ab" * 31)
    with pytest.raises(InvalidInputError, match="maximum"):
        TokenizerIdentity.external(2**31 + 1, 0, 1, digest)
    assert TokenizerIdentity.external(2**31, 0, 1, digest).vocabulary_size == 2**31


# Regression: decode limits past int64 were a foreign error where they were used.
def test_decode_limits_beyond_int64_are_rejected_where_they_enter():
    limits = DecodeLimits(2**63 - 1, 2**63 - 1)
    binding = BatchBinding.for_tokenizer(ByteTokenizer(), split="audit", limits=limits)
    assert len(ExampleTable.from_arrays([0, 5, 1], [0, 3], binding)) == 1
    for name, arguments in [("max_tokens", (2**64, 10)), ("max_bytes", (10, 2**63))]:
        with pytest.raises(InvalidInputError, match=f"{name} is .*; the maximum is 9223372036854775807"):
            DecodeLimits(*arguments)


# Regression: token_bytes took a bool, float or str as a token ID.
@pytest.mark.parametrize("token", [True, 2.0, "2"])
def test_token_bytes_takes_only_int_ids(token):
    tokenizer = ByteTokenizer()
    assert tokenizer.token_bytes(np.int64(67)) == b"A"
    with pytest.raises(TokenizerError, match="a token ID must be an int"):
        tokenizer.token_bytes(token)


def test_ragged_ids_merges_and_limits_of_the_wrong_kind_are_named():
    # numpy's ValueError, a TypeError and an AttributeError escaped before (review).
    import seqpack as sp

    tokenizer = sp.ByteTokenizer.fixture()
    binding = sp.BatchBinding.fixture()
    ragged = [0, [5, 6], 1]
    cases = [
        (lambda: sp.BatchDocument("d", ragged), "token IDs is not a regular array"),
        (lambda: tokenizer.decode_document_bounded(ragged, binding.limits), "token IDs is not a regular array"),
        (lambda: binding.validate_document(ragged), "token IDs is not a regular array"),
        (lambda: sp.ByteTokenizer(None), "merges must be an iterable of \\(left, right\\) ID pairs, not NoneType"),
        (lambda: sp.ByteTokenizer("ab"), "merges must be an iterable of .* not str"),
        (lambda: tokenizer.decode_document_bounded([0, 5, 1], (10, 10)), "limits must be a DecodeLimits, not tuple"),
    ]
    for call, message in cases:
        with pytest.raises(sp.InvalidInputError, match=message):
            call()
    assert tokenizer.decode_document_bounded([0, 5, 1], binding.limits) == bytes([3])
