"""The installed ``seqpack`` command, run as a user runs it."""

import json
import os
import shutil
import subprocess
import sys

import pytest


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
