"""Packing a corpus on a local 2-CPU Ray cluster against the serial pipeline, in one run.

    python bench/bench_ray.py                    # about 16 MB of text through a BPE
    python bench/bench_ray.py --megabytes 300 --json

The corpus: the Python standard library's sources, cycled into ``--megabytes`` of JSONL
(16 files, one document a source file, written untimed); a byte-level BPE of 8192
entries trained here on the first 300 files (``tokenizers``). Every run packs the whole
corpus to disk (``--capacity 2048``, best-fit-decreasing, ``--cut-long``), timed from
the call to the published manifest:

- serial, best: ``seqpack.io.pack_corpus`` in this process, one part, the tokenizer's
  own thread pool on (every core);
- Ray, 1 worker: ``seqpack.ray.pack_corpus`` with ``--shards`` shards, one task at a time,
  a single-threaded tokenizer per task;
- Ray, 2 workers: the same with two tasks at once;
- Ray, 2 threads per task: ``threads=2``, so each task takes both CPUs and runs the
  tokenizer's pool of 2 threads, one task at a time.

Ratios: (a) scaling, Ray 1 worker / Ray 2 workers (the issue asks 1.7x or more); (b)
overhead, serial best / the faster of the two Ray runs that use both CPUs (the issue
asks 0.85x or more). With ``--repeats N`` the four runs take turns, N rounds of all
four, and each figure is a median over the rounds (a ratio: the median of each round's
ratio): on a shared machine whose speed drifts by tens of percent within minutes, runs
measured side by side compare like with like. Ray's start-up (``ray.init(num_cpus=2)``)
is timed separately and not in any ratio; the serial runs take their turns with Ray
started (idle) beside them. The in-run
peak is the tokenizer's own speed on one and on all threads over 4 MB of the corpus in
memory. The CPU, the load average before and after, the driver's peak RSS, the share of
the machine Ray's own processes keep busy while idle, and per run the machine's busy
cores (from ``/proc/stat``) are printed: other jobs take CPU from whichever run they
overlap. Per run, the CPU seconds of every process (``/proc/*/stat``) are summed by
kind: this process (the driver, and the serial runs' work), Ray's task workers
(``ray::`` processes) and the rest (Ray's own services, other jobs); "work / serial" is
the driver's plus the workers' CPU seconds against the serial run's in the same round,
the extra CPU time the same shards cost inside Ray's workers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import seqpack as sp
from seqpack import io
from seqpack.data.corpus import stdlib_sources

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_corpus import train_bpe  # noqa: E402
from timing import conditions, positive, positive_size  # noqa: E402

FILES = 16
CAPACITY = 2048
POLICY = "best-fit-decreasing"


def write_corpus(directory: Path, megabytes: float) -> list[Path]:
    """``FILES`` JSONL files holding the standard library's sources, cycled to ``megabytes``."""
    directory.mkdir()
    sources = [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_sources()]
    per_file = megabytes * 1e6 / FILES
    paths, cycle = [], itertools.cycle(sources)
    for number in range(FILES):
        path, size = directory / f"corpus-{number:02d}.jsonl", 0
        with open(path, "w", encoding="utf-8") as handle:
            while size < per_file:
                line = json.dumps({"text": next(cycle)}) + "\n"
                handle.write(line)
                size += len(line)
        paths.append(path)
    return paths


def tokenizer_speed(tokenizer, texts: list[str], parallel: bool) -> float:
    """MB/s of ``encode_batch_fast`` over ``texts`` on one thread or on the pool."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
    start = time.perf_counter()
    tokenizer.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    seconds = time.perf_counter() - start
    os.environ.pop("TOKENIZERS_PARALLELISM")
    return sum(len(t.encode()) for t in texts) / 1e6 / seconds


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy so far (``/proc/stat``: every state
    but idle and I/O wait): robust to Ray starting and ending worker processes."""
    with open("/proc/stat") as handle:
        ticks = [int(value) for value in handle.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def idle_ray_share(seconds: float = 5.0) -> float:
    """The share of the machine that Ray's own processes keep busy with nothing submitted."""
    busy, start = busy_seconds(), time.perf_counter()
    time.sleep(seconds)
    return (busy_seconds() - busy) / (time.perf_counter() - start) / os.cpu_count()


def process_seconds() -> dict[int, tuple[str, float]]:
    """Every process's name and CPU seconds so far (user and system, its threads included)."""
    found, tick = {}, os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:  # the process ended while we looked
                continue
            name, fields = text[text.index("(") + 1: text.rindex(")")], text[text.rindex(")") + 2:].split()
            found[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return found


def cpu_by_kind(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds spent between two :func:`process_seconds` snapshots: by this process,
    by Ray's task workers (named ``ray::...``), and by everything else."""
    spent = {"driver": 0.0, "ray workers": 0.0, "other": 0.0}
    for pid, (name, seconds) in after.items():
        used = seconds - before.get(pid, (name, 0.0))[1]
        kind = "driver" if pid == os.getpid() else "ray workers" if name.startswith("ray::") else "other"
        spent[kind] += used
    return spent


def timed_rounds(calls: dict, rounds: int, work: Path) -> dict[str, dict]:
    """Run every call in ``calls`` (name to ``call(out)``, the serial run first) once per
    round, in turn; per name: the median seconds, the machine's median busy cores (busy
    CPU seconds over wall seconds), the median CPU seconds by kind (:func:`cpu_by_kind`),
    the median over rounds of its driver and worker CPU seconds against the first call's
    in the same round ("work / serial"), and the last manifest."""
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for number, (name, call) in enumerate(calls.items()):
            out = work / f"out-{number}"
            shutil.rmtree(out, ignore_errors=True)
            busy, processes, start = busy_seconds(), process_seconds(), time.perf_counter()
            manifest = call(out)
            seconds = time.perf_counter() - start
            spent = cpu_by_kind(processes, process_seconds())
            samples[name].append({"seconds": seconds, "cores": (busy_seconds() - busy) / seconds, "cpu": spent,
                                  "manifest": manifest})
    serial = samples[next(iter(calls))]
    results = {}
    for name, runs in samples.items():
        work_seconds = [run["cpu"]["driver"] + run["cpu"]["ray workers"] for run in runs]
        base = [run["cpu"]["driver"] for run in serial]
        results[name] = {
            "seconds": statistics.median(run["seconds"] for run in runs),
            "cores": statistics.median(run["cores"] for run in runs),
            "cpu_seconds": {kind: statistics.median(run["cpu"][kind] for run in runs) for kind in runs[0]["cpu"]},
            "work_over_serial": statistics.median(w / b for w, b in zip(work_seconds, base)),
            "rounds": [run["seconds"] for run in runs],
            "manifest": runs[-1]["manifest"],
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=positive_size, default=16, help="text in the corpus (default 16)")
    parser.add_argument("--shards", type=positive, default=8, help="shards of the Ray runs (default 8)")
    parser.add_argument("--repeats", type=positive, default=1, help="rounds of the four runs in turn; medians (default 1)")
    parser.add_argument("--workdir", type=Path, help="where the corpus and outputs go (default: a temporary dir)")
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    args = parser.parse_args()
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    import ray

    from seqpack.ray import pack_corpus as pack_on_ray

    head = conditions()
    work = Path(tempfile.mkdtemp(prefix="bench-ray-", dir=args.workdir))
    try:
        paths = write_corpus(work / "corpus", args.megabytes)
        train_bpe([p.read_text(encoding="utf-8", errors="replace") for p in stdlib_sources()[:300]], work / "bpe.json")
        tokenizer = io.TokenizerFile(work / "bpe.json", bos="<|endoftext|>", eos="<|endoftext|>")
        binding = sp.BatchBinding.for_tokenizer(tokenizer.identity, split="corpus")
        config = sp.PackConfig(CAPACITY, 8)
        sample, size = [], 0
        for path in paths:   # 4 MB of the corpus, file after file
            with open(path, encoding="utf-8") as handle:
                for line in handle:
                    sample.append(json.loads(line)["text"])
                    size += len(sample[-1])
                    if size >= 4e6:
                        break
            if size >= 4e6:
                break
        peak_one, peak_all = tokenizer_speed(tokenizer, sample, False), tokenizer_speed(tokenizer, sample, True)
        readers = lambda: [io.JsonLines(path) for path in paths]  # noqa: E731
        start = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
        startup = time.perf_counter() - start
        try:
            idle_share = idle_ray_share()
            ray_run = lambda workers, threads: lambda out: pack_on_ray(  # noqa: E731
                readers(), out, tokenizer=tokenizer, binding=binding, config=config, policy=POLICY, long="cut",
                shards=args.shards, workers=workers, threads=threads)
            results = timed_rounds({
                "serial, best (tokenizer pool on)": lambda out: io.pack_corpus(
                    readers(), out, binding=binding, tokenizer=tokenizer, config=config, policy=POLICY, long="cut"),
                "Ray, 1 worker (1 tokenizer thread)": ray_run(1, 1),
                "Ray, 2 workers (1 tokenizer thread each)": ray_run(2, 1),
                "Ray, 2 threads per task (tokenizer pool on)": ray_run(1, 2),
            }, args.repeats, work)
        finally:
            ray.shutdown()
        manifests = [result.pop("manifest") for result in results.values()]
        assert manifests[1] == manifests[2] == manifests[3], "the worker or thread count changed the dataset"
        megabytes = manifests[0]["input_bytes"] / 1e6
        tokens = manifests[0]["counts"]["tokens"]
        records = []
        for (name, result), manifest in zip(results.items(), manifests):
            records.append({"run": name, **result, "parts": len(manifest["parts"]),
                            "MB/s": megabytes / result["seconds"], "M tokens/s": tokens / result["seconds"] / 1e6})
        serial, one, two, pooled = (record["rounds"] for record in records)

        def ratio(over):   # the median over the rounds of each round's ratio
            return statistics.median(over(*round_seconds) for round_seconds in zip(serial, one, two, pooled))

        summary = {
            "conditions": head, "load_after": os.getloadavg(), "megabytes": megabytes, "tokens": tokens,
            "shards": args.shards, "repeats": args.repeats, "ray_startup_seconds": startup,
            "ray_idle_machine_share": idle_share,
            "tokenizer_peak_MB_per_s": {"one thread": peak_one, "all threads": peak_all},
            "scaling_ray_2_over_1": ratio(lambda s, o, t, p: o / t),
            "ray_2_workers_vs_serial_best": ratio(lambda s, o, t, p: s / t),
            "ray_2_threads_per_task_vs_serial_best": ratio(lambda s, o, t, p: s / p),
            "ray_best_vs_serial_best": ratio(lambda s, o, t, p: s / min(t, p)),
            "driver_peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "runs": records,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
        return
    print(head)
    print(f"corpus: {megabytes:.1f} MB of JSONL text, {tokens:,} tokens (BPE 8192), {args.shards} shards for Ray; "
          f"median of {args.repeats} rounds, the four runs in turn in each")
    print(f"in-run tokenizer peak: {peak_one:.2f} MB/s on one thread, {peak_all:.2f} MB/s on the pool")
    print(f"{'run':44} {'seconds':>8} {'MB/s':>7} {'M tok/s':>8} {'busy cores':>10} {'parts':>6} "
          f"{'CPU s: driver':>13} {'workers':>8} {'other':>6} {'work / serial':>13}")
    for r in records:
        cpu = r["cpu_seconds"]
        print(f"{r['run']:44} {r['seconds']:8.2f} {r['MB/s']:7.2f} {r['M tokens/s']:8.3f} {r['cores']:10.2f} "
              f"{r['parts']:6d} {cpu['driver']:13.2f} {cpu['ray workers']:8.2f} {cpu['other']:6.2f} "
              f"{r['work_over_serial']:13.2f}")
    print(f"(a) scaling, Ray 2 workers over 1: {summary['scaling_ray_2_over_1']:.2f}x (target >= 1.7x)")
    print(f"(b) the faster Ray run on both CPUs against serial best: {summary['ray_best_vs_serial_best']:.2f}x "
          f"(target >= 0.85x); 2 workers {summary['ray_2_workers_vs_serial_best']:.2f}x, "
          f"2 threads per task {summary['ray_2_threads_per_task_vs_serial_best']:.2f}x")
    print(f"Ray start-up (ray.init, num_cpus=2), not in the ratios: {startup:.1f} s; Ray's own processes, idle, "
          f"keep {100 * idle_share:.1f}% of the machine busy")
    load = " ".join(f"{v:.2f}" for v in summary["load_after"])
    print(f"load average after: {load}; driver peak RSS {summary['driver_peak_rss_MiB']:.0f} MiB")


if __name__ == "__main__":
    main()
