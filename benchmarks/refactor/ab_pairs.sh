#!/usr/bin/env bash
# ab_pairs.sh OLD_TREE NEW_TREE   (trees: git worktrees of the two commits, e.g. git worktree add --detach ../old REV)
#
# A/B timing of three benchmarks, OLD vs NEW code, in PAIRS pairs (default 5); within each pair and benchmark the
# two trees run back to back, OLD first in odd pairs and NEW first in even pairs. Runs ONE process at a time.
#   trainer          benchmarks/trainer_bench.py, NestPipe side only (no --torchrec-python), --pipeline off;
#                    figure: samples/s per rank (nestpipe.samples_per_s_per_rank in its --json)
#   pipeline-gr      benchmarks/pipeline_bench.py's loopback GR workload, --pipeline off only, no cap, no TorchRec;
#   pipeline-pooled  the same for the pooled workload; both via benchmarks/refactor/pipeline_off.py (pipeline_bench.py has no
#                    mode/workload selector, the driver calls its run_modes with modes=("off",));
#                    figure: metrics.json samples_per_s (steady state, both ranks)
# Prints, per benchmark, the PAIRS NEW/OLD ratios of samples/s (> 1: NEW faster) and their median.
#
# Nothing is written into either tree's benchmarks/results: each tree's benchmarks/ folder is copied to WORK and the
# scripts run from the copy (benchmarks/record.py writes its record next to the copy), with PYTHONPATH=TREE so that
# TREE's nestpipe package is the one imported (checked). Numba's on-disk cache goes to TREE's (git-ignored)
# __pycache__ as in any run.
#
# Environment knobs:
#   PAIRS=5            pairs
#   TB_STEPS=30        trainer_bench --steps (its default; --warmup stays at its default 8)
#   PB_STEPS=20        pipeline_bench steps (its default); its 3-step warm-up launch always runs first
#   BENCHES="trainer pipeline"    which to run; PB_WORKLOADS="gr pooled"
#   WORK=/tmp/ab.XXXX  scratch (copies, shards, JSON, logs); kept at the end
#   PY=.venv/bin/python of this checkout (any python with the project installed; TREE comes first on PYTHONPATH)
# Expected wall time on the shared 2-core machine at the defaults: about 46 s (trainer) + 134 s (pipeline gr+pooled)
# per tree per pair -> ~6 min per pair, ~30 min for 5 pairs (more under load).
set -euo pipefail

if [ $# -ne 2 ]; then echo "usage: $0 OLD_TREE NEW_TREE" >&2; exit 2; fi
OLD=$(cd "$1" && pwd -P)
NEW=$(cd "$2" && pwd -P)
PAIRS=${PAIRS:-5}
TB_STEPS=${TB_STEPS:-30}
PB_STEPS=${PB_STEPS:-20}
BENCHES=${BENCHES:-trainer pipeline}
PB_WORKLOADS=${PB_WORKLOADS:-gr pooled}
PY=${PY:-$(cd "$(dirname "$0")/../.." && pwd -P)/.venv/bin/python}
HERE=$(cd "$(dirname "$0")" && pwd -P)
WORK=${WORK:-$(mktemp -d /tmp/ab.XXXXXX)}
mkdir -p "$WORK/res" "$WORK/logs"
echo "work dir: $WORK" >&2

declare -A TREE=([old]=$OLD [new]=$NEW)
for side in old new; do
    t=${TREE[$side]}
    rm -rf "$WORK/$side"; mkdir -p "$WORK/$side"
    cp -r "$t/benchmarks" "$WORK/$side/benchmarks"
    rm -rf "$WORK/$side/benchmarks/results"; mkdir -p "$WORK/$side/benchmarks/results"
    got=$(cd "$t" && PYTHONPATH="$t" "$PY" -c 'import nestpipe, os; print(os.path.realpath(nestpipe.__file__))')
    case "$got" in "$t"/nestpipe/*) ;; *) echo "ERROR: $side: nestpipe imported from $got, not $t" >&2; exit 1;; esac
    echo "$side: $t at $(git -C "$t" rev-parse --short=12 HEAD 2>/dev/null || echo '?')" \
         "($(git -C "$t" status --porcelain --untracked-files=no 2>/dev/null | wc -l) modified tracked files)" >&2
done

run_one() {  # run_one BENCH SIDE PAIR
    local bench=$1 side=$2 pair=$3 t=${TREE[$2]} t0=$SECONDS rc=0
    local log="$WORK/logs/$bench-$side-$pair.log" json="$WORK/res/$bench-$side-$pair.json"
    case $bench in
        trainer)
            (cd "$t" && PYTHONPATH="$t" "$PY" "$WORK/$side/benchmarks/trainer_bench.py" --steps "$TB_STEPS" \
                --json "$json") >"$log" 2>&1 || rc=$?;;
        pipeline)
            # shards are made on the first run of each side and reused (as pipeline_bench reuses its --out)
            (cd "$t" && PYTHONPATH="$t" "$PY" "$HERE/pipeline_off.py" "$WORK/$side/benchmarks" "$WORK/$side/pb-out" \
                "$json" --steps "$PB_STEPS" --workloads $PB_WORKLOADS) >"$log" 2>&1 || rc=$?;;
    esac
    if [ $rc -ne 0 ]; then echo "ERROR: $bench $side pair $pair failed (rc $rc); log $log:" >&2; tail -20 "$log" >&2; exit 1; fi
    echo "pair $pair $bench $side: $((SECONDS - t0)) s wall; load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
}

T0=$SECONDS
for pair in $(seq 1 "$PAIRS"); do
    if [ $((pair % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
    for bench in $BENCHES; do
        for side in $order; do run_one "$bench" "$side" "$pair"; done
    done
done
echo "total: $((SECONDS - T0)) s" >&2

"$PY" - "$WORK/res" "$PAIRS" $BENCHES <<'EOF'
import json, os, statistics, sys
res, pairs, benches = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def load(b, side, p):
    path = os.path.join(res, f"{b}-{side}-{p}.json")
    return json.load(open(path))

figs = {}  # name -> (unit, getter over (bench json))
if "trainer" in benches:
    figs["trainer"] = ("trainer", lambda d: d["nestpipe"]["samples_per_s_per_rank"], "samples/s per rank")
if "pipeline" in benches:
    d0 = load("pipeline", "old", 1)
    for w in ("gr", "pooled"):
        if w in d0:
            figs[f"pipeline-{w}"] = ("pipeline", (lambda w: lambda d: d[w]["samples_per_s"])(w), "samples/s (off)")
print(f"NEW/OLD ratio of throughput per pair (> 1: NEW faster); pairs 1..{pairs}, OLD first in odd pairs")
for name, (b, get, unit) in figs.items():
    old = [get(load(b, "old", p)) for p in range(1, pairs + 1)]
    new = [get(load(b, "new", p)) for p in range(1, pairs + 1)]
    ratios = [n / o for n, o in zip(new, old)]
    print(f"{name:16s} ratios {' '.join(f'{r:.3f}' for r in ratios)}  median {statistics.median(ratios):.3f}  "
          f"(median {unit}: OLD {statistics.median(old):.1f}, NEW {statistics.median(new):.1f}; "
          f"range of ratios {min(ratios):.3f}..{max(ratios):.3f})")
EOF
