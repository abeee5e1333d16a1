"""A readable summary of an ingest output, with every shard verified against the manifest."""

from __future__ import annotations

import os
from typing import Any, Dict

import numpy as np

from nestpipe.datasets import shards as shard_format


def shard_report(directory: str, verify: bool = True) -> Dict[str, Any]:
    m = shard_format.load_manifest(directory)
    errors = []
    sets: Dict[str, Any] = {}
    for split, entries in m.sets.items():
        tokens = 0
        unique = {t: 0 for t in m.tables}
        batches = samples = 0
        for e in entries:
            if verify:
                try:
                    shard_format.verify_shard(directory, e)
                except shard_format.ShardError as err:
                    errors.append(str(err))
                    continue
            for b in shard_format.iter_shard(os.path.join(directory, e.path)):
                batches += 1
                samples += len(b["mb"])
                first = next(iter(m.tables))
                tokens += int(b[f"{first}.values"].size)
                for t in m.tables:
                    unique[t] += int(b[f"{t}.unique"].size)
        sets[split] = {
            **m.totals()[split],
            "batches_read": batches,
            "mean_values_per_sample": tokens / max(1, samples),
            "mean_unique_per_batch": {t: u / max(1, batches) for t, u in unique.items()},
        }
    return {
        "directory": directory, "task": m.task, "batch_size": m.batch_size, "micro_batches": m.micro_batches,
        "tables": {k: vars(v) for k, v in m.tables.items()}, "sets": sets, "rejected_rows": m.rejected_rows,
        "dropped_samples": m.dropped_samples, "stats": {k: v for k, v in m.stats.items() if k != "fingerprint"},
        "errors": errors, "ok": not errors, "verified": verify,
    }


def format_report(rep: Dict[str, Any]) -> str:
    lines = [f"{rep['directory']}: task {rep['task']}, batch {rep['batch_size']}, {rep['micro_batches']} micro-batches"]
    lines.append("tables:")
    for name, t in rep["tables"].items():
        lines.append(f"  {name:<20} vocab {t['vocab']:>12,}  dim {t['dim']:>4}  {t['kind']}")
    for split, s in rep["sets"].items():
        lines.append(
            f"{split}: {s['shards']} shards, {s['batches']} batches, {s['samples']:,} samples, "
            f"{s['bytes'] / 2**20:.1f} MiB; {s['mean_values_per_sample']:.1f} values/sample in the first table"
        )
        uniq = ", ".join(f"{t} {u:.0f}" for t, u in list(s["mean_unique_per_batch"].items())[:6])
        lines.append(f"  unique keys per batch: {uniq}")
    lines.append(f"rejected rows: {rep['rejected_rows']}; training samples dropped (the incomplete last batch; the "
                 f"other splits keep theirs as a smaller last batch): {rep['dropped_samples'].get('train', 0)}")
    st = rep["stats"]
    if "seconds" in st:
        lines.append(f"ingest: {st.get('input_rows', 0):,} input rows in {st['seconds']:.1f} s")
    lines.append("shards verified: " + ("OK" if rep["ok"] and rep["verified"] else
                                        "skipped" if not rep["verified"] else "FAILED"))
    lines += [f"  {e}" for e in rep["errors"]]
    return "\n".join(lines)
