"""The installed ``seqpack`` command, run as a user runs it."""

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def seqpack_command():
    """The console script installed beside this interpreter."""
    script = shutil.which("seqpack", path=os.path.dirname(sys.executable))
    assert script, "the seqpack console script is not installed beside this Python (pip install the package)"
    return script


def run(*args, timeout=300):
    return subprocess.run([seqpack_command(), *args], capture_output=True, text=True, timeout=timeout)


def test_version():
    import seqpack

    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"seqpack {seqpack.__version__}"


def test_demo_padded_json():
    result = run("demo", "padded")
    assert result.returncode == 0, result.stderr
    trace = json.loads(result.stdout)
    rows = trace["rows"]
    assert [r["inputs"] for r in rows] == [[0, 99, -1, -1], [0, 100, 101, 102]]
    assert [r["targets"] for r in rows] == [[99, 1, -1, -1], [100, 101, 102, 1]]
    assert [r["positions"] for r in rows] == [[0, 1, 0, 0], [0, 1, 2, 3]]
    assert [r["segments"] for r in rows] == [[0, 0, -1, -1], [1, 1, 1, 1]]
    for field in ("input_exists", "target_exists", "target_supervised"):
        assert [r[field] for r in rows] == [[True, True, False, False], [True] * 4]
    assert [r["allowed_keys"] for r in rows] == [[[0], [0, 1], [], []], [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]]
    assert trace["cells"] == 8 and trace["valid_targets"] == 6
    assert trace["fixed_window_contrast"]["admitted_targets"] == 4
    assert trace["fixed_window_contrast"]["variable_example_targets"] == 6
    assert [e["document"] for e in trace["examples"]] == [[0, 99, 1], [0, 100, 101, 102, 1]]
    probe = trace["loss_probe"]
    assert round(probe["loss_sum"], 6) == 5.545177 and round(probe["mean"], 6) == 0.924196
    assert round(probe["wrong_per_cell_mean"], 6) == 0.693147
    assert round(probe["wrong_document_mean"], 6) == 0.953077
    decoder = trace["decoder"]
    assert decoder["seed"] == 42 and decoder["parameter_count"] == 3448
    assert decoder["logit_comparisons"] == 1596 and decoder["comparisons_outside_tolerance"] == 0
    assert isinstance(decoder["loss_sum"]["separate"], float)
    assert abs(decoder["loss_sum"]["separate"] - decoder["loss_sum"]["padded"]) <= 1e-9 * decoder["loss_sum"]["separate"]


@pytest.mark.slow
def test_module_entry_point_matches_script():
    module = subprocess.run([sys.executable, "-m", "seqpack", "demo", "padded"],
                            capture_output=True, text=True, timeout=120)
    assert module.returncode == 0
    assert json.loads(module.stdout) == json.loads(run("demo", "padded").stdout)


@pytest.mark.parametrize("args", [("demo", "nonsense"), ("frobnicate",)])
def test_bad_arguments_exit_nonzero_on_stderr(args):
    result = run(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "invalid choice" in result.stderr


def test_no_command_prints_help():
    result = run()
    assert result.returncode == 2
    assert "usage: seqpack" in result.stderr


def test_demo_packed_json():
    result = run("demo", "packed")
    assert result.returncode == 0, result.stderr
    trace = json.loads(result.stdout)
    assert [e["document"] for e in trace["examples"]] == [[0, 99, 100, 1], [0, 101, 1], [0, 102, 103, 104, 1]]
    rows = trace["rows"]
    assert [r["inputs"] for r in rows] == [[0, 99, 100, 0, 101, -1], [0, 102, 103, 104, -1, -1]]
    assert [r["targets"] for r in rows] == [[99, 100, 1, 101, 1, -1], [102, 103, 104, 1, -1, -1]]
    assert [r["segments"] for r in rows] == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]
    assert [r["positions"] for r in rows] == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert rows[0]["allowed_keys"] == [[0], [0, 1], [0, 1, 2], [3], [3, 4], []]
    assert [(o["example"], o["row"], o["columns"], o["segment"]) for o in trace["occurrences"]] == [
        ("A", 0, [0, 3], 0), ("B", 0, [3, 5], 1), ("C", 1, [0, 4], 2)]
    assert trace["cells"] == 12 and trace["valid_targets"] == 9
    first, second = trace["density"]
    assert first["padded"]["valid_density"] == first["packed"]["valid_density"] == 0.75
    assert (second["padded"]["storage_cells"], second["padded"]["dense_score_positions"]) == (16, 64)
    assert (second["packed"]["storage_cells"], second["packed"]["valid_density"]) == (12, 1.0)
    assert second["packed"]["dense_score_positions"] == 144
    assert second["padded"]["permitted_edges"] == second["packed"]["permitted_edges"] == 26
    assert trace["traversal"]["query_order_equals_tiled"] is True
    probe = trace["loss_probe"]
    assert round(probe["loss_sum"], 6) == 7.624619 and round(probe["mean"], 6) == 0.847180
    assert round(probe["wrong_row_mean"], 6) == 0.831777
    assert round(probe["wrong_document_mean"], 6) == 0.924196
    decoder = trace["decoder"]
    assert (decoder["logit_comparisons"], decoder["gradient_comparisons"]) == (4788, 6896)
    assert decoder["comparisons_outside_tolerance"] == 0
    sums = decoder["loss_sum"]
    assert max(sums.values()) - min(sums.values()) <= 1e-9 * sums["separate"]


@pytest.mark.slow
@pytest.mark.bench
def test_bench_attention_json_on_the_fixture_shape():
    result = run("bench", "attention", "--workload", "c", "--dtype", "float64", "--repeats", "1", "--json")
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    methods = {r["method"] for r in records}
    assert {"seqpack fused", "numpy dense masked"} <= methods
    for record in records:
        assert (record["workload"], record["dtype"]) == ("c", "float64")
        low, high = record["peak_gflops_range"]
        assert 0 < low <= record["peak_gflops"] <= high
        if record["method"] == "seqpack fused":
            assert record["forward_ms"] > 0 and record["forward_backward_ms"] >= record["forward_ms"] * 0.5
            assert record["edges"] < record["dense_cells"]
    # Workload c has 2 query heads; the grouped-query row runs them on 1 key/value head
    # and says so in the records, the table and the profile summary alike.
    gqa = next(r for r in records if r["method"].startswith("seqpack fused GQA"))
    assert (gqa["method"], gqa["kv_heads"]) == ("seqpack fused GQA 2:1", 1)
    from seqpack.bench.attention import print_table

    table = io.StringIO()
    print_table(records, table)
    assert "| seqpack fused GQA 2:1 |" in table.getvalue()
    assert "\nseqpack fused GQA 2:1 (1 key/value head), thread-ms" in table.getvalue()
    assert "heads/4" not in table.getvalue()


@pytest.mark.slow
@pytest.mark.bench
def test_bench_corpus_json_reports_every_workload_and_the_floor_of_workload_a():
    """The floor of (a): reading the file alone and writing the output at the in-run disk
    speed, and each TRL time over the longer of the two (the most any job could reach)."""
    pytest.importorskip("trl", reason="bench_corpus.py's TRL rows need the bench extra: pip install 'seqpack[bench]'")
    result = subprocess.run([sys.executable, str(BENCH / "bench_corpus.py"), "--examples", "2000", "--files", "5",
                             "--repeats", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    seconds = {record["method"]: record["seconds"] for record in report["records"]}
    assert {record["workload"] for record in report["records"]} == {"a", "b"}
    assert all(value > 0 for value in seconds.values())
    floor = report["floor_a"]
    assert floor["read_seconds"] == seconds["seqpack: reading the Parquet file alone (flat values + offsets)"]
    disk = report["conditions"]["disk_write_fsync_mb_per_s"]
    assert floor["write_seconds"] == pytest.approx(report["storage"]["bytes_on_disk"] / (disk * 2**20))
    longer = max(floor["read_seconds"], floor["write_seconds"])
    in_memory = seconds["TRL pack_dataset(strategy='bfd') on the table in memory"]
    to_disk = seconds["TRL: Dataset.from_parquet + pack_dataset(bfd) + save_to_disk"]
    assert floor["ceilings"] == pytest.approx({"TRL in memory": in_memory / longer, "TRL to disk": to_disk / longer})


def test_bench_attention_gqa_label_names_the_ratio_it_runs():
    """The row was labelled "kv heads = heads/4" on workloads with 2 heads and 1 key/value head."""
    from seqpack.bench.attention import GQA, gqa_kv_heads, method_label
    from seqpack.bench.workloads import workload

    for name, label, kv_heads in (("a", "seqpack fused GQA 8:2", 2), ("b", "seqpack fused GQA 2:1", 1),
                                  ("c", "seqpack fused GQA 2:1", 1)):
        assert (method_label(GQA, workload(name)), gqa_kv_heads(workload(name))) == (label, kv_heads)
    assert method_label("seqpack fused", workload("c")) == "seqpack fused"


@pytest.mark.slow
@pytest.mark.bench
def test_bench_train_json():
    pytest.importorskip("transformers", reason="seqpack bench train needs the hf extra: pip install 'seqpack[hf]'")
    result = run("bench", "train", "--repeats", "1", "--layers", "1", "--json", timeout=900)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["targets"] == 7051 and (report["threads"], report["layers"]) == (2, 1)
    methods = set(report["seconds"])
    assert {"HF per-example", "HF padded (16)"} <= methods
    for policy in ("next-fit", "best-fit-decreasing", "flat"):
        for method in ("HF packed sdpa", "seqpack packed", "no-op bound", "query-only no-op"):
            assert any(name.startswith(f"{method}, {policy} (") for name in methods), (method, policy)
    assert all(len(times) == 1 and times[0] > 0 for times in report["seconds"].values())
    assert len(report["ratios"]) == 12 and all(ratio[0] > 0 for ratio in report["ratios"].values())
    # The ceiling of each layout: its no-op bound against the best baseline and sdpa on it.
    assert len(report["ceilings"]) == 6 and all(ratio[0] > 0 for ratio in report["ceilings"].values())
    seconds = report["seconds"]
    flat = next(name for name in seconds if name.startswith("no-op bound, flat ("))
    best = min(seconds[name][0] for name in seconds if name.startswith(("HF per-example", "HF padded", "HF packed")))
    assert report["ceilings"][f"{flat} / best HF baseline"][0] == pytest.approx(best / seconds[flat][0])


def test_the_training_bounds_differ_only_in_key_and_value_gradients():
    pytest.importorskip("transformers", reason="seqpack bench train needs the hf extra: pip install 'seqpack[hf]'")
    import torch

    from seqpack import hf
    from seqpack.bench import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = train.make_model(torch, hf, layers=1)
        ids = torch.arange(2, 34).reshape(2, 16)
        fields = {"input_ids": ids, "labels": ids, "use_cache": False}
        losses = {}
        for implementation in ("noop", "noop-query"):
            train.run(model, implementation, [fields])
            attention = model.model.layers[0].self_attn
            losses[implementation] = model(**fields).loss.item()
            grads = {name: getattr(attention, name).weight.grad for name in ("q_proj", "k_proj", "v_proj")}
            assert grads["q_proj"] is not None and grads["q_proj"].abs().sum() > 0
            if implementation == "noop":  # key and value run their backward, with zero gradients
                assert all(grads[name] is not None and not grads[name].any() for name in ("k_proj", "v_proj"))
            else:
                assert grads["k_proj"] is None and grads["v_proj"] is None
        assert losses["noop"] == losses["noop-query"]
    finally:
        torch.set_num_threads(threads)  # the rest of the session keeps its threads


def test_bench_train_argument_errors():
    result = run("bench", "train", "--repeats", "0")
    assert result.returncode == 2 and "--repeats must be at least 1" in result.stderr  # a usage error, as pack's


def test_bench_needs_a_suite():
    result = run("bench", "nonsense")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_pack_on_an_unreachable_ray_address_fails_in_seconds(tmp_path):
    """It printed nothing for about ten minutes, then only Ray's GCS timeout."""
    pytest.importorskip("ray", reason="the Ray engine needs the ray extra: pip install 'seqpack[ray]'")
    (tmp_path / "data.jsonl").write_text('{"text": "some text"}\n', encoding="utf-8")
    with socket.socket() as probe:  # a loopback port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    result = run("pack", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "out"), "--engine", "ray",
                 "--address", f"127.0.0.1:{port}", "--cut-long", timeout=60)
    assert time.monotonic() - started < 30
    assert result.returncode == 1 and result.stdout == ""
    assert f"cannot reach a Ray cluster at 127.0.0.1:{port}: " in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("suite, summary", [
    ("attention", "seqpack bench attention: fused range attention against dense and PyTorch peers."),
    ("train", "seqpack bench train: a Hugging Face training step, seqpack attention on packed rows against HF's ways."),
])
def test_bench_help_describes_the_suite_in_plain_text(suite, summary):
    """The description was the module docstring's first line, reStructuredText and all."""
    result = run("bench", suite, "--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "`" not in result.stdout
    assert summary in " ".join(result.stdout.split())  # argparse rewraps the paragraph


@pytest.mark.parametrize("script", sorted(path.name for path in BENCH.glob("*.py")
                                          if 'if __name__ == "__main__":' in path.read_text(encoding="utf-8")))
def test_bench_scripts_answer_help_without_running(script):
    """``python bench/bench_decoder.py --help`` started the full benchmark."""
    result = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: {script}")


@pytest.mark.slow
def test_a_ctrl_c_while_the_command_starts_is_one_line_not_a_traceback(tmp_path):
    """SIGINT while the command line was still importing printed a raw KeyboardInterrupt
    traceback: ``import seqpack`` now loads nothing heavy, and the rest loads inside the
    command's handling of Ctrl-C. (A signal while Python itself starts, before the console
    script imports ``seqpack.cli``, is Python's: the sweep starts once that import is done.)"""
    import signal

    started = []
    for _ in range(3):
        begin = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import seqpack.cli"], check=True)
        started.append(time.perf_counter() - begin)
    outcomes = set()
    for delay in np.linspace(1.5 * max(started), 0.6, 20):
        process = subprocess.Popen([seqpack_command(), "pack", "--sample", "--out", str(tmp_path / "out"),
                                    "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
        assert "Traceback" not in stderr, (delay, stderr)
        # Before Python's own handler is in place the signal ends the process unprinted.
        assert (process.returncode, stderr) in {(130, "seqpack: interrupted\n"), (-signal.SIGINT, "")}, (delay, stderr)
        outcomes.add(process.returncode)
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
    assert 130 in outcomes
