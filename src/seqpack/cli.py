"""The ``seqpack`` command line: ``--version``, ``demo padded|packed``, ``bench attention``.

Exit status: 0 on success (also when the reader of the output goes away, as in
``seqpack demo packed | head -1``), 1 for bad input or a failed write (one line on
stderr), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__
from .chapters import demo
from .errors import SeqpackError

TRACES = {"padded": demo.padded_trace, "packed": demo.packed_trace}


def build_parser() -> argparse.ArgumentParser:
    from .bench import attention

    parser = argparse.ArgumentParser(
        prog="seqpack",
        description="Pad and pack variable-length causal-LM examples without joining their contexts.",
    )
    parser.add_argument("--version", action="version", version=f"seqpack {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo_parser = commands.add_parser("demo", help="print a chapter fixture's JSON trace",
                                      description="Print a chapter fixture's JSON trace.")
    demo_parser.add_argument("trace", choices=sorted(TRACES), help="which trace to print")
    bench_parser = commands.add_parser("bench", help="benchmarks, every method in one process",
                                       description="Benchmarks: every method on the same inputs in one process.")
    suites = bench_parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    attention_parser = suites.add_parser("attention", help="range attention against dense and PyTorch peers",
                                         description=attention.__doc__.splitlines()[0])
    attention.add_arguments(attention_parser)
    attention_parser.set_defaults(run=attention.run_command)
    return parser


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor to redirect: nothing will flush
        pass


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "demo":
        json.dump(TRACES[args.trace](), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    return args.run(args)


def main(argv: list[str] | None = None) -> int:
    try:
        status = _run(argv)
        sys.stdout.flush()
        return status
    except SeqpackError as error:
        print(f"seqpack: error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except OSError as error:
        _silence_stdout()
        print(f"seqpack: error: cannot write the output: {error.strerror or error}", file=sys.stderr)
        return 1
