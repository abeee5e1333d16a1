"""``nestpipe measure sequence-cost``: the calibration whose output is ``nestpipe ingest --sequence-cost A,B``."""

import json

import pytest

from nestpipe import cli
from nestpipe.datasets.sequence_cost import SequenceCost

SMALL = ["--lengths", "8", "16", "32", "--tokens-per-call", "128", "--repeats", "1", "--dim", "16"]


def test_sequence_cost_prints_a_fit_the_ingest_accepts(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert cli.main(["measure", "sequence-cost", *SMALL, "--json", "--out", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(out.read_text())
    assert sorted(doc["seconds_per_sequence"], key=int) == ["8", "16", "32"]
    assert all(s > 0 for s in doc["seconds_per_sequence"].values())
    assert set(doc["relative_errors"]) == set(doc["seconds_per_sequence"])
    fit = SequenceCost.parse(doc["sequence_cost"])  # the ingest's own parser takes the printed argument
    assert fit.a >= 0 and fit.b >= 0 and fit.a + fit.b > 0
    assert doc["fit"]["a"] >= 0 and doc["fit"]["b"] >= 0
    assert doc["settings"] == {"dim": 16, "tokens_per_call": 128, "repeats": 1, "threads": 1}

    # the plain output ends with the ingest argument
    assert cli.main(["measure", "sequence-cost", *SMALL]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines[:3]] == ["n     8", "n    16", "n    32"]
    last = lines[-1]
    assert last.startswith("nestpipe ingest ... --sequence-cost ")
    SequenceCost.parse(last.rsplit(" ", 1)[1])


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "64"], "at least two distinct lengths"),
    (["--lengths", "64", "64"], "at least two distinct lengths"),
    (["--lengths", "0", "16"], "--lengths must be >= 1"),
    (["--lengths", "8", "16", "--repeats", "0"], "--repeats must be >= 1"),
    (["--lengths", "8", "16", "--dim", "-4"], "--dim must be >= 1"),
])
def test_sequence_cost_refuses_bad_arguments_before_timing(argv, message, capsys):
    assert cli.main(["measure", "sequence-cost", *argv]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and message in err, err


def test_measure_explains_itself():
    with pytest.raises(SystemExit) as e:
        cli.main(["measure", "sequence-cost", "--lengths", "x"])
    assert e.value.code == 2  # argparse: not an integer
    parser = cli.build_parser(["nestpipe.measure.cli"])
    help_text = parser._subparsers._group_actions[0].choices["measure"]._subparsers._group_actions[0] \
        .choices["sequence-cost"].format_help()
    assert "--sequence-cost A,B" in help_text and "nestpipe ingest" in help_text
    assert cli.main(["measure"]) == 2  # no measurement named: the help, and a usage status
