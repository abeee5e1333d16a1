"""``nestpipe serve``: the ranking service of a trained HSTU run."""

from __future__ import annotations

import argparse
import os
import signal
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a trained hstu run over HTTP, each user's prefix K/V kept resident",
        description="Rank candidates for users with a trained hstu run (RUN's latest checkpoint). POST /v1/prefill "
                    "stores a user's events and computes the K/V of their history once; POST /v1/rank appends new "
                    "events and scores candidates computing only the new tokens (cache hit) or the whole window "
                    "(miss); GET /v1/stats. Scores are nestpipe eval's: cosine of the last hidden state and the "
                    "candidate's output embedding over the temperature. Needs the 'serve' extra (FastAPI, uvicorn).")
    p.add_argument("--run", required=True, help="a `nestpipe train` run directory of the hstu model")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8080, help="port to bind")
    p.add_argument("--cache-mb", type=float, default=1024.0,
                   help="bytes of prefix K/V kept resident, least recently used evicted first")
    p.add_argument("--spill-dir", default=None,
                   help="a second tier on local disk for the prefixes evicted from --cache-mb: the user's next "
                   "request reads the prefix back (a hit) instead of recomputing it (per replica: DIR/replica-I)")
    p.add_argument("--spill-mb", type=float, default=4096.0, help="bytes of the --spill-dir tier (per replica)")
    p.add_argument("--history", default=None,
                   help="SQLite file keeping every user's events across restarts (default: RUN/serving/history.sqlite;"
                   " 'none': in memory only)")
    p.add_argument("--replicas", type=int, default=1,
                   help="ranking processes behind one front on --port that routes each user to one of them (jump "
                   "consistent hashing), so a user's requests meet the cache that holds its prefix; they share one "
                   "memory-mapped copy of the model, each has its own --cache-mb and history file, and one that "
                   "exits is restarted")
    p.add_argument("--shards", default=None, help="where the run's shards are now, if they moved")
    p.add_argument("--max-in-flight", type=int, default=64,
                   help="ranking requests in service at once per replica; the next one is refused at once with 503 "
                        "and Retry-After (an overloaded server answers what it admits in time)")
    p.add_argument("--shared", default=None, help=argparse.SUPPRESS)  # a replica: the model files of save_shared
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    try:
        import uvicorn  # the optional 'serve' extra: imported only by this command
    except ImportError:
        raise RuntimeError("nestpipe serve needs FastAPI and uvicorn: pip install 'nestpipe[serve]'")
    from nestpipe.serving.ranker import Ranker  # torch and the model: only when serving
    from nestpipe.serving.server import create_app  # FastAPI: only when serving

    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    history = args.history or os.path.join(args.run, "serving", "history.sqlite")
    # uvicorn shuts down gracefully on SIGTERM and then raises the signal again for the previous handler: this
    # one makes that a normal exit (status 0) instead of death by the signal
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.replicas > 1:
        from nestpipe.serving.front import Replicas, create_front_app  # FastAPI: only when serving
        from nestpipe.serving.ranker import save_shared  # torch and the model: only when serving

        shared = save_shared(args.run, args.shards)
        hist_dir = os.path.dirname(os.path.abspath(history)) if history != "none" else os.path.join(
            args.run, "serving")
        replicas = Replicas(args.run, shared, args.replicas, args.cache_mb, hist_dir, args.spill_dir, args.spill_mb,
                            args.max_in_flight)
        print(f"serving {args.run} (hstu) with {args.replicas} replicas on http://{args.host}:{args.port}",
              flush=True)
        try:
            uvicorn.run(create_front_app(replicas, args.max_in_flight), host=args.host, port=args.port,
                        log_level="warning")
        finally:
            replicas.stop()
        print("stopped", flush=True)
        return 0
    hist = None if history == "none" else history
    if args.shared:
        ranker = Ranker.from_shared(args.run, args.shared, cache_mb=args.cache_mb, history=hist,
                                    spill_dir=args.spill_dir, spill_mb=args.spill_mb)
    else:
        ranker = Ranker.from_run(args.run, cache_mb=args.cache_mb, shards=args.shards, history=hist,
                                 spill_dir=args.spill_dir, spill_mb=args.spill_mb)
    print(f"serving {args.run} (hstu, window {ranker.window} events) on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(create_app(ranker, args.max_in_flight), host=args.host, port=args.port, log_level="warning")
    print("stopped", flush=True)
    return 0
