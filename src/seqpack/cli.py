"""The ``seqpack`` command line.

``pack`` turns a corpus into a packed dataset on disk, ``stats`` reports it (text, JSON,
an SVG figure), ``verify`` checks every checksum and batch invariant, ``show`` draws a
batch's cells beside its permission matrices (of a dataset or of a chapter fixture),
``score`` runs a Hugging Face causal LM over a dataset and writes each example's NLL,
``demo`` prints a chapter's JSON trace and ``bench`` runs a benchmark.

Exit status: 0 on success (also when the reader of the output goes away, as in
``seqpack demo packed | head -1``), 1 for bad input, a failed check or a failed write (one
line on stderr naming the file and line, row or batch), 2 for bad usage, 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.util
import json
import math
import os
import signal
import sys
import textwrap
import threading
from pathlib import Path

from . import __version__
from .errors import DecodeLimitError, InvalidInputError, SeqpackError

#: The chapter traces ``demo`` prints and ``show`` draws, by name.
TRACES = ("packed", "padded")
POLICY_CHOICES = ("next-fit", "first-fit-decreasing", "best-fit-decreasing")
PARTITION_CHOICES = ("train", "validation", "test")
#: Columns ``show`` draws of a dataset's row unless ``--columns`` says otherwise.
SHOWN_COLUMNS = 48
#: ``score --dtype``: the model's dtype, by the name of its torch dtype.
SCORE_DTYPES = ("float32", "float64", "bfloat16")


def _refused_inputs() -> str:
    """The inputs ``pack`` refuses, from the table its docstring shows too."""
    from .io.job import REFUSED_INPUTS

    return "Refused inputs: " + "; ".join(REFUSED_INPUTS) + "."


class _WholeFlags(argparse.HelpFormatter):
    """Help text wrapped between words only: a flag (``--ids-field``) is never cut at its hyphens."""

    def _split_lines(self, text, width):
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(self._whitespace_matcher.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


def _add_pack(commands) -> None:
    from .data.binding import DEFAULT_LIMITS
    from .io.templates import TemplateLimits

    pack = commands.add_parser(
        "pack", help="pack a corpus into a packed dataset on disk", formatter_class=_WholeFlags,
        description="Read, tokenize and pack documents into a packed dataset directory (written into a "
                    "temporary sibling and renamed into place only when complete), then print its report. "
                    "Preference records ('chosen' and 'rejected', TRL's DPO formats, found by their keys) are "
                    "packed as pairs: each pair's chosen and rejected sequences side by side in one row.",
        epilog=_refused_inputs())
    pack.add_argument("inputs", nargs="*", metavar="INPUT",
                      help="text files or directories (one document per file), .jsonl, .parquet, .arrow, "
                           "or a Megatron .idx/.bin prefix")
    pack.add_argument("--sample", action="store_true",
                      help="pack the Python standard library's .py sources (implies --cut-long)")
    pack.add_argument("--out", required=True, type=Path, metavar="DIR", help="the dataset directory to create")
    pack.add_argument("--force", action="store_true", help="replace an existing DIR")
    pack.add_argument("--tokenizer", type=Path, metavar="JSON",
                      help="a Hugging Face tokenizers JSON file (default: the byte tokenizer)")
    pack.add_argument("--bos", metavar="ID_OR_TOKEN",
                      help="BOS of --tokenizer (an ID or a token; default: the one its post-processor adds, if any)")
    pack.add_argument("--eos", metavar="ID_OR_TOKEN", help="EOS of --tokenizer (an ID or a token)")
    pack.add_argument("--text-field", metavar="NAME", help="the text field of JSONL or column of Parquet/Arrow "
                                                           "(default: text)")
    pack.add_argument("--ids-field", metavar="NAME", help="read pre-tokenized IDs from this field or column")
    pack.add_argument("--framed", action="store_true",
                      help="pre-tokenized documents already start with BOS and end with EOS")
    pack.add_argument("--no-completion-only-loss", action="store_true",
                      help="prompt-completion records and completion_mask columns: supervise the prompt too")
    pack.add_argument("--chat-template", type=Path, metavar="FILE.jinja",
                      help="render 'messages' conversations with this chat template (transformers)")
    pack.add_argument("--assistant-only-loss", action="store_true",
                      help="conversations: supervise only the template's {%% generation %%} spans")
    pack.add_argument("--template-seconds", type=float, metavar="S",
                      help=f"stop a record whose chat template renders for longer (default {TemplateLimits.seconds:g})")
    pack.add_argument("--template-characters", type=int, metavar="N",
                      help="stop a record whose chat template renders more characters "
                           f"(default {TemplateLimits.characters:,})")
    pack.add_argument("--glob", metavar="PATTERN", help="only files whose names match PATTERN inside directories (e.g. '*.py'; a name, not a path)")
    pack.add_argument("--capacity", type=int, default=2048, help="columns (predictions) per row (default 2048)")
    pack.add_argument("--rows-per-batch", type=int, default=8, help="rows per batch (default 8)")
    pack.add_argument("--policy", choices=POLICY_CHOICES, default="next-fit", help="placement policy (default next-fit)")
    pack.add_argument("--partition", choices=PARTITION_CHOICES, default="train", help="the data split (default train)")
    pack.add_argument("--split", default="corpus", metavar="NAME_OR_RECEIPT",
                      help="the split's name, or a split receipt file (a path ending in .json or with a "
                           "directory part; default: the name 'corpus')")
    pack.add_argument("--cut-long", action="store_true",
                      help="cut documents longer than a row into overlapping windows (default: refuse them; "
                           "a preference pair longer than a row is refused either way)")
    pack.add_argument("--max-document-tokens", type=int, metavar="N", default=DEFAULT_LIMITS.max_tokens,
                      help="refuse a document of more than N tokens, BOS and EOS included, before cutting it "
                           f"(a guard against a runaway file; default {DEFAULT_LIMITS.max_tokens:,})")
    pack.add_argument("--threads", type=int, metavar="N",
                      help="threads for tokenizing and kernels (with --engine ray: per task, default 1)")
    pack.add_argument("--engine", choices=("serial", "ray"), default="serial",
                      help="pack here (default) or as one Ray task per shard (the 'ray' extra)")
    pack.add_argument("--shards", type=int, metavar="N",
                      help="split the inputs into at most N shards, each packed into its own part (the same bytes "
                           "with either engine; default: one part, or with --engine ray one shard per 64 MiB)")
    pack.add_argument("--address", metavar="ADDR",
                      help="with --engine ray: the Ray cluster to join (e.g. auto); default: start a local one")
    pack.add_argument("--workers", type=int, metavar="N",
                      help="with --engine ray: at most N tasks at once (default: as many as the cluster's CPUs take)")
    pack.add_argument("--quiet", action="store_true", help="no progress bar")
    pack.add_argument("--json", action="store_true", help="print the manifest as JSON instead of the report")
    pack.set_defaults(run=_pack)


def _add_dataset_commands(commands) -> None:
    stats = commands.add_parser("stats", help="a packed dataset's efficiency report and figure",
                                description="Print a packed dataset's efficiency report and storage "
                                            "(histograms with --json and --svg).")
    stats.add_argument("dataset", type=Path, metavar="DIR")
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.add_argument("--svg", type=Path, metavar="FILE", help="write a figure of example lengths and row fill")
    stats.set_defaults(run=_stats)
    verify = commands.add_parser("verify", help="check a packed dataset's checksums and every batch",
                                 description="Recompute every file's SHA-256, check counts and placement rules, "
                                             "and verify() every batch.")
    verify.add_argument("dataset", type=Path, metavar="DIR")
    verify.add_argument("--tokenizer", type=Path, metavar="JSON",
                        help="also check that this tokenizers JSON file is the one the dataset was packed with")
    verify.add_argument("--json", action="store_true", help="print what was checked as JSON")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")
    verify.set_defaults(run=_verify)
    show = commands.add_parser(
        "show", help="draw a batch's cells beside its permission matrices",
        description="Draw each row's cells (input, target, position, segment, three validity fields) beside its "
                    "permission matrix: of a packed dataset DIR (a directory wins), or of the chapter fixture "
                    "'padded' or 'packed'.")
    show.add_argument("target", metavar="DIR|padded|packed")
    show.add_argument("--batch", type=int, help="batch of DIR (default 0)")
    show.add_argument("--row", type=int, help="only this row (default: every row of a fixture, row 0 of DIR)")
    show.add_argument("--columns", metavar="START:STOP",
                      help=f"column window (default: all of a fixture, the first {SHOWN_COLUMNS} of DIR)")
    show.add_argument("--svg", type=Path, metavar="FILE", help="also write the figure as SVG")
    show.set_defaults(run=_show)


def _add_score(commands) -> None:
    score = commands.add_parser(
        "score", help="score a packed dataset with a causal LM: each example's NLL to Parquet",
        description="Run a Hugging Face causal LM saved with save_pretrained (read offline) over a packed dataset "
                    "under seqpack attention; write one row per example (input, line, example_id, targets, "
                    "nll_sum, nll_mean, perplexity) to a Parquet file (written into a temporary sibling and renamed "
                    "into place only when complete), then print the loss and perplexity over all targets. Needs "
                    "the hf and corpus extras: pip install 'seqpack[hf,corpus]'.")
    score.add_argument("dataset", type=Path, metavar="DIR")
    score.add_argument("--model", required=True, type=Path, metavar="MODEL_DIR",
                       help="a directory written by save_pretrained (AutoModelForCausalLM)")
    score.add_argument("--out", required=True, type=Path, metavar="FILE", help="the Parquet file to create")
    score.add_argument("--force", action="store_true", help="replace an existing FILE")
    score.add_argument("--batches", type=int, metavar="N", help="score only the first N batches (default: all)")
    score.add_argument("--threads", type=int, metavar="N", help="torch and attention-kernel threads")
    score.add_argument("--dtype", choices=SCORE_DTYPES, default="float32",
                       help="the model's dtype (default float32)")
    score.add_argument("--quiet", action="store_true", help="no progress bar")
    score.add_argument("--json", action="store_true", help="print the totals as JSON (null for a "
                       "perplexity or loss beyond the float range)")
    score.set_defaults(run=_score)


class _Parser(argparse.ArgumentParser):
    """argparse that lets a failed write of help or version text to stdout raise (argparse
    ignores it), so that ``main`` reports it like any other failed write."""

    def _print_message(self, message, file=None):
        if message and file is sys.stdout:
            file.write(message)
        else:
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    from .bench import attention, train

    parser = _Parser(
        prog="seqpack",
        description="Pad and pack variable-length causal-LM examples without joining their contexts.",
    )
    parser.add_argument("--version", action="version", version=f"seqpack {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_pack(commands)
    _add_dataset_commands(commands)
    _add_score(commands)
    demo_parser = commands.add_parser("demo", help="print a chapter fixture's JSON trace",
                                      description="Print a chapter fixture's JSON trace.")
    demo_parser.add_argument("trace", choices=sorted(TRACES), help="which trace to print")
    bench_parser = commands.add_parser("bench", help="benchmarks, every method in one process",
                                       description="Benchmarks: every method on the same inputs in one process.")
    suites = bench_parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    attention_parser = suites.add_parser("attention", help="range attention against dense and PyTorch peers")
    attention.add_arguments(attention_parser)
    attention_parser.set_defaults(run=attention.run_command)
    train_parser = suites.add_parser("train", help="a Hugging Face training step: seqpack against HF's ways")
    train.add_arguments(train_parser)
    train_parser.set_defaults(run=train.run_command)
    return parser


def _pack(args) -> int:
    from . import data, io
    from .data.corpus import stdlib_sources
    from .io import format as fmt
    from .io.templates import TemplateLimits
    from .packing import PackConfig

    if args.sample == bool(args.inputs):
        raise UsageError("give INPUT paths or --sample" + (", not both" if args.sample else ""))
    if args.text_field is not None and args.ids_field is not None:
        raise UsageError("give --text-field or --ids-field, not both")
    if args.tokenizer is None and (args.bos is not None or args.eos is not None):
        raise UsageError("--bos and --eos go with --tokenizer (the byte tokenizer has BOS 0 and EOS 1)")
    if args.tokenizer is not None and args.eos is None:
        raise UsageError("--tokenizer needs --eos (--bos is optional: by default, the one its post-processor adds)")
    needs = {"ray": "ray"} if args.engine == "ray" else {}
    if args.tokenizer is not None:
        needs["hf"] = "tokenizers"
    _check_extras("seqpack pack" + " --engine ray" * (args.engine == "ray") + " --tokenizer" * bool(args.tokenizer),
                  needs)
    if args.address is not None and args.engine != "ray":
        raise UsageError("--address goes with --engine ray")
    if args.workers is not None and args.engine != "ray":
        raise UsageError("--workers goes with --engine ray")
    if args.glob == "":
        raise UsageError("--glob needs a file name pattern such as '*.py' (it was given an empty one)")
    if args.glob is not None and ("/" in args.glob or os.sep in args.glob):
        raise UsageError(f"--glob matches file names in every subdirectory, not paths: {args.glob!r} has a "
                         f"'/' (try {Path(args.glob).name!r})")
    if args.threads is not None:
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' pool, read when it starts
    if not args.split.strip():
        raise UsageError("--split needs the split's name or a split receipt .json file")
    # A path (it has a directory part or ends in .json, in any case) is a receipt, read or refused; else a name.
    receipt = args.split.lower().endswith(".json") or any(sep and sep in args.split for sep in (os.sep, os.altsep))
    split = Path(args.split) if receipt else args.split
    # The byte guard scales with the token guard, in the defaults' ratio.
    from .data.binding import DEFAULT_LIMITS

    bytes_per_token = DEFAULT_LIMITS.max_bytes // DEFAULT_LIMITS.max_tokens
    limits = data.DecodeLimits(args.max_document_tokens, bytes_per_token * args.max_document_tokens)
    try:
        if args.tokenizer is None:
            tokenizer = data.ByteTokenizer()
            binding = data.BatchBinding.for_tokenizer(tokenizer, split=split, limits=limits)
        else:
            tokenizer = io.TokenizerFile(args.tokenizer, bos=args.bos, eos=args.eos)
            binding = data.BatchBinding.for_tokenizer(tokenizer.identity, split=split, limits=limits)
    except OSError as error:
        raise InvalidInputError(f"{error.filename}: cannot read: {error.strerror or error}") from None
    if args.sample:
        readers = [io.TextFiles(stdlib_sources())]
    else:
        readers = [io.reader_for(path, text_field=args.text_field, ids_field=args.ids_field, pattern=args.glob)
                   for path in args.inputs]
    _check_input_flags(args, readers)
    config = PackConfig(args.capacity, args.rows_per_batch)
    if args.assistant_only_loss and args.chat_template is None:
        raise UsageError("--assistant-only-loss goes with --chat-template FILE.jinja")
    template = None
    if args.chat_template is not None:
        try:
            template = args.chat_template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise InvalidInputError(f"{args.chat_template}: cannot read the chat template: "
                                    f"{getattr(error, 'strerror', None) or error}") from None
    job = io.PackJob.of(
        readers, args.out, tokenizer=tokenizer, binding=binding, config=config, policy=args.policy,
        partition=data.Partition(args.partition), long="cut" if args.cut_long or args.sample else "error",
        framed=args.framed, completion_only_loss=not args.no_completion_only_loss, chat_template=template,
        assistant_only_loss=args.assistant_only_loss,
        template_limits=TemplateLimits(
            TemplateLimits.seconds if args.template_seconds is None else args.template_seconds,
            TemplateLimits.characters if args.template_characters is None else args.template_characters),
        shards=args.shards, threads=args.threads, progress=not args.quiet, force=args.force)
    stamp = fmt.manifest_stamp(args.out)
    try:
        status = _pack_and_report(args, job)
        args.signals.check()
        return status
    except (KeyboardInterrupt, Terminated):
        if fmt.manifest_stamp(args.out) not in (stamp, None) and fmt.is_packed_dataset(args.out):
            args.signals.answered()
            print(f"seqpack: {_one_line(args.out)} is complete: it was published before the signal took effect",
                  file=sys.stderr)
            return 0
        raise


def _pack_and_report(args, job) -> int:
    """Run ``job`` with the chosen engine, then print the report (or the manifest)."""
    from . import io
    from .ray import supervisor

    try:
        if args.engine == "ray" and not supervisor.supervised():
            return supervisor.run_supervised(args.argv, args.out)
        if args.engine == "ray":
            from .ray import run_on_ray

            if os.environ.get(supervisor.DRIVER_VARIABLE) == "1":
                supervisor.die_with_supervisor()
            manifest = run_on_ray(job, address=args.address, workers=args.workers)
        else:
            manifest = io.job.run_job(job)
    except OSError as error:
        raise InvalidInputError(_pack_os_error(error, args.out)) from None
    except DecodeLimitError as error:
        raise DecodeLimitError(f"{error} (--max-document-tokens raises the limit)", error.position) from None
    for directory in (d for reader in job.readers if isinstance(reader, io.TextFiles) for d in reader.skipped):
        print(f"seqpack: skipped {_one_line(directory)}: a packed dataset, not text", file=sys.stderr)
    supervision = manifest.get("supervision") or {}
    if supervision.get("mismatched_prompts"):
        count = supervision["mismatched_prompts"]
        completion = "chosen or rejected" if any("preference" in name for name in supervision["applied"]) \
            else "completion"
        first = _one_line(supervision["first_mismatched_prompt"])
        print(f"seqpack: warning: {count:,} record{'s' if count != 1 else ''}' prompt encoding is not a prefix of "
              f"prompt + {completion} (first: {first}); as in TRL, the completion begins where they diverge",
              file=sys.stderr)
    if args.json:
        _print_json(manifest)
    else:
        _print_pack_report(args.out, manifest)
    return 0


def _print_pack_report(out: Path, manifest: dict) -> None:
    """The report of the dataset this pack published (``manifest``), read back from ``out``;
    a note instead when another pack has replaced it since (its report would be another's)."""
    from .io import format as fmt
    from .io import open_dataset
    from .io.stats import dataset_stats, stats_text

    try:
        dataset = open_dataset(out)
        ours = dataset.manifest == manifest
    except SeqpackError:
        try:
            ours = fmt.read_manifest(out) == manifest
        except SeqpackError:
            ours = False
        if ours:
            raise
    if not ours:
        print(f"seqpack: {_one_line(out)} was published, then replaced by another pack before its report was read; "
              f"'seqpack stats {_one_line(out)}' reports what is there now", file=sys.stderr)
        return
    print(stats_text(dataset_stats(dataset)))


def _check_input_flags(args, readers) -> None:
    """A reading flag that no INPUT uses is a usage error, not silently ignored."""
    from .io import readers as kinds

    structured = [r for r in readers if isinstance(r, (kinds.JsonLines, kinds.ArrowBatches))]
    uses = {
        "--glob": (any(isinstance(reader, kinds.TextFiles) and Path(path).is_dir()
                       for path, reader in zip(args.inputs, readers)),
                   "no INPUT is a directory of files (a datasets save_to_disk directory is one dataset)"),
        "--text-field": (bool(structured), "no INPUT is JSONL, Parquet or Arrow"),
        "--ids-field": (bool(structured), "no INPUT is JSONL, Parquet or Arrow"),
        "--framed": (args.ids_field is not None or any(isinstance(r, kinds.Megatron) for r in readers)
                     or any(r.record_kind == "ids" and not _table_masks(r) for r in structured),
                     "it applies to pre-tokenized inputs (--ids-field, an 'input_ids' field or Megatron) without "
                     "TRL's mask columns (IDs with masks are taken as they are)"),
        "--chat-template": (any(r.record_fields.conversational for r in structured),
                            "no INPUT holds conversations (a 'messages' field, or prompt-completion or preference "
                            "records of lists of messages)"),
        "--no-completion-only-loss": (any(r.record_kind in ("prompt-completion", "conversational prompt-completion")
                                          or r.record_kind == "ids" and (isinstance(r, kinds.JsonLines)
                                                                         or "completion_mask" in _table_masks(r))
                                          for r in structured),
                                      "no INPUT holds prompt-completion records or token IDs (whose records may "
                                      "carry a 'completion_mask')"),
        "--assistant-only-loss": (any(r.record_fields.conversational and not r.record_fields.preference
                                      for r in structured),
                                  "no INPUT holds conversations or conversational prompt-completion records "
                                  "(preference pairs are supervised on their completions)"),
    }
    for flag in ("--template-seconds", "--template-characters"):
        uses[flag] = (args.chat_template is not None, "it bounds the rendering of --chat-template")
    for flag, (used, reason) in uses.items():
        given = getattr(args, flag[2:].replace("-", "_"))
        if given not in (None, False) and not used:
            raise UsageError(f"{flag} has no effect here: {reason}")


def _table_masks(reader) -> tuple:
    """The mask columns of a Parquet or Arrow input of token IDs (its schema names them); ()
    for JSONL, whose records may each carry their own."""
    from .io import readers as kinds

    return tuple(reader.record_fields.masks) if isinstance(reader, kinds.ArrowBatches) else ()


# Errors that only writing raises.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def _pack_os_error(error: OSError, out: Path) -> str:
    """The one-line message of an OSError while packing: a write error names the output,
    a read error the file read (an error that names no file and is not a full or
    read-only disk is shown as is)."""
    target = out.resolve()
    if error.errno in _WRITE_ERRNOS:
        return f"{error.filename or out}: cannot write: {error.strerror or error}"
    if error.filename is not None:
        path = Path(error.filename).resolve()
        written = path == target or target in path.parents or any(
            part.name.startswith(f".{out.name}.seqpack-") for part in (path, *path.parents))
        return f"{error.filename}: cannot {'write' if written else 'read'}: {error.strerror or error}"
    return str(error)


def _print_json(value) -> None:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _stats(args) -> int:
    from .io import open_dataset
    from .io.stats import dataset_stats, stats_svg, stats_text

    _check_figure_path(args.svg)
    stats = dataset_stats(open_dataset(args.dataset))
    if args.svg is not None:
        _write_text(args.svg, stats_svg(stats))
    if args.json:
        _print_json(stats)
    else:
        print(stats_text(stats))
    return 0


def _verify(args) -> int:
    from .io import verify_dataset
    from .io.progress import Progress

    checked = verify_dataset(args.dataset, tokenizer=args.tokenizer, progress=Progress(enabled=not args.quiet))
    if args.json:
        _print_json(checked)
    else:
        from .io.render import printable

        sealed = "the manifest matches its seal" if checked["sealed"] else \
            "the manifest has no seal (an older seqpack wrote it)"
        tokenizer = ", the tokenizer is the one it was packed with" if args.tokenizer else ""
        print(f"{printable(str(args.dataset))}: ok: {sealed}{tokenizer}, {checked['files']} files "
              f"({checked['bytes']:,} bytes) match their SHA-256, "
              f"{_counted(checked['examples'], 'example')}"
              f"{'' if checked['pairs'] is None else ' (' + _counted(checked['pairs'], 'preference pair') + ')'} "
              f"placed by the rules, "
              f"{_counted(checked['batches_verified'], 'batch', 'batches')} verified")
    return 0


def _score(args) -> int:
    from .io import open_dataset
    from .io.progress import Progress
    from .io.scores import check_scores_output, import_parquet, scores_table, write_scores

    _check_extras("seqpack score", {"hf": "transformers", "corpus": "pyarrow"})
    check_scores_output(args.out, args.force)
    dataset = open_dataset(args.dataset)
    import_parquet()
    torch, hf = _import_hf("seqpack score")
    if args.threads is not None:
        _set_threads(torch, args.threads)
    model = _causal_lm(args.model, getattr(torch, args.dtype), hf)
    count = len(dataset) if args.batches is None else min(args.batches, len(dataset))
    # evaluate refuses a vocabulary smaller than the dataset's before the first forward.
    evaluation = hf.evaluate(model, _scored_batches(dataset, count, Progress(enabled=not args.quiet)))
    loss = float(evaluation.loss)
    summary = {"dataset": str(args.dataset), "model": str(args.model), "dtype": args.dtype, "out": str(args.out),
               "batches": count, "dataset_batches": len(dataset), "examples": len(evaluation.example_ids),
               "targets": int(evaluation.total_targets), "nll_sum": float(evaluation.nll_sums.sum()),
               "loss": loss, "perplexity": _exp(loss)}
    # A signal before the rename leaves nothing; one from the rename on, a complete file.
    late = write_scores(scores_table(dataset, evaluation, summary), args.out, force=args.force)
    try:
        _print_score(args, summary)
        args.signals.check()
    except (KeyboardInterrupt, Terminated):
        late = True
    if late:
        args.signals.answered()
        print(f"seqpack: {_one_line(args.out)} is complete: it was written before the signal took effect",
              file=sys.stderr)
    return 0


def _exp(x: float) -> float:
    """``e ** x``, infinite past the float range."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _print_score(args, summary: dict) -> None:
    if args.json:
        from .io.scores import json_ready

        _print_json(json_ready(summary))
        return
    from .io.render import printable

    part = "" if summary["batches"] == summary["dataset_batches"] else f" of {summary['dataset_batches']:,}"
    print(f"scored {_counted(summary['examples'], 'example')}, {_counted(summary['targets'], 'target')} "
          f"({_counted(summary['batches'], 'batch', 'batches')}{part}) of {printable(summary['dataset'])} with "
          f"{printable(summary['model'])} in {summary['dtype']}")
    print(f"loss {summary['loss']:.6f} nats per target (token-weighted mean), perplexity {summary['perplexity']:.6g}")
    print(f"wrote {printable(summary['out'])}")


def _scored_batches(dataset, count: int, progress):
    """The dataset's first ``count`` batches (sharing one set of buffers: each is scored
    before the next is asked for), the bar advanced by each one's targets then."""
    targets = dataset.batch_targets()
    progress.phase("scoring", int(targets[:count].sum()), " targets")
    try:
        for number, batch in zip(range(count), dataset.batches(reuse_buffers=True)):
            yield batch
            progress.advance(int(targets[number]))
    finally:
        progress.close()


def _check_extras(command: str, needs: dict[str, str]) -> None:
    """Refuse ``command`` naming at once every extra it needs that is missing (``needs``:
    each extra, by the module of it that the command imports)."""
    missing = [extra for extra, module in needs.items() if importlib.util.find_spec(module) is None]
    if missing:
        from .io.readers import missing_extra

        raise missing_extra(command, *missing)


def _import_hf(command: str):
    """``torch`` and ``seqpack.hf``, or an error naming the extra (``HF_HUB_OFFLINE`` set
    unless the environment says otherwise: nothing is downloaded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch

        from . import hf
    except ImportError:
        from .io.readers import missing_extra

        raise missing_extra(command, "hf") from None
    return torch, hf


def _set_threads(torch, threads: int) -> None:
    """``threads`` for torch and for seqpack's kernels, which follow the OpenMP runtime's
    limit: ``torch.set_num_threads`` sets it when both use one runtime, threadpoolctl (if
    installed) when they do not."""
    from ._openmp import max_threads

    torch.set_num_threads(threads)
    if max_threads() != threads and importlib.util.find_spec("threadpoolctl") is not None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads, user_api="openmp")


def _causal_lm(path: Path, dtype, hf):
    """The causal LM saved at ``path``, in ``dtype``, under seqpack attention, in eval mode;
    anything else at ``path`` is an InvalidInputError naming it."""
    if not path.is_dir():
        problem = "not a directory" if path.exists() else "no such directory"
        raise InvalidInputError(f"{path}: {problem} (--model takes a directory written by save_pretrained)")
    if not (path / "config.json").is_file():
        raise InvalidInputError(f"{path}: no config.json: not a model written by save_pretrained")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils import logging as hf_logging

    hf.register()
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # what matters of its warnings is refused below
    hf_logging.disable_progress_bar()  # the command draws its own
    try:
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as error:  # (transformers raises TypeError, ZeroDivisionError... on a malformed config.json)
            raise InvalidInputError(f"{path}: not a transformers model: {_first_line(error)}") from None
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise InvalidInputError(f"{path}: a {config.model_type!r} model is not a causal LM "
                                    f"(AutoModelForCausalLM has no class for it)")
        config.use_cache = False
        try:  # weights of another shape than the config's come back as mismatched_keys, refused below
            model, loading = AutoModelForCausalLM.from_pretrained(
                path, config=config, dtype=dtype, attn_implementation=hf.NAME, local_files_only=True,
                output_loading_info=True, ignore_mismatched_sizes=True)
        except Exception as error:  # (the same, from the model's constructor or the checkpoint)
            raise InvalidInputError(f"{path}: cannot load the model: {_first_line(error)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    if loading["mismatched_keys"]:
        name, stored, expected = sorted(loading["mismatched_keys"], key=lambda found: found[0])[0]
        raise InvalidInputError(
            f"{path}: {_counted(len(loading['mismatched_keys']), 'weight')} of the checkpoint do not fit config.json "
            f"(first: {name} is {list(stored)} in the checkpoint, {list(expected)} in the model)")
    if loading["missing_keys"]:
        absent = sorted(loading["missing_keys"])
        raise InvalidInputError(f"{path}: the checkpoint lacks {_counted(len(absent), 'weight')} of the model "
                                f"(first: {absent[0]}), which would score with random values")
    return model.eval()


def _counted(number: int, noun: str, plural: str | None = None) -> str:
    """``"1 batch"``, ``"2 batches"``: the number with thousands separators and the noun it takes."""
    return f"{number:,} {noun if number == 1 else plural or noun + 's'}"


def _columns(text: str | None, width: int, default: int) -> range:
    if text is None:
        return range(0, min(width, default))
    try:
        start, stop = (int(v) if v else None for v in text.split(":"))
    except ValueError:
        raise UsageError(f"--columns takes START:STOP, not {text!r}") from None
    if (start or 0) < 0 or (stop or 0) < 0:
        raise UsageError(f"--columns {text}: START and STOP are columns from 0, not negative")
    if stop is not None and stop <= (start or 0):
        raise UsageError(f"--columns {text} is empty: STOP must be above START")
    return range(start or 0, width if stop is None else stop)


def _show(args) -> int:
    from .io.render import batch_svg, batch_text

    _check_figure_path(args.svg)
    if Path(args.target).is_dir():
        from .io import open_dataset

        dataset = open_dataset(args.target)
        index = 0 if args.batch is None else args.batch
        batch = dataset.batch(index)
        title = f"{args.target}: batch {index}"
        rows = [0 if args.row is None else args.row]
        columns = _columns(args.columns, batch.shape[1], SHOWN_COLUMNS)
    elif args.target in TRACES:
        if args.batch is not None:
            raise UsageError(f"--batch has no effect here: the {args.target} fixture is one batch")
        from .chapters.fixtures import chapter_batch
        from .data import BatchBinding

        batch = chapter_batch(args.target, BatchBinding.fixture())
        title = f"the {args.target} chapter fixture"
        rows = None if args.row is None else [args.row]
        columns = _columns(args.columns, batch.shape[1], batch.shape[1])
    else:
        raise InvalidInputError(f"{args.target}: neither a packed dataset directory nor 'padded' or 'packed'")
    colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    text = batch_text(batch, rows=rows, columns=columns, colour=colour)
    if args.svg is not None:  # first: a figure that cannot be written fails the command before it prints
        _write_text(args.svg, batch_svg(batch, rows=rows, columns=columns, title=title))
    print(text)
    return 0


def _check_figure_path(svg: Path | None) -> None:
    """Refuse an ``--svg`` file inside a packed dataset (the one drawn or another), and one
    that is a link or a special file (it would be replaced, not written through)."""
    if svg is not None:
        from .io.publish import check_outside_datasets, check_replaceable_file

        check_outside_datasets(Path(svg), "--svg")
        check_replaceable_file(Path(svg), "--svg")


def _write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: into a temporary sibling, then renamed into
    place (a failed write leaves an existing file as it was)."""
    from .io.publish import temporary_sibling

    temporary = temporary_sibling(path, "partial")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    except OSError as error:
        raise InvalidInputError(f"{path}: cannot write: {error.strerror or error}") from None
    finally:
        temporary.unlink(missing_ok=True)


class UsageError(Exception):
    """Arguments that parse but do not fit together (exit status 2)."""


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor to redirect: nothing will flush
        pass


def _run(argv: list[str] | None, signals: _Signals) -> int:
    parser = build_parser()  # loads the commands' modules (and numpy): signals wait for it
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "demo":
        from .chapters import demo

        json.dump({"padded": demo.padded_trace, "packed": demo.packed_trace}[args.trace](), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _check_flag_ranges(args)
    signals.arm()
    args.signals = signals
    return args.run(args)


def _check_flag_ranges(args) -> None:
    """Every numeric flag of every command within its range, else a usage error naming the
    flag and the bound, before anything is read or run (a huge thread count would fail
    deep in a pool, a zero capacity as bad input)."""
    from ._arguments import INT32_MAX
    from ._threads import MAX_THREADS

    ranges = {"capacity": (1, INT32_MAX), "rows_per_batch": (1, INT32_MAX), "threads": (1, MAX_THREADS),
              "shards": (1, None), "workers": (1, None), "batch": (0, None), "row": (0, None),
              "batches": (1, None), "repeats": (1, 1000), "layers": (1, 256), "max_document_tokens": (3, 1 << 40),
              "template_characters": (1, None)}
    for name, (minimum, maximum) in ranges.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if value < minimum:
            raise UsageError(f"{flag} must be at least {minimum}")
        if maximum is not None and value > maximum:
            raise UsageError(f"{flag} is {value}; the maximum is {maximum}")
    seconds = getattr(args, "template_seconds", None)
    if seconds is not None and not 0 < seconds <= threading.TIMEOUT_MAX:   # (NaN too)
        raise UsageError(f"--template-seconds must be a positive number of seconds, at most "
                         f"{threading.TIMEOUT_MAX:g}; got {seconds:g}")


def _first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (another library's, which may run on for lines)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _one_line(message) -> str:
    """``message`` on one line and harmless to a terminal: line breaks and control
    characters (in a file name, say) written as escapes, ``\\n``, ``\\x1b``..."""
    from .io.render import printable

    return printable(str(message))


class Terminated(BaseException):
    """SIGTERM (``kill``, ``timeout``, a scheduler) raised inside a command, which then
    cleans up as for Ctrl-C."""


class _Signals:
    """SIGINT and SIGTERM during one command (Python's default handlers replaced in the main
    thread). Python can lose the exception a handler raises: inside an import's C code, a
    weakref callback or a finalizer it is dropped or turned into another error (numpy's
    "PyCapsule_Import could not import module"). So each signal is also noted. Until
    :meth:`arm`, while the command's modules load, it is only noted, and ``arm`` raises it;
    from then on it raises at once, and :meth:`check` raises a noted one again where the
    command ends. :func:`main` reports any failure that follows a signal as that signal,
    and does not print a signal's exception that Python could not raise
    (``sys.unraisablehook``)."""

    EXCEPTIONS = {signal.SIGINT: KeyboardInterrupt, signal.SIGTERM: Terminated}
    RAISED = tuple(EXCEPTIONS.values())

    def __init__(self, after_exit=None):
        self.noted = None
        self._armed = False
        self._kept = {}
        self._hook = None
        self._after_exit = after_exit   # the handlers from then on (None: the ones replaced)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for number, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
                if signal.getsignal(number) == default:
                    self._kept[number] = signal.signal(number, self._handle)
        self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exception):
        sys.unraisablehook = self._hook
        for number, handler in self._kept.items():
            signal.signal(number, handler if self._after_exit is None else self._after_exit)

    def _handle(self, number, frame):
        self.noted = self.noted or number
        if self._armed:
            raise self.EXCEPTIONS[number]()

    def _unraisable(self, unraisable):
        if self.noted is None or not issubclass(unraisable.exc_type, self.RAISED):
            self._hook(unraisable)

    def arm(self) -> None:
        """The command's modules are loaded: raise a signal noted so far, and each one from now on."""
        self._armed = True
        self.check()

    def check(self) -> None:
        """Raise the exception of a signal noted since the command began."""
        if self.noted is not None:
            raise self.EXCEPTIONS[self.noted]()

    def answered(self) -> None:
        """The command has told what the signal left on disk: nothing more to raise."""
        self.noted = None


def main(argv: list[str] | None = None, *, exiting: bool = False) -> int:
    """The ``seqpack`` command: its exit status (0 done, 1 bad input or a failed check, 2
    usage, 130 interrupted, 143 terminated); errors are one line on stderr.

    ``exiting``: the process ends with this status (the console script): SIGINT and SIGTERM
    are ignored once the command is over, so one that arrives while Python shuts down does
    not turn a finished command into an interrupted one."""
    if sys.stdout is None:  # (started with stdout closed: nothing could be reported)
        if sys.stderr is not None:
            print("seqpack: error: cannot write the output: stdout is closed", file=sys.stderr)
        return 1
    with _console_streams(), _Signals(signal.SIG_IGN if exiting else None) as signals:
        try:
            try:
                status = _run(argv, signals)
            except SystemExit as done:  # argparse: --help, --version and usage errors
                status = 0 if done.code is None else done.code
            signals.check()  # one whose exception Python lost on the way
            sys.stdout.flush()
            return status
        except BaseException as error:
            if signals.noted is not None and not isinstance(error, signals.RAISED):
                error = signals.EXCEPTIONS[signals.noted]()  # the signal's error, in another form
            return _failed(error)


@contextlib.contextmanager
def _console_streams():
    """stdout and stderr as a command writes them: what their encoding cannot hold (a file
    name's undecodable bytes, any non-ASCII text under ``PYTHONIOENCODING=ascii``) as
    backslash escapes, not a traceback after the work is done; and a stderr closed when the
    process started (None) as /dev/null meanwhile, so that no error line falls back to
    stdout and no file the command opens takes descriptor 2, where C libraries write."""
    closed = sys.stderr is None
    if closed:
        sys.stderr = open(os.devnull, "w")
    strict = [stream for stream in (sys.stdout, sys.stderr) if getattr(stream, "errors", None) == "strict"]
    escaped = [stream for stream in strict if _errors_as(stream, "backslashreplace")]
    try:
        yield
    finally:
        for stream in escaped:
            _errors_as(stream, "strict")
        if closed:
            sys.stderr.close()
            sys.stderr = None


def _errors_as(stream, errors: str) -> bool:
    """Whether ``stream`` (a text stream) now encodes with ``errors``."""
    try:
        stream.reconfigure(errors=errors)
    except (AttributeError, OSError, ValueError):   # (no reconfigure, or its flush failed: a broken stream)
        return False
    return True


def console() -> int:
    """The ``seqpack`` console script: :func:`main` of the process's arguments, exiting."""
    return main(exiting=True)


def _failed(error: BaseException) -> int:
    """The exit status for ``error``, its one line printed on stderr; an error no command
    expects is raised (a bug: its traceback is wanted)."""
    if isinstance(error, UsageError):
        print(f"seqpack: error: {_one_line(error)}", file=sys.stderr)
        return 2
    if isinstance(error, SeqpackError):
        print(f"seqpack: error: {_one_line(error)}", file=sys.stderr)
        return 1
    if isinstance(error, KeyboardInterrupt):
        print("seqpack: interrupted", file=sys.stderr)
        return 130
    if isinstance(error, Terminated):
        print("seqpack: terminated", file=sys.stderr)
        return 143
    if isinstance(error, BrokenPipeError):
        _silence_stdout()
        return 0
    if isinstance(error, MemoryError):
        print(f"seqpack: error: not enough memory: {error or 'an allocation failed'}", file=sys.stderr)
        return 1
    if isinstance(error, OSError):
        if error.filename is not None:   # a file the command read or wrote
            print(f"seqpack: error: {_one_line(error.filename)}: {error.strerror or error}", file=sys.stderr)
            return 1
        if not _working_directory_exists():   # (relative paths cannot be resolved: no file to name)
            print("seqpack: error: the working directory no longer exists: run the command from one that does, "
                  "or give absolute paths", file=sys.stderr)
            return 1
        _silence_stdout()
        print(f"seqpack: error: cannot write the output: {error.strerror or error}", file=sys.stderr)
        return 1
    raise error


def _working_directory_exists() -> bool:
    """Whether the process's working directory still exists (it may have been removed)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return False
    return True
