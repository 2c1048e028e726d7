"""The ``seqpack`` command line: ``--version``, ``demo padded|packed``, ``bench attention``."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .chapters import demo
from .errors import SeqpackError

TRACES = {"padded": demo.padded_trace, "packed": demo.packed_trace}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="seqpack",
        description="Pad and pack variable-length causal-LM examples without joining their contexts.",
    )
    parser.add_argument("--version", action="version", version=f"seqpack {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo_parser = commands.add_parser("demo", help="print a chapter fixture's JSON trace")
    demo_parser.add_argument("trace", choices=sorted(TRACES), help="which trace to print")
    bench_parser = commands.add_parser(
        "bench", help="benchmarks (run 'seqpack bench attention --help' for options)", add_help=False
    )
    bench_parser.add_argument("suite", choices=["attention"], help="which benchmark to run")
    bench_parser.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "demo":
            json.dump(TRACES[args.trace](), sys.stdout, indent=2)
            sys.stdout.write("\n")
        elif args.command == "bench":
            from .bench import attention

            return attention.main(args.options)
    except SeqpackError as error:
        print(f"seqpack: error: {error}", file=sys.stderr)
        return 1
    return 0
