"""From a corpus on disk to a packed dataset on disk, against TRL's pack_dataset, in one run.

    python bench/bench_corpus.py                 # every workload below, one table
    python bench/bench_corpus.py --json          # the same records as JSON

(a) 200k pre-tokenized examples whose token counts are lognormal (median 250, sigma 1,
    ``numpy.random.default_rng(0)``, clipped to [2, 2048]), each framed ``[BOS, ..., EOS]``
    in the byte tokenizer's vocabulary, in one Parquet file (a list<int32> column, written
    untimed). seqpack: ``pack_corpus`` with best-fit-decreasing at capacity 2048 (read,
    validate, place, write ``tokens.bin`` in placement order, checksums, fsync, publish),
    and for reference the same table placed in memory (``ExampleTable.from_arrays`` +
    ``seqpack.plan``), then with every batch's rows built as well (what TRL's in-memory
    packing also does: every token copied into its packed row), and reading the file
    alone. TRL (when installed): ``pack_dataset(..., strategy="bfd")`` on the same table as
    a ``datasets.Dataset`` in memory, and TRL's path to disk: ``Dataset.from_parquet`` +
    ``pack_dataset`` + ``save_to_disk``. Printed after the table: the floor of any job from
    this file to disk here (reading the file alone; writing the output at the in-run disk
    speed) and each TRL time over the longer of the two, the most such a job could reach.
(b) Raw text through a byte-level BPE (``tokenizers``, vocabulary 8192, trained here on
    the first files of the Python standard library): tokenizing alone
    (``encode_batch_fast`` on texts already in memory) against ``pack_corpus`` of the same
    files (reading, tokenizing, validating, packing and writing), timed in turns; and, since a shared
    machine's load moves between runs, the time spent inside ``encode_batch_fast`` during
    those same ``pack_corpus`` runs, against their whole time.
(c) Bytes on disk per token of (a), against the 19 bytes per cell (plus 8 per row) of the
    eager epoch of the same placement.

Every timing is the median of ``--repeats`` runs after one untimed run. The CPU and its
vector flags, the threads, the load average before and after, the in-run sequential
write+fsync speed of the output disk and the process's peak RSS are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import seqpack as sp
from seqpack import io
from seqpack._threads import default_threads
from seqpack.bench.measure import cpu_description
from seqpack.data.corpus import stdlib_sources
from seqpack.packing.budget import CELL_BYTES, ROW_BYTES
from timing import positive

CAPACITY = 2048
MEDIAN_TOKENS = 250


def timed(call, before=None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def median_time(call, repeats: int, before=None) -> float:
    """The median of ``repeats`` timed calls, after one untimed call (imports, caches, first pages)."""
    timed(call, before)
    return statistics.median(timed(call, before) for _ in range(repeats))


def disk_write_speed(directory: Path, megabytes: int = 256) -> float:
    """Sequential write + fsync of ``megabytes`` MiB into ``directory``, MiB/s (the in-run disk peak)."""
    block = np.random.default_rng(1).integers(0, 255, size=1 << 20, dtype=np.uint8).tobytes()
    path = directory / "disk-probe.bin"
    start = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(megabytes):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return megabytes / seconds


def lognormal_table(count: int):
    """The (a) workload as a pyarrow table with one list<int32> column of framed documents."""
    import pyarrow as pa

    rng = np.random.default_rng(0)
    sizes = np.clip(np.rint(rng.lognormal(np.log(MEDIAN_TOKENS), 1.0, count)), 2, CAPACITY).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    tokens = rng.integers(2, 258, size=int(offsets[-1]), dtype=np.int32)
    tokens[offsets[:-1]] = 0
    tokens[offsets[1:] - 1] = 1
    column = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))
    return pa.table({"input_ids": column}), tokens, offsets


def workload_a(work: Path, count: int, repeats: int) -> tuple[list[dict], dict]:
    import pyarrow.parquet as pq

    table, tokens, offsets = lognormal_table(count)
    parquet = work / "lognormal.parquet"
    pq.write_table(table, parquet)
    tokenizer = sp.ByteTokenizer()
    binding = sp.BatchBinding.for_tokenizer(tokenizer, split="bench")
    config = sp.PackConfig(CAPACITY, 8)
    out = work / "packed-a"
    records = []

    def pack():
        io.pack_corpus([io.ArrowBatches(parquet, ids_field="input_ids")], out, binding=binding, tokenizer=tokenizer,
                       config=config, policy="best-fit-decreasing", framed=True)

    def clear():
        shutil.rmtree(out, ignore_errors=True)

    def read_only():
        for _ in io.ArrowBatches(parquet, ids_field="input_ids").chunks(0):
            pass

    def in_memory():
        column = table.column(0).combine_chunks()
        flat = column.flatten().to_numpy()
        starts = column.offsets.to_numpy().astype(np.int64)
        examples = sp.ExampleTable.from_arrays(flat, starts, binding)
        return sp.plan(examples, config, partition=sp.Partition.TRAIN, binding=binding, policy="best-fit-decreasing")

    def rows_built():  # what TRL's pack_dataset also does: every token copied into its packed row
        for _ in in_memory().batches(reuse_buffers=True):
            pass

    seqpack_disk = median_time(pack, repeats, clear)
    records.append({"workload": "a", "method": "seqpack pack_corpus: Parquet -> packed dataset on disk (BFD)",
                    "seconds": seqpack_disk})
    records.append({"workload": "a", "method": "seqpack: reading the Parquet file alone (flat values + offsets)",
                    "seconds": median_time(read_only, repeats)})
    records.append({"workload": "a", "method": "seqpack in memory: from_arrays + plan (BFD), placement only",
                    "seconds": median_time(in_memory, repeats)})
    records.append({"workload": "a", "method": "seqpack in memory: from_arrays + plan (BFD) + every batch's rows built",
                    "seconds": median_time(rows_built, repeats)})
    manifest = json.loads((out / "manifest.json").read_text())
    try:
        import datasets
        from trl import pack_dataset
    except ImportError:
        print("TRL or datasets not installed: TRL rows skipped", file=sys.stderr)
        return records, manifest
    datasets.disable_progress_bars()  # no bars drawn inside the timed calls, nor in the table
    dataset = datasets.Dataset(table)
    trl_memory = median_time(lambda: pack_dataset(dataset, CAPACITY, strategy="bfd"), repeats)
    records.append({"workload": "a", "method": "TRL pack_dataset(strategy='bfd') on the table in memory",
                    "seconds": trl_memory})
    trl_out = work / "trl-a"

    def trl_disk():
        loaded = datasets.Dataset.from_parquet(str(parquet), cache_dir=str(work / "hf-cache"), keep_in_memory=True)
        pack_dataset(loaded, CAPACITY, strategy="bfd").save_to_disk(str(trl_out))

    def trl_clear():
        shutil.rmtree(trl_out, ignore_errors=True)
        shutil.rmtree(work / "hf-cache", ignore_errors=True)

    records.append({"workload": "a", "method": "TRL: Dataset.from_parquet + pack_dataset(bfd) + save_to_disk",
                    "seconds": median_time(trl_disk, repeats, trl_clear)})
    return records, manifest


def train_bpe(texts: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))


def workload_b(work: Path, files: int, repeats: int) -> list[dict]:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print("tokenizers not installed: workload (b) skipped", file=sys.stderr)
        return []
    paths = [p for p in stdlib_sources()[:files]]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
    paths = [p for p, t in zip(paths, texts) if t]
    texts = [t for t in texts if t]
    tokenizer_path = work / "bpe.json"
    train_bpe(texts[:200], tokenizer_path)
    bound = io.TokenizerFile(tokenizer_path, bos="<|endoftext|>", eos="<|endoftext|>")
    binding = sp.BatchBinding.for_tokenizer(bound.identity, split="bench")
    out = work / "packed-b"

    encoder = bound.tokenizer
    inside = []

    class Timed:
        """The tokenizer, timing its encode_batch_fast calls made inside pack_corpus."""

        def __getattr__(self, name):   # everything else as the tokenizer has it
            return getattr(encoder, name)

        def encode_batch_fast(self, *args, **kwargs):
            start = time.perf_counter()
            result = encoder.encode_batch_fast(*args, **kwargs)
            inside[-1] += time.perf_counter() - start
            return result

    bound.tokenizer = Timed()

    def tokenize_only():
        encoder.encode_batch_fast(texts, add_special_tokens=False)

    def pack():
        inside.append(0.0)
        io.pack_corpus([io.TextFiles(paths)], out, binding=binding, tokenizer=bound, config=sp.PackConfig(CAPACITY, 8),
                       policy="best-fit-decreasing", long="cut")

    # In turns, so that a drift of the machine's speed hits both alike; one untimed round first.
    tokenize_only()
    pack()
    inside.clear()
    turns = [(timed(tokenize_only), timed(pack, lambda: shutil.rmtree(out, ignore_errors=True)))
             for _ in range(repeats)]
    tokenize, whole = (statistics.median(column) for column in zip(*turns))
    encoding = statistics.median(inside)
    manifest = json.loads((out / "manifest.json").read_text())
    size = sum(len(t.encode()) for t in texts)
    return [
        {"workload": "b", "method": f"tokenizers encode_batch_fast alone ({len(texts)} files, {size / 1e6:.1f} MB, "
                                    f"{manifest['counts']['document_tokens']:,} tokens)", "seconds": tokenize},
        {"workload": "b", "method": "seqpack pack_corpus: read + tokenize + validate + pack (BFD) + write",
         "seconds": whole, "overhead_over_tokenizing": whole / tokenize - 1},
        {"workload": "b", "method": "  of which inside encode_batch_fast", "seconds": encoding,
         "overhead_over_tokenizing": (whole - encoding) / encoding},
    ]


def storage(manifest: dict) -> dict:
    part = manifest["parts"][0]
    disk = sum(record["bytes"] for record in part["files"].values())
    cells = manifest["report"]["cells"]
    eager = cells * CELL_BYTES + manifest["report"]["rows"] * ROW_BYTES
    return {"workload": "c", "tokens": manifest["counts"]["tokens"], "bytes_on_disk": disk,
            "bytes_per_token": disk / manifest["counts"]["tokens"], "cells": cells,
            "eager_bytes": eager, "eager_bytes_per_cell": eager / cells,
            "eager_bytes_per_token": eager / manifest["counts"]["tokens"], "eager_over_disk": eager / disk}


def job_floor(records_a: list[dict], storage_record: dict, disk_mb_per_s: float) -> dict:
    """What workload (a) cannot go below on this machine: reading its Parquet file and
    writing its output at the measured disk speed, and each TRL method's time over the
    longer of the two (the most any Parquet-to-disk job could be faster than TRL here)."""
    seconds = {record["method"]: record["seconds"] for record in records_a}
    read = next(value for method, value in seconds.items() if method.startswith("seqpack: reading"))
    write = storage_record["bytes_on_disk"] / (disk_mb_per_s * 2**20)
    peers = {"TRL in memory": "TRL pack_dataset", "TRL to disk": "TRL: Dataset.from_parquet"}
    ceilings = {label: value / max(read, write) for label, prefix in peers.items()
                for method, value in seconds.items() if method.startswith(prefix)}
    return {"read_seconds": read, "write_seconds": write, "ceilings": ceilings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=positive, default=200_000)
    parser.add_argument("--files", type=positive, default=600, help="standard-library files for workload (b)")
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.workdir) as temporary:
        work = Path(temporary)
        disk = disk_write_speed(work)
        records_a, manifest = workload_a(work, args.examples, args.repeats)
        records_b = workload_b(work, args.files, args.repeats)
        bytes_record = storage(manifest)
    conditions = {"cpu": cpu_description(), "cores": os.cpu_count(), "threads": default_threads(),
                  "load_average_before": load_before, "load_average_after": os.getloadavg(),
                  "disk_write_fsync_mb_per_s": disk,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "examples": args.examples, "repeats": args.repeats}
    records = records_a + records_b
    floor = job_floor(records_a, bytes_record, disk)
    if args.json:
        json.dump({"conditions": conditions, "records": records, "storage": bytes_record, "floor_a": floor},
                  sys.stdout, indent=2)
        print()
        return
    before, after = (" ".join(f"{v:.2f}" for v in conditions[k]) for k in ("load_average_before", "load_average_after"))
    print(f"CPU {conditions['cpu']}, {conditions['cores']} cores, {conditions['threads']} threads; "
          f"load average before {before}, after {after}; in-run disk write+fsync {disk:.0f} MiB/s; "
          f"peak RSS {conditions['peak_rss_mib']:.0f} MiB; medians of {args.repeats} (after one untimed call)")
    reference = {r["workload"]: r["seconds"] for r in records if r["method"].startswith("seqpack pack_corpus")}
    print("| workload | method | median s | vs seqpack pack_corpus |")
    print("| --- | --- | --- | --- |")
    for record in records:
        ratio = record["seconds"] / reference[record["workload"]]
        print(f"| ({record['workload']}) | {record['method']} | {record['seconds']:.3f} | {ratio:.2f}x |")
    print(f"(a) floor of any Parquet-to-disk job here: reading the file alone {floor['read_seconds']:.3f} s, writing "
          f"the output at the in-run disk speed {floor['write_seconds']:.3f} s", end="")
    if floor["ceilings"]:
        print("; so at most " + ", ".join(f"{ratio:.1f}x {peer}" for peer, ratio in floor["ceilings"].items())
              + " (the longer step alone, everything else free and overlapped)")
    else:
        print()
    if records_b:
        print(f"(b) reading, validating, packing and writing add {records_b[1]['overhead_over_tokenizing']:.1%} "
              f"to tokenizing alone, and {records_b[2]['overhead_over_tokenizing']:.1%} to the time spent "
              f"tokenizing inside the same pack_corpus runs")
    s = bytes_record
    print(f"(c) {s['bytes_on_disk']:,} bytes on disk for {s['tokens']:,} tokens = {s['bytes_per_token']:.2f} "
          f"bytes/token; the eager epoch: {s['eager_bytes']:,} bytes = {s['eager_bytes_per_cell']:.2f} bytes/cell = "
          f"{s['eager_bytes_per_token']:.1f} bytes/token ({s['eager_over_disk']:.1f}x the disk)")


if __name__ == "__main__":
    main()
