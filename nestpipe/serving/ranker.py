"""Online ranking with a trained HSTU: each user's prefix K/V kept resident, only new tokens computed (RelayGR).

Scoring is ``nestpipe eval``'s: the user's history (the last ``max_seq_len`` events at most: the *window*) is read
by the model, and a candidate's score is the cosine similarity of the last position's hidden state with the
candidate's output embedding, plus with the transition term ``w`` times the cosine of the last event's ``from`` block
with the candidate's ``to`` block, divided by the model's temperature, plus with ``item_bias`` the candidate's learned
offset (the training logit, without the logQ term).

Why a prefix can be cached exactly: an HSTU layer computes every token's ``u, v, q, k`` from that token alone, a
token attends to the tokens at or before it with ``SiLU(q . k / sqrt(d) + bias(i - j)) / max_seq_len`` (a constant
divisor and a bias of the distance only: nothing depends on the sequence's length), and the residual stream is
per token. So the K/V of a prefix, per layer, never change when tokens are appended, and a new token's hidden state
needs only the prefix's K/V and the new tokens themselves. Positions are absolute within the window: when appending
would push the window past ``max_seq_len`` events it is *rebased* to its last ``max_seq_len // 2`` events and
recomputed (a miss), which leaves room for the next events to hit.

State per user: the stored history (item, author, action, time per event; small, never evicted) in
:class:`Ranker`; the window's K/V per layer and the last hidden state in the :class:`PrefixCache`, an LRU bounded
in bytes. A request that finds no cached window, or one that no longer matches the stored history, recomputes it
(``cache: "miss"``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import sqlite3
import threading
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from nestpipe.datasets.shards import table_offsets
from nestpipe.trainer import checkpoint
from nestpipe.trainer.config import load_run_config
from nestpipe.trainer.data import ShardStream, iter_shard
from nestpipe.trainer.embedding.placement import to_vocab
from nestpipe.trainer.export import assemble
from nestpipe.trainer.models import build_model, model_table_dims
from nestpipe.trainer.models.hstu import HSTU, event_seconds
from nestpipe.trainer.run_files import run_manifest
from nestpipe.utils.jsonio import read_json, write_json_atomic

EVENT_FIELDS = ("item_id", "action", "time_ms")


@dataclasses.dataclass
class Events:
    """A user's events, oldest first: item id, author id (-1: unknown), action bitmask, time in ms."""

    item: np.ndarray
    author: np.ndarray
    action: np.ndarray
    time: np.ndarray

    @classmethod
    def empty(cls) -> "Events":
        z = np.zeros(0, np.int64)
        return cls(z, z.copy(), z.copy(), z.copy())

    def __len__(self) -> int:
        return len(self.item)

    def __getitem__(self, sl: slice) -> "Events":
        return Events(self.item[sl], self.author[sl], self.action[sl], self.time[sl])

    def concat(self, other: "Events") -> "Events":
        return Events(*(np.concatenate([a, b]) for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass
class CachedPrefix:
    """The K/V of every layer for the first ``length`` events of a user's window starting at history event
    ``start``, and the hidden state of the window's last event."""

    start: int
    length: int
    kv: List[Tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [length, heads, head_dim]
    last_hidden: torch.Tensor  # [D]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv) + \
            self.last_hidden.numel() * self.last_hidden.element_size()


class SpillStore:
    """The second tier: prefixes evicted from DRAM, one file per user in ``directory`` (raw float32 K/V and a JSON
    header, written under a temporary name and renamed), least recently spilled removed first beyond
    ``capacity_bytes``. A prefix read back is removed from the tier (it returns to DRAM). Not thread-safe on its
    own: :class:`PrefixCache` calls it under its lock."""

    def __init__(self, directory: str, capacity_bytes: int):
        self.dir = directory
        self.capacity = int(capacity_bytes)
        os.makedirs(directory, exist_ok=True)
        for f in os.listdir(directory):  # what an earlier process spilled: its K/V may not match this model
            os.remove(os.path.join(directory, f))
        self.items: "collections.OrderedDict[int, int]" = collections.OrderedDict()  # user -> bytes
        self.bytes = 0
        self.evictions = 0
        self.reads = 0

    def _path(self, user: int) -> str:
        return os.path.join(self.dir, f"user-{int(user)}")

    def put(self, user: int, entry: CachedPrefix) -> None:
        self.drop(user)
        if entry.nbytes > self.capacity:
            self.evictions += 1
            return
        parts = [t.contiguous().view(-1) for k, v in entry.kv for t in (k, v)] + [entry.last_hidden.view(-1)]
        flat = torch.cat(parts).numpy().astype(np.float32, copy=False)
        head = {"start": entry.start, "length": entry.length,
                "shapes": [list(t.shape) for k, v in entry.kv for t in (k, v)] + [list(entry.last_hidden.shape)]}
        path = self._path(user)
        flat.tofile(path + ".bin.tmp")
        os.replace(path + ".bin.tmp", path + ".bin")
        write_json_atomic(path + ".json", head)
        self.items[user] = flat.nbytes
        self.bytes += flat.nbytes
        while self.bytes > self.capacity:
            gone, _ = next(iter(self.items.items()))
            self.drop(gone)
            self.evictions += 1

    def take(self, user: int) -> Optional[CachedPrefix]:
        if user not in self.items:
            return None
        path = self._path(user)
        head = read_json(path + ".json", "spilled prefix")
        flat = torch.from_numpy(np.fromfile(path + ".bin", dtype=np.float32))
        tensors, at = [], 0
        for shape in head["shapes"]:
            n = int(np.prod(shape))
            tensors.append(flat[at:at + n].view(*shape))
            at += n
        self.drop(user)
        self.reads += 1
        kv = [(tensors[2 * i], tensors[2 * i + 1]) for i in range((len(tensors) - 1) // 2)]
        return CachedPrefix(head["start"], head["length"], kv, tensors[-1])

    def drop(self, user: int) -> None:
        size = self.items.pop(user, None)
        if size is None:
            return
        self.bytes -= size
        for ext in (".bin", ".json"):
            try:
                os.remove(self._path(user) + ext)
            except FileNotFoundError:
                pass


class PrefixCache:
    """LRU of :class:`CachedPrefix` per user, at most ``capacity_bytes`` in DRAM (a prefix larger than the whole
    capacity is not kept); with ``spill`` a :class:`SpillStore` receives the evicted prefixes and gives them back on
    the user's next request. Thread-safe."""

    def __init__(self, capacity_bytes: int, spill: Optional[SpillStore] = None):
        self.capacity = int(capacity_bytes)
        self.spill = spill
        self.items: "collections.OrderedDict[int, CachedPrefix]" = collections.OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self.lock = threading.Lock()

    def get(self, user: int) -> Optional[CachedPrefix]:
        with self.lock:
            entry = self.items.get(user)
            if entry is not None:
                self.items.move_to_end(user)
                return entry
            entry = self.spill.take(user) if self.spill is not None else None
            if entry is not None:
                self._put(user, entry)
            return entry

    def put(self, user: int, entry: CachedPrefix) -> None:
        with self.lock:
            if self.spill is not None:
                self.spill.drop(user)  # the new prefix supersedes a spilled one
            self._put(user, entry)

    def _put(self, user: int, entry: CachedPrefix) -> None:
        old = self.items.pop(user, None)
        if old is not None:
            self.bytes -= old.nbytes
        if entry.nbytes > self.capacity:
            if self.spill is not None:
                self.spill.put(user, entry)
            return
        self.items[user] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.capacity:
            gone_user, gone = self.items.popitem(last=False)
            self.bytes -= gone.nbytes
            self.evictions += 1
            if self.spill is not None:
                self.spill.put(gone_user, gone)

    def stats(self) -> Dict[str, int]:
        with self.lock:
            out = {"users": len(self.items), "bytes": self.bytes, "capacity_bytes": self.capacity,
                   "evictions": self.evictions}
            if self.spill is not None:
                out.update({"spilled_users": len(self.spill.items), "spilled_bytes": self.spill.bytes,
                            "spill_capacity_bytes": self.spill.capacity, "spill_evictions": self.spill.evictions,
                            "spill_reads": self.spill.reads})
            return out


class HistoryStore:
    """Every user's events in an SQLite file (standard library; one row per event, appended in one transaction per
    request), so that a restarted server rebuilds any user's window from what it was sent: the first request after a
    restart is a miss, never a lost history."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS events (user INTEGER, seq INTEGER, item INTEGER, author INTEGER, "
                        "action INTEGER, time INTEGER, PRIMARY KEY (user, seq))")
        self.lock = threading.Lock()

    def load(self, user: int) -> Events:
        with self.lock:
            rows = self.db.execute("SELECT item, author, action, time FROM events WHERE user = ? ORDER BY seq",
                                   (int(user),)).fetchall()
        if not rows:
            return Events.empty()
        a = np.asarray(rows, dtype=np.int64)
        return Events(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy())

    def append(self, user: int, first_seq: int, ev: Events) -> None:
        rows = [(int(user), first_seq + i, int(ev.item[i]), int(ev.author[i]), int(ev.action[i]), int(ev.time[i]))
                for i in range(len(ev))]
        with self.lock:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)", rows)
            self.db.execute("COMMIT")


class Ranker:
    """Scores candidates for users from a trained HSTU run, keeping each user's prefix K/V resident.

    ``prefill(user, events)`` appends events to the user's stored history and computes its window's K/V (RelayGR's
    pre-inference); ``rank(user, events, candidates)`` appends the new events (possibly none), computes only what
    the cache does not hold, and returns one score per candidate and whether the cached prefix served (``"hit"``)
    or the window was recomputed (``"miss"``)."""

    def __init__(self, model: HSTU, item_rows: torch.Tensor, tables: Dict[str, torch.Tensor],
                 vocabs: Dict[str, int], item_author: np.ndarray, cache_mb: float = 1024.0,
                 temperature: float = 0.1, store: Optional[HistoryStore] = None,
                 candidates: Optional[torch.Tensor] = None, spill: Optional[SpillStore] = None):
        if not isinstance(model, HSTU):
            raise ValueError(f"serving ranks with an HSTU run; this run's model is {type(model).__name__}")
        self.model = model.eval()
        self.tables = tables  # table -> full weight [V, width] (float32)
        self.vocabs = vocabs
        # [V, D] unit output embeddings (given: a shared memory-mapped copy, see save_shared)
        self.candidates = candidates if candidates is not None else F.normalize(model.candidates(item_rows), dim=-1)
        self.item_author = item_author
        self.temperature = temperature
        self.cache = PrefixCache(int(cache_mb * (1 << 20)), spill)
        self.history: Dict[int, Events] = {}  # users seen by this process (the store holds every user's)
        self.store = store
        self.lock = threading.Lock()  # the stored histories
        self.compute_lock = threading.Lock()
        self.counts = collections.Counter()

    # -- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_run(cls, run: str, cache_mb: float = 1024.0, shards: Optional[str] = None,
                 history: Optional[str] = None, spill_dir: Optional[str] = None, spill_mb: float = 4096.0
                 ) -> "Ranker":
        """The latest checkpoint of ``run`` (an ``hstu`` run), assembled into full tables as ``nestpipe export``
        writes them; the item -> author map from the run's training shards (cached as
        ``RUN/serving/item_author.npy``). ``history``: an SQLite file keeping every user's events across restarts
        (:class:`HistoryStore`; None: in memory only). ``spill_dir``: the second tier of evicted prefixes, at most
        ``spill_mb`` (:class:`SpillStore`)."""
        cfg = load_run_config(run)
        if cfg.model != "hstu":
            raise ValueError(f"{run}: serving ranks with hstu runs; this run trained {cfg.model!r}")
        man, cfg.shards = run_manifest(run, cfg, shards, need_data=False)
        full = assemble(run)
        model = build_model(cfg, man, model_table_dims(cfg, man))
        model.load_state_dict({k[len("dense."):]: v.float() for k, v in full.items() if k.startswith("dense.")})
        seq = sorted(t for t, s in man.tables.items() if s.kind == "sequence")
        tables = {t: full[f"embedding.{t}.weight"].float() for t in seq}
        vocabs = {t: int(man.tables[t].vocab) for t in seq}
        return cls(model, tables["item"], tables, vocabs, item_authors(run, cfg.shards, vocabs["item"]), cache_mb,
                   model.score_temperature, HistoryStore(history) if history else None,
                   spill=SpillStore(spill_dir, int(spill_mb * (1 << 20))) if spill_dir else None)

    @classmethod
    def from_shared(cls, run: str, shared: str, cache_mb: float = 1024.0, history: Optional[str] = None,
                    spill_dir: Optional[str] = None, spill_mb: float = 4096.0) -> "Ranker":
        """A ranker over the model files :func:`save_shared` wrote: the tables and the candidates memory-mapped
        read-only, so that every replica on a host shares one copy in the page cache."""
        cfg = load_run_config(run)
        man, _ = run_manifest(run, cfg, None, need_data=False)
        meta = read_json(os.path.join(shared, "meta.json"), "shared serving model")
        model = build_model(cfg, man, model_table_dims(cfg, man))
        model.load_state_dict(torch.load(os.path.join(shared, "dense.pt"), map_location="cpu", weights_only=True))
        tables = {t: _mapped(os.path.join(shared, f"table-{t}.npy")) for t in meta["tables"]}
        return cls(model, tables["item"], tables, meta["vocabs"], np.load(os.path.join(shared, "item_author.npy")),
                   cache_mb, model.score_temperature, HistoryStore(history) if history else None,
                   candidates=_mapped(os.path.join(shared, "candidates.npy")),
                   spill=SpillStore(spill_dir, int(spill_mb * (1 << 20))) if spill_dir else None)

    @property
    def window(self) -> int:
        return int(self.model.max_len)

    # -- the API ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, user: int, events) -> Dict[str, object]:
        """Store ``events`` (appended to the user's history) and compute the window's K/V."""
        hist = self._append(user, self._events(events))
        if not len(hist):
            raise KeyError(f"user {user}: no stored history and no events: send events")
        with self.compute_lock:
            _, how = self._hidden(user, hist)
        return {"cache": how, "events": len(hist)}

    @torch.no_grad()
    def rank(self, user: int, events, candidates: Sequence[int]) -> Tuple[np.ndarray, str]:
        """Scores of ``candidates`` (item ids) after appending ``events`` to the user's history, and ``"hit"`` /
        ``"miss"``."""
        hist = self._append(user, self._events(events))
        if not len(hist):
            raise KeyError(f"user {user}: no stored history and no events: send events")
        with self.compute_lock:  # one request of a user at a time sees and extends its cached prefix
            hidden, how = self._hidden(user, hist)
        return self._score(hidden, hist.item[-1:], candidates), how

    def window_events(self, user: int) -> Events:
        """The events of the user's current window (what the cached prefix covers after a request)."""
        cached = self.cache.get(user)
        hist = self.history.get(user, Events.empty())
        return hist[cached.start:] if cached is not None else hist[self._window_start(len(hist), 0):]

    @torch.no_grad()
    def full_scores(self, events, candidates: Sequence[int]) -> np.ndarray:
        """The reference: ``events`` (at most ``max_seq_len``: a window) through ``model.encode`` from scratch, the
        way ``nestpipe eval`` reads a sample; no cache involved."""
        ev = self._events(events)
        if not 0 < len(ev) <= self.window:
            raise ValueError(f"full_scores reads one window: 1 to {self.window} events, got {len(ev)}")
        hidden = self.model.encode(self.model.token_inputs(self._token_rows(ev)),
                                   torch.tensor([len(ev)], dtype=torch.int64), torch.from_numpy(ev.time.astype(np.int64)))
        return self._score(hidden[-1], ev.item[-1:], candidates)

    def stats(self) -> Dict[str, object]:
        return {"users": len(self.history), "requests": dict(self.counts), "cache": self.cache.stats()}

    # -- internals ----------------------------------------------------------------------------------------------
    def _events(self, events) -> Events:
        if isinstance(events, Events):
            return events
        events = list(events or [])
        cols = {f: np.zeros(len(events), np.int64) for f in EVENT_FIELDS}
        author = np.full(len(events), -2, np.int64)  # -2: look the author up
        for i, e in enumerate(events):
            for f in EVENT_FIELDS:
                if f not in e:
                    raise ValueError(f"event {i}: missing {f!r} (an event is {{item_id, action, time_ms}})")
                v = e[f]
                if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                    raise ValueError(f"event {i}: {f} must be an integer, got {v!r}")
                cols[f][i] = int(v)
            if e.get("author_id") is not None:
                author[i] = int(e["author_id"])
        look = author == -2
        item_in = to_vocab(cols["item_id"][look], self.vocabs["item"])
        author[look] = self.item_author[item_in] if len(item_in) else author[look]
        return Events(cols["item_id"], author, cols["action"], cols["time_ms"])

    def _append(self, user: int, ev: Events) -> Events:
        with self.lock:
            hist = self.history.get(user)
            if hist is None:
                hist = self.store.load(user) if self.store is not None else Events.empty()
                if len(hist):
                    self.history[user] = hist
            if len(ev):
                t = np.concatenate([hist.time[-1:], ev.time])  # the stored last event first, if any
                bad = np.flatnonzero(np.diff(t) < 0)
                if len(bad):
                    k = int(bad[0]) + (0 if len(hist) else 1)  # the offending event's index in this request
                    raise ValueError(f"events out of time order: event {k} has time_ms {int(t[bad[0] + 1])}, "
                                     f"before the previous event's {int(t[bad[0]])}; send events oldest first")
                if self.store is not None:
                    self.store.append(user, len(hist), ev)
                hist = hist.concat(ev)
                self.history[user] = hist
            return hist

    def _window_start(self, n: int, start: int) -> int:
        """The window of a history of ``n`` events whose current window starts at ``start``: kept while it holds at
        most ``max_seq_len`` events, else rebased to the last ``max_seq_len // 2`` (at least 1)."""
        if n - start <= self.window:
            return start
        return n - max(1, self.window // 2)

    def _hidden(self, user: int, hist: Events) -> Tuple[torch.Tensor, str]:
        cached = self.cache.get(user)
        n = len(hist)
        if cached is not None and self._window_start(n, cached.start) == cached.start:
            new = hist[cached.start + cached.length:]
            if not len(new):
                self.counts["hit"] += 1
                return cached.last_hidden, "hit"
            kv, last = self._extend(cached, new, hist.time[cached.start:])
            self.cache.put(user, CachedPrefix(cached.start, cached.length + len(new), kv, last))
            self.counts["hit"] += 1
            return last, "hit"
        start = self._window_start(n, 0 if cached is None else cached.start)
        if cached is not None:
            self.counts["rebase"] += 1
        empty = CachedPrefix(start, 0, [(None, None)] * len(self.model.layers), torch.zeros(0))
        kv, last = self._extend(empty, hist[start:], hist.time[start:])
        self.cache.put(user, CachedPrefix(start, n - start, kv, last))
        self.counts["miss"] += 1
        return last, "miss"

    def _token_rows(self, ev: Events) -> Dict[str, torch.Tensor]:
        ids = {"item": ev.item, "author": ev.author, "action": ev.action}
        return {t: self.tables[t].index_select(0, torch.from_numpy(to_vocab(ids[t], self.vocabs[t])))
                for t in self.tables}

    def _extend(self, cached: CachedPrefix, new: Events, window_times: np.ndarray):
        """Hidden states of ``new`` at positions ``cached.length ..``: every layer's new tokens attend to the cached
        K/V and to each other (causal). ``window_times``: the event times (ms) of the window's events, cached ones
        and ``new`` (read by a model with the time bias). Returns the extended K/V per layer and the last hidden
        state."""
        model = self.model
        p0 = cached.length
        times = None
        if model.needs_times:  # seconds, as HSTU.encode converts them
            times = event_seconds(torch.from_numpy(np.asarray(window_times[:p0 + len(new)], dtype=np.int64)))
        emb = model.token_inputs(self._token_rows(new))
        pos = torch.arange(p0, p0 + len(new))
        x = sum(emb[t] for t in model.tables) + model.pos.index_select(0, pos.clamp(max=model.max_len - 1))
        kv_out = []
        for layer, (k_old, v_old) in zip(model.layers, cached.kv):
            x, k_all, v_all = layer.forward_cached(x, k_old, v_old, p0, times)
            kv_out.append((k_all, v_all))
        return kv_out, model.norm_out(x)[-1]

    def _score(self, hidden: torch.Tensor, last_item: np.ndarray, candidates: Sequence[int]) -> np.ndarray:
        """Scores of ``candidates`` for the last position's ``hidden`` state; ``last_item``: its item id (1
        element), whose row the transition term reads."""
        cand = np.asarray(list(candidates), dtype=np.int64)
        if cand.ndim != 1:
            raise ValueError("candidates must be a list of item ids")
        cand_idx = torch.from_numpy(to_vocab(cand, self.vocabs["item"]))
        rows = self.candidates.index_select(0, cand_idx)
        last_row = self.tables["item"].index_select(0, torch.from_numpy(to_vocab(last_item, self.vocabs["item"])))
        q = F.normalize(self.model.queries(hidden[None], last_row)[0], dim=-1)
        scores = rows @ q / self.temperature
        bias = self.model.candidate_bias(self.tables["item"].index_select(0, cand_idx))
        return (scores if bias is None else scores + bias).numpy()


def save_shared(run: str, shards: Optional[str] = None) -> str:
    """Write what replicas memory-map: ``RUN/serving/shared-step-S/`` with every sequence table
    (``table-T.npy``), the unit output embeddings (``candidates.npy``), the dense parameters (``dense.pt``), the
    item -> author map and ``meta.json``; atomic (a temporary directory renamed), reused when it exists."""
    ranker = Ranker.from_run(run, cache_mb=0, shards=shards)
    step = int(assemble_step(run))
    out = os.path.join(run, "serving", f"shared-step-{step:08d}")
    if os.path.exists(os.path.join(out, "meta.json")):
        return out
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for t, w in ranker.tables.items():
        np.save(os.path.join(tmp, f"table-{t}.npy"), w.numpy(), allow_pickle=False)
    np.save(os.path.join(tmp, "candidates.npy"), ranker.candidates.numpy(), allow_pickle=False)
    np.save(os.path.join(tmp, "item_author.npy"), ranker.item_author, allow_pickle=False)
    torch.save(ranker.model.state_dict(), os.path.join(tmp, "dense.pt"))
    write_json_atomic(os.path.join(tmp, "meta.json"), {"step": step, "tables": sorted(ranker.tables),
                                                       "vocabs": ranker.vocabs})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def assemble_step(run: str) -> int:
    latest = checkpoint.latest(run)
    if latest is None:
        raise FileNotFoundError(f"{run}: no complete checkpoint (train first)")
    return int(checkpoint.read_meta(latest)["step"])


def _mapped(path: str) -> torch.Tensor:
    """A read-only memory-mapped ``.npy`` as a tensor (never written: the ranker only reads its rows)."""
    arr = np.load(path, mmap_mode="r")
    with warnings.catch_warnings():  # torch warns that the array is not writable; nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def item_authors(run: str, shards: str, vocab: int) -> np.ndarray:
    """``[vocab]`` int64: the author of every in-vocabulary item as the training shards record it (-1 where no
    training token names one), built once and kept in ``RUN/serving/item_author.npy``."""
    path = os.path.join(run, "serving", "item_author.npy")
    if os.path.exists(path):
        out = np.load(path, allow_pickle=False)
        if len(out) == vocab:
            return out
    out = np.full(vocab, -1, dtype=np.int64)
    stream = ShardStream(shards, "train", 0, 1, verify=False)
    for e in stream.entries:
        for rec in iter_shard(os.path.join(shards, e.path)):
            items = to_vocab(np.asarray(rec["item.values"], np.int64), vocab)
            out[items] = np.asarray(rec["author.values"], np.int64)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.npy"
    np.save(tmp, out, allow_pickle=False)
    os.replace(tmp, path)
    return out


def events_from_rows(items: Iterable[int], actions: Iterable[int], times: Iterable[int]) -> List[Dict[str, int]]:
    return [{"item_id": int(i), "action": int(a), "time_ms": int(t)} for i, a, t in zip(items, actions, times)]


__all__ = ["CachedPrefix", "Events", "HistoryStore", "PrefixCache", "Ranker", "SpillStore", "events_from_rows", "item_authors"]
