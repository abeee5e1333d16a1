"""The ``nestpipe`` command. Each component registers its own subcommands; heavy imports happen in handlers."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

from nestpipe import __version__

# The one command registry: command -> the module that registers it. Every module exposes ``add_parser(subparsers)``,
# which registers its commands and sets ``func`` on them. ``nestpipe COMMAND ...`` imports only the owner of COMMAND
# (``nestpipe.kernels`` imports torch, about a second that ``nestpipe ingest`` has no use for); ``--help`` or an
# unknown command imports every module. A module that is not installed is simply absent from ``--help``.
COMMANDS = {
    "synth": "nestpipe.datasets.cli",
    "check-raw": "nestpipe.ingest.cli",
    "ingest": "nestpipe.ingest.cli",
    "shard-report": "nestpipe.ingest.cli",
    "cluster-report": "nestpipe.clustering.cli",
    "train": "nestpipe.trainer.cli",
    "eval": "nestpipe.trainer.cli",
    "export": "nestpipe.trainer.cli",
    "kernels-info": "nestpipe.kernels.cli",
    "kernels-tune": "nestpipe.kernels.cli",
    "plan": "nestpipe.planning.cli",
    "simulate": "nestpipe.measure.cli",
    "measure": "nestpipe.measure.cli",
    "serve": "nestpipe.serving.cli",
    "demo": "nestpipe.demo",
}
COMMAND_MODULES = list(dict.fromkeys(COMMANDS.values()))  # in the order of --help


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
    owner = COMMANDS.get(words[0]) if words else None
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
    except BrokenPipeError:  # the reader of our output went away (`nestpipe plan ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141
    except (ValueError, OSError, RuntimeError) as e:  # OSError: a path that cannot be read or written, a full disk
        if getattr(args, "debug", False):
            raise
        print(f"nestpipe {args.command}: error: {e}", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
