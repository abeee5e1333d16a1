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
    "nestpipe.measure.cli",
    "nestpipe.demo",
]

# Which module registers each command: ``nestpipe COMMAND ...`` imports only that one (``nestpipe.kernels`` imports
# torch, about a second that ``nestpipe ingest`` has no use for). A command missing here is still found: every
# module is imported when the first argument is not a known command (``--help``, a typo).
COMMAND_OWNERS = {
    "synth": "nestpipe.datasets.cli", "check-raw": "nestpipe.datasets.cli",
    "ingest": "nestpipe.ingest.cli", "shard-report": "nestpipe.ingest.cli",
    "cluster-report": "nestpipe.clustering.cli",
    "train": "nestpipe.trainer.cli", "eval": "nestpipe.trainer.cli", "export": "nestpipe.trainer.cli",
    "kernels-info": "nestpipe.kernels.cli",
    "plan": "nestpipe.planning.cli", "simulate": "nestpipe.measure.cli",
    "demo": "nestpipe.demo",
}


def build_parser(modules: Optional[List[str]] = None) -> argparse.ArgumentParser:
    """The command-line parser with the subcommands of ``modules`` (default: every component's)."""
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
    for name in modules or COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name or (e.name and name.startswith(e.name)):
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    owner = COMMAND_OWNERS.get(words[0]) if words else None
    parser = build_parser([owner] if owner else None)
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
