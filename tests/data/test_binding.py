"""Partitions, split receipts, BatchBinding (fixture and external) and BatchDocument."""

import copy
import dataclasses
import hashlib
import importlib.resources
import json
import pickle

import numpy as np
import pytest

from seqpack.data import DEFAULT_LIMITS
from seqpack import (
    BatchBinding,
    BatchDocument,
    BindingError,
    ByteTokenizer,
    DecodeLimitError,
    DecodeLimits,
    InvalidInputError,
    Partition,
    SplitReceipt,
    TokenizerError,
    TokenizerIdentity,
)
import seqpack as sp
from seqpack import _threads
from seqpack.layout import counts as layout_counts
from seqpack.errors import BatchIndexError

RECEIPT_DIGEST = "cd" * 32
GPT2_LIKE = TokenizerIdentity.external(50257, 50256, 50256, "ef" * 32)


def test_partition_values():
    assert [p.value for p in Partition] == ["train", "validation", "test"]
    assert Partition("validation") is Partition.VALIDATION


def test_fixture_receipt():
    receipt = SplitReceipt.fixture()
    assert receipt.partitions[Partition.TRAIN] == ("short", "long")
    assert receipt.partition_of("long") is Partition.TRAIN
    assert receipt.partition_of("held-out-b") is Partition.TEST
    with pytest.raises(InvalidInputError, match="not in the split receipt"):
        receipt.partition_of("missing")
    resource = importlib.resources.files("seqpack.fixtures").joinpath("split_receipt.json")
    payload = json.loads(resource.read_text(encoding="utf-8"))
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    assert receipt.digest == hashlib.sha256(canonical).hexdigest()


def test_receipt_load_from_path_and_digest_ignores_formatting(tmp_path):
    payload = {"partitions": {"train": ["a"], "validation": [], "test": ["b"]}, "note": "x"}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(payload, indent=4))
    loaded = SplitReceipt.load(path)
    assert loaded == SplitReceipt.load(str(path)) == SplitReceipt(payload)
    payload["note"] = "y"
    assert SplitReceipt(payload).digest != loaded.digest


@pytest.mark.parametrize(
    "payload, match",
    [
        ({}, "partitions"),
        ({"partitions": {"train": [], "test": []}}, "exactly"),
        ({"partitions": {"train": ["a"], "validation": ["a"], "test": []}}, "both"),
        ({"partitions": {"train": [""], "validation": [], "test": []}}, "bad ID"),
        ({"partitions": {"train": "a", "validation": [], "test": []}}, "list"),
        ({"partitions": {"train": [], "validation": [], "test": []}, "x": {1.5}}, "plain JSON"),
        # Keys that do not sort together, NaN: TypeError and a non-JSON digest before (review).
        ({"partitions": {Partition.TRAIN: ["a"], Partition.VALIDATION: [], Partition.TEST: []}},
         r"got \[\"<Partition.TEST: 'test'>\", .*\(keys are the partitions' names as strings\)"),
        ({"partitions": {"train": [], "validation": [], "test": [], 1: []}}, r"got \[\"'test'\", .*'1'\]"),
        ({"partitions": {"train": [], "validation": [], "test": []}, "x": float("nan")}, "plain JSON"),
        # A key JSON makes a string merged two pieces of evidence into one digest; a lone surrogate
        # was a UnicodeEncodeError (review).
        ({"partitions": {"train": [], "validation": [], "test": []}, "x": {1: "alice", "1": "bob"}},
         "keys must be strings"),
        ({"partitions": {"train": ["doc-\ud800"], "validation": [], "test": []}}, "plain JSON data: .*surrogates not allowed"),
        ({"partitions": {"train": [], "validation": [], "test": []}, "note": "\udcff"}, "plain JSON"),
    ],
)
def test_bad_receipts(payload, match):
    with pytest.raises(InvalidInputError, match=match):
        SplitReceipt(payload)


def test_receipt_rejects_invalid_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        SplitReceipt.load(path)
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"partitions": {"train": ["caf\xe9"], "validation": [], "test": []}}')
    for source, message in ((latin1, " is not UTF-8"), (tmp_path / "missing.json", ": cannot read: No such file"),
                            (tmp_path, ": cannot read: Is a directory")):
        with pytest.raises(InvalidInputError, match=f"split receipt {source}{message}"):
            SplitReceipt.load(source)


def test_a_receipt_file_s_errors_name_it_and_receipts_pickle(tmp_path):
    path = tmp_path / "odd.json"
    path.write_text('{"partitions": {"train": ["doc-\\ud800"], "validation": [], "test": []}}')
    with pytest.raises(InvalidInputError, match=f"^split receipt {path}: a split receipt must be plain JSON") as raised:
        SplitReceipt.load(path)
    assert raised.value.path == str(path)
    receipt = SplitReceipt.fixture()
    assert pickle.loads(pickle.dumps(receipt)) == copy.deepcopy(receipt) == receipt   # TypeError before (review)
    assert pickle.loads(pickle.dumps(receipt)).partitions == receipt.partitions


def test_fixture_binding():
    binding = BatchBinding.fixture()
    assert binding.vocabulary_size == 266
    assert (binding.bos_id, binding.eos_id) == (0, 1)
    assert binding.split_receipt_digest == SplitReceipt.fixture().digest
    assert binding.limits.max_tokens >= 1_000_000 and binding.limits.max_bytes >= 8_000_000
    assert binding == BatchBinding.fixture() and hash(binding) == hash(BatchBinding.fixture())
    assert binding.validate_document(np.array([0, 99, 1], dtype=np.int32)) == 1
    assert binding.validate_document(np.array([0, 100, 101, 102, 1], dtype=np.int32)) == 3
    assert binding.validate_document(np.array([0, 1], dtype=np.int32)) == 0
    assert binding.decode_document([0, 263, 1]) == b"the "


def test_binding_equality_by_value_and_each_field_matters():
    tokenizer = ByteTokenizer.fixture()
    limits = DecodeLimits(100, 200)
    base = BatchBinding(tokenizer.identity, RECEIPT_DIGEST, limits, tokenizer)
    assert base == BatchBinding(ByteTokenizer.fixture().identity, RECEIPT_DIGEST, DecodeLimits(100, 200), ByteTokenizer.fixture())
    # The decoding tokenizer is not compared: the identity stands for it.
    assert base == BatchBinding(tokenizer.identity, RECEIPT_DIGEST, limits)
    others = [
        BatchBinding(ByteTokenizer(tokenizer.merges[:7]).identity, RECEIPT_DIGEST, limits, ByteTokenizer(tokenizer.merges[:7])),
        BatchBinding(tokenizer.identity, "ce" * 32, limits, tokenizer),
        BatchBinding(tokenizer.identity, RECEIPT_DIGEST, DecodeLimits(101, 200), tokenizer),
        BatchBinding(tokenizer.identity, RECEIPT_DIGEST, DecodeLimits(100, 199), tokenizer),
    ]
    for other in others:
        assert base != other
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.limits = DecodeLimits(1, 1)


def test_binding_rejects_mismatched_or_malformed_fields():
    tokenizer = ByteTokenizer.fixture()
    limits = DecodeLimits(10, 10)
    with pytest.raises(BindingError, match="identity differs"):
        BatchBinding(ByteTokenizer().identity, RECEIPT_DIGEST, limits, tokenizer)
    with pytest.raises(InvalidInputError, match="split_receipt_digest"):
        BatchBinding(tokenizer.identity, "not-a-digest", limits, tokenizer)
    with pytest.raises(InvalidInputError, match="DecodeLimits"):
        BatchBinding(tokenizer.identity, RECEIPT_DIGEST, (10, 10), tokenizer)
    with pytest.raises(InvalidInputError, match="ByteTokenizer or a TokenizerIdentity"):
        BatchBinding.for_tokenizer("gpt2", split="web-2024")


def test_for_tokenizer_binds_a_split_by_receipt_file_or_name(tmp_path):
    """A receipt, its file or a name: the digest a binding records for the split."""
    tokenizer = ByteTokenizer.fixture()
    receipt = SplitReceipt.fixture()
    by_receipt = BatchBinding.for_tokenizer(tokenizer, split=receipt)
    assert by_receipt == BatchBinding.fixture() and by_receipt.split_receipt_digest == receipt.digest
    path = tmp_path / "receipt.json"
    path.write_text(json.dumps({"partitions": {"train": ["a"], "validation": [], "test": ["b"]}}))
    by_file = BatchBinding.for_tokenizer(tokenizer, split=path)
    assert by_file.split_receipt_digest == SplitReceipt.load(path).digest != receipt.digest
    by_name = BatchBinding.for_tokenizer(tokenizer, split="wikitext-2024-06")
    assert by_name == BatchBinding.for_tokenizer(tokenizer, split="wikitext-2024-06")
    assert by_name != BatchBinding.for_tokenizer(tokenizer, split="wikitext-2024-07")
    # A plain string is a name, never a path: the same text as a Path reads the file.
    assert BatchBinding.for_tokenizer(tokenizer, split=str(path)) != by_file
    assert by_name.limits == DEFAULT_LIMITS
    external = BatchBinding.for_tokenizer(GPT2_LIKE, split="web", limits=DecodeLimits(6, 1))
    assert external.tokenizer is None and external.vocabulary_size == 50257
    for bad in ("", None, 3):
        with pytest.raises(InvalidInputError, match="split must be"):
            BatchBinding.for_tokenizer(tokenizer, split=bad)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        BatchBinding.for_tokenizer(tokenizer, split=tmp_path / "broken.json")


def test_validate_document_errors_beside_their_twins():
    binding = BatchBinding(ByteTokenizer.fixture().identity, RECEIPT_DIGEST, DecodeLimits(5, 4), ByteTokenizer.fixture())
    assert binding.validate_document(np.array([0, 263, 1], dtype=np.int32)) == 1  # 4 bytes
    with pytest.raises(DecodeLimitError, match="5 bytes") as caught:
        binding.validate_document(np.array([0, 263, 99, 1], dtype=np.int32))
    assert caught.value.position == 2
    assert binding.validate_document(np.array([0, 99, 99, 99, 1], dtype=np.int32)) == 3  # 5 tokens
    with pytest.raises(DecodeLimitError, match="6 tokens") as caught:
        binding.validate_document(np.array([0, 99, 99, 99, 99, 1], dtype=np.int32))
    assert caught.value.position == 5
    with pytest.raises(TokenizerError, match="position 1") as caught:
        binding.validate_document(np.array([0, 266, 1], dtype=np.int32))
    assert caught.value.position == 1


def test_external_gpt2_like_binding():
    binding = BatchBinding(GPT2_LIKE, RECEIPT_DIGEST, DecodeLimits(6, 1))
    assert binding.tokenizer is None
    assert (binding.vocabulary_size, binding.bos_id, binding.eos_id) == (50257, 50256, 50256)
    # BOS and EOS share an ID: framing is by place; the byte limit cannot apply.
    doc = np.array([50256, 464, 3290, 50255, 50256], dtype=np.int32)
    assert binding.validate_document(doc) == 3
    assert binding.validate_document(np.array([50256, 50256], dtype=np.int32)) == 0
    cases = [
        ([50256, 464, 50256, 3290, 50256], 2, "control token 50256"),
        ([464, 3290, 50256], 0, "start with BOS 50256"),
        ([50256, 464, 3290], 2, "end with EOS 50256"),
        ([50256, 50257, 50256], 1, "token 50257 at position 1 is out of vocabulary"),
        ([50256, -5, 50256], 1, "negative"),
        ([50256], 0, "no EOS"),
    ]
    for ids, position, match in cases:
        with pytest.raises(TokenizerError, match=match) as caught:
            binding.validate_document(np.array(ids, dtype=np.int32))
        assert caught.value.position == position
    with pytest.raises(DecodeLimitError, match="7 tokens; the limit is 6") as caught:
        binding.validate_document(np.array([50256, 1, 2, 3, 4, 5, 50256], dtype=np.int32))
    assert caught.value.position == 6
    with pytest.raises(BindingError, match="cannot decode"):
        binding.decode_document(doc)
    assert binding != BatchBinding(TokenizerIdentity.external(50257, 50256, 50256, "ee" * 32), RECEIPT_DIGEST, DecodeLimits(6, 1))


def test_document_storage():
    source = np.array([0, 99, 1], dtype=np.int64)
    doc = BatchDocument("short", source)
    source[1] = 5
    assert doc.token_ids.tolist() == [0, 99, 1]
    assert doc.token_ids.dtype == np.int32 and doc.token_ids.flags.c_contiguous
    assert not doc.token_ids.flags.writeable
    assert (doc.source_id, doc.partition, len(doc)) == ("short", Partition.TRAIN, 3)
    strided = np.arange(10, dtype=np.uint16)[::2]
    assert BatchDocument("s", strided, Partition.TEST).token_ids.tolist() == [0, 2, 4, 6, 8]
    assert BatchDocument("list", [0, 1]).token_ids.dtype == np.int32
    assert len(BatchDocument("empty", [])) == 0
    bounds = [-(2**31), 2**31 - 1]
    assert BatchDocument("edge", bounds).token_ids.tolist() == bounds
    with pytest.raises(AttributeError):
        doc.source_id = "other"


@pytest.mark.parametrize(
    "source_id, token_ids, partition, match",
    [
        ("", [0, 1], Partition.TRAIN, "source_id"),
        (7, [0, 1], Partition.TRAIN, "source_id"),
        ("d", [0.0, 1.0], Partition.TRAIN, "integers"),
        ("d", [True, False], Partition.TRAIN, "integers"),
        ("d", [[0, 1]], Partition.TRAIN, "1-D"),
        ("d", [0, 2**31], Partition.TRAIN, "int32"),
        ("d", np.array([-(2**31) - 1, 1]), Partition.TRAIN, "int32"),
        ("d", np.array([2**64 - 1], dtype=np.uint64), Partition.TRAIN, "int32"),
        ("d", [0, 1], "train", "Partition"),
    ],
)
def test_document_rejects(source_id, token_ids, partition, match):
    with pytest.raises(InvalidInputError, match=match):
        BatchDocument(source_id, token_ids, partition)


TRAIN = sp.Partition.TRAIN


@pytest.fixture(scope="module")
def examples(binding):
    documents = [sp.BatchDocument(f"d{i}", [0] + [99 + j for j in range(i % 5 + 1)] + [1]) for i in range(12)]
    return [sp.SequenceExample.from_document(f"e{i}", d, binding) for i, d in enumerate(documents)]


def many_documents(count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` framed two-prediction documents, over the bulk kernels' thread threshold."""
    return np.tile(np.array([0, 99, 100, 1]), count), np.arange(0, 4 * count + 1, 4)


@pytest.mark.kernel
def test_thread_counts_that_would_end_the_process_are_refused(binding):
    """threads=32768 ended the process (libgomp could not start the team) and 65536
    crashed it; the most a caller may ask for is now 1024, which runs."""
    tokens, offsets = many_documents(400_000)
    for call in (lambda t: sp.ExampleTable.from_arrays(tokens, offsets, binding, threads=t),
                 lambda t: sp.pack(table, sp.PackConfig(12), partition=TRAIN, binding=binding, threads=t)):
        table = sp.ExampleTable.from_arrays(tokens, offsets, binding, threads=1)
        for threads in (_threads.MAX_THREADS + 1, 32768, 65536):
            with pytest.raises(InvalidInputError, match=rf"threads is {threads}; the maximum is 1024"):
                call(threads)
    table = sp.ExampleTable.from_arrays(tokens, offsets, binding, threads=1024)
    many = sp.pack(table, sp.PackConfig(12), partition=TRAIN, binding=binding, threads=1024)
    one = sp.pack(table, sp.PackConfig(12), partition=TRAIN, binding=binding, threads=1)
    for name, field in one.fields.items():
        assert np.array_equal(many.fields[name], field), name


@pytest.mark.kernel
def test_permitted_edges_are_exact_past_int64():
    """2**20 segments of 2**22 predictions permit 2**63 + 2**42 edges; the report said
    -9223369837831520256 (and a negative permitted fraction)."""
    lengths = np.full(2**20, 2**22, dtype=np.int64)
    assert layout_counts.permitted_edges(lengths) == 2**20 * (2**22 * (2**22 + 1) // 2)
    rng = np.random.default_rng(0)
    for count in (0, 1, 1000):
        lengths = rng.integers(0, 2**31, count)
        assert layout_counts.permitted_edges(lengths) == sum(int(n) * (int(n) + 1) // 2 for n in lengths)
    report = sp.EfficiencyReport.of("next-fit", 2**31 - 1, 4, np.full(4, 2**31 - 1, np.int64), np.ones(4, np.int64))
    assert report.permitted_edges == 4 * ((2**31 - 1) * 2**31 // 2) and 0 < report.permitted_fraction <= 1
    with pytest.raises(InvalidInputError, match="segment lengths"):
        layout_counts.permitted_edges(np.array([-1]))


@pytest.mark.kernel
def test_example_ids_are_checked_before_they_name_a_bad_range(binding):
    """A bad range was named through ids before ids were checked: a generator, a set, a
    dict or an int raised TypeError or KeyError, and a string named example 'b'."""
    tokens, offsets = np.array([0, 5, 6, 1, 0, 7, 8, 1]), np.array([0, 4, 8])
    bad_ranges = np.array([[0, 4], [0, 9]])
    for ids in ({"a", "b"}, {"a": 1, "b": 2}, 5, "ab", b"ab"):
        with pytest.raises(InvalidInputError, match="ids must be (a|an ordered) sequence of names"):
            sp.ExampleTable.from_arrays(tokens, offsets, binding, ranges=bad_ranges, ids=ids)
    for ids in ((name for name in ("a", "b")), ["a", "b"], np.array(["a", "b"])):
        with pytest.raises(InvalidInputError, match=r"example 'b' \(index 1\): source range \[0, 9\) must lie"):
            sp.ExampleTable.from_arrays(tokens, offsets, binding, ranges=bad_ranges, ids=ids)
    with pytest.raises(InvalidInputError, match="1 ids for 2 examples"):
        sp.ExampleTable.from_arrays(tokens, offsets, binding, ranges=bad_ranges, ids=["a"])
    table = sp.ExampleTable.from_arrays(tokens, offsets, binding, ids=(name for name in ("a", "b")))
    assert [table.example_id(i) for i in range(2)] == ["a", "b"]
    assert len(table.chunk(-1, 5)) == 1
    for bad in (0.5, "1", None):
        with pytest.raises(InvalidInputError, match="start must be an int"):
            table.chunk(bad, 2)


@pytest.mark.kernel
def test_a_constructed_example_with_a_bad_range_is_refused(examples, binding):
    """SequenceExample's constructor only stores: an example of no prediction vanished
    from the packed row, one past its document's end took 8 cells for 3 predictions, and a
    reversed range raised from len()."""
    document = sp.BatchDocument("d", [0, 99, 100, 1])
    for bad in (range(0, 1), range(0, 9), range(3, 1), range(0, 4, 2), (0, 4)):
        raw = sp.SequenceExample("raw", document, bad, binding)
        for call in (lambda: sp.pack([examples[0], raw], sp.PackConfig(12), partition=TRAIN, binding=binding),
                     lambda: sp.pad([examples[0], raw], sp.PadConfig(), partition=TRAIN, binding=binding),
                     lambda: sp.plan([examples[0], raw], sp.PackConfig(12), partition=TRAIN, binding=binding)):
            with pytest.raises(InvalidInputError, match=r"example 'raw' \(index 1\): source range .* is not a step-1"):
                call()
    raw = sp.SequenceExample("raw", [0, 99, 1], range(0, 3), binding)
    with pytest.raises(InvalidInputError, match="holds no BatchDocument"):
        sp.pack([raw], sp.PackConfig(12), partition=TRAIN, binding=binding)
    fine = sp.SequenceExample("fine", document, range(0, 4), binding)
    assert sp.pack([fine], sp.PackConfig(12), partition=TRAIN, binding=binding)[0].target_count == 3


@pytest.mark.kernel
def test_a_batch_number_outside_the_batches_is_one_error_everywhere(examples, binding, tmp_path):
    """Epochs raised a bare IndexError or TypeError where plans raised InvalidInputError;
    every container of batches now raises BatchIndexError, which is both."""
    config = sp.PackConfig(8, 2)
    plan = sp.plan(examples, config, partition=TRAIN, binding=binding)
    epoch = sp.pack(examples, config, partition=TRAIN, binding=binding)
    padded = sp.pad(examples, sp.PadConfig(rows_per_batch=5), partition=TRAIN, binding=binding)
    count = len(plan)
    assert count == len(epoch) == len(epoch.batches) > 2 and len(padded) == 3
    for container, owner, size in ((epoch, "epoch", count), (epoch.batches, "epoch", count), (padded, "epoch", 3),
                                   (plan, "plan", count)):
        assert container[-1].segments.tolist() == container[size - 1].segments.tolist()
        for bad in (size, -size - 1, True, 1.0, "a"):
            with pytest.raises(BatchIndexError, match=rf"this {owner}'s batches (are numbered )?\[0, {size}\)") as caught:
                container[bad]
            assert isinstance(caught.value, IndexError) and isinstance(caught.value, InvalidInputError)
    assert [b.segments.tolist() for b in epoch] == [b.segments.tolist() for b in plan]  # iteration unchanged
    assert len(epoch[1:3]) == 2 and len(padded[::2]) == 2


@pytest.mark.kernel
def test_a_decoder_names_a_config_that_is_not_one():
    with pytest.raises(InvalidInputError, match="config must be a DecoderConfig, not NoneType"):
        sp.Decoder(None, 0)
