"""The installed ``seqpack`` command, run as a user runs it."""

import io
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np
import pytest
import gzip

from helpers import one_error_line, run, seqpack_command, write_megatron

BENCH = Path(__file__).resolve().parents[2] / "bench"


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
    assert decoder["parameters_from"].startswith("numpy.random.default_rng(42), not the chapters' Rust generator")
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
        assert record["peers_apart"] < 1e-12  # every peer's results were compared in the run
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
def test_bench_attention_runs_each_cpu_path_named_and_each_head_size():
    # The benchmark names the CPU path each row ran, and sets paths and head sizes side by side.
    from seqpack.nn import _attention

    paths = _attention.cpu_paths()
    result = run("bench", "attention", "--workload", "c", "--dtype", "float64", "--repeats", "1", "--json",
                 "--cpu-path", ",".join(paths), "--head-dim", "4,13")
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    fused = [r for r in records if r["method"].startswith("seqpack fused [")]
    assert [(r["method"], r["head_dim"]) for r in fused] == [
        (f"seqpack fused [{path}]", size) for size in (4, 13) for path in paths]
    assert all(r["cpu_paths"] == paths and r["cpu_path"] == paths[-1] and r["forward_ms"] > 0 for r in fused)
    table = run("bench", "attention", "--workload", "c", "--dtype", "float64", "--repeats", "1")
    assert f"fused kernels on CPU path {paths[-1]} (this CPU runs {', '.join(paths)})" in table.stdout
    for args, message in ((("--cpu-path", "avx9"), "choose from baseline, avx2, avx512"),
                          (("--head-dim", "0"), "head sizes are integers in")):
        refused = run("bench", "attention", "--workload", "c", *args)
        assert refused.returncode == 2 and message in refused.stderr
    missing = [path for path in _attention.CPU_PATHS if path not in paths]
    if missing:  # this CPU cannot run a path: an error naming what it runs
        refused = run("bench", "attention", "--workload", "c", "--cpu-path", missing[0])
        assert refused.returncode == 1 and f"this CPU runs only {', '.join(paths)}" in refused.stderr


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


@pytest.mark.slow
@pytest.mark.bench
def test_bench_sft_json_measures_every_method_and_the_disk(tmp_path):
    pytest.importorskip("trl", reason="bench_sft.py's TRL row needs the bench extra: pip install 'seqpack[bench]'")
    result = subprocess.run([sys.executable, str(BENCH / "bench_sft.py"), "--records", "300", "--repeats", "1",
                             "--json", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["seconds"]) == {"seqpack pack", "seqpack verify", "floor", "trl"}
    assert all(value > 0 for value in report["seconds"].values())
    assert 0 < report["supervised_targets"] < report["tokens"] and report["bytes_per_token"] > 2
    assert not list(tmp_path.iterdir())  # the work directory is removed

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
    assert 0 < report["gradients_apart"] < 1e-3  # every method computes the same step
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


def test_bench_train_refuses_methods_that_compute_another_step():
    # Each HF method's loss was its batches' own mean: per example, 23 means summed (review).
    pytest.importorskip("transformers", reason="seqpack bench train needs the hf extra: pip install 'seqpack[hf]'")
    import torch

    from seqpack import SeqpackError, hf
    from seqpack.bench import train

    model = train.make_model(torch, hf, layers=1)
    ids = torch.arange(2, 34).reshape(2, 16)
    whole = {"input_ids": ids, "labels": ids, "use_cache": False, "num_items_in_batch": 30}
    halves = [{**whole, "input_ids": ids[i : i + 1], "labels": ids[i : i + 1]} for i in range(2)]
    same = {"one batch": ("sdpa", [whole], 30), "two": ("sdpa", halves, 30), "seqpack": ("seqpack", [whole], 30)}
    assert train.warm_up_and_compare(torch, model, same) < 1e-5
    means = [{key: value for key, value in fields.items() if key != "num_items_in_batch"} for fields in halves]
    with pytest.raises(SeqpackError, match=r"^two means computes another step than one batch: loss "):
        train.warm_up_and_compare(torch, model, {"one batch": same["one batch"], "two means": ("sdpa", means, 30)})


def test_bench_train_argument_errors():
    result = run("bench", "train", "--repeats", "0")
    assert result.returncode == 2 and "--repeats must be at least 1" in result.stderr  # a usage error, as pack's


def test_bench_needs_a_suite():
    result = run("bench", "nonsense")
    assert result.returncode == 2 and "invalid choice" in result.stderr


@pytest.mark.parametrize("args, message", [
    (("--engine", "ray"), "seqpack pack --engine ray needs the 'ray' extra: pip install 'seqpack[ray]'"),
    # Each missing extra was named on its own run, after the input's (review).
    (("--engine", "ray", "--tokenizer", "tok.json", "--eos", "1"),
     "seqpack pack --engine ray --tokenizer needs the 'ray' and 'hf' extras: pip install 'seqpack[ray,hf]'"),
])
def test_pack_names_every_missing_extra_at_once(tmp_path, args, message):
    script = ("import sys\nsys.modules.update(dict.fromkeys(('ray', 'tokenizers', 'pyarrow')))\n"
              "from seqpack.cli import main\nsys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", script, "pack", str(tmp_path / "a.parquet"), "--out",
                             str(tmp_path / "out"), *args], capture_output=True, text=True, timeout=120)
    assert one_error_line(result) == f"seqpack: error: {message}"


def test_pack_with_a_tokenizer_file_needs_tokenizers_not_transformers(tmp_path):
    pytest.importorskip("tokenizers", reason="--tokenizer needs the hf extra: pip install 'seqpack[hf]'")
    script = ("import sys\nsys.modules['transformers'] = None\nfrom seqpack.cli import main\n"
              "sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", script, "pack", str(tmp_path / "a.txt"), "--out",
                             str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok.json"), "--eos", "1"],
                            capture_output=True, text=True, timeout=120)
    assert "tok.json" in one_error_line(result) and "extra" not in result.stderr


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
    for delay in np.linspace(2 * max(started), 0.6, 20):
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


def swallowed_sigint():
    """SIGINT to this process, its KeyboardInterrupt lost as C code inside an import or a
    weakref callback loses it."""
    import signal

    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs here at the latest
    except KeyboardInterrupt:
        pass


@pytest.mark.parametrize("then", ["returns", "fails"])
def test_a_ctrl_c_python_loses_while_the_command_loads_still_stops_it(tmp_path, textdir, monkeypatch, capsys, then):
    """A KeyboardInterrupt raised inside an import can be lost (numpy's C code turned one into
    'PyCapsule_Import could not import module "datetime"', a weakref callback of importlib
    drops one): `seqpack pack` then ran to the end and exited 0, or failed on that other
    error. While the command loads its modules a signal is only noted, then raised."""
    from seqpack import cli

    build = cli.build_parser

    def loading():
        swallowed_sigint()
        if then == "fails":
            raise ImportError('PyCapsule_Import could not import module "datetime"')
        return build()

    monkeypatch.setattr(cli, "build_parser", loading)
    assert cli.main(["pack", str(textdir), "--out", str(tmp_path / "out"), "--quiet"]) == 130
    assert capsys.readouterr().err == "seqpack: interrupted\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_signal_deferred_by_the_publish_is_raised_once_the_dataset_is_published(tmp_path, textdir, monkeypatch,
                                                                                   capsys, name):
    """A signal that came while --force removed the replaced dataset was recorded and then
    dropped: the command printed its report and exited 0 as if none had come."""
    import signal

    from seqpack import cli
    from seqpack.io import publish

    out = tmp_path / "out"
    assert cli.main(["pack", str(textdir), "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    removing = publish._remove_unless

    def signalled(directory, caught):
        os.kill(os.getpid(), getattr(signal, name))   # just after the manifest's rename: the commit
        return removing(directory, caught)

    monkeypatch.setattr(publish, "_remove_unless", signalled)
    assert cli.main(["pack", str(textdir), "--out", str(out), "--force", "--capacity", "64", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"seqpack: {out} is complete: it was published before the signal took effect\n"
    assert captured.out == ""   # (the command stopped there: no report)
    assert run("verify", out, "--quiet").returncode == 0
    assert json.loads((out / "manifest.json").read_text())["config"]["capacity"] == 64


@pytest.mark.parametrize("lost_in", ["an except clause", "a weakref callback"])
def test_a_ctrl_c_python_loses_mid_pack_is_answered_by_what_is_on_disk(tmp_path, textdir, monkeypatch, capsys,
                                                                       lost_in):
    """A KeyboardInterrupt lost while the pack ran let it exit 0 as if no signal came: the
    command checks for a noted signal when it ends, and tells that the dataset was
    published first. The lost exception is not printed as 'Exception ignored'."""
    import signal
    import weakref

    import seqpack.io.job
    from seqpack import cli

    pack = seqpack.io.job.run_job

    def losing(*args, **kwargs):
        if lost_in == "an except clause":
            swallowed_sigint()
        else:
            anything = type("Anything", (), {})()
            reference = weakref.ref(anything, lambda _: os.kill(os.getpid(), signal.SIGINT))
            del anything
            time.sleep(0.05)
            assert reference() is None
        return pack(*args, **kwargs)

    monkeypatch.setattr(seqpack.io.job, "run_job", losing)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    out = tmp_path / "out"
    assert cli.main(["pack", str(textdir), "--out", str(out), "--quiet"]) == 0
    assert unraisable == [] and sys.unraisablehook == unraisable.append
    assert capsys.readouterr().err == f"seqpack: {out} is complete: it was published before the signal took effect\n"
    assert run("verify", out, "--quiet").returncode == 0
    # A lost signal in a command that writes nothing ends it as interrupted.
    monkeypatch.setattr(seqpack.io, "verify_dataset", lambda *args, **kwargs: swallowed_sigint())
    assert cli.main(["verify", str(out), "--quiet"]) == 130
    assert capsys.readouterr().err == "seqpack: interrupted\n"


@pytest.mark.parametrize("fixture", ["padded", "packed"])
@pytest.mark.parametrize("batch", ["0", "3"])
def test_show_batch_of_a_fixture_is_a_usage_error(fixture, batch):
    result = run("show", fixture, "--batch", batch)
    assert "--batch has no effect here" in one_error_line(result, 2)
    assert result.stdout == ""


@pytest.mark.parametrize("suite", ["attention", "train"])
def test_bench_huge_threads_is_one_line_not_a_traceback(suite):
    result = run("bench", suite, "--threads", 10**20, "--repeats", 1)
    assert "--threads is 100000000000000000000; the maximum is 1024" in one_error_line(result, 2)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [("--help",), ("--version",), ("show", "--help")])
@pytest.mark.parametrize("unbuffered", [True, False])
def test_help_and_version_into_a_full_disk_fail_with_one_line(args, unbuffered):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        result = run(*args, stdout=full, env=env)
    assert "cannot write the output" in one_error_line(result, 1)


def test_help_into_a_closed_pipe_exits_quietly():
    process = subprocess.Popen([seqpack_command(), "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()
    assert process.wait(timeout=60) == 0
    assert process.stderr.read() == b""


def chapter_batch(kind="packed"):
    from seqpack.chapters import chapter_batch
    from seqpack.data import BatchBinding

    return chapter_batch(kind, BatchBinding.fixture())


def test_loss_probe_refuses_nan_gold_probabilities():
    from seqpack.chapters import loss_probe
    from seqpack.errors import InvalidInputError

    batch = chapter_batch()
    with pytest.raises(InvalidInputError, match="strictly between 0 and 1"):
        loss_probe(batch, np.full(batch.shape, np.nan))


def test_loss_probe_refuses_a_wrong_shape():
    from seqpack.chapters import loss_probe
    from seqpack.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"gold probabilities have shape \(1, 3\); the batch is \(2, 6\)"):
        loss_probe(chapter_batch(), np.full((1, 3), 0.5))


def test_gold_probabilities_of_a_non_chapter_example_is_invalid_input():
    from seqpack.chapters import gold_probabilities
    from seqpack.chapters.fixtures import examples_of, packed_batch
    from seqpack.data import BatchBinding
    from seqpack.errors import InvalidInputError

    binding = BatchBinding.fixture()
    batch = packed_batch(examples_of({"X": [0, 5, 6, 1]}, binding), binding, 6)
    with pytest.raises(InvalidInputError, match="'X' is not a chapter fixture example"):
        gold_probabilities(batch)


@pytest.mark.parametrize("tile", [0, -2])
def test_edge_inventory_refuses_a_tile_below_one(tile):
    from seqpack.chapters.demo import edge_inventory
    from seqpack.errors import InvalidInputError

    batch = chapter_batch()
    assert len(edge_inventory(batch)) == len(edge_inventory(batch, 2)) == 19
    with pytest.raises(InvalidInputError, match="tile_width must be at least 1"):
        edge_inventory(batch, tile)


@pytest.fixture
def textdir(tmp_path):
    directory = tmp_path / "textdir"
    directory.mkdir()
    (directory / "a.txt").write_text("hello")
    (directory / "b.txt").write_text("world")
    return directory


@pytest.mark.parametrize("inside", ["out", "sub/out"])
def test_pack_refuses_an_output_inside_an_input_directory(tmp_path, textdir, inside):
    (textdir / "sub").mkdir()
    result = run("pack", textdir, "--out", textdir / inside, "--quiet")
    line = one_error_line(result, 1)
    assert line.endswith(f"the output {textdir / inside} lies inside the input directory {textdir}: "
                         f"write it outside the inputs")
    assert sorted(p.name for p in textdir.iterdir()) == ["a.txt", "b.txt", "sub"]


def test_a_packed_dataset_inside_an_input_directory_is_skipped_and_reported(tmp_path, textdir):
    """It used to be packed as documents (manifest.json, *.npy, tokens.bin)."""
    assert run("pack", textdir, "--out", tmp_path / "first", "--quiet").returncode == 0
    (tmp_path / "first").rename(textdir / "out")
    result = run("pack", textdir, "--out", tmp_path / "again", "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"seqpack: skipped {textdir / 'out'}: a packed dataset, not text\n"
    # A name's escape sequence reached the terminal from this line (review).
    (textdir / "out").rename(textdir / "out\x1b[2J")
    result = run("pack", textdir, "--out", tmp_path / "third", "--quiet", "--json")
    assert result.stderr == f"seqpack: skipped {textdir}/out\\x1b[2J: a packed dataset, not text\n"
    (textdir / "out\x1b[2J").rename(textdir / "out")
    manifest = json.loads(result.stdout)
    assert [item["name"] for item in manifest["inputs"]] == [str(textdir / "a.txt"), str(textdir / "b.txt")]
    assert one_error_line(run("pack", textdir / "out", "--out", tmp_path / "x"), 1).endswith(
        f"{textdir / 'out'}: a packed dataset, not text files")


@pytest.mark.parametrize("name", ["good.jsonl.gz", "renamed.jsonl", "renamed.txt"])
def test_pack_refuses_a_gzip_file(tmp_path, name):
    """It used to pack the gzip bytes as one text document (exit 0)."""
    (tmp_path / name).write_bytes(gzip.compress(b'{"text": "hi"}\n'))
    line = one_error_line(run("pack", tmp_path / name, "--out", tmp_path / "out"), 1)
    assert line.endswith(f"{tmp_path / name}: gzip-compressed; decompress it first")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (("--threads", 100000), "--threads is 100000; the maximum is 1024"),
    (("--threads", 0), "--threads must be at least 1"),
    (("--capacity", 0), "--capacity must be at least 1"),
    (("--capacity", 3000000000), "--capacity is 3000000000; the maximum is 2147483647"),
    (("--rows-per-batch", 0), "--rows-per-batch must be at least 1"),
    (("--shards", 0), "--shards must be at least 1"),
    (("--ids-field", "input_ids", "--text-field", "text"), "give --text-field or --ids-field, not both"),
])
@pytest.mark.parametrize("source", ["sample", "jsonl"])
def test_bad_pack_option_values_are_usage_errors(tmp_path, args, message, source):
    """Each used to exit 1 (from the library, some after reading the inputs)."""
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "hi", "input_ids": [5]}) + "\n")
    inputs = ["--sample"] if source == "sample" else [tmp_path / "docs.jsonl"]
    line = one_error_line(run("pack", *inputs, "--out", tmp_path / "out", *args), 2)
    assert line == f"seqpack: error: {message}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--batch", "--row"])
def test_a_negative_show_batch_or_row_is_a_usage_error(flag):
    assert one_error_line(run("show", "packed", flag, -1), 2) == f"seqpack: error: {flag} must be at least 0"


def test_pack_reads_a_megatron_prefix(tmp_path):
    """``pack --help`` says a prefix is an INPUT; it used to fail 'meg: no such file or directory'."""
    write_megatron(tmp_path / "meg", [[5, 6, 7], [8, 9]])
    result = run("pack", tmp_path / "meg", "--out", tmp_path / "out", "--quiet", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["counts"]["documents"] == 2
    (tmp_path / "half.idx").write_bytes((tmp_path / "meg.idx").read_bytes())
    assert one_error_line(run("pack", tmp_path / "half", "--out", tmp_path / "x"), 1).endswith(
        f"{tmp_path / 'half.bin'}: no such file (a Megatron dataset is PREFIX.idx + PREFIX.bin)")


@pytest.mark.parametrize("args, status, message", [
    (("pack", "--out", "x"), 2, "give INPUT paths or --sample"),
    (("pack", "textdir", "--sample", "--out", "x"), 2, "give INPUT paths or --sample, not both"),
    (("verify", "textdir/a.txt"), 1, "textdir/a.txt: not a directory"),
    (("stats", "nowhere"), 1, "nowhere: no such directory"),
    (("pack", "textdir", "--out", "nowhere/x"), 1, "nowhere does not exist (the parent of nowhere/x)"),
    (("pack", "textdir", "--out", "textdir/a.txt/x"), 1, "textdir/a.txt is not a directory (the parent of "
                                                         "textdir/a.txt/x)"),
    (("pack", "textdir", "textdir/a.txt", "--out", "x"), 1,
     "textdir/a.txt is an input twice (also inside textdir): give each file once"),
    (("pack", "textdir/a.txt", "textdir", "--out", "x"), 1,
     "textdir/a.txt (inside textdir) is an input twice (also as textdir/a.txt): give each file once"),
    (("pack", "textdir", "--out", "x", "--glob", "*.rs"), 1, "textdir: no file matches --glob '*.rs'"),
])
def test_error_wording(tmp_path, textdir, args, status, message):
    result = subprocess.run([seqpack_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            timeout=300, cwd=tmp_path)
    assert one_error_line(result, status) == f"seqpack: error: {message}"


def test_verify_counts_one_example_and_one_batch_in_the_singular(tmp_path, textdir):
    """It printed '1 batches verified'."""
    assert run("pack", textdir / "a.txt", "--out", tmp_path / "out", "--quiet").returncode == 0
    result = run("verify", tmp_path / "out", "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(", 1 example placed by the rules, 1 batch verified\n")


def big_jsonl(path, documents=60_000):
    rng = np.random.default_rng(0)
    with open(path, "w") as handle:
        for size in rng.integers(10, 400, documents):
            handle.write(json.dumps({"text": "w " * int(size)}) + "\n")
    return path


@pytest.mark.slow
def test_sigterm_mid_pack_cleans_up_like_ctrl_c(tmp_path):
    """SIGTERM (kill, timeout, a scheduler) killed the process with no message and left the
    hidden partial directory behind for good."""
    import signal
    import time

    source = big_jsonl(tmp_path / "big.jsonl")
    process = subprocess.Popen([seqpack_command(), "pack", str(source), "--out", str(tmp_path / "out"), "--cut-long",
                                "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".out.seqpack-partial") for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert (process.returncode, stderr) == (143, "seqpack: terminated\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]


def test_an_unreadable_file_is_named_not_called_the_output(tmp_path, monkeypatch, capsys):
    """verify, stats and show said 'cannot write the output: Permission denied' for a
    dataset file they could not read (as a user without the right to)."""
    import seqpack.io
    from seqpack import cli

    (tmp_path / "a.txt").write_text("hello")
    assert cli.main(["pack", str(tmp_path / "a.txt"), "--out", str(tmp_path / "ds"), "--quiet"]) == 0
    tokens = tmp_path / "ds" / "part-00000" / "tokens.bin"

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tokens))

    monkeypatch.setattr(seqpack.io, "verify_dataset", refuse)
    capsys.readouterr()
    assert cli.main(["verify", str(tmp_path / "ds"), "--quiet"]) == 1
    assert capsys.readouterr().err == f"seqpack: error: {tokens}: Permission denied\n"


def test_an_allocation_that_fails_is_one_line(tmp_path, monkeypatch, capsys):
    from seqpack import cli

    def huge(argv, signals):
        raise MemoryError("Unable to allocate 32.0 GiB for an array with shape (1, 2147483647)")

    monkeypatch.setattr(cli, "_run", huge)
    assert cli.main(["show", "packed"]) == 1
    assert capsys.readouterr().err == ("seqpack: error: not enough memory: Unable to allocate 32.0 GiB for an array "
                                       "with shape (1, 2147483647)\n")


@pytest.mark.parametrize("out", [".", "..", "sub/.."])
def test_an_output_of_dot_is_refused_before_any_work(tmp_path, out):
    """``--out .`` packed everything, then refused at publish time because of its own
    temporary directory, made inside the output."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("hello")
    result = subprocess.run([seqpack_command(), "pack", "sub/a.txt", "--out", out, "--force"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    line = one_error_line(result, 1)
    assert f"the output '{out}' ends in '.' or '..': name the dataset's own directory" in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.txt", "sub"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
@pytest.mark.parametrize("name", ["fifo.txt", "fifo.jsonl", "fifo.parquet", "fifo.idx"])
def test_a_pipe_is_named_as_such_not_as_missing(tmp_path, name):
    """``/dev/stdin``, ``<(...)`` and named pipes were reported as 'no such file'."""
    pipe = tmp_path / name
    os.mkfifo(pipe)
    if name.endswith(".idx"):
        (tmp_path / "fifo.bin").write_bytes(b"")
    line = one_error_line(run("pack", pipe, "--out", tmp_path / "out"), 1)
    assert line == (f"seqpack: error: {pipe}: not a regular file (a pipe, a device or a socket): write the data to a "
                    f"file first")
    assert not (tmp_path / "out").exists()


def test_a_file_name_with_a_line_break_stays_on_one_line(tmp_path):
    path = tmp_path / "bad\nname.jsonl"
    path.write_text('{"text": 1}\n')
    line = one_error_line(run("pack", path, "--out", tmp_path / "out"), 1)
    assert line == f"seqpack: error: {tmp_path}/bad\\nname.jsonl:1: field 'text' is not a string"


def test_a_document_over_the_token_limit_names_the_flag_that_raises_it(tmp_path):
    """--cut-long did not lift the 1,000,000-token guard, and nothing said what would."""
    book = tmp_path / "book.txt"
    book.write_text("ab " * 400_000)
    line = one_error_line(run("pack", book, "--out", tmp_path / "out", "--cut-long"), 1)
    assert line == (f"seqpack: error: {book}: document has 1200002 tokens; the limit is 1000000 (first token over it "
                    f"at position 1000000) (--max-document-tokens raises the limit)")
    result = run("pack", book, "--out", tmp_path / "out", "--cut-long", "--quiet", "--json",
                 "--max-document-tokens", 1_200_002)
    assert result.returncode == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert manifest["binding"]["limits"] == {"max_tokens": 1_200_002, "max_bytes": 9_600_016}
    assert run("verify", tmp_path / "out", "--quiet").returncode == 0
    assert "--max-document-tokens must be at least 3" in one_error_line(
        run("pack", book, "--out", tmp_path / "other", "--max-document-tokens", 2), 2)


@pytest.mark.parametrize("split", ["", "  "])
def test_an_empty_split_name_is_a_usage_error(tmp_path, split):
    (tmp_path / "a.txt").write_text("hello")
    line = one_error_line(run("pack", tmp_path / "a.txt", "--out", tmp_path / "out", "--split", split), 2)
    assert line == "seqpack: error: --split needs the split's name or a split receipt .json file"


def test_a_split_path_in_any_case_or_with_a_directory_is_a_receipt(tmp_path):
    # "./receipt.JSON" was bound as a split *named* "./receipt.JSON", exit 0 (review).
    (tmp_path / "a.txt").write_text("hello")
    receipt = Path(__file__).resolve().parents[2] / "fixtures" / "split_receipt.json"
    shutil.copy(receipt, tmp_path / "receipt.JSON")
    digests = []
    for number, split in enumerate((receipt, "./receipt.JSON")):
        result = run("pack", "a.txt", "--out", f"out{number}", "--split", split, "--quiet", "--json", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        digests.append(json.loads(result.stdout)["binding"]["split_receipt_digest"])
    assert digests[0] == digests[1]
    line = one_error_line(run("pack", "a.txt", "--out", "out2", "--split", "splits/train", cwd=tmp_path))
    assert line.startswith("seqpack: error: split receipt splits/train: cannot read")
    result = run("pack", "a.txt", "--out", "out3", "--split", "train-2024", "--quiet", "--json", cwd=tmp_path)
    assert json.loads(result.stdout)["binding"]["split_receipt_digest"] != digests[0]   # a name stays a name


def test_a_signal_after_the_command_leaves_its_status(tmp_path):
    # A SIGINT while Python shut down after a finished pack killed the process: 130, the dataset complete (review).
    script = ("import os, signal, sys\nfrom seqpack.cli import main\nstatus = main(['--version'], exiting=True)\n"
              "os.kill(os.getpid(), signal.SIGINT)\nos.kill(os.getpid(), signal.SIGTERM)\nsys.exit(status)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("seqpack "), result.stderr
    inside = ("import os, signal\nfrom seqpack.cli import main\nmain(['--version'])\n"
              "os.kill(os.getpid(), signal.SIGINT)\n")   # main() in a program: the program's handlers come back
    assert subprocess.run([sys.executable, "-c", inside], capture_output=True, timeout=120).returncode != 0


# --- show and stats on a dataset: names, column windows, figures, the median -------------


@pytest.fixture
def dataset(tmp_path, textdir):
    out = tmp_path / "d"
    assert run("pack", textdir, "--out", out, "--capacity", 16, "--rows-per-batch", 3, "--quiet").returncode == 0
    return out


# Regression: undecodable or control-character names broke show --svg (a traceback, not XML) and stats.
@pytest.mark.skipif(os.name != "posix", reason="needs file names of arbitrary bytes")
def test_names_with_undecodable_bytes_or_control_characters_are_shown_escaped(tmp_path, dataset):
    """A directory name with a byte that is not UTF-8 made show --svg a traceback (and left
    the figure empty); one with a control character wrote an SVG that is not XML."""
    strict = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # a locale whose stdout refuses surrogates
    for raw, shown in ((b"bad\xffname", "bad\\xffname"), (b"d\x01<&x", "d\\x01<&x")):
        renamed = os.path.join(os.fsencode(tmp_path), raw)
        os.rename(os.fsencode(dataset), renamed)
        figure = tmp_path / "figure.svg"
        result = run("show", os.fsdecode(renamed), "--columns", "0:3", "--svg", figure, env=strict)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        titles = [t.text for t in ElementTree.parse(figure).iter("{http://www.w3.org/2000/svg}text")]
        assert f"{tmp_path}/{shown}: batch 0" in titles
        stats = run("stats", os.fsdecode(renamed), env=strict)
        assert stats.returncode == 0, stats.stderr
        assert stats.stdout.splitlines()[0].endswith(f"/{shown}")
        verify = run("verify", os.fsdecode(renamed), "--quiet", env=strict)
        assert verify.returncode == 0 and verify.stdout.startswith(f"{tmp_path}/{shown}: ok:"), verify.stderr
        os.rename(renamed, os.fsencode(dataset))


# Regression: an empty --columns window was not a usage error.
@pytest.mark.parametrize("window", ["3:3", "5:2"])
def test_an_empty_column_window_is_a_usage_error(dataset, window):
    result = run("show", dataset, "--columns", window)
    assert f"--columns {window} is empty: STOP must be above START" in one_error_line(result, 2)
    # A negative column was exit 1, not a usage error (review).
    result = run("show", dataset, "--columns", ":-1")
    assert "--columns :-1: START and STOP are columns from 0, not negative" in one_error_line(result, 2)


# Regression: a figure written inside the dataset made the dataset fail verify.
@pytest.mark.parametrize("command", ["stats", "show"])
def test_a_figure_inside_the_dataset_is_refused(dataset, command):
    """The figure made the dataset fail verify: it holds only its manifest and parts."""
    figure = dataset / "part-00000" / ".." / "figure.svg"
    line = one_error_line(run(command, dataset, "--svg", figure), 1)
    assert f"--svg {figure} is inside the packed dataset {dataset.resolve()}, which holds only its manifest" in line
    assert not (dataset / "figure.svg").exists()
    assert run("verify", dataset, "--quiet").returncode == 0


# Review: --svg /dev/stdout replaced the link with a regular file (as root), and a FIFO became a file.
@pytest.mark.parametrize("command", ["stats", "show"])
def test_a_figure_over_a_link_or_a_fifo_is_refused(dataset, tmp_path, command):
    link, fifo = tmp_path / "stdout-like", tmp_path / "fifo"
    link.symlink_to(tmp_path / "target.svg")
    os.mkfifo(fifo)
    for figure, kind in ((link, "a symbolic link"), (fifo, "not a regular file")):
        line = one_error_line(run(command, dataset, "--svg", figure), 1)
        assert f"--svg {figure} is {kind}; seqpack writes a new file or replaces a regular one whole" in line
    assert link.is_symlink() and stat.S_ISFIFO(fifo.stat().st_mode) and not (tmp_path / "target.svg").exists()
    regular = tmp_path / "figure.svg"
    regular.write_text("old")
    assert run(command, dataset, "--svg", regular).returncode == 0 and regular.read_text() != "old"


# Review: outputs inside another packed dataset were written, and it then failed verify.
@pytest.mark.parametrize("command", [("show", "packed", "--svg"), ("stats", None, "--svg"),
                                     ("pack", None, "--out")])
def test_an_output_inside_another_dataset_is_refused(dataset, textdir, tmp_path, command):
    name, target, option = command
    other = tmp_path / "other"
    shutil.copytree(dataset, other)
    out = other / "part-00000" / "inner"
    args = {"show": ("show", target), "stats": ("stats", dataset), "pack": ("pack", textdir)}[name]
    line = one_error_line(run(*args, option, out, *(("--capacity", 64) if name == "pack" else ())), 1)
    assert f"{out} is inside the packed dataset {other.resolve()}, which holds only its manifest and parts" in line
    assert not out.exists() and run("verify", other, "--quiet").returncode == 0


def test_a_figure_write_that_fails_leaves_the_old_file(tmp_path):
    # The figure was written in place: a failed write left it truncated (review).
    import resource

    figure = tmp_path / "figure.svg"
    figure.write_text("the old figure")
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))  # noqa: E731  (bytes per file)
    result = subprocess.run([seqpack_command(), "show", "packed", "--svg", str(figure)], capture_output=True,
                            text=True, timeout=120, preexec_fn=limit)
    assert "figure.svg: cannot write: File too large" in one_error_line(result, 1)
    assert figure.read_text() == "the old figure" and sorted(p.name for p in tmp_path.iterdir()) == ["figure.svg"]


# Regression: stats printed 'median 2' for lengths 2 and 3 (round half to even).
def test_the_median_length_keeps_its_half(tmp_path):
    """Two examples of 2 and 3 predictions printed 'median 2' (round half to even)."""
    corpus = tmp_path / "two"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a")
    (corpus / "b.txt").write_text("bc")
    assert run("pack", corpus, "--out", tmp_path / "o", "--capacity", 8, "--quiet").returncode == 0
    result = run("stats", tmp_path / "o")
    assert "(lengths: median 2.5, mean 2.5, max 3)" in result.stdout


# From the 0c1584e fix: show printed its text before finding that the figure cannot be written.
def test_a_figure_that_cannot_be_written_fails_before_anything_is_printed(tmp_path):
    result = run("show", "packed", "--svg", tmp_path / "missing" / "figure.svg")
    assert "figure.svg: cannot write: No such file or directory" in one_error_line(result, 1)
    assert result.stdout == ""


# Review: an input named with a byte that is not UTF-8 was packed whole, then sealing the
# manifest raised UnicodeEncodeError (a traceback); --split such a name crashed at start.
@pytest.mark.skipif(os.name != "posix", reason="needs file names of arbitrary bytes")
def test_inputs_and_split_names_that_are_not_utf8_are_refused_by_name(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "b.txt").write_text("world")
    with open(os.path.join(os.fsencode(corpus), b"\xffname.txt"), "w") as file:
        file.write("hello")
    line = one_error_line(run("pack", corpus, "--out", tmp_path / "out", "--quiet"), 1)
    assert line == (f"seqpack: error: {corpus}/\\xffname.txt: the name holds a byte that is not UTF-8; a packed "
                    f"dataset's manifest names its inputs in UTF-8: rename it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]
    line = one_error_line(run("pack", corpus / "b.txt", "--out", tmp_path / "out", "--split", os.fsdecode(b"s\xff")), 1)
    assert "the split name 's\\udcff' holds a byte that is not UTF-8" in line
    assert run("pack", corpus / "b.txt", "--out", tmp_path / "out", "--quiet").returncode == 0


# Review: with stdout closed (`>&-`) every command ended in an AttributeError traceback.
@pytest.mark.skipif(os.name != "posix", reason="closes the child's stdout")
@pytest.mark.parametrize("args", [("demo", "packed"), ("show", "packed")])
def test_a_closed_stdout_is_one_error_line(args):
    result = subprocess.run([seqpack_command(), *args], stderr=subprocess.PIPE, text=True, timeout=120,
                            preexec_fn=lambda: os.close(1))
    assert (result.returncode, result.stderr) == (1, "seqpack: error: cannot write the output: stdout is closed\n")


# Review: with stderr closed (`2>&-`) pack and verify exited 1 having done nothing (an
# AttributeError no one could see), and error lines went into stdout.
@pytest.mark.skipif(os.name != "posix", reason="closes the child's stderr")
def test_a_closed_stderr_changes_nothing_but_silences_errors(tmp_path, textdir):
    def without_stderr(*args):
        return subprocess.run([seqpack_command(), *map(str, args)], stdout=subprocess.PIPE, text=True, timeout=120,
                              preexec_fn=lambda: os.close(2))

    packed = without_stderr("pack", textdir, "--out", tmp_path / "out")
    assert packed.returncode == 0 and "documents" in packed.stdout
    verified = without_stderr("verify", tmp_path / "out")
    assert verified.returncode == 0 and ": ok: " in verified.stdout
    assert (without_stderr("stats", tmp_path / "missing").returncode, without_stderr("stats", "--json").stdout) == \
        (1, "")
    assert (without_stderr().returncode, without_stderr().stdout) == (2, "")


# Review: a report holding what stdout's encoding could not hold was a traceback after the
# work (show's drawing always; a dataset's name under PYTHONIOENCODING=ascii).
def test_what_stdout_cannot_encode_is_escaped(tmp_path, textdir):
    out = tmp_path / "päcked"
    environment = {**os.environ, "PYTHONIOENCODING": "ascii"}
    packed = run("pack", textdir, "--out", out, env=environment)
    assert packed.returncode == 0 and f"{tmp_path}/p\\xe4cked" in packed.stdout, packed.stderr
    shown = run("show", out, "--columns", "0:4", env=environment)
    assert shown.returncode == 0 and "\\u25a0" in shown.stdout, shown.stderr
    missing = run("verify", tmp_path / "nö", env=environment)
    assert one_error_line(missing) == f"seqpack: error: {tmp_path}/n\\xf6: no such directory"


def test_main_in_process_leaves_the_streams_as_it_found_them(monkeypatch):
    # It set every stream it had escaped back to 'strict', though stderr's default is
    # 'backslashreplace' (review).
    import io as text_io

    from seqpack import cli

    err = text_io.TextIOWrapper(text_io.BytesIO(), encoding="ascii", errors="backslashreplace")
    out = text_io.TextIOWrapper(text_io.BytesIO(), encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(["verify", os.fsdecode(b"/nowhere-\xc3\xa9")]) == 1
    assert (err.errors, out.errors) == ("backslashreplace", "strict")
    err.seek(0)
    assert err.read() == "seqpack: error: /nowhere-\\xe9: no such directory\n"


# Review: run from a deleted directory, a relative --out was "cannot write the output".
@pytest.mark.skipif(os.name != "posix", reason="removes the working directory")
def test_a_deleted_working_directory_is_named(tmp_path, textdir):
    gone = tmp_path / "gone"
    gone.mkdir()
    process = subprocess.run(f"cd {gone} && rmdir {gone} && {seqpack_command()} pack {textdir} --out rel",
                             shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    assert one_error_line(process) == ("seqpack: error: the working directory no longer exists: run the command "
                                       "from one that does, or give absolute paths")


def test_a_pack_replaced_before_its_report_exits_0_and_says_so(tmp_path, textdir, monkeypatch, capsys):
    """The report reopened the output: a second --force pack publishing just then made the
    first, already published, exit 1 ('manifest.json: missing'), or print the other's report
    (review)."""
    from seqpack import cli

    out, replaced = tmp_path / "out", []
    report = cli._print_pack_report

    def another_pack_publishes_first(path, manifest):
        if not replaced:
            replaced.append(True)
            assert cli.main(["pack", str(textdir), "--out", str(out), "--force", "--capacity", "64", "--quiet"]) == 0
        return report(path, manifest)

    monkeypatch.setattr(cli, "_print_pack_report", another_pack_publishes_first)
    assert cli.main(["pack", str(textdir), "--out", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"seqpack: {out} was published, then replaced by another pack before its report was "
                            f"read; 'seqpack stats {out}' reports what is there now\n")
    assert captured.out.count("capacity") == 1   # the other pack's report, printed by that pack alone
    assert json.loads((out / "manifest.json").read_text())["config"]["capacity"] == 64
