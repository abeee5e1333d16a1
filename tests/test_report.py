"""README's results blocks are rendered from the benchmark records: a hand edit inside a block fails here."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import report  # noqa: E402


def test_readme_blocks_are_the_records_rendered():
    with open(report.README) as f:
        text = f.read()
    assert "<!-- BEGIN results:quality -->" in text
    assert report.render_readme(text) == text, "README.md differs from benchmarks/results: run benchmarks/report.py"


def test_a_hand_edit_inside_a_block_is_caught_and_outside_is_not():
    with open(report.README) as f:
        text = f.read()
    begin = text.index("<!-- BEGIN results:quality -->")
    end = text.index("<!-- END results:quality -->")
    edited = text[:begin] + text[begin:end].replace("|", "| 0.9999 |", 1) + text[end:]
    if edited == text:  # a block without a table: change a word instead
        edited = text[:end] + "an edited line\n" + text[end:]
    assert report.render_readme(edited) != edited
    outside = text + "\nprose after the blocks\n"
    assert report.render_readme(outside) == outside


def _record(split, tag, hstu, counting, verdict):
    ps = {"model": {"HR@10": [hstu - 0.02, hstu + 0.02], "NDCG@10": [0.05, 0.07]},
          "baseline_successor_counts": {"HR@10": [counting - 0.02, counting + 0.02], "NDCG@10": [0.05, 0.07]},
          "baseline_most_popular": {"HR@10": [0.02, 0.04], "NDCG@10": [0.01, 0.02]}}
    comp = {"baseline_successor_counts": {"HR@10": {"verdict": verdict}, "NDCG@10": {"verdict": "tie"}}}
    return {"dataset": "ml-100k", "split": split, "tag": tag, "seeds": [0], "command": "python benchmarks/x.py",
            "commit": "0123456789abcdef", "host": "h", "cpus": 2, "versions": {"torch": "2.13.0"},
            "means": {"hstu HR@10": hstu, "hstu NDCG@10": 0.06, "successor_counts HR@10": counting,
                      "successor_counts NDCG@10": 0.06, "most_popular HR@10": 0.03, "most_popular NDCG@10": 0.015},
            "per_seed": {"0": {"hstu": {"intervals": ps, "comparisons": comp}}}}


def test_quality_block_prefers_the_eval_split_and_the_untagged_record(tmp_path):
    for name, rec in (("real_quality-ml-100k-valid.json", _record("valid", "", 0.2, 0.1, "better")),
                      ("real_quality-ml-100k-eval-x.json", _record("eval", "x-", 0.3, 0.1, "better")),
                      ("real_quality-ml-100k-eval.json", _record("eval", "", 0.1177, 0.1188, "tie"))):
        with open(tmp_path / name, "w") as f:
            json.dump(rec, f)
    out = report.render_quality(str(tmp_path))
    assert "eval split" in out and "| hstu | 0.1177 [0.0977, 0.1377]" in out and "| tie, tie |" in out
    assert "| successor counts | 0.1188 [0.0988, 0.1388]" in out
    assert "0.3000" not in out and "0.2000" not in out
    assert report.render_quality(str(tmp_path / "none")).startswith("No real-data quality record yet")


def test_quality_block_prefers_the_defaults_among_records_of_one_split(tmp_path):
    tuned = _record("valid", "bias-", 0.4444, 0.1, "better")
    tuned["sets"] = ["hstu.relative_bias=true"]
    for name, rec in (("real_quality-ml-100k-valid-bias.json", tuned),
                      ("real_quality-ml-100k-valid-def.json", _record("valid", "def-", 0.1205, 0.1188, "tie"))):
        with open(tmp_path / name, "w") as f:
            json.dump(rec, f)
    out = report.render_quality(str(tmp_path))
    assert "| hstu | 0.1205" in out and "0.4444" not in out
