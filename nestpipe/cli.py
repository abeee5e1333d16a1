"""The ``nestpipe`` command. Each component registers its own subcommands; heavy imports happen in handlers."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# (module, description). Every module exposes ``add_parser(subparsers)`` which registers one or more subcommands
# and sets ``func`` on them. A component that is not there yet is simply absent from ``--help``.
COMMAND_MODULES = [
    "nestpipe.datasets.cli",
    "nestpipe.ingest.cli",
    "nestpipe.clustering.cli",
    "nestpipe.trainer.cli",
    "nestpipe.kernels.cli",
    "nestpipe.planning.cli",
    "nestpipe.demo",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nestpipe",
        description=(
            "NestPipe: preprocess recommendation logs into clustered WebDataset shards and train embedding-heavy "
            "models (HSTU, DLRM) with synchronous, staleness-free nested pipelining."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `nestpipe COMMAND --help` for the options of one command.",
    )
    from nestpipe import __version__

    parser.add_argument("--version", action="version", version=f"nestpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name or (e.name and name.startswith(e.name)):
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        if getattr(args, "debug", False):
            raise
        print(f"nestpipe {args.command}: error: {e}", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
