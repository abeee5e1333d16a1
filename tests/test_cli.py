"""The ``nestpipe`` command imports only the component that owns the command it runs."""

import argparse
import subprocess
import sys

from nestpipe import cli


def _registered():
    """{command: module} as every component registers them."""
    owners = {}
    for name in cli.COMMAND_MODULES:
        parser = cli.build_parser([name])
        sub = next(a for a in parser._actions if a.dest == "command")
        for command in sub.choices:
            owners[command] = name
    return owners


def test_every_command_is_mapped_to_the_module_that_registers_it():
    assert cli.COMMANDS == _registered()
    # control: a registry entry pointing at another module is caught
    wrong = dict(cli.COMMANDS, simulate="nestpipe.planning.cli")
    assert wrong != _registered()


def test_ingest_does_not_import_torch():
    code = ("import sys\nfrom nestpipe.cli import main\n"
            "try:\n    main(['ingest', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "TORCH False" in out
    # nor does running it: the modules the driver and its workers load (a torch import costs every ingest process
    # about a second and a half)
    run = ("import sys\nimport nestpipe.ingest.stages, nestpipe.ingest.gr, nestpipe.ingest.ctr, nestpipe.ingest.engines\n"
           "import nestpipe.clustering, nestpipe.datasets.synth\nprint('TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, check=True).stdout
    assert "TORCH False" in out
    # control: the full parser (top-level --help) does import torch through nestpipe.kernels
    code_all = code.replace("['ingest', '--help']", "['--help']")
    out = subprocess.run([sys.executable, "-c", code_all], capture_output=True, text=True, check=True).stdout
    assert "TORCH True" in out


def test_every_command_explains_itself_in_help():
    """Every subcommand has a description and every option a help text; no option shows "(default: None)";
    preset names appear in --help (not only in errors); --model says it defaults from the shards' task."""
    from nestpipe.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, p in sub.choices.items():
        if not p.description:
            missing.append(f"{name}: no description")
        for a in p._actions:
            if a.dest != "help" and a.option_strings and not a.help:
                missing.append(f"{name} {a.option_strings[0]}: no help")
        assert "(default: None)" not in p.format_help(), name
    assert not missing, missing
    assert "a100" in sub.choices["simulate"].format_help() and "paper-hstu" in sub.choices["simulate"].format_help()
    assert "h100" in sub.choices["plan"].format_help()
    assert "from the shards' task" in sub.choices["train"].format_help()


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """`nestpipe plan ... | head -1`: the reader leaves after one line; the command stops without a traceback."""
    tables = tmp_path / "t.json"
    tables.write_text('{"tables": [' + ",".join(
        f'{{"name": "t{i}", "vocab": 1000, "dim": 16, "kind": "single"}}' for i in range(400)) + "]}")
    p = subprocess.run(f"{sys.executable} -m nestpipe plan --tables {tables} --workers 8 --json | head -1",
                       shell=True, capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "{"
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr[-2000:]
