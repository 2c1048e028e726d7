"""``seqpack pack | stats | verify | show`` run as a user runs them: outputs, figures, every error, crashes."""

import os
import json
import re
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from helpers import one_error_line, run, seqpack_command

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def docs(tmp_path):
    directory = tmp_path / "docs"
    directory.mkdir()
    for index in range(40):
        (directory / f"{index:02d}.txt").write_text(("word%d " % index) * (3 + 7 * (index % 9)))
    return directory


@pytest.fixture
def conversational_pairs(tmp_path):
    """``dpo.jsonl``, one conversational preference record, and ``chat.jinja``, a template for it."""
    turn = [{"role": "user", "content": "hi"}]
    (tmp_path / "dpo.jsonl").write_text(json.dumps({"prompt": turn, "chosen": [{"role": "assistant", "content": "yes"}],
                                                    "rejected": [{"role": "assistant", "content": "no"}]}) + "\n")
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")


@pytest.fixture
def packed(tmp_path, docs):
    result = run("pack", docs, "--out", tmp_path / "packed", "--capacity", 128, "--rows-per-batch", 2,
                 "--policy", "best-fit-decreasing", "--cut-long")
    assert result.returncode == 0, result.stderr
    return tmp_path / "packed"


def cells_of(svg_text):
    root = ElementTree.fromstring(svg_text)
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == "cell"]


@pytest.mark.slow
def test_pack_prints_the_report_and_json(tmp_path, docs, packed):
    result = run("pack", docs, "--out", tmp_path / "again", "--capacity", 128, "--cut-long", "--json", "--quiet")
    assert result.returncode == 0 and result.stderr == ""
    manifest = json.loads(result.stdout)
    assert manifest["format"] == "seqpack-packed-dataset" and manifest["counts"]["documents"] == 40
    assert manifest["config"]["capacity"] == 128 and manifest["policy"] == "next-fit"
    report = run("stats", packed)
    assert report.returncode == 0 and "real-target fraction" in report.stdout and "bytes/token" in report.stdout


@pytest.mark.slow
def test_verify_stats_and_figures(tmp_path, packed):
    checked = run("verify", packed, "--json")
    assert checked.returncode == 0, checked.stderr
    summary = json.loads(checked.stdout)
    assert summary["batches_verified"] == summary["batches"] > 1 and summary["files"] == 4
    assert run("verify", packed).stdout.startswith(f"{packed}: ok: the manifest matches its seal, 4 files")
    stats = run("stats", packed, "--json", "--svg", tmp_path / "stats.svg")
    assert stats.returncode == 0
    values = json.loads(stats.stdout)
    manifest = json.loads((packed / "manifest.json").read_text())
    assert values["report"]["valid_targets"] == manifest["counts"]["valid_targets"]
    assert sum(values["row_fill"]["counts"]) == manifest["counts"]["rows"]
    assert sum(values["example_lengths"]["counts"]) == manifest["counts"]["examples"]
    root = ElementTree.parse(tmp_path / "stats.svg").getroot()
    assert root.tag == f"{SVG}svg" and len([r for r in root.iter(f"{SVG}rect") if r.get("class") == "bar"]) == 64


@pytest.mark.parametrize("fixture, cells, permitted", [("padded", 8, 3 + 10), ("packed", 12, 6 + 3 + 10)])
def test_show_a_fixture_with_one_svg_cell_per_storage_cell(tmp_path, fixture, cells, permitted):
    result = run("show", fixture, "--svg", tmp_path / "figure.svg")
    assert result.returncode == 0, result.stderr
    assert "supervised" in result.stdout and "\x1b[" not in result.stdout  # no colour into a pipe
    figure = (tmp_path / "figure.svg").read_text()
    found = cells_of(figure)
    assert len(found) == cells
    assert {(g.get("data-row"), g.get("data-column")) for g in found} == {
        (str(r), str(c)) for r in range(2) for c in range(cells // 2)}
    edges = [r for r in ElementTree.fromstring(figure).iter(f"{SVG}rect") if r.get("class") == "edge"]
    assert len(edges) == permitted  # one square per permitted (query, key) pair


@pytest.mark.slow
def test_show_a_dataset_row(tmp_path, packed):
    result = run("show", packed, "--batch", 1, "--row", 1, "--columns", "0:20", "--svg", tmp_path / "row.svg")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("row 1: ") and "columns 0..19 shown" in result.stdout
    assert len(cells_of((tmp_path / "row.svg").read_text())) == 20


@pytest.mark.parametrize("command", ["pack", "stats", "verify", "show"])
def test_every_subcommand_has_help(command):
    result = run(command, "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: seqpack " + command)


@pytest.mark.parametrize("args, status, message", [
    (("pack", "--out", "x"), 2, "give INPUT paths or --sample"),
    (("pack", "docs", "--sample", "--out", "x"), 2, "give INPUT paths or --sample"),
    (("pack", "docs", "--out", "x", "--bos", "5"), 2, "--bos and --eos go with --tokenizer"),
    (("pack", "docs", "--out", "x", "--tokenizer", "t.json"), 2, "--tokenizer needs --eos"),
    (("pack", "docs", "--out", "x", "--threads", "0"), 2, "--threads must be at least 1"),
    (("pack", "docs", "--out", "x", "--policy", "worst-fit"), 2, "invalid choice"),
    (("pack", "docs"), 2, "--out"),
    (("show", "packed", "--columns", "a:b"), 2, "--columns takes START:STOP"),
    (("show", "packed", "--columns", ":0"), 2, "--columns :0 is empty: STOP must be above START"),  # was exit 1
    (("pack", "nowhere", "--out", "x"), 1, "nowhere: no such file or directory"),
    (("pack", "docs", "--out", "x", "--capacity", "0"), 2, "capacity must be at least 1"),
    (("pack", "docs", "--out", "x", "--template-characters", "0"), 2, "--template-characters must be at least 1"),
    (("pack", "docs", "--out", "x", "--template-seconds", "0"), 2,
     r"--template-seconds must be a positive number of seconds, at most 9\.22337e\+09; got 0"),
    (("pack", "docs", "--out", "x", "--template-seconds", "nan"), 2, "--template-seconds must be a positive number"),
    (("pack", "docs", "--out", "x", "--capacity", "16"), 1, r"docs/00.txt: the document has 19 predictions; capacity is 16"),
    (("pack", "docs", "--out", "docs"), 1, "docs already exists"),
    (("pack", "docs", "--out", "docs", "--force"), 1, "docs is not a packed dataset"),
    (("pack", "docs", "--out", "x", "--ids-field", "ids"), 2, "--ids-field has no effect here: no INPUT is JSONL"),
    (("pack", "docs/00.txt", "--out", "x", "--glob", "*.py"), 2, "--glob has no effect here: no INPUT is a directory"),
    (("pack", "docs", "--out", "x", "--framed"), 2, "--framed has no effect here"),
    (("pack", "--sample", "--out", "x", "--glob", "*.py"), 2, "--glob has no effect here"),
    (("pack", "dpo.jsonl", "--out", "x", "--chat-template", "chat.jinja", "--assistant-only-loss"), 2,
     r"--assistant-only-loss has no effect here: .* \(preference pairs are supervised on their completions\)"),
    (("pack", "docs", "--out", "x", "--split", "nope.json"), 1, "nope.json: cannot read: No such file"),
    (("pack", "docs/00.txt", "docs/00.txt", "--out", "x"), 1, "docs/00.txt is an input twice"),
    (("pack", "docs", "docs/03.txt", "--out", "x"), 1, "docs/03.txt is an input twice"),
    (("stats", "nowhere"), 1, "nowhere: no such directory"),
    # An escape sequence in a name reached the terminal (review).
    (("stats", "no\x1b[31mwhere"), 1, r"no\\x1b\[31mwhere: no such directory"),
    (("verify", "docs"), 1, "docs/manifest.json: missing"),
    (("show", "nonsense"), 1, "nonsense: neither a packed dataset directory"),
    (("show", "packed", "--row", "9"), 1, "row 9 is outside this batch's rows"),
])
def test_errors_exit_with_one_line(tmp_path, docs, conversational_pairs, args, status, message):
    result = run(*args, cwd=tmp_path)
    assert result.returncode == status, (result.stdout, result.stderr)
    assert re.search(message, result.stderr), result.stderr
    if status == 1:
        one_error_line(result)
    assert not (tmp_path / "x").exists()


def test_glob_has_no_effect_on_a_datasets_directory(tmp_path):
    # A save_to_disk directory is read as one dataset: --glob was silently ignored there.
    datasets = pytest.importorskip("datasets", reason="writing a saved dataset needs datasets: pip install "
                                                      "'seqpack[bench]'")
    datasets.Dataset.from_dict({"text": ["hello", "world"]}).save_to_disk(str(tmp_path / "saved"))
    result = run("pack", "saved", "--out", "x", "--glob", "*.py", cwd=tmp_path)
    assert result.returncode == 2 and "--glob has no effect here: no INPUT is a directory of files" in result.stderr
    assert not (tmp_path / "x").exists()
    assert run("pack", "saved", "--out", "x", cwd=tmp_path).returncode == 0  # the twin without --glob


def test_flags_a_tables_schema_makes_void_and_an_empty_glob_are_refused(tmp_path, docs):
    # --framed on IDs with TRL's masks, --no-completion-only-loss on IDs without a completion_mask column and
    # --glob '' were accepted and ignored (the whole directory was packed for --glob "$UNSET") (review).
    pq = pytest.importorskip("pyarrow.parquet", reason="writing Parquet needs the corpus extra: pip install "
                                                       "'seqpack[corpus]'")
    import pyarrow as pa

    pq.write_table(pa.table({"input_ids": [[5, 6, 7]], "completion_mask": [[0, 1, 1]]}), tmp_path / "masked.parquet")
    pq.write_table(pa.table({"input_ids": [[0, 6, 7, 1]]}), tmp_path / "plain.parquet")
    for args, message in ((("masked.parquet", "--framed"), "--framed has no effect here: .* without TRL's mask "
                                                           "columns"),
                          (("plain.parquet", "--no-completion-only-loss"), "--no-completion-only-loss has no effect"),
                          (("docs", "--glob", ""), "--glob needs a file name pattern such as '\\*.py' \\(it was "
                                                   "given an empty one\\)")):
        result = run("pack", *args, "--out", "x", cwd=tmp_path)
        assert result.returncode == 2 and re.search(message, result.stderr), result.stderr
    for args in (("masked.parquet", "--no-completion-only-loss"), ("plain.parquet", "--framed")):   # the twins
        assert run("pack", *args, "--out", "x", "--force", cwd=tmp_path).returncode == 0
    import seqpack as sp
    from seqpack import io

    with pytest.raises(sp.InvalidInputError, match="must be a file name pattern"):
        io.TextFiles([tmp_path / "docs"], pattern="")


def test_pre_tokenized_jsonl_needs_no_ids_field_and_takes_framed(tmp_path):
    # TRL's pre-tokenized JSONL ({"input_ids", "completion_mask"}) is found by name, as in Parquet: no --ids-field.
    records = [{"input_ids": [0, 70, 71, 72, 1], "completion_mask": [0, 0, 1, 1, 1]},
               {"input_ids": [0, 80, 81, 1], "completion_mask": [0, 1, 1, 1]}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for out, flags in (("named", ["--ids-field", "input_ids"]), ("found", [])):
        result = run("pack", "sft.jsonl", "--out", out, "--framed", "--capacity", 16, "--json", *flags, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        manifest = json.loads(result.stdout)
        assert (manifest["counts"]["tokens"], manifest["counts"]["supervised_targets"]) == (9, 6)
        assert manifest["supervision"]["applied"] == ["completion_mask"]
    assert (tmp_path / "named" / "part-00000" / "tokens.bin").read_bytes() \
        == (tmp_path / "found" / "part-00000" / "tokens.bin").read_bytes()


@pytest.mark.slow
def test_preference_records_are_packed_as_pairs_and_every_command_counts_them(tmp_path):
    # TRL's pre-tokenized DPO records, found by their keys: no flag says they are pairs.
    records = [{"prompt_ids": [40 + i] * (1 + i % 4), "chosen_ids": [60 + i] * (1 + i % 3),
                "rejected_ids": [80 + i] * (2 + i % 5)} for i in range(30)]
    (tmp_path / "dpo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    packed = run("pack", "dpo.jsonl", "--out", "out", "--capacity", 24, "--rows-per-batch", 2, "--quiet",
                 "--policy", "best-fit-decreasing", cwd=tmp_path)
    assert packed.returncode == 0 and packed.stderr == "", packed.stderr
    assert re.search(r"^preference pairs +30 \(chosen and rejected side by side in one row\)$", packed.stdout, re.M)
    stats = json.loads(run("stats", "out", "--json", cwd=tmp_path).stdout)
    assert stats["counts"]["pairs"] == stats["report"]["pairs"] == 30 and stats["counts"]["examples"] == 60
    checked = run("verify", "out", cwd=tmp_path)
    assert checked.returncode == 0 and "60 examples (30 preference pairs) placed by the rules" in checked.stdout
    assert json.loads(run("verify", "out", "--json", "--quiet", cwd=tmp_path).stdout)["pairs"] == 30
    # The longest pair (line 20) has 5 + 9 predictions: a row of 13 is refused, --cut-long or not; 14 packs it whole.
    for flags in ([], ["--cut-long"]):
        line = one_error_line(run("pack", "dpo.jsonl", "--out", "short", "--capacity", 13, *flags, cwd=tmp_path))
        assert line.endswith("dpo.jsonl:20: the preference pair (chosen 5 + rejected 9) has 14 predictions; "
                             "capacity is 13; its chosen and rejected sequences share one row, and a pair is never "
                             "cut (not even by --cut-long)"), line
    assert not (tmp_path / "short").exists()
    assert run("pack", "dpo.jsonl", "--out", "exact", "--capacity", 14, "--cut-long", "--quiet",
               cwd=tmp_path).returncode == 0
    usage = " ".join(run("pack", "--help").stdout.split())
    assert "Preference records ('chosen' and 'rejected'" in usage and "refused either way" in usage


def test_a_tokenizer_file_that_is_not_one_is_one_line(tmp_path, docs):
    pytest.importorskip("tokenizers", reason="--tokenizer needs the hf extra: pip install 'seqpack[hf]'")
    line = one_error_line(run("pack", "docs", "--out", "x", "--tokenizer", "docs/00.txt", "--bos", "0", "--eos", "1",
                              cwd=tmp_path))
    assert "00.txt: not a tokenizers JSON file" in line and not (tmp_path / "x").exists()


def test_force_never_deletes_inputs_or_other_files(tmp_path, docs):
    """--force replaces a packed dataset only: never the corpus, a dataset it would read,
    or a file that is not a dataset; nothing is left behind."""
    before = sorted(p.name for p in docs.iterdir())
    line = one_error_line(run("pack", docs, "--out", docs, "--force", "--capacity", 128, "--cut-long"))
    assert "is not a packed dataset" in line and sorted(p.name for p in docs.iterdir()) == before
    inner = docs / "packed"
    assert run("pack", docs / "00.txt", "--out", inner, "--capacity", 128, "--cut-long", "--quiet").returncode == 0
    line = one_error_line(run("pack", docs, "--out", inner, "--force", "--capacity", 128, "--cut-long"))
    assert "lies inside the input directory" in line and run("verify", inner, "--quiet").returncode == 0
    line = one_error_line(run("pack", inner / "part-00000" / "examples.npy", "--out", inner, "--force"))
    assert "lies inside the output" in line and run("verify", inner, "--quiet").returncode == 0
    plain = tmp_path / "plain.txt"
    plain.write_text("mine")
    line = one_error_line(run("pack", docs / "00.txt", "--out", plain, "--force"))
    assert "plain.txt is not a directory" in line and plain.read_text() == "mine"
    assert not [p.name for p in (*tmp_path.iterdir(), *docs.iterdir()) if p.name.startswith(".")]


def test_bad_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n{"text": 3}\n')
    line = one_error_line(run("pack", path, "--out", tmp_path / "out"))
    assert line.endswith("docs.jsonl:2: field 'text' is not a string")


@pytest.mark.slow
def test_verify_names_a_flipped_byte(tmp_path, packed):
    for name in ("tokens.bin", "occurrences.npy", "examples.npy", "documents.npy"):
        target = tmp_path / f"copy-{name}"
        shutil.copytree(packed, target)
        path = target / "part-00000" / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x80
        path.write_bytes(bytes(data))
        line = one_error_line(run("verify", target))
        assert f"part-00000/{name}: SHA-256" in line


KILLERS = {
    # Three moments of a pack: while reading (after a chunk was staged), while writing the
    # part (tokens.bin written, the tables not yet), after the rename, before the manifest.
    "reading": "seqpack.io.progress.Progress.reading",
    "writing": "seqpack.io.publish.write_array",
    "publishing": "seqpack.io.publish.signals_deferred",
}
KILL_SCRIPT = """
import importlib, os, signal, sys
module, _, name = sys.argv[1].rpartition(".")
try:
    owner = importlib.import_module(module)
except ImportError:  # a method: module.Class.name
    package, _, klass = module.rpartition(".")
    owner = getattr(importlib.import_module(package), klass)
def killer(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
setattr(owner, name, killer)
from seqpack.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("moment", sorted(KILLERS))
def test_sigkill_leaves_nothing_complete_looking(tmp_path, docs, moment):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", KILL_SCRIPT, KILLERS[moment], "pack", str(docs),
                             "--out", str(out), "--cut-long", "--capacity", "64", "--quiet"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    complete = [p for p in tmp_path.rglob("manifest.json")]
    assert complete == []
    assert (moment == "publishing") == out.exists()  # only the last moment has renamed the directory into place
    hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".out.seqpack-partial-")]
    assert len(hidden) == (0 if moment == "publishing" else 1)
    if out.exists():
        assert "not a complete packed dataset" in one_error_line(run("verify", out))
    # A fresh pack after the crash works (the leftover is a hidden sibling, never read).
    assert run("pack", docs, "--out", out, "--cut-long", "--capacity", 64, "--quiet", "--force").returncode == 0
    assert run("verify", out, "--quiet").returncode == 0


@pytest.mark.slow
def test_interrupt_and_full_disk_remove_the_partial_output(tmp_path, docs):
    for failure, status, message in ((
            "raise KeyboardInterrupt", 130, "seqpack: interrupted"),
            ("raise OSError(28, 'No space left on device', 'staged')", 1, "cannot write: No space left on device")):
        script = (f"import seqpack.io.publish as f\ndef boom(*a, **k):\n    {failure}\nf.HashingFile.write = boom\n"
                  "from seqpack.cli import main\nimport sys\nsys.exit(main(sys.argv[1:]))")
        result = subprocess.run([sys.executable, "-c", script, "pack", str(docs), "--out", str(tmp_path / "out"),
                                 "--cut-long", "--quiet"], capture_output=True, text=True, timeout=120)
        assert result.returncode == status and message in result.stderr, result.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]


@pytest.mark.slow
def test_an_existing_dataset_survives_a_refused_and_a_killed_pack(tmp_path, docs, packed):
    before = (packed / "manifest.json").read_text()
    assert "already exists" in one_error_line(run("pack", docs, "--out", packed))
    result = subprocess.run([sys.executable, "-c", KILL_SCRIPT, KILLERS["writing"], "pack", str(docs),
                             "--out", str(packed), "--force", "--quiet", "--cut-long"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL
    assert (packed / "manifest.json").read_text() == before
    assert run("verify", packed, "--quiet").returncode == 0


@pytest.mark.slow
def test_the_sample_corpus_packs_verifies_and_reports(tmp_path):
    """The README's first command: the standard library's sources."""
    result = run("pack", "--sample", "--out", tmp_path / "packed", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "real-target fraction" in result.stdout and "bytes/token" in result.stdout
    assert run("verify", tmp_path / "packed", "--quiet").returncode == 0
    stats = json.loads(run("stats", tmp_path / "packed", "--json").stdout)
    assert stats["counts"]["documents"] > 1000 and stats["report"]["real_target_fraction"] > 0.9
    assert stats["storage"]["bytes_per_token"] < 2.5


@pytest.mark.slow
def test_the_readme_training_snippet_runs_on_a_packed_directory(tmp_path, docs, monkeypatch):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (block,) = re.findall(r"```python corpus\n(.*?)```", readme, flags=re.S)
    assert run("pack", docs, "--out", "stdlib/", "--cut-long", "--quiet", cwd=tmp_path).returncode == 0
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["number"] == len(namespace["dataset"]) - 1


#: A --force pack that sends itself a signal at one step of its publish: ``sys.argv[1]``
#: names the step, ``sys.argv[2]`` the signal; the rest is the command line.
SIGNAL_AT_STEP_SCRIPT = """
import os, shutil, signal, sys
from seqpack import cli
from seqpack.io import publish
step, number = sys.argv[1], getattr(signal, sys.argv[2])
out = os.path.abspath(sys.argv[sys.argv.index("--out") + 1])
real_rename, real_rmtree, real_print_report = os.rename, shutil.rmtree, cli._print_pack_report
def rename(source, target):
    real_rename(source, target)
    if (step == "staging renamed in" and os.path.abspath(target) == out
            or step == "manifest renamed in" and os.path.basename(target) == "manifest.json"):
        os.kill(os.getpid(), number)
def rmtree(path, *args, **kwargs):
    if step == "old dataset removed" and ".seqpack-old-" in str(path):
        os.kill(os.getpid(), number)
    real_rmtree(path, *args, **kwargs)
def print_report(*args):
    if step == "report printed":
        os.kill(os.getpid(), number)
    real_print_report(*args)
publish.os.rename, publish.shutil.rmtree, cli._print_pack_report = rename, rmtree, print_report
sys.exit(cli.main(sys.argv[3:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("number", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("step", ["staging renamed in", "manifest renamed in", "old dataset removed",
                                  "report printed"])
def test_a_signal_during_a_force_publish_tells_the_truth(tmp_path, docs, packed, step, number):
    """SIGINT during --force's clean-up printed 'interrupted' and exited 130 although the
    output was already the new dataset, and left .packed.seqpack-old-*/ for ever. Before
    the manifest's rename the old dataset stays; from it on the command has succeeded, and
    says the signal came after (one during the clean-up was dropped silently before)."""
    before = (packed / "manifest.json").read_text()
    (docs / "more.txt").write_text("one more document " * 5)
    result = subprocess.run([sys.executable, "-c", SIGNAL_AT_STEP_SCRIPT, step, number, "pack", str(docs), "--out",
                             str(packed), "--force", "--capacity", "128", "--cut-long", "--quiet"],
                            capture_output=True, text=True, timeout=120)
    committed = step != "staging renamed in"
    if committed:
        assert result.returncode == 0, result.stderr
        assert (packed / "manifest.json").read_text() != before
        assert result.stderr == f"seqpack: {packed} is complete: it was published before the signal took effect\n"
    else:
        status, line = {"SIGINT": (130, "seqpack: interrupted"), "SIGTERM": (143, "seqpack: terminated")}[number]
        assert (result.returncode, result.stderr.strip()) == (status, line)
        assert (packed / "manifest.json").read_text() == before
    assert run("verify", packed, "--quiet").returncode == 0
    left = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("docs", "packed"))
    # A signal from the commit on stops the old dataset's removal, which the next pack finishes.
    assert len(left) == (step in ("manifest renamed in", "old dataset removed")), left
    assert run("pack", docs, "--out", tmp_path / "other", "--capacity", "128", "--cut-long", "--quiet").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "other", "packed"]


def test_concurrent_force_packs_each_write_their_own_manifest(tmp_path, docs, packed):
    """Concurrent --force runs shared .manifest.json.partial, so the loser reported 'not a
    packed dataset (it holds '.manifest.json.partial')'."""
    runs = [subprocess.Popen([seqpack_command(), "pack", str(docs), "--out", str(packed), "--force", "--capacity",
                              "128", "--cut-long", "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True) for _ in range(4)]
    for process in runs:
        _, stderr = process.communicate(timeout=120)
        assert ".manifest.json" not in stderr, stderr
        assert process.returncode == 0 or "seqpack: error:" in stderr, stderr
    assert run("verify", packed, "--quiet").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "packed"]


def test_a_long_output_name_names_the_hidden_suffix(tmp_path, docs):
    line = one_error_line(run("pack", docs, "--out", tmp_path / ("x" * 240), "--cut-long", "--quiet"))
    assert "hidden sibling name" in line and "give --out a name of at most" in line, line


def test_an_output_name_holding_a_byte_that_is_not_utf8_is_written(tmp_path, docs):
    # Measuring the name for its hidden sibling raised UnicodeEncodeError (review).
    out = tmp_path / os.fsdecode(b"packed\xfe")
    result = run("pack", docs, "--out", out, "--cut-long")
    assert result.returncode == 0, result.stderr
    assert "packed\\xfe" in result.stdout and run("verify", out, "--quiet").returncode == 0
