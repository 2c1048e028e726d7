"""verify_dataset: every flipped byte, every broken rule and every incomplete pack is refused, naming the file."""

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import seqpack as sp
from helpers import reseal
from seqpack import io
from seqpack.io import format as fmt
from seqpack.io import publish
from seqpack.io.stats import dataset_stats

TOKENIZER = sp.ByteTokenizer()
BINDING = sp.BatchBinding.for_tokenizer(TOKENIZER, split="tests")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    docs = root / "docs"
    docs.mkdir()
    rng = np.random.default_rng(3)
    for index in range(30):
        (docs / f"{index:02d}.txt").write_bytes(bytes(rng.integers(32, 127, size=int(rng.integers(1, 90)),
                                                                   dtype=np.uint8)))
    io.pack_corpus([io.TextFiles([docs])], root / "packed", binding=BINDING, tokenizer=TOKENIZER,
                   config=sp.PackConfig(40, 2), policy="best-fit-decreasing", long="cut")
    return root / "packed"


def copy_of(packed, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(packed, target)
    return target


def test_a_good_dataset_verifies(packed):
    checked = io.verify_dataset(packed)
    manifest = json.loads((packed / "manifest.json").read_text())
    assert checked["batches_verified"] == manifest["counts"]["batches"] > 3
    assert checked["files"] == 4 and checked["examples"] == manifest["counts"]["examples"]


@pytest.mark.parametrize("name", fmt.PART_FILES)
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_one_flipped_byte_in_any_file_is_named(packed, tmp_path, name, where):
    target = copy_of(packed, tmp_path)
    path = target / "part-00000" / name
    data = bytearray(path.read_bytes())
    at = min(int(where * len(data)), len(data) - 1)
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(sp.VerificationError, match=rf"{name}: SHA-256 .* differs from the manifest's"):
        io.verify_dataset(target)


def test_an_incomplete_pack_is_refused(packed, tmp_path):
    target = copy_of(packed, tmp_path)
    (target / "manifest.json").unlink()
    with pytest.raises(sp.InvalidInputError, match="manifest.json: missing, so .* is not a complete packed dataset"):
        io.verify_dataset(target)
    with pytest.raises(sp.InvalidInputError, match="not a complete packed dataset"):
        io.open_dataset(target)


def rewrite(target, name, array):
    """Replace a part file and record its new checksum: only the rules can catch it now."""
    record = publish.write_array(target / "part-00000" / name, array)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["parts"][0]["files"][name] = record
    reseal(target, manifest)


def test_a_placement_other_than_the_policy_is_refused(packed, tmp_path):
    target = copy_of(packed, tmp_path)
    occurrences = np.load(target / "part-00000" / "occurrences.npy")
    swapped = occurrences.copy()
    swapped[[0, 1], 0] = swapped[[1, 0], 0]  # two examples trade places
    rewrite(target, "occurrences.npy", swapped)
    with pytest.raises(sp.VerificationError, match=r"occurrences\.npy: the placement differs from best-fit-decreasing"):
        io.verify_dataset(target)


def test_examples_that_are_not_the_documents_windows_are_refused(packed, tmp_path):
    target = copy_of(packed, tmp_path)
    examples = np.load(target / "part-00000" / "examples.npy")
    examples[0, 1:] += 1  # the same size, shifted
    rewrite(target, "examples.npy", examples)
    with pytest.raises(sp.VerificationError, match=r"examples\.npy: the examples are not the documents' ranges"):
        io.verify_dataset(target)


def test_a_count_that_disagrees_is_refused(packed, tmp_path):
    target = copy_of(packed, tmp_path)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["parts"][0]["valid_targets"] += 1
    reseal(target, manifest)
    with pytest.raises(sp.VerificationError, match="records valid_targets"):
        io.verify_dataset(target)


def test_a_placement_outside_its_row_is_refused_on_open(packed, tmp_path):
    """The fill kernel trusts placements: opening refuses one that would write past a row."""
    target = copy_of(packed, tmp_path)
    occurrences = np.load(target / "part-00000" / "occurrences.npy")
    occurrences[0, 2] = 39
    rewrite(target, "occurrences.npy", occurrences)
    with pytest.raises(sp.InvalidInputError, match=r"occurrences\.npy: placement 0 does not lie inside a row"):
        io.open_dataset(target)
    with pytest.raises(sp.VerificationError, match=r"occurrences\.npy: placement 0 does not lie inside a row"):
        io.verify_dataset(target)


def test_tokens_out_of_vocabulary_are_refused(packed, tmp_path):
    target = copy_of(packed, tmp_path)
    path = target / "part-00000" / "tokens.bin"
    tokens = np.fromfile(path, dtype="<u2")
    tokens[5] = 400
    tokens.tofile(path)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["parts"][0]["files"]["tokens.bin"]["sha256"] = publish.file_sha256(path)
    reseal(target, manifest)
    with pytest.raises(sp.VerificationError, match=r"tokens\.bin: a token lies outside the vocabulary"):
        io.verify_dataset(target)


def test_a_manifest_nested_too_deep_is_one_clear_error(packed, tmp_path):
    """JSON nested 100,000 deep raised a RecursionError traceback from every command."""
    target = copy_of(packed, tmp_path)
    (target / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    for call in (io.open_dataset, io.verify_dataset):
        with pytest.raises(sp.InvalidInputError, match=r"manifest\.json: not a seqpack packed-dataset manifest: its "
                                                       r"JSON is nested too deep to read"):
            call(target)
    assert not fmt.is_packed_dataset(target)


def test_a_token_file_of_a_partial_token_is_refused(packed, tmp_path):
    """One byte appended to a uint16 tokens.bin (its size and checksum recorded, the
    manifest sealed again) verified ok: 30 tokens in 61 bytes."""
    target = copy_of(packed, tmp_path)
    path = target / "part-00000" / "tokens.bin"
    path.write_bytes(path.read_bytes() + b"\0")
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["parts"][0]["files"]["tokens.bin"] = {"bytes": path.stat().st_size, "sha256": publish.file_sha256(path)}
    reseal(target, manifest)
    with pytest.raises(sp.VerificationError, match=r"tokens\.bin: \d+ bytes, not a whole number of 2-byte tokens"):
        io.verify_dataset(target)


def test_document_lengths_no_pack_writes_name_their_file(packed, tmp_path):
    """A flipped byte in documents.npy (long documents cut) reached the cutting of the
    documents into windows, whose error named no file."""
    target = copy_of(packed, tmp_path)
    documents = np.load(target / "part-00000" / "documents.npy")
    documents[0, 2] = -(2**56)
    rewrite(target, "documents.npy", documents)
    with pytest.raises(sp.InvalidInputError, match=r"documents\.npy: lengths must not be negative"):
        io.open_dataset(target)


def test_an_example_whose_tokens_break_the_binding_is_named(packed, tmp_path):
    """A token file changed past its checksum (verify names it) made example(0) fail
    with 'document must start with BOS', naming neither the example nor the file."""
    target = copy_of(packed, tmp_path)
    path = target / "part-00000" / "tokens.bin"
    data = bytearray(path.read_bytes())
    data[0] = 0xFF
    path.write_bytes(bytes(data))
    dataset = io.open_dataset(target)
    with pytest.raises(sp.TokenizerError, match=rf"^example {re.escape(repr(dataset.example_id(0)))}: document must "
                                                r"start with BOS 0; position 0 holds 255$"):
        dataset.example(0)


@pytest.mark.parametrize("damage, message", [
    ("no parts", r"manifest\.json: lists no part$"),
    ("part without files", r"manifest\.json: malformed manifest \(no 'files' key\)$"),
    ("bad capacity", r"manifest\.json: malformed manifest \(capacity must be an int, got str\)$"),
    # A part named outside the directory, or listed twice, let a directory of nothing but a
    # manifest verify.
    ("part elsewhere", r"malformed manifest \(part name '\.\./original/part-00000' is not part-NNNNN\)$"),
    ("absolute part", r"malformed manifest \(part name '/.*/part-00000' is not part-NNNNN\)$"),
    ("part twice", r"malformed manifest \(part 'part-00000' is listed twice\)$"),
    ("linked part", r"part-00000: a symbolic link; a dataset's parts are its own directories$"),
])
def test_a_malformed_manifest_is_one_clear_error(packed, tmp_path, damage, message):
    target = copy_of(packed, tmp_path)
    manifest = json.loads((target / "manifest.json").read_text())
    if damage == "no parts":
        manifest["parts"] = []
    elif damage == "part without files":
        del manifest["parts"][0]["files"]
    elif damage in ("part elsewhere", "absolute part", "linked part"):
        original = copy_of(packed, tmp_path / "original-root")
        shutil.move(original, tmp_path / "original")
        shutil.rmtree(target / "part-00000")
        if damage == "linked part":
            (target / "part-00000").symlink_to(tmp_path / "original" / "part-00000")
        else:
            where = "../original" if damage == "part elsewhere" else str(tmp_path / "original")
            manifest["parts"][0]["name"] = f"{where}/part-00000"
    elif damage == "part twice":
        manifest["parts"].append(manifest["parts"][0])
    else:
        manifest["config"]["capacity"] = "wide"
    reseal(target, manifest)
    with pytest.raises(sp.InvalidInputError, match=message):
        io.open_dataset(target)
    with pytest.raises(sp.VerificationError, match=message):  # verify reports every fault as a VerificationError
        io.verify_dataset(target)


@pytest.mark.parametrize("damage, message", [
    # Each of these verified "ok" (review).
    ("linked file", r"part-00000/tokens\.bin: a symbolic link; a dataset's manifest, parts and files are its own$"),
    ("linked manifest", r"manifest\.json: a symbolic link; a dataset's manifest, parts and files are its own$"),
    ("a file listed but not the format's", r"manifest\.json: part part-00000 lists 'notes\.txt', which no part "
                                           r"holds$"),
    ("a file outside listed", r"manifest\.json: part part-00000 lists '\.\./\.\./outside\.txt', which no part "
                              r"holds$"),
])
def test_verify_refuses_what_is_not_the_datasets_own(packed, tmp_path, damage, message):
    target = copy_of(packed, tmp_path)
    original = copy_of(packed, tmp_path / "original")
    manifest = json.loads((target / "manifest.json").read_text())
    if damage == "linked file":
        (target / "part-00000" / "tokens.bin").unlink()
        (target / "part-00000" / "tokens.bin").symlink_to(original / "part-00000" / "tokens.bin")
    elif damage == "linked manifest":
        (target / "manifest.json").unlink()
        (target / "manifest.json").symlink_to(original / "manifest.json")
    else:
        name = "notes.txt" if damage == "a file listed but not the format's" else "../../outside.txt"
        (target / "part-00000" / name).write_text("notes")
        manifest["parts"][0]["files"][name] = {"bytes": 5, "sha256": publish.file_sha256(target / "part-00000" / name)}
        reseal(target, manifest)
    with pytest.raises(sp.VerificationError, match=message):
        io.verify_dataset(target)


def test_a_npy_header_numpy_cannot_parse_is_one_clear_error(packed, tmp_path):
    # An unbalanced bracket raised tokenize.TokenError: a traceback from verify, stats and show (review).
    target = copy_of(packed, tmp_path)
    path = target / "part-00000" / "examples.npy"
    data = bytearray(path.read_bytes())
    data[data.index(b"), }")] = ord(" ")
    path.write_bytes(bytes(data))
    with pytest.raises(sp.InvalidInputError, match=r"examples\.npy: not a readable \.npy file: "):
        io.open_dataset(target)


@pytest.fixture(scope="module")
def two_parts(tmp_path_factory):
    """Two shards of one JSONL file, two batches each (what ``seqpack pack --shards 2`` writes)."""
    from seqpack.io import pack_corpus
    root = tmp_path_factory.mktemp("two-parts")
    rng = np.random.default_rng(5)
    lines = [json.dumps({"text": "".join(rng.choice(list("abcdefgh "), size=int(rng.integers(3, 26))))})
             for _ in range(40)]
    (root / "c.jsonl").write_text("\n".join(lines) + "\n")
    pack_corpus([io.JsonLines(root / "c.jsonl")], root / "packed", binding=BINDING, tokenizer=TOKENIZER,
                 config=sp.PackConfig(32, 8), shards=2)
    return root / "packed"


def edited(packed, tmp_path, key, value, sealed=True):
    """A copy whose manifest has ``key`` (dotted, or a tuple of keys; list indices as numbers) set to ``value``, or
    deleted; sealed again unless ``sealed`` is false (as a hand edit leaves it)."""
    target = copy_of(packed, tmp_path)
    manifest = json.loads((target / "manifest.json").read_text())
    keys = key if isinstance(key, tuple) else key.split(".")
    *path, last = [int(k) if k.isdigit() else k for k in keys]
    holder = manifest
    for k in path:
        holder = holder[k]
    if value is DELETE:
        del holder[last]
    else:
        holder[last] = value
    if sealed:
        reseal(target, manifest)
    else:
        (target / "manifest.json").write_text(json.dumps(manifest))
    return target


DELETE = object()


def test_two_parts_verify(two_parts):
    manifest = json.loads((two_parts / "manifest.json").read_text())
    assert len(manifest["parts"]) == 2 and all(part["batches"] == 2 for part in manifest["parts"])
    assert io.verify_dataset(two_parts)["batches_verified"] == 4


@pytest.mark.parametrize("key, value, message", [
    ("parts.1.first_example", 0, "part part-00001 records first_example 0; the parts before it hold 20 examples"),
    ("parts.1.first_batch", 4, "part part-00001 records first_batch 4; the parts before it hold 2 batches"),
    ("parts.1.first_document", 0, "part part-00001 records first_document 0"),
    ("parts.1.first_row", 0, "part part-00001 records first_row 0"),
    ("config.rows_per_batch", 3, r"part part-00000 records batches 2; its \d+ rows make 5"),
    # An index of 2**40 entries was allocated before the count was checked: 'not enough memory'.
    ("parts.0.batches", 2**40, r"part part-00000 records batches 1099511627776; its \d+ rows make 2"),
    ("parts.0.rows", 10**9, r"part part-00000 records 1000000000 rows of its \d+ examples; a row holds at least one"),
    # A cap no pack could have written under: verify said ok, and every batch was served over it.
    ("config.max_cells", 64, "a batch of 8 rows x 32 columns has 256 cells; its config's max_cells is 64"),
    ("parts.0.tokens", 1, "part part-00000 records tokens 1; its files hold"),
    ("parts.1.document_tokens", 1, "part part-00001 records document_tokens 1; its files hold"),
    ("parts.1.permitted_edges", 1, "part part-00001 records permitted_edges 1; its files hold"),
    ("counts.documents", 99, "counts records documents 99; the parts hold 40"),
    ("counts.tokens", 1, "counts records tokens 1"),
    ("counts.valid_targets", 1, "counts records valid_targets 1"),
    ("counts.skipped_empty_documents", 1, "counts records skipped_empty_documents 1"),
    ("report.cells", 5, "report records cells 5"),
    ("report.real_target_fraction", 0.5, "report records real_target_fraction 0.5"),
    ("report.policy", "best-fit-decreasing", "report records policy 'best-fit-decreasing'"),
    ("shards.count", 1, "shards records count 1; the dataset's part count is 2"),
    ("inputs", [], "a document names an input outside the manifest's 0 inputs"),
    ("inputs.0.name", 5, r"inputs\[0\] needs a name"),
    ("inputs.0.unit", "page", r"inputs\[0\] needs a name, a kind and a unit"),
    ("partition", "bogus", "'bogus' is not a valid Partition"),
    ("policy", "nope", "unknown placement policy 'nope'"),
    ("long_documents", "maybe", "long_documents 'maybe' is not one of"),
    ("token_dtype", "<i4", "token_dtype '<i4' is not the one a vocabulary of 258 is stored in"),
])
def test_every_count_and_field_of_the_manifest_is_checked(two_parts, tmp_path, key, value, message):
    target = edited(two_parts, tmp_path, key, value)
    with pytest.raises(sp.VerificationError, match=rf"(manifest\.json|documents\.npy): .*{message}"):
        io.verify_dataset(target)


@pytest.mark.parametrize("key", ["counts", "long_documents", "report", "parts.0.first_row", "counts.rows"])
def test_a_missing_manifest_key_is_named(two_parts, tmp_path, key):
    target = edited(two_parts, tmp_path, key, DELETE)
    name = key.split(".")[-1]
    with pytest.raises(sp.VerificationError, match=rf"manifest\.json: .*'{name}'"):
        io.verify_dataset(target)
    if key != "report":  # the report is recomputed on open; verify compares it
        with pytest.raises(sp.InvalidInputError, match=rf"manifest\.json: malformed manifest \(no '{name}' key\)"):
            dataset_stats(io.open_dataset(target))


@pytest.mark.parametrize("add, name", [
    (lambda d: (d / "fig.svg").write_text("<svg/>"), "fig.svg"),
    (lambda d: (d / "part-00000" / "notes.txt").write_text("mine"), "part-00000/notes.txt"),
    (lambda d: (d / "part-00001").mkdir(), "part-00001"),
])
def test_a_file_the_manifest_does_not_list_fails_verify(tmp_path, add, name):
    """verify said ok while --force called the same directory 'not a packed dataset'."""
    out = tmp_path / "ds"
    (tmp_path / "a.txt").write_text("hello")
    io.pack_corpus([io.TextFiles([tmp_path / "a.txt"])], out, binding=sp.BatchBinding.for_tokenizer(
        sp.ByteTokenizer(), split="tests"), tokenizer=sp.ByteTokenizer(), config=sp.PackConfig(32, 2))
    io.verify_dataset(out)
    add(out)
    with pytest.raises(sp.VerificationError, match=rf"^{re.escape(str(out / name))}: not listed in the manifest"):
        io.verify_dataset(out)


# verify refuses each of these hand edits of a sealed manifest, naming the edited key.
@pytest.mark.parametrize("key, value, named", [
    ("binding.limits.max_tokens", 3, r"binding\.limits\.max_tokens \(edited\)"),
    ("binding.split_receipt_digest", "0" * 64, r"binding\.split_receipt_digest \(edited\)"),
    ("binding.tokenizer.digest", "0" * 64, r"binding\.tokenizer\.digest \(edited\)"),
    ("partition", "test", r"partition \(edited\)"),
    ("inputs.0.name", "other.jsonl", r"inputs\[0\]\.name \(edited\)"),
    ("input_bytes", 1, r"input_bytes \(edited\)"),
    ("long_documents", "cut", r"long_documents \(edited\)"),
    ("config.max_memory_bytes", 1 << 40, r"config\.max_memory_bytes \(edited\)"),
    ("counts.rows", 99, r"counts\.rows \(edited\)"),
    ("created_by", "someone", r"created_by \(edited\)"),
    (("parts", "1", "files", "tokens.bin", "sha256"), "0" * 64, r"parts\[1\]\.files\.tokens\.bin \(edited\)"),
    ("report.padding_cells", 0, r"report\.padding_cells \(edited\)"),
    ("counts", DELETE, r"counts \(removed\)"),
    ("mine", "added", r"mine \(added\)"),
    ("seal.sha256", "0" * 64, "the seal itself"),
])
def test_an_edited_manifest_field_is_named_by_open_and_verify(two_parts, tmp_path, key, value, named):
    target = edited(two_parts, tmp_path, key, value, sealed=False)
    message = rf"manifest\.json: the manifest differs from its seal at {named}"
    with pytest.raises(sp.InvalidInputError, match=message):
        io.open_dataset(target)
    with pytest.raises(sp.VerificationError, match=message):
        io.verify_dataset(target)


def test_seqpack_verify_names_an_edited_field_and_exits_1(two_parts, tmp_path):
    target = edited(two_parts, tmp_path, "binding.limits.max_tokens", 3, sealed=False)
    run = subprocess.run([sys.executable, "-m", "seqpack", "verify", str(target)], capture_output=True, text=True)
    assert run.returncode == 1 and run.stdout == ""
    assert re.fullmatch(r"seqpack: error: .*manifest\.json: the manifest differs from its seal at "
                        r"binding\.limits\.max_tokens \(edited\): .*\n", run.stderr)


def test_a_broken_seal_is_refused(two_parts, tmp_path):
    target = edited(two_parts, tmp_path, "seal", "trust me", sealed=False)
    with pytest.raises(sp.InvalidInputError, match=r"manifest\.json: its seal is not a seqpack seal"):
        io.open_dataset(target)


def test_a_manifest_from_before_seals_opens_and_verifies_unsealed(two_parts, tmp_path):
    target = edited(two_parts, tmp_path, "seal", DELETE, sealed=False)
    assert len(io.open_dataset(target)) == 4
    assert io.verify_dataset(target)["sealed"] is False
    assert io.verify_dataset(two_parts)["sealed"] is True


def test_a_version_1_part_holding_a_supervision_file_is_refused(two_parts, tmp_path):
    # A file only version 2 writes, left in a dataset whose version was lowered to 1, is refused.
    target = edited(two_parts, tmp_path, "seal", DELETE, sealed=False)
    leftover = target / "part-00001" / fmt.SUPERVISION_FILE
    np.save(leftover, np.zeros(0, np.uint32))
    message = rf"^{re.escape(str(leftover))}: a part of a version-1 dataset holds no supervision\.npy; only version 2"
    with pytest.raises(sp.InvalidInputError, match=message):
        io.open_dataset(target)
    with pytest.raises(sp.VerificationError, match=message):
        io.verify_dataset(target)


def test_limits_are_checked_against_the_documents(two_parts, tmp_path):
    """Resealed, an edited limit still disagrees with the documents it should bound."""
    target = edited(two_parts, tmp_path, "binding.limits.max_tokens", 3)
    with pytest.raises(sp.VerificationError, match=r"documents\.npy: document \d+ has \d+ tokens; the manifest's "
                                                   r"binding\.limits\.max_tokens is 3"):
        io.verify_dataset(target)


def test_long_documents_is_checked_against_the_windows(packed, tmp_path):
    """The fixture cut long documents into windows; a manifest saying it refused them is wrong."""
    target = edited(packed, tmp_path, "long_documents", "error")
    with pytest.raises(sp.VerificationError, match=r"examples\.npy: the examples are not the documents' ranges"):
        io.verify_dataset(target)


# --- a dataset of preference pairs (format version 3) -------------------------------------------


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Eight pairs of equal sequences (4 predictions each), two pairs a row: pair p is examples 2p and 2p + 1,
    row p // 2. Equal lengths let a test move a sequence to another row and keep every row tiled."""
    from helpers import write_jsonl

    root = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(7)
    records = [{key: rng.integers(2, 258, size).tolist() for key, size in
                (("prompt_ids", 2), ("chosen_ids", 3), ("rejected_ids", 3))} for _ in range(8)]
    io.pack_corpus([io.reader_for(write_jsonl(root / "dpo.jsonl", records))], root / "packed", binding=BINDING,
                   tokenizer=TOKENIZER, config=sp.PackConfig(16, 2), policy="best-fit-decreasing")
    return root / "packed"


def test_a_dataset_of_pairs_verifies(pairs):
    checked = io.verify_dataset(pairs)
    assert (checked["pairs"], checked["examples"], checked["files"], checked["batches_verified"]) == (8, 16, 6, 2)
    assert io.open_dataset(pairs).parts[0].rows.tolist() == [p // 4 for p in range(16)]


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_one_flipped_byte_in_the_pair_map_is_named(pairs, tmp_path, where):
    target = copy_of(pairs, tmp_path)
    path = target / "part-00000" / fmt.PAIRS_FILE
    data = bytearray(path.read_bytes())
    data[min(int(where * len(data)), len(data) - 1)] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(sp.VerificationError, match=rf"{fmt.PAIRS_FILE}: SHA-256 .* differs from the manifest's"):
        io.verify_dataset(target)


def damaged(pairs, tmp_path, name, change, manifest_change=None):
    """A copy whose part file ``name`` is ``change(array)``, its checksum recorded and the manifest
    (changed by ``manifest_change``) sealed again: only the rules can catch it now."""
    target = copy_of(pairs, tmp_path)
    path = target / "part-00000" / name
    record = publish.write_array(path, change(np.load(path)))
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["parts"][0]["files"][name] = record
    if manifest_change is not None:
        manifest_change(manifest)
    reseal(target, manifest)
    return target


def swapped(array, first, second):
    """``array`` with the occurrences of ordinals ``first`` and ``second`` trading places."""
    array = array.copy()
    at = [int(np.flatnonzero(array[:, 0] == first)[0]), int(np.flatnonzero(array[:, 0] == second)[0])]
    array[at, 0] = array[at[::-1], 0]
    return array


def grown(manifest):
    """Nine pairs recorded everywhere: the part, the counts and the report."""
    for holder in (manifest["parts"][0], manifest["counts"], manifest["report"]):
        holder["pairs"] = 9


@pytest.mark.parametrize("name, change, manifest_change, message", [
    (fmt.PAIRS_FILE, lambda a: a[:, ::-1], None, r"pairs\.npy: pair 0 is examples 1 and 0, not 0 \(chosen\) and "
                                                 r"1 \(rejected\)"),
    (fmt.PAIRS_FILE, lambda a: np.concatenate([a[:1], a[:-1]]), None,  # an example in two pairs, one in none
     r"pairs\.npy: pair 1 is examples 0 and 1, not 2 \(chosen\) and 3 \(rejected\)"),
    (fmt.PAIRS_FILE, lambda a: a[:-1], None, r"pairs\.npy: holds int64 \(7, 2\); expected int64 \(8, 2\)"),
    (fmt.PAIRS_FILE, lambda a: a.astype(np.int32), None, r"pairs\.npy: holds int32 \(8, 2\); expected int64 \(8, 2\)"),
    (fmt.PAIRS_FILE, lambda a: np.arange(18).reshape(9, 2), grown,
     r"manifest\.json: part part-00000 records 9 pairs of its 16 examples; a pair is two"),
    ("occurrences.npy", lambda a: swapped(a, 1, 5), None,  # pair 0's rejected in row 1, pair 2's in row 0
     r"occurrences\.npy: pair 0 \(examples 0 and 1\) is not side by side in one row, chosen first: placements 0 "
     r"and 5, in rows 0 and 1"),
    ("occurrences.npy", lambda a: swapped(a, 0, 1), None,
     r"occurrences\.npy: pair 0 \(examples 0 and 1\) is not side by side in one row, chosen first: placements 1 "
     r"and 0, in rows 0 and 0"),
])
def test_a_damaged_pair_map_or_placement_is_refused_on_open_and_by_verify(pairs, tmp_path, name, change,
                                                                           manifest_change, message):
    target = damaged(pairs, tmp_path, name, change, manifest_change)
    with pytest.raises(sp.InvalidInputError, match=message):
        io.open_dataset(target)
    with pytest.raises(sp.VerificationError, match=message):
        io.verify_dataset(target)


def test_a_supervision_record_of_another_type_is_malformed(pairs, tmp_path):
    """It was an AttributeError, a traceback from ``seqpack verify``."""
    target = edited(pairs, tmp_path, "supervision", "yes")
    message = r"manifest\.json: malformed manifest \(supervision is a str, not an object\)$"
    with pytest.raises(sp.InvalidInputError, match=message):
        io.open_dataset(target)
    with pytest.raises(sp.VerificationError, match=message):
        io.verify_dataset(target)


def test_a_sequence_without_a_supervised_target_is_refused(pairs, tmp_path):
    from seqpack.data.supervision import flips_of, supervision_of

    def unsupervised(flips):  # placement 1 (pair 0's rejected) supervises nothing, in the canonical form
        offsets = io.open_dataset(pairs).parts[0].token_offsets
        supervised = supervision_of(flips.astype(np.int64), 0, int(offsets[-1]))
        supervised[offsets[1] + 1: offsets[2]] = False
        for first in offsets[1:-1]:  # an example's first token is no target: it keeps the state before it
            supervised[first] = supervised[first - 1]
        return flips_of(supervised, 0, True).astype(flips.dtype)

    target = damaged(pairs, tmp_path, fmt.SUPERVISION_FILE, unsupervised,
                     lambda m: [holder.update(supervised_targets=holder["supervised_targets"] - 3)
                                for holder in (m["parts"][0], m["counts"], m["report"])])
    with pytest.raises(sp.VerificationError, match=r"supervision\.npy: placement 1 has no supervised target"):
        io.verify_dataset(target)


def test_whole_pairs_placed_against_the_policy_fail_verify(pairs, tmp_path):
    target = damaged(pairs, tmp_path, "occurrences.npy", lambda a: swapped(swapped(a, 0, 4), 1, 5))  # pairs 0 and 2
    assert io.open_dataset(target).pair_count == 8  # each pair is whole, in one row: only the policy is broken
    with pytest.raises(sp.VerificationError, match=r"occurrences\.npy: the placement differs from best-fit-decreasing"):
        io.verify_dataset(target)


@pytest.mark.parametrize("key, value, message", [
    ("counts.pairs", 9, r"manifest\.json: counts records pairs 9; the parts hold 8"),
    ("report.pairs", 9, r"manifest\.json: report records pairs 9; the parts give 8"),
])
def test_the_pair_counts_of_the_manifest_are_checked(pairs, tmp_path, key, value, message):
    with pytest.raises(sp.VerificationError, match=message):
        io.verify_dataset(edited(pairs, tmp_path, key, value))


def test_a_dataset_replaced_while_it_is_verified_is_not_called_corrupt(packed, tmp_path, monkeypatch):
    """A pack --force publishing during verify made verify report a healthy dataset's file
    as differing from its manifest (the old manifest against the new file; review)."""
    from seqpack.io import verify as module

    out = copy_of(packed, tmp_path)
    docs = tmp_path / "other"
    docs.mkdir()
    (docs / "a.txt").write_bytes(b"another dataset" * 9)
    hash_files = module.check_checksums

    def hash_while_replaced(path, manifest, progress):
        io.pack_corpus([io.TextFiles([docs])], out, binding=BINDING, tokenizer=TOKENIZER,
                       config=sp.PackConfig(40, 2), long="cut", force=True)
        return hash_files(path, manifest, progress)

    monkeypatch.setattr(module, "check_checksums", hash_while_replaced)
    with pytest.raises(sp.InvalidInputError, match=f"{out}: the dataset was replaced while it was being "
                                                   f"verified \\(a pack with --force into it\\?\\): verify it again"):
        io.verify_dataset(out)
    monkeypatch.undo()
    assert io.verify_dataset(out)["examples"] == io.open_dataset(out).occurrence_count
