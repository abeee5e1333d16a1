"""Options of one ingest run."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Tuple

# The ``--task`` names (the task objects are ``nestpipe.ingest.stages.TASKS``; named here so the command line
# lists them without importing Polars).
TASKS = ("gr", "ctr")
# The ``--clustering`` names (``nestpipe.clustering.method_names()``, named here for the same reason; a test keeps
# the two equal): checked before any work starts.
CLUSTERING_METHODS = ("default", "random", "minhash", "kmeans")
DEFAULT_BATCH_SIZE, DEFAULT_MICRO_BATCHES = 512, 8
MIN_TRAIN_BATCHES = 8  # left to the defaults, batches shrink until the training split fills this many
# ``--balance``: tokens (batches and micro-batches), batches (the micro-batches left as the clustering made them), off
BALANCE_MODES = ("tokens", "batches", "off")
WINDOW_BATCHES, BATCH_TOLERANCE, MICRO_TOLERANCE = 64, 0.005, 0.05  # nestpipe.ingest.balance's (fingerprinted)

# Options that do not change the output bytes (excluded from the run's fingerprint).
NON_SEMANTIC = ("raw", "out", "workers", "force", "progress", "keep_work", "engine", "scheduler", "work_dir")
ENGINES = ("local", "dask")
# ``--format`` (``nestpipe.ingest.formats.FORMATS``, named here so that the command line lists them without Polars)
FORMATS = ("auto", "kuairand", "movielens", "amazon", "atomic")


@dataclasses.dataclass
class IngestConfig:
    """``nestpipe ingest`` options. Output depends only on the inputs and the semantic options, never on
    ``workers``."""

    raw: str
    out: str
    task: str = "gr"
    # None: DEFAULT_BATCH_SIZE / DEFAULT_MICRO_BATCHES, or smaller where the training split cannot fill
    # MIN_TRAIN_BATCHES batches of them (``fit_batches``; the choice is printed and recorded in the manifest)
    batch_size: Optional[int] = None
    micro_batches: Optional[int] = None
    max_seq_len: int = 256  # gr: window length; ctr: recent-history window length is ``history_len``
    history_len: int = 20
    max_reject_fraction: float = 0.001
    workers: int = 1
    force: bool = False
    seed: int = 0
    partitions: Optional[int] = None  # hash partitions for the spill; default from the input size
    chunk_mb: float = 64  # parse chunk size; memory per worker is a small multiple of it
    batches_per_shard: Optional[int] = None  # default: about 128 MB per shard
    clustering: str = "default"
    dim: int = 64
    ctr_eval_days: int = 3
    validation: bool = False  # a "valid" split carved from the training data (see ``splits``)
    ctr_valid_days: int = 1  # ctr with ``validation``: the valid split's dates, the last ones before the eval dates
    release: Optional[str] = None
    balance: Optional[str] = None  # gr: "tokens" (the default), "batches" or "off" (BALANCE_MODES); ctr: always off
    sequence_cost: Optional[str] = None  # "A,B": c(n) = A n^2 + B n seconds (default: balance.DEFAULT_COST)
    progress: bool = True
    keep_work: bool = False
    engine: str = "local"  # local: this host's process pool; dask: Dask distributed (nestpipe.ingest.dask_engine)
    scheduler: Optional[str] = None  # dask: tcp://HOST:8786 of a running scheduler (default: a LocalCluster)
    work_dir: Optional[str] = None  # a URL --out's working directory (spills, samples): a path or a URL
    format: str = "auto"  # the raw data's format (FORMATS); anything but KuaiRand is converted first
    positive_rating: float = 4.0  # rated data: a rating at or above it is a click (the positive label)

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {TASKS}, got {self.task!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.micro_batches is not None and not 1 <= self.micro_batches <= (self.batch_size or DEFAULT_BATCH_SIZE):
            raise ValueError(f"--micro-batches must be between 1 and --batch-size "
                             f"({self.batch_size or DEFAULT_BATCH_SIZE}), got {self.micro_batches}")
        if self.ctr_eval_days < 1:
            raise ValueError(f"--ctr-eval-days must be >= 1, got {self.ctr_eval_days}")
        if self.ctr_valid_days < 1:
            raise ValueError(f"--ctr-valid-days must be >= 1, got {self.ctr_valid_days}")
        if self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len must be >= 2, got {self.max_seq_len}")
        if not 0.0 <= self.max_reject_fraction <= 1.0:
            raise ValueError(f"--max-reject-fraction must be in [0, 1], got {self.max_reject_fraction}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.partitions is not None and self.partitions < 1:
            raise ValueError(f"--partitions must be >= 1, got {self.partitions}")
        if self.clustering not in CLUSTERING_METHODS:
            raise ValueError(f"--clustering must be one of {', '.join(CLUSTERING_METHODS)}, got {self.clustering!r}")
        if self.batches_per_shard is not None and self.batches_per_shard < 1:
            raise ValueError(f"--batches-per-shard must be >= 1, got {self.batches_per_shard}")
        if self.balance is not None and self.balance not in BALANCE_MODES:
            raise ValueError(f"--balance must be one of {', '.join(BALANCE_MODES)}, got {self.balance!r}")
        if self.task != "gr" and self.balance in ("tokens", "batches"):
            raise ValueError(f"--balance {self.balance} is for gr samples (sequences of different lengths); ctr samples all "
                             "cost the same: leave --balance out")
        if self.work_dir is not None and "://" not in self.out:
            raise ValueError(f"--work-dir is for a URL --out (a local --out keeps its work in {self.out}/_work)")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.scheduler and self.engine != "dask":
            raise ValueError("--scheduler is the address of a Dask scheduler: it needs --engine dask")
        if self.sequence_cost is not None:
            self.cost()  # parse errors now, before any work
        if self.format not in FORMATS:
            raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if not math.isfinite(self.positive_rating):
            raise ValueError(f"--positive-rating must be a number, got {self.positive_rating!r}")

    def fit_batches(self, train_samples: int) -> Tuple[int, int, str]:
        """(batch size B, micro-batches N, why) for a training split of ``train_samples``. A size the user gave is
        kept. Left to the defaults, B is DEFAULT_BATCH_SIZE where the split fills MIN_TRAIN_BATCHES batches of it,
        else the largest power of two that does (at least 1), and N is DEFAULT_MICRO_BATCHES, at most B; "why" is
        empty when nothing was shrunk."""
        B = self.batch_size or DEFAULT_BATCH_SIZE
        if self.batch_size is None and train_samples < MIN_TRAIN_BATCHES * DEFAULT_BATCH_SIZE:
            floor = self.micro_batches or 1  # never below the micro-batches the user asked for
            B = max(floor, 1 << max(0, (train_samples // MIN_TRAIN_BATCHES).bit_length() - 1))
            B = min(B, DEFAULT_BATCH_SIZE)
        N = self.micro_batches or min(DEFAULT_MICRO_BATCHES, B)
        why = ""
        if B != (self.batch_size or DEFAULT_BATCH_SIZE) or N != (self.micro_batches or DEFAULT_MICRO_BATCHES):
            why = (f"the {train_samples} training samples cannot fill {MIN_TRAIN_BATCHES} batches of "
                   f"{DEFAULT_BATCH_SIZE}: batch size {B}, {N} micro-batches (--batch-size and --micro-batches "
                   "choose them)")
        return B, N, why

    def balanced(self) -> bool:
        """Cost-balanced batches: gr unless ``--balance off``."""
        return self.task == "gr" and self.balance != "off"

    def cost(self):
        from nestpipe.datasets.sequence_cost import DEFAULT_COST, SequenceCost  # NumPy: the CLI parses without it

        return SequenceCost.parse(self.sequence_cost) if self.sequence_cost else DEFAULT_COST

    def splits(self) -> Tuple[str, ...]:
        """The output splits. ``validation``: ``valid`` is carved from what would be training data, for choosing
        settings without reading ``eval`` (gr: every user's second-to-last interaction is held out as ``eval``
        holds out the last, training windows end before it; ctr: the last ``ctr_valid_days`` dates before the eval
        dates)."""
        return ("train", "valid", "eval") if self.validation else ("train", "eval")

    def semantic(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in NON_SEMANTIC:
            d.pop(k)
        if self.batch_size is None or self.micro_batches is None:  # sized to the data (fit_batches)
            d["sized_to_data"] = [k for k in ("batch_size", "micro_batches") if d[k] is None]
            d["batch_size"] = d["batch_size"] or DEFAULT_BATCH_SIZE
            d["micro_batches"] = d["micro_batches"] or DEFAULT_MICRO_BATCHES
        if not d["validation"]:  # outputs written before the option existed keep their fingerprint
            d.pop("validation")
        if self.task != "ctr" or not self.validation or self.ctr_valid_days == 1:  # the same: the same fingerprint
            d.pop("ctr_valid_days")
        d.pop("balance"), d.pop("sequence_cost")
        # the source format is fingerprinted as the data it names (``ingest``): KuaiRand outputs keep their fingerprint
        d.pop("format"), d.pop("positive_rating")
        if self.balanced():  # resolved: the method and the cost model the batches were balanced with
            d["balance"] = {"method": self.balance or "tokens", **self.cost().to_dict(),
                            "window_batches": WINDOW_BATCHES, "batch_tolerance": BATCH_TOLERANCE,
                            "tolerance_of": "max_over_mean"}  # both tolerances bound the costliest (ingest.balance)
            if d["balance"]["method"] == "tokens":
                d["balance"]["micro_tolerance"] = MICRO_TOLERANCE
                d["balance"]["micro_splits"] = "train"  # valid and eval micro-batches as the clustering made them
                if self.clustering != "random":  # exact-gain swaps after the balancing (ingest.common)
                    d["balance"]["micro_refine"] = "exact_swaps"
        return d
