#!/usr/bin/env bash
# state_digests.sh TREE OUTDIR   (a refactor that changes no behaviour keeps every digest; diff two OUTDIRs' digests.txt)
#
# Runs a fixed, small NestPipe pipeline with TREE's code (synth -> ingest ctr + gr -> train dlrm and hstu on 2 ranks,
# --pipeline off and nested -> safetensors export) under OUTDIR, then prints sha256 digests of the raw synthetic
# files, the shard files and the exported files (also saved to OUTDIR/digests.txt). Logs go to OUTDIR/logs/.
#
# Normalisations (everything else is digested byte for byte):
#   * shards */manifest.json: stats.seconds and stats.stage_seconds are wall-clock timings of the ingest run; they
#     are removed before digesting (digest label "manifest.json[-timings]"). Every shard tar is digested on its own.
#   * export */*.config.json: holds the run's absolute paths (config.out, config.shards, under OUTDIR); the OUTDIR
#     prefix is replaced by the literal string OUTDIR before digesting (label "...config.json[OUTDIR]").
set -euo pipefail

if [ $# -ne 2 ]; then echo "usage: $0 TREE OUTDIR" >&2; exit 2; fi
TREE=$(cd "$1" && pwd -P)
mkdir -p "$2"
OUT=$(cd "$2" && pwd -P)
if [ -n "$(ls -A "$OUT")" ]; then echo "OUTDIR $OUT is not empty" >&2; exit 2; fi
PY=${PY:-$(cd "$(dirname "$0")/../.." && pwd -P)/.venv/bin/python}
SEED=0
STEPS_DLRM=6        # ctr: 53 train batches of 512 -> 26 per rank; 6 steps per rank
STEPS_HSTU=4        # gr: 9 train batches of 64 -> 4 per rank

export PYTHONPATH="$TREE"
export OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 PYTHONHASHSEED=0
cd "$TREE"
mkdir -p "$OUT/logs" "$OUT/export"

# The package must come from TREE (an editable install may point at another checkout).
got=$("$PY" -c 'import nestpipe, os; print(os.path.realpath(nestpipe.__file__))')
echo "nestpipe imported from: $got" >&2
case "$got" in "$TREE"/nestpipe/*) ;; *) echo "ERROR: nestpipe not imported from $TREE" >&2; exit 1;; esac
echo "tree commit: $(git -C "$TREE" rev-parse HEAD 2>/dev/null || echo '?') (dirty files: $(git -C "$TREE" status --porcelain 2>/dev/null | wc -l))" >&2

np() { local log=$1; shift; echo "+ nestpipe $*" >&2; "$PY" -m nestpipe "$@" >"$OUT/logs/$log.log" 2>&1 || { tail -30 "$OUT/logs/$log.log" >&2; exit 1; }; }

t0=$SECONDS
np synth     synth  --out "$OUT/raw" --scale tiny --seed $SEED --quiet
np ingest-ctr ingest --raw "$OUT/raw" --out "$OUT/shards-ctr" --task ctr --seed $SEED --workers 1 --quiet \
    --batch-size 512 --micro-batches 2 --batches-per-shard 16
np ingest-gr  ingest --raw "$OUT/raw" --out "$OUT/shards-gr" --task gr --seed $SEED --workers 1 --quiet \
    --batch-size 64 --micro-batches 4 --max-seq-len 64 --batches-per-shard 8
for pipe in off nested; do
    np train-dlrm-$pipe train --shards "$OUT/shards-ctr" --out "$OUT/runs/dlrm-$pipe" --model dlrm --nproc-per-node 2 \
        --pipeline $pipe --steps $STEPS_DLRM --seed $SEED --no-progress
    np export-dlrm-$pipe export --run "$OUT/runs/dlrm-$pipe" --out "$OUT/export/dlrm-$pipe.safetensors"
    np train-hstu-$pipe train --shards "$OUT/shards-gr" --out "$OUT/runs/hstu-$pipe" --model hstu --nproc-per-node 2 \
        --pipeline $pipe --steps $STEPS_HSTU --seed $SEED --no-progress
    np export-hstu-$pipe export --run "$OUT/runs/hstu-$pipe" --out "$OUT/export/hstu-$pipe.safetensors"
done
# dlrm --pipeline off over the shards' clustered micro-batches: the same micro-batching as nested, so its export must
# equal dlrm-nested's bit for bit (plain off trains each batch whole: pipe.micro_batching=auto, a different sum order)
np train-dlrm-off-clustered train --shards "$OUT/shards-ctr" --out "$OUT/runs/dlrm-off-clustered" --model dlrm \
    --nproc-per-node 2 --pipeline off --steps $STEPS_DLRM --seed $SEED --no-progress --set 'pipe.micro_batching="clustered"'
np export-dlrm-off-clustered export --run "$OUT/runs/dlrm-off-clustered" --out "$OUT/export/dlrm-off-clustered.safetensors"
echo "pipeline done in $((SECONDS - t0)) s" >&2

# ---- digests ----
{
    cd "$OUT"
    for f in $(find raw -type f | LC_ALL=C sort); do sha256sum "$f"; done
    for d in shards-ctr shards-gr; do
        for f in $(find "$d" -type f ! -name manifest.json | LC_ALL=C sort); do sha256sum "$f"; done
        h=$("$PY" - "$d/manifest.json" <<'EOF'
import hashlib, json, sys
m = json.load(open(sys.argv[1]))
for k in ("seconds", "stage_seconds"):
    m.get("stats", {}).pop(k, None)
print(hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest())
EOF
)
        echo "$h  $d/manifest.json[-timings]"
    done
    for f in $(find export -type f | LC_ALL=C sort); do
        case "$f" in
            *.config.json) echo "$(sed "s|$OUT|OUTDIR|g" "$f" | sha256sum | cut -d' ' -f1)  $f[OUTDIR]";;
            *) sha256sum "$f";;
        esac
    done
} | tee "$OUT/digests.txt"
