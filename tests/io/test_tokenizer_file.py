"""A Hugging Face tokenizers BPE, trained here on local text, bound by identity and round-tripped through a pack."""

import hashlib
import json
import pickle
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="the hf extra provides tokenizers")

import seqpack as sp  # noqa: E402
from seqpack import io  # noqa: E402

TEXTS = [
    "Packing keeps contexts apart.",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé text, emoji 🙂 and tabs\tsurvive the round trip.",
    "def f(x):\n    return x * 2\n",
] * 5


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    corpus = root / "train.txt"
    corpus.write_text("\n".join(TEXTS * 4))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(corpus)], trainer)
    tokenizer.enable_truncation(max_length=4)  # seqpack must turn this off: nothing is truncated
    path = root / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_identity_is_the_file(tokenizer_file):
    bound = io.TokenizerFile(tokenizer_file, bos="<|bos|>", eos="<|eos|>")
    assert bound.identity.digest == hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    assert (bound.bos_id, bound.eos_id) == (1, 2)
    assert bound.identity.vocabulary_size == bound.tokenizer.get_vocab_size(with_added_tokens=True)
    assert io.TokenizerFile(tokenizer_file, bos="1", eos=2).identity == bound.identity
    with pytest.raises(sp.InvalidInputError, match=r"--bos token '<s>' is not in the vocabulary"):
        io.TokenizerFile(tokenizer_file, bos="<s>", eos="<|eos|>")
    with pytest.raises(sp.InvalidInputError, match=r"--eos 100000 is not an ID"):
        io.TokenizerFile(tokenizer_file, bos=1, eos=100000)
    numpy_ids = io.TokenizerFile(tokenizer_file, bos=np.int64(1), eos=np.uint16(2))
    assert numpy_ids.identity == bound.identity and type(numpy_ids.bos_id) is int
    with pytest.raises(sp.InvalidInputError, match=r"--bos token '٣' is not in the vocabulary"):
        io.TokenizerFile(tokenizer_file, bos="٣", eos=2)  # a digit to str.isdigit, not an ID
    with pytest.raises(sp.InvalidInputError, match=r"--bos True is not an ID"):
        io.TokenizerFile(tokenizer_file, bos=True, eos=2)
    with pytest.raises(sp.InvalidInputError, match=r"for the tokenizer file, got float"):
        io.TokenizerFile(2.5, eos=2)
    # IDs too long for Python to print or parse raised its own ValueError (a traceback from the CLI)
    with pytest.raises(sp.InvalidInputError, match=r"--eos is a number of 5000 digits, not an ID in \[0, "):
        io.TokenizerFile(tokenizer_file, bos=1, eos="1" * 5000)
    with pytest.raises(sp.InvalidInputError, match=r"--eos an int of 16610 bits is not an ID in \[0, "):
        io.TokenizerFile(tokenizer_file, bos=1, eos=10**5000)


def test_unpickled_copies_share_one_tokenizer_and_encode_the_same(tmp_path, tokenizer_file):
    bound = io.TokenizerFile(tokenizer_file, bos="<|bos|>", eos="<|eos|>")
    data = pickle.dumps(bound)
    moved = tmp_path / "moved.json"
    tokenizer_file.rename(moved)  # a worker on another node: the file is not needed there
    try:
        copies = [pickle.loads(data) for _ in range(3)]
    finally:
        moved.rename(tokenizer_file)
    assert all(copy.tokenizer is copies[0].tokenizer for copy in copies)  # built once per process
    assert copies[0].tokenizer is not bound.tokenizer
    for copy in copies:
        assert (copy.identity, copy.describe(), copy.path) == (bound.identity, bound.describe(), bound.path)
        assert copy.tokenizer.truncation is None and copy.tokenizer.padding is None
        for got, expected in zip(copy.encode(TEXTS), bound.encode(TEXTS)):
            np.testing.assert_array_equal(got, expected)
    other = io.TokenizerFile(tokenizer_file, bos="<|eos|>", eos="<|bos|>")
    swapped = pickle.loads(pickle.dumps(other))  # same JSON, other control IDs: its own state
    assert swapped.tokenizer is copies[0].tokenizer and (swapped.bos_id, swapped.eos_id) == (2, 1)


def test_threads_unpickling_at_once_share_the_cache_safely(monkeypatch, tokenizer_file):
    from seqpack.io import tokenizer_file as tokenizer_module

    bound = io.TokenizerFile(tokenizer_file, bos="<|bos|>", eos="<|eos|>")
    parsed = json.loads(bound.tokenizer.to_str())
    texts = [json.dumps(parsed, indent=indent) for indent in range(tokenizer_module._UNPICKLED_KEPT + 3)]
    expected = bound.tokenizer.encode(TEXTS[0]).ids
    monkeypatch.setattr(tokenizer_module, "_UNPICKLED", {})
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            built = list(pool.map(tokenizer_module._unpickled_tokenizer, texts * 100))
    finally:
        sys.setswitchinterval(previous)
    assert all(tokenizer.encode(TEXTS[0]).ids == expected for tokenizer in built)
    assert len(tokenizer_module._UNPICKLED) == tokenizer_module._UNPICKLED_KEPT


def test_unpickling_without_tokenizers_names_the_extra(monkeypatch, tokenizer_file):
    from seqpack.io import tokenizer_file as tokenizer_module

    data = pickle.dumps(io.TokenizerFile(tokenizer_file, bos="<|bos|>", eos="<|eos|>"))
    monkeypatch.setattr(tokenizer_module, "_UNPICKLED", {})
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as on a worker without the extra
    with pytest.raises(sp.InvalidInputError, match=r"needs the 'hf' extra"):
        pickle.loads(data)


def test_a_bpe_round_trips_through_pack_and_verify(tmp_path, tokenizer_file):
    bound = io.TokenizerFile(tokenizer_file, bos="<|bos|>", eos="<|eos|>")
    binding = sp.BatchBinding.for_tokenizer(bound.identity, split="tests")
    lines = tmp_path / "docs.jsonl"
    lines.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    manifest = io.pack_corpus([io.JsonLines(lines)], tmp_path / "packed", binding=binding, tokenizer=bound,
                              config=sp.PackConfig(64, 2), policy="first-fit-decreasing")
    assert manifest["binding"]["tokenizer"]["digest"] == bound.identity.digest
    assert manifest["binding"]["tokenizer"]["kind"] == "tokenizers"
    io.verify_dataset(tmp_path / "packed")
    dataset = io.open_dataset(tmp_path / "packed")
    assert dataset.binding == binding
    for ordinal, text in enumerate(TEXTS):
        tokens = dataset.example(ordinal).document.token_ids
        assert tokens[0] == bound.bos_id and tokens[-1] == bound.eos_id
        assert bound.tokenizer.decode(tokens[1:-1].tolist()) == text
    expected = sum(len(bound.tokenizer.encode(t, add_special_tokens=False).ids) + 1 for t in TEXTS)
    assert dataset.report().valid_targets == expected  # every content token and each EOS, untruncated


def test_a_control_token_inside_a_text_names_the_line(tmp_path, tokenizer_file):
    bound = io.TokenizerFile(tokenizer_file, bos="<|bos|>", eos="<|eos|>")
    binding = sp.BatchBinding.for_tokenizer(bound.identity, split="tests")
    lines = tmp_path / "docs.jsonl"
    lines.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "a <|eos|> b"}) + "\n")
    with pytest.raises(sp.TokenizerError, match=r"docs\.jsonl:2: control token 2 \(EOS\) at position \d+ is inside"):
        io.pack_corpus([io.JsonLines(lines)], tmp_path / "packed", binding=binding, tokenizer=bound,
                       config=sp.PackConfig(64))
    assert not (tmp_path / "packed").exists()


def test_a_text_ending_with_the_eos_text_gets_no_second_eos(tmp_path, tokenizer_file):
    # TRL's add_eos appends EOS only to a text that does not end with it; such texts were refused (review).
    bound = io.TokenizerFile(tokenizer_file, bos="<|bos|>", eos="<|eos|>")
    binding = sp.BatchBinding.for_tokenizer(bound.identity, split="tests")
    texts = ["fine<|eos|>", "<|eos|>", "fine", "a<|eos|>"]
    lines = tmp_path / "docs.jsonl"
    lines.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    io.pack_corpus([io.JsonLines(lines)], tmp_path / "packed", binding=binding, tokenizer=bound,
                   config=sp.PackConfig(64), policy="next-fit")
    dataset = io.open_dataset(tmp_path / "packed")
    kept = [t for t in texts if t != "<|eos|>"]   # nothing but the EOS text: an empty document, skipped as "" is
    assert dataset.occurrence_count == len(kept)
    for ordinal, text in enumerate(kept):   # TRL: BOS, then the IDs of the text with the EOS text at its end once
        ending = text if text.endswith("<|eos|>") else text + "<|eos|>"
        expected = [bound.bos_id] + bound.tokenizer.encode(ending, add_special_tokens=False).ids
        assert dataset.example(ordinal).document.token_ids.tolist() == expected, text
    twice = tmp_path / "twice.jsonl"   # an EOS text before the last stays inside the content: refused
    twice.write_text(json.dumps({"text": "fine<|eos|><|eos|>"}) + "\n")
    with pytest.raises(sp.TokenizerError, match=r"twice\.jsonl:1: control token 2 \(EOS\) at position \d+ is inside"):
        io.pack_corpus([io.JsonLines(twice)], tmp_path / "refused", binding=binding, tokenizer=bound,
                       config=sp.PackConfig(64))


def test_without_final_drops_each_documents_last_token_when_it_is_the_one_given():
    content = np.array([5, 2, 7, 2, 2, 9], dtype=np.int32)
    every = np.ones(5, dtype=bool)
    kept, offsets = io.tokenizer_file.without_final(content, np.array([0, 2, 2, 3, 5, 6]), 2, every)
    assert kept.tolist() == [5, 7, 2, 9] and offsets.tolist() == [0, 1, 1, 2, 3, 4]
    kept, offsets = io.tokenizer_file.without_final(content, np.array([0, 2, 2, 3, 5, 6]), 2, ~every)
    assert kept.tolist() == content.tolist()   # only where the text ends with the EOS text
    kept, offsets = io.tokenizer_file.without_final(np.zeros(0, np.int32), np.array([0, 0]), 2, every[:1])
    assert kept.size == 0 and offsets.tolist() == [0, 0]


def test_the_binding_must_be_the_tokenizers(tmp_path, tokenizer_file):
    bound = io.TokenizerFile(tokenizer_file, bos="<|bos|>", eos="<|eos|>")
    lines = tmp_path / "docs.jsonl"
    lines.write_text(json.dumps({"text": "x"}))
    with pytest.raises(sp.InvalidInputError, match="identity differs"):
        io.pack_corpus([io.JsonLines(lines)], tmp_path / "packed", tokenizer=bound, config=sp.PackConfig(64),
                       binding=sp.BatchBinding.for_tokenizer(sp.ByteTokenizer(), split="tests"))
    assert np.all([not p.name.startswith(".") for p in tmp_path.iterdir()])


def pack_lines(tmp_path, tokenizer, lines, **options):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    binding = sp.BatchBinding.for_tokenizer(tokenizer.identity, split="tests")
    out = tmp_path / "out"
    io.pack_corpus([io.reader_for(path, **options)], out, config=sp.PackConfig(64, 2), tokenizer=tokenizer,
                   binding=binding)
    return out


def word_level(tmp_path, vocab, name="words.json"):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / name))
    return tmp_path / name


def test_a_text_the_tokenizer_cannot_encode_names_its_line(tmp_path):
    """The library's own error (an unknown token missing from a WordLevel vocabulary) was a
    traceback naming nothing; it is one InvalidInputError naming the file and line."""
    tokenizer = io.TokenizerFile(word_level(tmp_path, {"[BOS]": 0, "[EOS]": 1, "a": 2, "b": 3}), bos=0, eos=1)
    with pytest.raises(sp.InvalidInputError, match=r"in.jsonl:3: the tokenizer failed: .*Missing \[UNK\] token"):
        pack_lines(tmp_path, tokenizer, [{"text": "a b"}, {"text": "b"}, {"text": "a zzz"}])
    assert not (tmp_path / "out").exists()


def test_bpe_dropout_in_the_file_is_turned_off(tmp_path, tokenizer_file):
    """A file with BPE dropout gave other tokens on every run under one identity."""
    settings = json.loads(tokenizer_file.read_text())
    settings["model"]["dropout"] = 0.5
    path = tmp_path / "dropout.json"
    path.write_text(json.dumps(settings))
    tokenizer = io.TokenizerFile(path, bos="<|bos|>", eos="<|eos|>")
    plain = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    plain.no_truncation()
    for text in TEXTS[:4]:
        expected = plain.encode(text, add_special_tokens=False).ids
        assert all(tokenizer.encode([text] * 8)[0].tolist() == expected * 8 for _ in range(5))


def test_ids_in_a_gap_of_the_vocabulary_are_refused(tmp_path):
    """Pre-tokenized IDs that name no token passed the range check (and verify)."""
    path = word_level(tmp_path, {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, "a": 3, "b": 10})
    tokenizer = io.TokenizerFile(path, bos="[BOS]", eos="[EOS]")
    with pytest.raises(sp.InvalidInputError, match=r"in.jsonl:2: token ID 5 names no token of words.json "
                                                   r"\(a gap in its IDs\)"):
        pack_lines(tmp_path, tokenizer, [{"input_ids": [3, 10]}, {"input_ids": [3, 5, 6]}], ids_field="input_ids")
    out = pack_lines(tmp_path, tokenizer, [{"input_ids": [3, 10]}], ids_field="input_ids")
    assert io.open_dataset(out).example(0).document.token_ids.tolist() == [1, 3, 10, 2]


def test_a_directory_or_an_id_past_int32_is_named(tmp_path):
    with pytest.raises(sp.InvalidInputError, match=r"model: a directory, not a tokenizers JSON file \(a model "
                                                   r"directory holds one as .*model/tokenizer.json\)"):
        (tmp_path / "model").mkdir()
        io.TokenizerFile(tmp_path / "model", bos=0, eos=1)
    # Written into the JSON: tokenizers' own save walks every ID up to the largest (20 s).
    path = word_level(tmp_path, {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, "big": 3}, name="huge.json")
    described = json.loads(path.read_text())
    described["model"]["vocab"]["big"] = 2**31
    path.write_text(json.dumps(described))
    with pytest.raises(sp.InvalidInputError, match=r"huge.json: token ID 2147483648 does not fit int32"):
        io.TokenizerFile(path, bos=1, eos=2)


def test_verify_with_a_tokenizer_file_detects_a_different_one(tmp_path, tokenizer_file):
    """verify notices a tokenizer file changed since the pack (naming it) and passes the one packed with."""
    import subprocess


    bound = io.TokenizerFile(tokenizer_file, bos="<|bos|>", eos="<|eos|>")
    lines = tmp_path / "docs.jsonl"
    lines.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    io.pack_corpus([io.JsonLines(lines)], tmp_path / "packed", binding=sp.BatchBinding.for_tokenizer(
        bound.identity, split="tests"), tokenizer=bound, config=sp.PackConfig(64, 2))
    assert io.verify_dataset(tmp_path / "packed", tokenizer=tokenizer_file)["tokenizer"] == str(tokenizer_file)
    changed = tmp_path / "changed.json"
    described = json.loads(tokenizer_file.read_text())
    described["model"]["vocab"]["zzz-new"] = max(described["model"]["vocab"].values()) + 1
    changed.write_text(json.dumps(described))
    with pytest.raises(sp.VerificationError, match=rf"changed\.json: not the tokenizer .*packed was packed with "
                                                   r"\(SHA-256 .* \d+ IDs; the manifest records 'tokenizer\.json'"):
        io.verify_dataset(tmp_path / "packed", tokenizer=changed)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**described, "added_tokens": [], "model": {**described["model"], "vocab": {"a": 0}}}))
    with pytest.raises(sp.VerificationError, match=r"empty\.json: not the tokenizer .* was packed with \(not a tokenizers JSON file"):
        io.verify_dataset(tmp_path / "packed", tokenizer=empty)
    run = subprocess.run([sys.executable, "-m", "seqpack", "verify", str(tmp_path / "packed"), "--tokenizer",
                          str(changed), "--quiet"], capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.startswith("seqpack: error: ") and "not the tokenizer" in run.stderr
    run = subprocess.run([sys.executable, "-m", "seqpack", "verify", str(tmp_path / "packed"), "--tokenizer",
                          str(tokenizer_file), "--quiet"], capture_output=True, text=True)
    assert run.returncode == 0 and ": ok: the manifest matches its seal, the tokenizer is the one it was packed with, " \
        in run.stdout


def test_verify_with_a_tokenizer_file_refuses_a_byte_tokenizer_dataset(tmp_path, tokenizer_file):
    (tmp_path / "a.txt").write_text("hello")
    io.pack_corpus([io.TextFiles([tmp_path / "a.txt"])], tmp_path / "packed", binding=sp.BatchBinding.for_tokenizer(
        sp.ByteTokenizer(), split="tests"), tokenizer=sp.ByteTokenizer(), config=sp.PackConfig(32, 2))
    with pytest.raises(sp.VerificationError, match="was packed with the byte tokenizer, not a tokenizers file"):
        io.verify_dataset(tmp_path / "packed", tokenizer=tokenizer_file)


def word_level_file(path, vocab, template_ids=None):
    """A WordLevel tokenizers file of ``vocab``; ``template_ids``: the IDs of a template
    post-processor's first special token."""
    post = None if template_ids is None else {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": template_ids, "tokens": ["<s>"] * len(template_ids)}}}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for t, i in vocab.items() if t.startswith("[")]   # matched whole inside a text
    path.write_text(json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                                "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": post,
                                "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}))
    return path


def test_gaps_hidden_by_shared_ids_and_a_templates_bos_are_checked(tmp_path):
    # Two tokens sharing an ID hid the gap at ID 4; a template's BOS was taken unchecked (an IndexError for an
    # empty one, a gap or an ID past the vocabulary accepted or named without the file) (review).
    shared = word_level_file(tmp_path / "shared.json", {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, "a": 3, "b": 3, "c": 5})
    bound = io.TokenizerFile(shared, bos="[BOS]", eos="[EOS]")
    assert bound.known_ids.tolist() == [0, 1, 2, 3, 5]
    lines = tmp_path / "ids.jsonl"
    lines.write_text(json.dumps({"input_ids": [3, 4, 5]}) + "\n")
    with pytest.raises(sp.InvalidInputError, match=r"ids\.jsonl:1: token ID 4 names no token of shared\.json"):
        io.pack_corpus([io.reader_for(lines, ids_field="input_ids")], tmp_path / "out", config=sp.PackConfig(64, 2),
                       tokenizer=bound, binding=sp.BatchBinding.for_tokenizer(bound.identity, split="t"))
    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, "a": 3, "b": 5}
    assert io.TokenizerFile(word_level_file(tmp_path / "empty.json", vocab, []), eos="[EOS]").bos_id is None
    assert io.TokenizerFile(word_level_file(tmp_path / "one.json", vocab, [1]), eos="[EOS]").bos_id == 1
    for name, ids in (("gap.json", [4]), ("outside.json", [50])):
        with pytest.raises(sp.InvalidInputError, match=rf"{name}: its post-processor puts ID {ids[0]} first, which "
                                                       rf"names no token of the vocabulary: give --bos"):
            io.TokenizerFile(word_level_file(tmp_path / name, vocab, ids), eos="[EOS]")
    assert io.TokenizerFile(tmp_path / "gap.json", bos="[BOS]", eos="[EOS]").bos_id == 1   # --bos decides


CONFIG = sp.PackConfig(64, 2)


def test_only_a_text_ending_with_the_eos_text_loses_its_final_eos(tmp_path):
    # TRL's add_eos compares the text: "...[EOS]\n" gets a second EOS there, so its first is inside the content
    # (refused), where IDs alone dropped it silently (review).
    path = word_level_file(tmp_path / "words.json", {"[UNK]": 0, "[EOS]": 1, "hello": 2, "world": 3})
    bound = io.TokenizerFile(path, eos="[EOS]")
    binding = sp.BatchBinding.for_tokenizer(bound.identity, split="t")
    for text, expected in (("hello world[EOS]", [2, 3, 1]), ("hello world", [2, 3, 1]),
                           ("hello world[EOS]\n", None), ("hello world [EOS][EOS]", None)):
        lines = tmp_path / "in.jsonl"
        lines.write_text(json.dumps({"text": text}) + "\n")
        out = tmp_path / f"out-{len(text)}"
        if expected is None:
            with pytest.raises(sp.TokenizerError, match=r"in\.jsonl:1: control token 1 \(EOS\) at position \d+ is"):
                io.pack_corpus([io.JsonLines(lines)], out, config=CONFIG, tokenizer=bound, binding=binding)
            continue
        io.pack_corpus([io.JsonLines(lines)], out, config=CONFIG, tokenizer=bound, binding=binding)
        assert io.open_dataset(out).example(0).document.token_ids.tolist() == expected, text
