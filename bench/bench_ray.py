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
asks 0.85x or more). Ray's start-up
(``ray.init(num_cpus=2)``) is timed separately and not in any ratio. The in-run peak is
the tokenizer's own speed on one and on all threads over 4 MB of the corpus in memory.
The CPU, the load average before and after, the driver's peak RSS, the share of the
machine Ray's own processes keep busy while idle, and per run the machine's busy cores
(from ``/proc/stat``) are printed: on a shared 2-core machine other jobs take CPU from
whichever run they overlap.
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
from timing import conditions  # noqa: E402

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


def timed(call, repeats: int, out: Path) -> tuple[float, float, dict]:
    """Median seconds of ``call(out)`` over ``repeats`` runs (the output removed before
    each), the machine's busy cores in them (busy CPU seconds over wall seconds), and
    the last manifest."""
    seconds, cores, manifest = [], [], None
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        cpu, start = busy_seconds(), time.perf_counter()
        manifest = call(out)
        seconds.append(time.perf_counter() - start)
        cores.append((busy_seconds() - cpu) / seconds[-1])
    return statistics.median(seconds), statistics.median(cores), manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=16, help="text in the corpus (default 16)")
    parser.add_argument("--shards", type=int, default=8, help="shards of the Ray runs (default 8)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per measurement, median (default 1)")
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
        with open(paths[0], encoding="utf-8") as handle:
            for line in handle:
                sample.append(json.loads(line)["text"])
                size += len(sample[-1])
                if size >= 4e6:
                    break
        peak_one, peak_all = tokenizer_speed(tokenizer, sample, False), tokenizer_speed(tokenizer, sample, True)
        readers = lambda: [io.JsonLines(path) for path in paths]  # noqa: E731
        serial, serial_cores, manifest = timed(lambda out: io.pack_corpus(
            readers(), out, binding=binding, tokenizer=tokenizer, config=config, policy=POLICY, long="cut"),
            args.repeats, work / "serial")
        start = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
        startup = time.perf_counter() - start
        try:
            idle_share = idle_ray_share()
            ray_run = lambda workers, threads: lambda out: pack_on_ray(  # noqa: E731
                readers(), out, tokenizer=tokenizer, binding=binding, config=config, policy=POLICY, long="cut",
                shards=args.shards, workers=workers, threads=threads)
            one, one_cores, one_manifest = timed(ray_run(1, 1), args.repeats, work / "ray1")
            two, two_cores, two_manifest = timed(ray_run(2, 1), args.repeats, work / "ray2")
            pooled, pooled_cores, pooled_manifest = timed(ray_run(1, 2), args.repeats, work / "ray-pool")
        finally:
            ray.shutdown()
        assert one_manifest == two_manifest == pooled_manifest, "the worker or thread count changed the dataset"
        megabytes = manifest["input_bytes"] / 1e6
        tokens = manifest["counts"]["tokens"]
        records = [
            {"run": "serial, best (tokenizer pool on)", "seconds": serial, "cores": serial_cores,
             "parts": len(manifest["parts"])},
            {"run": "Ray, 1 worker (1 tokenizer thread)", "seconds": one, "cores": one_cores,
             "parts": len(one_manifest["parts"])},
            {"run": "Ray, 2 workers (1 tokenizer thread each)", "seconds": two, "cores": two_cores,
             "parts": len(two_manifest["parts"])},
            {"run": "Ray, 2 threads per task (tokenizer pool on)", "seconds": pooled, "cores": pooled_cores,
             "parts": len(pooled_manifest["parts"])},
        ]
        for record in records:
            record["MB/s"] = megabytes / record["seconds"]
            record["M tokens/s"] = tokens / record["seconds"] / 1e6
        summary = {
            "conditions": head, "load_after": os.getloadavg(), "megabytes": megabytes, "tokens": tokens,
            "shards": args.shards, "repeats": args.repeats, "ray_startup_seconds": startup,
            "ray_idle_machine_share": idle_share,
            "tokenizer_peak_MB_per_s": {"one thread": peak_one, "all threads": peak_all},
            "scaling_ray_2_over_1": one / two, "ray_2_workers_vs_serial_best": serial / two,
            "ray_2_threads_per_task_vs_serial_best": serial / pooled, "ray_best_vs_serial_best": serial / min(two, pooled),
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
          f"median of {args.repeats}")
    print(f"in-run tokenizer peak: {peak_one:.2f} MB/s on one thread, {peak_all:.2f} MB/s on the pool")
    print(f"{'run':44} {'seconds':>8} {'MB/s':>7} {'M tok/s':>8} {'busy cores':>10} {'parts':>6}")
    for r in records:
        print(f"{r['run']:44} {r['seconds']:8.2f} {r['MB/s']:7.2f} {r['M tokens/s']:8.3f} {r['cores']:10.2f} "
              f"{r['parts']:6d}")
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
