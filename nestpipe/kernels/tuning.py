"""Per-host kernel choice by measurement: among paths whose results are bitwise equal, the fastest on this host.

Why: the fixed rule (:mod:`.select`) picks by device kind and instruction set, but the speed of a path differs
between hosts in ways no such rule predicts (fbgemm's row-wise AdaGrad backward has been 15x slower on one AVX-512
host than on another with the same versions). Where two paths compute bitwise the same result, the choice changes
nothing but time, so it may be made by timing them.

What may be swapped (:data:`EQUAL_PATHS`, CPU only), each pair shown bitwise equal by a test:

    adagrad_bags      numba <-> fbgemm      tests/test_kernels.py::test_adagrad_bags_numba_equals_fbgemm_bitwise
                                            (row widths that are multiples of 8 only: fbgemm sums the tail lanes in
                                            another order, so other widths keep the Numba kernel)
    lookup            numba <-> reference   tests/test_kernels.py::test_pool_segments_bitwise_equals_index_add
    dual_buffer_sync  numba <-> reference   tests/test_kernels.py::test_dual_buffer_sync_rows_exact (copies)
    place_keys        numba <-> reference   tests/test_hashing.py::test_place_keys_paths_agree (integer arithmetic)

Never swapped by timing (:data:`NOT_TIMED`): ``hstu_attention`` (numba's exact loops and the blocked tiles round
differently), ``adagrad_update`` (the reference builds per-entry gradients, another summation order), and every
accelerator path. The calibration also compares the candidates' results on its own data and drops a path that
differs, so a pair that stopped being equal (a new library version) is never chosen.

How: :func:`calibrate` times each candidate on shapes from the run (:class:`TuneShape`: the largest store's rows,
capped at 131,072 rows and 32 MiB, its dim, the owner's bags per update), for the ops the run calls only,
alternating the paths, a few repetitions each (about a second in all on a 2-core host); the fastest median wins
unless it is within 3% of the rule's path (ties keep the rule). The result is cached per host fingerprint (CPU
model, instruction-set flags, usable cores, torch / numba / fbgemm_gpu / nestpipe versions) and shape in
``$NESTPIPE_CACHE_DIR`` (default ``~/.cache/nestpipe``)``/kernels/``; a cache written on another host (another
fingerprint) is ignored. A path forced by ``NESTPIPE_KERNELS`` wins over the cache and the calibration. In a run, rank 0 decides and broadcasts; every rank applies the same paths (:func:`apply`) and
``metrics.json`` records them (``kernel_choice``: path, source -- forced, cache, calibration or rule -- and timings).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import statistics
import time
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from nestpipe import kernels
from nestpipe.kernels import select
from nestpipe.kernels.row_placement import affine_params
from nestpipe.utils.host import describe_host

EQUAL_PATHS: Dict[str, Tuple[str, ...]] = {
    "adagrad_bags": ("numba", "fbgemm"),
    "lookup": ("numba", "reference"),
    "dual_buffer_sync": ("numba", "reference"),
    "place_keys": ("numba", "reference"),
}
NOT_TIMED: Dict[str, str] = {
    "hstu_attention": "numba's exact loops and the blocked tiles round differently",
    "adagrad_update": "the reference builds per-entry gradients first: another summation order",
}
CACHE_ENV = "NESTPIPE_CACHE_DIR"
CACHE_FORMAT = 1
TIE = 0.03  # a candidate must beat the rule's path by more than this fraction to replace it
MAX_ROWS = 1 << 17  # calibration table rows (a larger table's gathers are memory-bound alike for every path)
MAX_TABLE_BYTES = 32 << 20  # and at most this many bytes of rows: wide rows get fewer (a bounded calibration)


@dataclasses.dataclass(frozen=True)
class TuneShape:
    """What the calibration times on: a table of ``rows`` x ``dim`` rows, ``bags`` bags of ``pooling`` ids per
    update (the owner's bags: batch x world for a pooled table), and ``shared`` the fraction of a batch's rows the
    next batch shares (the dual-buffer sync)."""

    rows: int
    dim: int
    bags: int
    pooling: int = 20
    shared: float = 0.5

    def key(self) -> str:
        """The cache key: sizes rounded to powers of two (nearby shapes share a measurement)."""
        def p2(x: int) -> int:
            return 1 << max(0, int(round(np.log2(max(1, x)))))
        return f"r{p2(self.rows)}-d{self.dim}-b{p2(self.bags)}-p{p2(self.pooling)}"

    @staticmethod
    def of_run(store_rows: Dict[str, int], store_dims: Dict[str, int], batch_size: int, world: int,
               pooled: bool) -> "TuneShape":
        """The run's shape: its largest store (rows capped at :data:`MAX_ROWS`) and the owner's bags per update."""
        if not store_rows:
            return TuneShape(1024, 64, batch_size * world, 20 if pooled else 1)
        big = max(store_rows, key=lambda s: store_rows[s])
        rows = min(store_rows[big], MAX_ROWS, max(1024, MAX_TABLE_BYTES // (4 * store_dims[big])))
        return TuneShape(rows, store_dims[big], batch_size * world, 20 if pooled else 1)


# -- the host -------------------------------------------------------------------------------------------------------
def _version(module: str) -> str:
    try:
        return importlib.metadata.version(module)
    except Exception:  # not installed
        return ""


def host_fingerprint() -> Dict[str, object]:
    """What a path's speed depends on besides the shapes: CPU, instruction sets, cores and library versions."""
    host = describe_host()
    return {"cpu_model": host["cpu_model"], "isa": host["isa"], "usable_cpus": host["usable_cpus"],
            "machine": host["machine"], "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "numba": _version("numba"), "fbgemm_gpu": _version("fbgemm-gpu-cpu") or
            _version("fbgemm-gpu"), "nestpipe": _version("nestpipe")}


def fingerprint_id(fp: Dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> str:
    return os.path.join(os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "nestpipe"),
                        "kernels")


def cache_path(fp: Dict[str, object]) -> str:
    return os.path.join(cache_dir(), f"{fingerprint_id(fp)}.json")


def load_cache(fp: Dict[str, object]) -> Dict[str, Dict[str, object]]:
    """``{shape key: {op: {"path", "timings_ms"}}}`` measured on this host; empty where there is none, where it is
    unreadable, or where its fingerprint is another host's (a copied cache directory)."""
    try:
        with open(cache_path(fp)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or doc.get("fingerprint") != fp:
        return {}
    shapes = doc.get("shapes")
    return shapes if isinstance(shapes, dict) else {}


def store_cache(fp: Dict[str, object], shape_key: str, result: Dict[str, Dict[str, object]]) -> str:
    """Add one shape's measurement to this host's cache (atomic replace); returns the file."""
    shapes = load_cache(fp)
    shapes[shape_key] = result
    path = cache_path(fp)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": CACHE_FORMAT, "fingerprint": fp, "shapes": shapes}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


# -- candidates and their timing --------------------------------------------------------------------------------------
def candidates(op: str, device: str = "cpu", shape: Optional[TuneShape] = None) -> List[str]:
    """The paths of ``op`` that may be swapped on ``device`` for ``shape`` and are available here (empty: nothing
    to tune). fbgemm's bag update equals the Numba kernel for row widths that are multiples of 8 only (its tail
    lanes sum in another order: ``tests/test_kernel_tuning.py`` shows both)."""
    if torch.device(device).type != "cpu" or op not in EQUAL_PATHS:
        return []
    have = {"numba": select.has_numba(), "reference": True,
            "fbgemm": (select.has_fbgemm_tbe_cpu() and (shape is None or shape.dim % 8 == 0))
            if op == "adagrad_bags" else select.has_fbgemm()}
    paths = [p for p in EQUAL_PATHS[op] if have[p]]
    return paths if len(paths) > 1 else []


def _bags_case(shape: TuneShape, rng: np.random.Generator):
    lens = rng.integers(max(1, shape.pooling // 2), shape.pooling + shape.pooling // 2 + 1, size=shape.bags)
    idx = torch.from_numpy(rng.integers(0, shape.rows, size=int(lens.sum())))
    off = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    return idx, off


def _floats(rng: np.random.Generator, *size: int) -> torch.Tensor:
    return torch.from_numpy(rng.random(size, dtype=np.float32) - 0.5)


# Each op: a case built once from the shape (the same inputs for every path), and one timed pass of a path over it
# on fresh copies of what the op writes; the pass returns (seconds per call, what the op wrote).
def _adagrad_bags_case(shape: TuneShape, calls: int, rng: np.random.Generator):
    return (_floats(rng, shape.rows, shape.dim) * 0.02, torch.full((shape.rows,), 0.1),
            [(*_bags_case(shape, rng), _floats(rng, shape.bags, shape.dim)) for _ in range(calls)])


def _adagrad_bags_pass(case, path: str):
    w0, s0, calls = case
    w, s, times = w0.clone(), s0.clone(), []
    with select.forced({"adagrad_bags": path}):
        for idx, off, g in calls:
            t0 = time.thread_time()
            kernels.adagrad_bags(w, s, idx, off, g, 0.01)
            times.append(time.thread_time() - t0)
    return times, (w, s)


def _lookup_case(shape: TuneShape, calls: int, rng: np.random.Generator):
    """Pooled bags (segment sums) or, with bags of one row (unique-based tables), row copies: the trainer's two
    uses of ``pool_segments``."""
    if shape.pooling <= 1:
        cases = [(torch.from_numpy(rng.integers(0, shape.rows, size=shape.bags)), None) for _ in range(calls)]
    else:
        cases = [_bags_case(shape, rng) for _ in range(calls)]
    return _floats(rng, shape.rows, shape.dim), cases, shape.bags, shape.dim


def _lookup_pass(case, path: str):
    src, calls, bags, dim = case
    out, times = torch.empty(bags * dim * len(calls)), []
    with select.forced({"lookup": path}):
        for r, (idx, off) in enumerate(calls):
            at = torch.arange(bags, dtype=torch.int64) * dim + r * bags * dim
            t0 = time.thread_time()
            kernels.pool_segments(src, idx, off, out, at)
            times.append(time.thread_time() - t0)
    return times, (out,)


def _dual_buffer_sync_case(shape: TuneShape, calls: int, rng: np.random.Generator):
    n = min(shape.rows, shape.bags * shape.pooling)
    out = []
    for _ in range(calls):
        a = np.sort(rng.choice(shape.rows, n, replace=False)).astype(np.int64)
        keep = rng.random(n) < shape.shared
        p = np.unique(np.concatenate([a[keep], rng.choice(shape.rows, n - int(keep.sum()), replace=False)]))
        out.append((torch.from_numpy(a), torch.from_numpy(p.astype(np.int64)), _floats(rng, n, shape.dim),
                    _floats(rng, n)))
    return out, shape.dim


def _dual_buffer_sync_pass(case, path: str):
    calls, dim = case
    outs, times = [], []
    with select.forced({"dual_buffer_sync": path}):
        for a, p, src_w, src_s in calls:
            dst_w, dst_s = torch.zeros(len(p), dim), torch.zeros(len(p))
            t0 = time.thread_time()
            kernels.dual_buffer_sync_rows(a, p, src_w, src_s, dst_w, dst_s)
            times.append(time.thread_time() - t0)
            outs += [dst_w, dst_s]
    return times, tuple(outs)


def _place_keys_case(shape: TuneShape, calls: int, rng: np.random.Generator):
    """The requester's routing of a batch's distinct keys over two owners (a table of twice the rows)."""
    vocab = 2 * shape.rows
    a, b = affine_params(0, vocab)
    n = min(vocab, shape.bags * shape.pooling)
    return [rng.integers(0, vocab, size=n) for _ in range(calls)], a, b, vocab, -(-vocab // 2)


def _place_keys_pass(case, path: str):
    calls, a, b, vocab, rows_per_shard = case
    outs, times = [], []
    with select.forced({"place_keys": path}):
        for ids in calls:
            t0 = time.thread_time()
            owner, row = kernels.place_keys(ids, a, b, vocab, rows_per_shard)
            times.append(time.thread_time() - t0)
            outs += [torch.from_numpy(owner), torch.from_numpy(row)]
    return times, tuple(outs)


_CASES = {"adagrad_bags": (_adagrad_bags_case, _adagrad_bags_pass), "lookup": (_lookup_case, _lookup_pass),
          "dual_buffer_sync": (_dual_buffer_sync_case, _dual_buffer_sync_pass),
          "place_keys": (_place_keys_case, _place_keys_pass)}


def time_op(op: str, shape: TuneShape, paths: List[str], reps: int = 5, rounds: int = 2
            ) -> Tuple[Dict[str, float], bool]:
    """Median thread-CPU milliseconds per call of every path on the same inputs (the first call of each pass is a
    warm-up; the order of the paths alternates between rounds), and whether their results were bitwise equal."""
    make, run = _CASES[op]
    case = make(shape, reps + 1, np.random.default_rng(0))
    times: Dict[str, List[float]] = {p: [] for p in paths}
    results = {}
    with select.calls_unrecorded():
        for k in range(rounds):
            for p in (paths if k % 2 == 0 else list(reversed(paths))):
                t, out = run(case, p)
                times[p] += t[1:]
                results.setdefault(p, out)
    first = results[paths[0]]
    equal = all(all(torch.equal(x, y) for x, y in zip(first, results[p])) for p in paths[1:])
    return {p: round(statistics.median(v) * 1e3, 4) for p, v in times.items()}, equal


def calibrate(shape: TuneShape, device: str = "cpu", ops: Optional[List[str]] = None
              ) -> Dict[str, Dict[str, object]]:
    """``{op: {"path", "timings_ms", "rule", "equal"}}`` for every tunable op: the fastest of its equal paths (the
    rule's path on a tie within :data:`TIE`, or where the results differed)."""
    out = {}
    for op in ops or list(EQUAL_PATHS):
        paths = candidates(op, device, shape)
        if not paths:
            continue
        rule = select.rule_path(op, device)
        timings, equal = time_op(op, shape, paths)
        best = min(paths, key=lambda p: timings[p])
        if not equal or rule not in timings or timings[best] >= timings[rule] * (1 - TIE):
            best = rule if rule in timings else paths[0]
        out[op] = {"path": best, "timings_ms": timings, "rule": rule, "equal": equal}
    return out


# -- the run's choice -------------------------------------------------------------------------------------------------
def choose(shape: TuneShape, device: str = "cpu", tune: bool = True, ops: Optional[List[str]] = None
           ) -> Dict[str, Dict[str, object]]:
    """``{op: {"path", "source", ...}}`` for every tunable op on this host: forced (``NESTPIPE_KERNELS``), else the
    cached measurement of this host and shape, else a calibration now (then cached), else the rule (``tune`` off,
    or nothing to choose between)."""
    choice: Dict[str, Dict[str, object]] = {}
    todo = []
    for op in (list(EQUAL_PATHS) if ops is None else ops):
        forced = select.forced_path(op)
        if forced is not None:
            choice[op] = {"path": forced, "source": "forced"}
        elif tune and candidates(op, device, shape):
            todo.append(op)
        else:
            choice[op] = {"path": select.rule_path(op, device), "source": "rule"}
    if todo:
        fp = host_fingerprint()
        cached = load_cache(fp).get(shape.key(), {})
        missing = [op for op in todo if op not in cached]
        if missing:
            t0 = time.perf_counter()
            measured = calibrate(shape, device, missing)
            cached = dict(cached, **measured)
            store_cache(fp, shape.key(), cached)
            for op in missing:
                choice[op] = dict(measured[op], source="calibration",
                                  seconds=round(time.perf_counter() - t0, 3))
        for op in todo:
            if op not in choice:
                choice[op] = dict(cached[op], source="cache")
    return choice


def apply(choice: Dict[str, Dict[str, object]]) -> None:
    """Make this process take the chosen paths (a forced path stays forced)."""
    select.set_tuned({op: c["path"] for op, c in choice.items() if c["source"] in ("cache", "calibration")})


@contextlib.contextmanager
def applied(choice: Dict[str, Dict[str, object]]) -> Iterator[None]:
    """:func:`apply` inside a ``with`` block (the paths taken before are restored after it)."""
    saved = select.tuned_paths()
    apply(choice)
    try:
        yield
    finally:
        select.set_tuned(saved)


def choose_for_run(shape: TuneShape, device: torch.device, rank: int, world: int, tune: bool, group=None,
                   ops: Optional[List[str]] = None) -> Dict[str, Dict[str, object]]:
    """Rank 0's :func:`choose` for ``ops`` (the ones the run calls; default every tunable op), broadcast so that
    every rank takes the same paths, then applied on every rank. Collective: every rank calls it."""
    choice = choose(shape, device.type, tune, ops) if rank == 0 else None
    if world > 1:
        box = [json.dumps(choice)]
        dist.broadcast_object_list(box, src=0, group=group)  # a JSON string: rank 0's decision, on every rank
        choice = json.loads(box[0])
    apply(choice)
    return choice
