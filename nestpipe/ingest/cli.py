"""``nestpipe ingest`` and ``nestpipe shard-report``."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys

from nestpipe.ingest.config import BALANCE_MODES, CLUSTERING_METHODS, ENGINES, FORMATS, TASKS, IngestConfig
from nestpipe.ingest.engines import make_executor
from nestpipe.ingest.executor import usable_cores
from nestpipe.utils.options import DefaultsHelpFormatter  # standard library only: the pool starts before Polars


def add_parser(sub) -> None:
    c = sub.add_parser(
        "check-raw",
        help="say which dataset a directory holds (KuaiRand, MovieLens, Amazon, atomic files) and check its files",
        description="Name the format and release of the raw data in DIR (what `nestpipe ingest --format auto` would "
                    "read) and list its files by role. KuaiRand (27K, 1K or Pure): every header is checked against "
                    "the published columns. Other formats: the files each role is read from (docs/datasets.md).",
    )
    c.add_argument("dir", metavar="DIR", help="directory with the raw dataset's files")
    c.add_argument("--format", choices=["auto", "kuairand", "movielens", "amazon", "atomic"], default="auto",
                   help="format to expect (default: detected from the file names)")
    c.add_argument("--release", choices=["27k", "1k", "pure"], default=None,
                   help="KuaiRand release to expect (default: detected from the file names)")
    c.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    c.set_defaults(func=run_check_raw)

    p = sub.add_parser(
        "ingest",
        help="raw logs (KuaiRand, MovieLens, Amazon, atomic files) -> clustered WebDataset batch shards + manifest.json",
        description=(
            "Read raw KuaiRand-format CSVs (or the same tables as Parquet; other public formats are converted into "
            "them first: --format) with bounded memory (chunked Polars parsing, Arrow IPC spills "
            "partitioned by video then by user), build samples (gr: chronological windows per user with a "
            "leave-one-out eval set; ctr: one per interaction with user/video features, labels and recent "
            "history), cut them into batches of exactly B samples, partition each batch into N micro-batches by "
            "key-centric clustering with its unique keys per table, and write WebDataset shards with a manifest. "
            "Malformed rows go to OUT/rejects.csv with file, line (Parquet: row), reason and raw text. An interrupted run "
            "resumes: rerun the same command."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--raw", required=True,
                   help="directory holding the raw dataset (see --format); KuaiRand tables: the published CSV files, "
                        "or any table as Parquet "
                        "under the same name without .csv (NAME.parquet, or a directory NAME/ or NAME.parquet/ of "
                        "*.parquet files); a path or an fsspec URL (file://, s3://, gs://, ...: the protocol's "
                        "package installed)")
    p.add_argument("--out", required=True,
                   help="output directory for shards, manifest.json and rejects.csv: a path, or an fsspec URL (each "
                        "file uploaded whole, manifest.json last: readers and --resume take only the shards it lists)")
    p.add_argument("--work-dir", default=None,
                   help="with a URL --out: the working directory (spills, sample arrays, each unit's marker): a path "
                        "every worker sees (shards are staged there before upload) or an fsspec URL such as "
                        "s3://bucket/scratch (no shared filesystem needed: each unit uploads its files, then its "
                        "marker, and readers download what they need); removed at the end unless --keep-work "
                        "(default: a directory named after --out in the system's temporary directory)")
    p.add_argument("--task", choices=TASKS, default="gr",
                   help="gr: generative-recommendation windows; ctr: one sample per interaction")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per batch (per worker), B (default: 512, or the largest power of two below it that "
                   "still makes 8 training batches where the data is smaller; the choice is printed and recorded)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per batch, N (default: 8, at most B)")
    p.add_argument("--max-seq-len", type=int, default=256, help="gr: maximum window length L")
    p.add_argument("--history-len", type=int, default=20, help="ctr: recent-history window length")
    p.add_argument("--max-reject-fraction", type=float, default=0.001,
                   help="fail when more than this fraction of input rows is malformed")
    p.add_argument("--workers", type=int, default=usable_cores(),
                   help="worker processes, each parsing one chunk or building one partition or shard at a time "
                        "(memory grows with it); the output does not depend on it. The default is the number of "
                        "usable cores")
    p.add_argument("--force", action="store_true", help="replace an existing output directory of another run")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample order and the clustering")
    p.add_argument("--partitions", type=int, default=None,
                   help="hash partitions of the spill (default: one per 128 MB of input, at least 4)")
    p.add_argument("--chunk-mb", type=float, default=64, help="parse chunk size in MB (bounds memory)")
    p.add_argument("--batches-per-shard", type=int, default=None, help="default: about 128 MB per shard")
    p.add_argument("--clustering", default="default", choices=CLUSTERING_METHODS,
                   help="micro-batch clustering: default (= minhash: rarity-weighted MinHash order, a few ms per "
                   "batch), random (no clustering), kmeans (spherical k-means + refinement, tens of ms per batch, "
                   "a little better); compare them with `nestpipe cluster-report`")
    p.add_argument("--balance", choices=BALANCE_MODES, default=None,
                   help="gr: tokens (the default) composes every training batch, and the micro-batches of each, so "
                   "that their attention cost a n^2 + b n over the sequences is nearly equal (ranks then wait less "
                   "for each other at every step); batches: the batches only (the micro-batches as the clustering "
                   "made them: fewer rows exchanged); off: batches in the seeded sample order. ctr: always off")
    p.add_argument("--sequence-cost", default=None, metavar="A,B",
                   help="gr: the per-sequence cost model c(n) = A n^2 + B n in seconds the balancing uses (default: "
                   "the HSTU layer's on a reference machine; `nestpipe measure sequence-cost` fits this machine's; "
                   "only B / A matters)")
    p.add_argument("--dim", type=int, default=64, help="default embedding dim recorded in the manifest")
    p.add_argument("--ctr-eval-days", type=int, default=3, help="ctr: the last D dates form the eval set")
    p.add_argument("--validation", action="store_true",
                   help="also write a 'valid' split carved from the training data, for choosing settings without "
                   "reading eval (gr: every user's second-to-last interaction held out; ctr: the last "
                   "--ctr-valid-days dates before the eval dates); evaluate on it with `nestpipe eval --split valid`")
    p.add_argument("--ctr-valid-days", type=int, default=1,
                   help="ctr with --validation: the last D dates before the eval dates form the valid set (default 1; "
                   "more where one date holds too few impressions to choose settings with)")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="the raw data's format: kuairand (the KuaiRand releases), movielens (100K u.data; 1M/10M "
                   "ratings.dat; 20M/25M/latest ratings.csv), amazon (a ratings CSV user,item,rating,timestamp, or "
                   "review JSON lines, plain or .gz), atomic (NAME.inter with NAME.item / NAME.user); auto detects it "
                   "from the file names (`nestpipe check-raw DIR` says what it sees). A format other than KuaiRand is "
                   "first converted into the KuaiRand tables (OUT/_work/s0; docs/datasets.md says what each column "
                   "becomes)")
    p.add_argument("--positive-rating", type=float, default=4.0,
                   help="rated data (MovieLens, Amazon, atomic files with a rating): a rating >= this is a click, "
                   "the ctr label and the gr action's click bit (>= it + 1 also sets like, < it - 1 sets hate)")
    p.add_argument("--release", choices=["27k", "1k", "pure"], default=None,
                   help="KuaiRand: the release to read (default: detect from file names)")
    p.add_argument("--keep-work", action="store_true",
                   help="keep the intermediate spill files in OUT/_work (with a URL --out: in --work-dir)")
    p.add_argument("--engine", choices=ENGINES, default="local",
                   help="local: a process pool on this host; dask: every unit a Dask task (a LocalCluster of "
                   "--workers processes, or the cluster of --scheduler); the shards are the same bytes either way")
    p.add_argument("--scheduler", default=None, metavar="tcp://HOST:8786",
                   help="dask: a running scheduler to use instead of a LocalCluster (--raw, --out and --work-dir on "
                   "a filesystem every worker sees, or fsspec URLs)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_ingest)

    r = sub.add_parser(
        "shard-report",
        help="summarise and verify a shard directory",
        description="Print the manifest summary of an ingest output and verify every shard's sha256.",
    )
    r.add_argument("shards", help="ingest output directory (holding manifest.json)")
    r.add_argument("--no-verify", action="store_true", help="skip the sha256 check")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.set_defaults(func=run_report)


def run_ingest(args) -> int:
    cfg = IngestConfig(
        raw=args.raw, out=args.out, task=args.task, batch_size=args.batch_size, micro_batches=args.micro_batches,
        max_seq_len=args.max_seq_len, history_len=args.history_len, max_reject_fraction=args.max_reject_fraction,
        workers=args.workers, force=args.force, seed=args.seed, partitions=args.partitions, chunk_mb=args.chunk_mb,
        batches_per_shard=args.batches_per_shard, clustering=args.clustering, dim=args.dim,
        ctr_eval_days=args.ctr_eval_days, validation=args.validation,
        ctr_valid_days=args.ctr_valid_days, release=args.release, keep_work=args.keep_work, progress=not args.quiet,
        balance=args.balance, sequence_cost=args.sequence_cost, engine=args.engine, scheduler=args.scheduler,
        work_dir=args.work_dir, format=args.format, positive_rating=args.positive_rating,
    )
    cfg.validate()
    # Start-up time: the pool starts before this process imports the stages (Polars, NumPy), so the spawned workers
    # import them (the preload) at the same time instead of after it.
    with make_executor(cfg, preload=("nestpipe.ingest.stages",)) as ex:
        from nestpipe.ingest.stages import ingest  # start-up time: after the pool started (see above)

        try:
            m = ingest(cfg, executor=ex)
        except OSError as e:
            text = str(e)
            if e.filename or not (e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) or "errno 28" in text
                                  or "Error writing" in text):
                raise  # it names its path, or it is not a write error
            # Arrow's write errors name no file (a full disk: "Error writing bytes to file ... errno 28")
            raise OSError(f"{e} (writing under {args.out}" + (f" and {args.work_dir}" if args.work_dir else "")
                          + "; rerun the same command to resume once it can be written)") from e
    t = m.totals()
    print(
        f"{args.out}: task {m.task}, B={m.batch_size}, N={m.micro_batches}: "
        f"train {t['train']['batches']} batches in {t['train']['shards']} shards, "
        + (f"valid {t['valid']['batches']} batches, " if "valid" in t else "")
        + f"eval {t['eval']['batches']} batches; {m.rejected_rows} rejected rows; "
        f"{m.stats.get('seconds', 0):.1f} s"
    )
    return 0


def run_report(args) -> int:
    from nestpipe.ingest.report import format_report, shard_report  # start-up time: Polars, NumPy

    rep = shard_report(args.shards, verify=not args.no_verify)
    if args.json:
        json.dump(rep, sys.stdout, indent=1)
        print()
    else:
        print(format_report(rep))
    return 0 if rep["ok"] else 1


def run_check_raw(args) -> int:
    # start-up time: Polars only for the command that runs
    from nestpipe.datasets import kuairand
    from nestpipe.ingest import formats
    from nestpipe.utils import storage

    source = formats.detect(args.dir, args.format)
    if source is not None:
        print(f"{source.root}: {source.format} data, release {source.variant} (`nestpipe ingest` converts it into "
              f"the KuaiRand tables first; ids {'kept as published' if source.numeric_ids else 'mapped to 0..n-1'})")
        for role, p in source.files():
            print(f"  {role}: {os.path.basename(p)}  ({storage.size(p) / 2**20:.1f} MiB)")
        return 0
    found = kuairand.discover(args.dir, release=args.release)
    print(f"{found.root}: KuaiRand {found.release} release, all columns as published (CSV headers, Parquet schemas)")
    for kind, paths in found.files.items():
        print(f"  {kind}: {len(paths)} file(s)")
        for p in paths:
            print(f"    {os.path.basename(p)}  ({storage.size(p) / 2**20:.1f} MiB)")
    return 0
