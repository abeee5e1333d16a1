"""The ``nestpipe`` command imports only the component that owns the command it runs."""

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
    # control: the full parser (top-level --help) does import torch through nestpipe.kernels
    code_all = code.replace("['ingest', '--help']", "['--help']")
    out = subprocess.run([sys.executable, "-c", code_all], capture_output=True, text=True, check=True).stdout
    assert "TORCH True" in out
