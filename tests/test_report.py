"""docs/benchmarks.md and README's results blocks are rendered from the benchmark records: a hand edit fails here."""

from __future__ import annotations

import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import report  # noqa: E402


def test_readme_blocks_are_the_records_rendered():
    with open(report.README) as f:
        text = f.read()
    assert "<!-- BEGIN results:quality -->" in text
    assert report.render_readme(text) == text, "README.md differs from benchmarks/results: run benchmarks/report.py"


def test_docs_benchmarks_is_the_records_rendered():
    with open(report.DOCS) as f:
        text = f.read()
    assert report.render_docs() == text, "docs/benchmarks.md differs from benchmarks/results: run benchmarks/report.py"
    assert len(text.splitlines()) <= 480  # one page of latest figures (four fault-campaign tables took it past 400)


def test_check_fails_on_a_hand_edited_figure_in_either_file(tmp_path):
    readme, docs = tmp_path / "README.md", tmp_path / "benchmarks.md"
    readme.write_text(open(report.README).read())
    docs.write_text(report.render_docs())
    args = ["--check", "--readme", str(readme), "--docs", str(docs)]
    assert report.main(args) == 0
    text = docs.read_text()
    figure = re.search(r"\*\*\d+\.\d+", text) or re.search(r"\d+\.\d+", text)  # a figure of a table
    docs.write_text(text[:figure.start()] + text[figure.start():].replace(figure.group(), figure.group() + "1", 1))
    assert report.main(args) == 1
    docs.write_text(text)
    assert report.main(args) == 0
    body = readme.read_text()
    edited = re.sub(r"(<!-- BEGIN results:summary -->\n.*?)(\d+\.\d+)", r"\g<1>9.99", body, count=1, flags=re.S)
    assert edited != body
    readme.write_text(edited)
    assert report.main(args) == 1


def test_every_section_renders_without_a_record_and_names_its_command(tmp_path):
    out = report.render_docs(str(tmp_path))
    for s in report.SECTIONS:
        assert f"## {s['title']}" in out and s["command"] in out
    assert out.count("No record yet") == len(report.SECTIONS)
    assert report.render_summary(str(tmp_path)).startswith("No benchmark record yet")


def test_a_record_carries_its_provenance_and_renders(tmp_path):
    import record

    rec = record.Recorder("synth", ["--scale", "tiny"], os.path.join(ROOT, "benchmarks", "synth_bench.py"),
                          results=str(tmp_path))
    path = rec.write({"scales": [{"scale": "tiny", "log_rows": 30000, "video_rows": 5000, "seconds": 2.0,
                                  "peak_rss_mib": 100.0, "written_mib": 3.0}]})
    assert os.listdir(tmp_path) == ["synth.json"]  # written under a temporary name, then renamed
    with open(path) as f:
        data = json.load(f)
    for key in ("command", "commit", "dirty_paths", "host", "cpu", "cpus", "versions", "load_before", "load_after",
                "date", "seconds", "figures"):
        assert key in data, key
    assert data["command"] == "python benchmarks/synth_bench.py --scale tiny"
    assert {"python", "torch", "numpy"} <= set(data["versions"])
    out = report.render_docs(str(tmp_path))
    assert "| tiny | 30,000 | 5,000 | 2.0 | 15,000 | 100 | 3 |" in out and f"Record `{path}`" in out


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


def test_quality_section_shows_where_the_models_lose_and_every_valid_setting(tmp_path):
    """The eval record's per-group figures are averaged over seeds, and every valid record becomes one row of the
    settings table (with its settings), so that what was tried stays visible beside the defaults' figures."""
    group = {"samples": 10, "hstu": 0.2, "successor_counts": 0.3}
    ctr = {"all": {"samples": 5, "click_rate": 0.4, "dlrm": {"AUC": 0.6, "logloss": 0.7},
                   "factorization_machine": {"AUC": 0.7, "logloss": 0.6}}}
    base = {"benchmark": "real_quality", "command": "c", "commit": "0" * 40, "host": "h", "cpus": 2,
            "versions": {"torch": "t"}, "dataset": "d"}
    per_seed = {"0": {"breakdown_hr10": {"g": group}, "ctr_breakdown": ctr},
                "1": {"breakdown_hr10": {"g": {**group, "hstu": 0.4}}, "ctr_breakdown": ctr}}
    (tmp_path / "real_quality-d-eval.json").write_text(json.dumps(
        {**base, "split": "eval", "seeds": [0, 1], "per_seed": per_seed, "means": {}}))
    for tag, sets in (("a", ["embedding.lr=0.1"]), ("b", [])):
        (tmp_path / f"real_quality-d-valid-{tag}.json").write_text(json.dumps(
            {**base, "split": "valid", "tag": tag, "sets_dlrm": sets, "seeds": [0], "per_seed": {},
             "means": {"dlrm AUC": 0.61, "dlrm logloss": 0.62, "factorization_machine AUC": 0.63,
                       "factorization_machine logloss": 0.64}}))
    text = "\n".join(report.quality_section(str(tmp_path)))
    assert "| g | 10 | 0.3000 | 0.3000 |" in text  # hstu's 0.2 and 0.4 averaged; counts 0.3
    assert "| all | 5 | 0.400 | 0.6000 | 0.7000 | 0.7000 | 0.6000 |" in text
    rows = [x for x in text.splitlines() if x.startswith("| real_quality-d-valid-")]
    assert len(rows) == 2 and "`embedding.lr=0.1`" in rows[0] and "the defaults then" in rows[1]
    assert "0.6100, 0.6200 (vs factorization machine 0.6300, 0.6400)" in rows[0]


def test_synthetic_quality_block_renders_the_defaults_record_only(tmp_path):
    """README's synthetic block shows the record of the defaults (mean [min..max] over seeds, the per-seed verdicts);
    a record with a setting, a generator option or a tag is never shown there."""
    cmp = {"baseline_successor_counts": {"HR@10": {"verdict": "tie"}, "NDCG@10": {"verdict": "worse"}}}
    base = {"benchmark": "quality_synthetic", "command": "c", "commit": "0" * 40, "host": "h", "cpus": 2,
            "versions": {"torch": "t"}, "scale": "small", "split": "eval", "seeds": [0, 1], "epochs": 3,
            "dlrm_epochs": 1, "date": "2026-01-01T00:00:00Z", "per_seed": [{"hstu": {"comparisons": cmp}}] * 2}
    row = {"mean": 0.25, "min": 0.2, "max": 0.3}
    (tmp_path / "quality_synthetic-small-eval.json").write_text(json.dumps(
        {**base, "summary": {"hstu HR@10": row, "hstu NDCG@10": row}}))
    (tmp_path / "quality_synthetic-small-eval-x.json").write_text(json.dumps(
        {**base, "tag": "x", "synth": ["click_taste_boost=1"], "summary": {"hstu HR@10": {**row, "mean": 0.9}}}))
    text = report.render_quality_synthetic(str(tmp_path))
    assert "| hstu | 0.2500 [0.2000..0.3000] | 0.2500 [0.2000..0.3000] | tie/tie, worse/worse |" in text
    assert "0.9000" not in text
    (tmp_path / "quality_synthetic-small-eval.json").unlink()
    assert report.render_quality_synthetic(str(tmp_path)).startswith("No synthetic-data quality record yet")
