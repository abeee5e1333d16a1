"""Strong simple baselines that ``nestpipe eval`` reports beside every model, on exactly the model's protocol.

Each baseline is fitted on the training split's shards only and scored on the same eval samples, targets and
(sampled protocol) negatives as the model.

Next-item (``gr`` shards; ranks of the held-out target, the number of items scoring strictly higher):

- :class:`MostPopular`: items ordered by their count in the training split (ties by id).
- :class:`SuccessorCounts`: the practitioner's counting model. Items are ordered by, in turn, (1) how often they
  followed the sample's last input item in the training split (transition counts over consecutive tokens of the
  training windows: the windows share one boundary token, so every training pair is counted once), (2) how often
  they occur in the sample's own input (the tokens the model reads), (3) popularity.

CTR (``ctr`` shards; AUC and logloss):

- the training split's positive rate as a constant (in :mod:`nestpipe.trainer.evaluate`);
- :class:`LogisticBaseline`: an L2-regularised logistic regression (scikit-learn, ``lbfgs``) over the model's own
  inputs: one-hot rows of every sparse table the model embeds (multi-hot counts for bags) and the dense features
  under the model's transform ``sign(x) log1p(|x|)``, standardised with the training split's moments. Fitted on at
  most ``max_train_samples`` training samples (the first ones in shard order), its regularisation chosen on a
  validation tail of them (:class:`LogisticConfig`); its settings, validation figures and fit time are recorded.
- :class:`FactorizationMachineBaseline`: a factorization machine over the same inputs (bags weighted by
  ``1 / length``): a factorised pairwise interaction of every pair of them, fitted by minibatch Adam with early
  stopping on a validation tail of the training samples and a refit on all of them (:class:`FMConfig`); fitted by
  every CTR eval (seconds to a minute), its settings, epochs, tail loglosses and fit time recorded.
- :class:`CrossLogisticBaseline` (``nestpipe eval --pairwise-baseline`` only: minutes to fit): the same regression
  with unfactorised pairwise interactions: beside those columns, one hashed column per (pair of tables, pair of
  ids) for every pair of the model's single-id tables and every pair the model takes a dot product of
  (``dlrm.dot_pairs``), so that it can express every cross the DLRM is given explicitly (and every cross of two
  single-id tables its cross network can form). The crosses are hashed into a fixed
  number of buckets (:class:`CrossConfig`, ``2**20`` by default), bounding the coefficients whatever the vocabularies;
  the model matrix holds at most ``max_train_samples x (pairs + ids + dense features)`` values.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from nestpipe.datasets.shards import table_offsets
from nestpipe.trainer.embedding.placement import to_vocab
from nestpipe.utils.hashing import GAMMA, mix64, splitmix64


# -- next item -----------------------------------------------------------------------------------------------------
def item_windows(rec, vocab: int) -> List[np.ndarray]:
    """Every sample's item tokens (in-vocabulary ids) of one gr record."""
    off = table_offsets(rec, "item")
    vals = to_vocab(rec["item.values"], vocab)
    return [vals[off[s]:off[s + 1]] for s in range(len(off) - 1)]


class MostPopular:
    """Items by training count, descending, ties by id; ``pop_rank[item]`` is its 0-based place."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.counts = np.zeros(vocab, dtype=np.int64)

    def add(self, windows: Iterable[np.ndarray]) -> None:
        for w in windows:
            np.add.at(self.counts, w, 1)

    def finish(self) -> "MostPopular":
        order = np.lexsort((np.arange(self.vocab), -self.counts))
        self.pop_rank = np.empty(self.vocab, dtype=np.int64)
        self.pop_rank[order] = np.arange(self.vocab)
        return self

    def rank(self, history: np.ndarray, target: int, negatives: Optional[np.ndarray] = None) -> int:
        pr = self.pop_rank
        if negatives is None:
            return int(pr[target])
        return int((pr[negatives] < pr[target]).sum())


class SuccessorCounts:
    """Transition counts ``a -> b`` over consecutive training tokens, then own-history counts, then popularity
    (see the module docstring). Ranks are exact for the full catalog without scoring every item: items that
    neither followed the last input item nor occur in the input are ordered by popularity alone."""

    def __init__(self, vocab: int, popular: MostPopular):
        self.vocab = vocab
        self.popular = popular
        self._pairs: List[np.ndarray] = []

    def add(self, windows: Iterable[np.ndarray]) -> None:
        for w in windows:
            if len(w) >= 2:
                self._pairs.append(w[:-1] * self.vocab + w[1:])

    def finish(self) -> "SuccessorCounts":
        pairs = np.concatenate(self._pairs) if self._pairs else np.zeros(0, np.int64)
        self.keys, self.counts = np.unique(pairs, return_counts=True)  # sorted by (a, b)
        self._pairs = []
        return self

    def _successors(self, last: int):
        """(items, counts) that followed ``last`` in training, items ascending."""
        lo, hi = np.searchsorted(self.keys, [last * self.vocab, (last + 1) * self.vocab])
        return self.keys[lo:hi] - last * self.vocab, self.counts[lo:hi]

    def _scores(self, history: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Lexicographic (successor count, own count, popularity) as one int64 per item."""
        succ = _counts_of(*self._successors(int(history[-1])), items)
        own = _counts_of(*np.unique(history, return_counts=True), items)
        v = self.vocab
        return (succ * (len(history) + 1) + own) * (v + 1) + (v - self.popular.pop_rank[items])

    def rank(self, history: np.ndarray, target: int, negatives: Optional[np.ndarray] = None) -> int:
        if len(history) == 0:
            return self.popular.rank(history, target, negatives)
        ts = self._scores(history, np.array([target], dtype=np.int64))[0]
        if negatives is not None:
            return int((self._scores(history, negatives) > ts).sum())
        cand = np.union1d(self._successors(int(history[-1]))[0], history)  # every item with a nonzero count
        above = int((self._scores(history, cand) > ts).sum())
        if np.isin(target, cand):
            return above  # the rest score popularity only, below any counted item
        pr = self.popular.pop_rank
        return above + int(pr[target]) - int((pr[cand] < pr[target]).sum())


def _counts_of(keys: np.ndarray, counts: np.ndarray, items: np.ndarray) -> np.ndarray:
    """``counts`` of ``items`` in the ascending ``keys`` (0 where absent)."""
    out = np.zeros(len(items), dtype=np.int64)
    if len(keys):
        pos = np.minimum(np.searchsorted(keys, items), len(keys) - 1)
        hit = keys[pos] == items
        out[hit] = counts[pos[hit]]
    return out


def fit_next_item(records: Iterable[Dict], vocab: int):
    """(MostPopular, SuccessorCounts) fitted on ``records`` (the training split)."""
    pop = MostPopular(vocab)
    succ = SuccessorCounts(vocab, pop)
    for rec in records:
        w = item_windows(rec, vocab)
        pop.add(w)
        succ.add(w)
    pop.finish()
    return pop, succ.finish()


# -- CTR -----------------------------------------------------------------------------------------------------------
def logloss(y: np.ndarray, p: np.ndarray) -> float:
    """Mean binary cross-entropy of probabilities ``p`` (clipped to [1e-7, 1 - 1e-7]) against labels ``y``."""
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def dense_transform(x: np.ndarray) -> np.ndarray:
    """The DLRM's dense-feature transform, ``sign(x) log1p(|x|)``."""
    x = np.asarray(x, dtype=np.float64)
    return np.sign(x) * np.log1p(np.abs(x))


@dataclasses.dataclass
class LogisticConfig:
    """``C`` (inverse L2 strength) is chosen from ``grid`` by the logloss on the last ``validation_share`` of the
    training samples, then the model is refitted on all of them with that ``C`` (the eval split is never read)."""

    grid: Tuple[float, ...] = (0.003, 0.01, 0.03)
    validation_share: float = 0.1
    solver: str = "lbfgs"
    max_iter: int = 300
    tol: float = 1e-3
    max_train_samples: int = 400_000
    # The model matrix's dtype: float32 values (beside 4-byte column indices) cut the bytes each of the solver's
    # sparse products reads, the fit's cost, while the regression's choice of C and its AUC stay those of float64.
    dtype: str = "float32"


def column_bases(tables: Sequence[str], vocabs: Dict[str, int]) -> Tuple[Dict[str, int], int]:
    """Each table's first column in a one-hot layout of the tables side by side, and the columns in all."""
    base, c = {}, 0
    for t in tables:
        base[t] = c
        c += vocabs[t]
    return base, c


class LogisticBaseline:
    """Logistic regression over the model's sparse rows (one-hot / multi-hot) and transformed dense features."""

    def __init__(self, tables: Sequence[str], vocabs: Dict[str, int], target_col: int,
                 cfg: Optional[LogisticConfig] = None):
        self.tables = list(tables)
        self.vocabs = vocabs
        self.k = target_col
        self.cfg = cfg or LogisticConfig()
        self.base, self.sparse_cols = column_bases(self.tables, vocabs)

    def features(self, rec: Dict):
        from scipy.sparse import csr_matrix

        b = len(rec["labels"])
        rows, cols = [], []
        for t in self.tables:
            off = table_offsets(rec, t)
            rows.append(np.repeat(np.arange(b), np.diff(off)))
            cols.append(self.base[t] + to_vocab(rec[f"{t}.values"], self.vocabs[t]))
        r, c = np.concatenate(rows), np.concatenate(cols)
        sp = csr_matrix((np.ones(len(r), dtype=self.cfg.dtype), (r, c)), shape=(b, self.sparse_cols))
        sp.sum_duplicates()
        dense = dense_transform(rec["dense"])
        return sp, dense

    def fit(self, records: Iterable[Dict]) -> "LogisticBaseline":
        from scipy.sparse import vstack

        sps, dens, ys, n = [], [], [], 0
        for rec in records:
            sp, d = self.features(rec)
            sps.append(sp)
            dens.append(d)
            ys.append(np.asarray(rec["labels"][:, self.k], np.float64))
            n += len(d)
            if n >= self.cfg.max_train_samples:
                break
        d = np.concatenate(dens)[: self.cfg.max_train_samples]
        self.mean, self.std = d.mean(0), d.std(0) + 1e-6
        x = self._matrix(vstack(sps)[: self.cfg.max_train_samples], d)
        y = np.concatenate(ys)[: self.cfg.max_train_samples]
        t0 = time.perf_counter()
        cut = int(len(y) * (1 - self.cfg.validation_share))
        validation = {}
        for C in self.cfg.grid:
            m, _ = self._fit(x[:cut], y[:cut], C)
            validation[C] = logloss(y[cut:], m.predict_proba(x[cut:])[:, 1])
        best = min(self.cfg.grid, key=lambda c: (validation[c], c))
        self.model, converged = self._fit(x, y, best)
        self.fit_info = {**dataclasses.asdict(self.cfg), "C": best,
                         "validation_logloss": {str(c): round(v, 6) for c, v in validation.items()},
                         "train_samples": int(len(y)), "features": int(x.shape[1]),
                         "fit_s": round(time.perf_counter() - t0, 3), "iterations": int(np.max(self.model.n_iter_)),
                         "converged": converged, "library": "scikit-learn LogisticRegression"}
        return self

    def _fit(self, x, y, C: float):
        import warnings

        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            m = LogisticRegression(C=C, solver=self.cfg.solver, max_iter=self.cfg.max_iter, tol=self.cfg.tol).fit(x, y)
        return m, not any(issubclass(w.category, ConvergenceWarning) for w in caught)

    def _matrix(self, sparse, dense: np.ndarray):
        """The model matrix: sparse rows beside the dense features standardised with the training moments."""
        from scipy.sparse import csr_matrix, hstack

        dense = csr_matrix(((dense - self.mean) / self.std).astype(self.cfg.dtype))
        return hstack([sparse, dense], format="csr").astype(self.cfg.dtype, copy=False)

    def predict(self, rec: Dict) -> np.ndarray:
        return self.model.predict_proba(self._matrix(*self.features(rec)))[:, 1]


@dataclasses.dataclass
class CrossConfig(LogisticConfig):
    """:class:`LogisticConfig` for :class:`CrossLogisticBaseline`: the crosses hashed into ``buckets`` columns, and
    fewer training samples by default (each sample carries one value per pair: 351 for the 27 single-id tables of
    the CTR ingest, about 1.2 GB of float32 values and int32 indices at 400k samples). ``2**20`` buckets rather than
    fewer: on the data of ``tests/test_trainer_learning.py`` eval AUC 0.6440 at the chosen C 0.003 (0.6415 at 0.001)
    against 0.6424 with ``2**18`` buckets, which fit in a third of the time."""

    buckets: int = 2 ** 20
    max_train_samples: int = 200_000


class CrossLogisticBaseline(LogisticBaseline):
    """:class:`LogisticBaseline` plus hashed pairwise crosses: for every pair ``(a, b)`` of ``pairs`` and every id
    ``i`` of table ``a`` and ``j`` of table ``b`` in a sample, column ``sparse_cols + h_p(i, j)`` with
    ``h_p(i, j) = splitmix64(i * vocab_b + j, p + 1) mod buckets`` (``p`` the pair's index), the product of their
    counts as its value (1 for two single ids). Two crosses may share a bucket (a hash collision); the regression
    then learns their shared weight."""

    def __init__(self, tables: Sequence[str], vocabs: Dict[str, int], target_col: int,
                 pairs: Sequence[Tuple[str, str]], cfg: Optional[CrossConfig] = None):
        super().__init__(tables, vocabs, target_col, cfg or CrossConfig())
        self.pairs = [(a, b) for a, b in pairs]
        missing = sorted({t for ab in self.pairs for t in ab} - set(vocabs))
        if missing:
            raise ValueError(f"cross pairs name tables without a vocabulary: {missing}")
        self.buckets = int(self.cfg.buckets)

    def cross_columns(self, rec: Dict) -> Tuple[np.ndarray, np.ndarray]:
        """(rows, hashed bucket) of every cross in ``rec``, one entry per (pair, id of a, id of b) in a sample."""
        b = len(rec["labels"])
        ids, offs, single = {}, {}, {}
        for t in {t for ab in self.pairs for t in ab}:
            offs[t] = table_offsets(rec, t)
            ids[t] = to_vocab(rec[f"{t}.values"], self.vocabs[t]).astype(np.uint64)
            single[t] = len(ids[t]) == b and bool((np.diff(offs[t]) == 1).all())
        rows, cols = [], []
        flat = [(p, a, c) for p, (a, c) in enumerate(self.pairs) if single[a] and single[c]]
        if flat:  # one id per sample in both tables: every such pair at once, [b, pairs]
            p_idx = np.array([p for p, _, _ in flat])
            ia = np.stack([ids[a] for _, a, _ in flat], 1)
            ic = np.stack([ids[c] for _, _, c in flat], 1)
            vocab_c = np.array([self.vocabs[c] for _, _, c in flat], dtype=np.uint64)
            with np.errstate(over="ignore"):
                key = ia * vocab_c + ic + (p_idx + 1).astype(np.uint64) * np.uint64(GAMMA)
            rows.append(np.repeat(np.arange(b), len(flat)))
            cols.append((mix64(key).ravel() % np.uint64(self.buckets)).astype(np.int64))
        for p, (a, c) in enumerate(self.pairs):
            if single[a] and single[c]:
                continue
            # bags: every id of a against every id of c in the same sample
            la, lc = np.diff(offs[a]), np.diff(offs[c])
            sa = np.repeat(np.arange(b), la)
            reps = lc[sa]
            r = np.repeat(sa, reps)
            ia = np.repeat(np.arange(len(sa)), reps)  # offsets start at 0: value index
            within = np.arange(len(r)) - np.repeat(np.cumsum(reps) - reps, reps)
            ic = np.repeat(offs[c][:-1][sa], reps) + within
            with np.errstate(over="ignore"):
                key = ids[a][ia] * np.uint64(self.vocabs[c]) + ids[c][ic]
            rows.append(r)
            cols.append((splitmix64(key, p + 1) % np.uint64(self.buckets)).astype(np.int64))
        if not rows:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(rows), np.concatenate(cols)

    def features(self, rec: Dict):
        from scipy.sparse import csr_matrix, hstack

        sp, dense = super().features(rec)
        r, c = self.cross_columns(rec)
        cross = csr_matrix((np.ones(len(r), dtype=self.cfg.dtype), (r, c)), shape=(sp.shape[0], self.buckets))
        cross.sum_duplicates()
        return hstack([sp, cross], format="csr"), dense

    def fit(self, records: Iterable[Dict]) -> "CrossLogisticBaseline":
        super().fit(records)
        self.fit_info.update({"pairs": ["*".join(ab) for ab in self.pairs], "buckets": self.buckets,
                              "hash": "splitmix64(id_a * vocab_b + id_b, pair index + 1) mod buckets"})
        return self


@dataclasses.dataclass
class FMConfig:
    """:class:`FactorizationMachineBaseline`'s settings. The number of epochs is chosen by early stopping on the
    last ``validation_share`` of the training samples (at most ``max_epochs``; stop after ``patience`` epochs
    without a lower logloss there), then the model is refitted on all of them for that many epochs (the eval split
    is never read). The other defaults were chosen on that tail of MovieLens-100K's CTR shards (docs/trainer.md,
    Evaluation)."""

    dim: int = 4
    lr: float = 0.001
    # decoupled weight decay: every parameter row shrinks by (1 - lr * weight_decay) per step
    weight_decay: float = 0.1
    batch_size: int = 1024
    max_epochs: int = 20
    patience: int = 2
    validation_share: float = 0.1
    refit: bool = True
    max_train_samples: int = 400_000
    init_scale: float = 0.01
    seed: int = 0


class FactorizationMachineBaseline:
    """A second-order factorization machine (Rendle, 2010) over the logistic regression's inputs: every id of every
    sparse table the model embeds (bags: each id weighted ``1 / bag length``) and every dense feature (its
    standardised ``sign(x) log1p(|x|)`` as the value), ``logit = b + sum_i w_i x_i + sum_{i<j} <v_i, v_j> x_i x_j``
    with ``v_i`` of ``dim`` values: a pairwise interaction of every pair of inputs (every pair of tables the DLRM is
    given, ``dot_pairs`` among them), each factorised, in ``O(inputs x dim)`` per sample. Parameters exist for the
    inputs the training samples hold only: an input never seen in training adds no term to a prediction.

    Fitted by minibatch Adam in numpy/scipy (single thread, deterministic from ``seed``): the moments of the rows a
    batch touches (lazy Adam), decoupled weight decay on every row every step (applied to a row when next touched,
    and to all before predicting), early stopping on the training tail (:class:`FMConfig`)."""

    def __init__(self, tables: Sequence[str], vocabs: Dict[str, int], target_col: int,
                 cfg: Optional[FMConfig] = None):
        self.tables = list(tables)
        self.vocabs = vocabs
        self.k = target_col
        self.cfg = cfg or FMConfig()
        self.base, self.sparse_cols = column_bases(self.tables, vocabs)

    def _sparse(self, rec: Dict):
        from scipy.sparse import csr_matrix

        b = len(rec["labels"])
        rows, cols, vals = [], [], []
        for t in self.tables:
            off = table_offsets(rec, t)
            lengths = np.diff(off)
            r = np.repeat(np.arange(b), lengths)
            rows.append(r)
            cols.append(self.base[t] + to_vocab(rec[f"{t}.values"], self.vocabs[t]))
            vals.append((1.0 / np.maximum(lengths, 1))[r])
        r, c = np.concatenate(rows), np.concatenate(cols)
        sp = csr_matrix((np.concatenate(vals).astype(np.float32), (r, c)), shape=(b, self.sparse_cols))
        sp.sum_duplicates()
        return sp, dense_transform(rec["dense"])

    def _matrix(self, sparse, dense: np.ndarray):
        from scipy.sparse import csr_matrix, hstack

        dense = csr_matrix(((dense - self.mean) / self.std).astype(np.float32))
        x = hstack([sparse, dense], format="csr").astype(np.float32, copy=False)
        x.sort_indices()
        return x

    def fit(self, records: Iterable[Dict]) -> "FactorizationMachineBaseline":
        from scipy.sparse import vstack

        cfg = self.cfg
        sps, dens, ys, n = [], [], [], 0
        for rec in records:
            sp, d = self._sparse(rec)
            sps.append(sp)
            dens.append(d)
            ys.append(np.asarray(rec["labels"][:, self.k], np.float32))
            n += len(d)
            if n >= cfg.max_train_samples:
                break
        d = np.concatenate(dens)[: cfg.max_train_samples]
        self.mean, self.std = d.mean(0), d.std(0) + 1e-6
        x = self._matrix(vstack(sps, format="csr")[: cfg.max_train_samples], d)
        y = np.concatenate(ys)[: cfg.max_train_samples]
        t0 = time.perf_counter()
        # parameters only for the inputs the training samples hold (an input never seen contributes nothing)
        self.inputs, self.all_inputs = np.unique(x.indices), x.shape[1]
        x = self._compact(x)
        cut = int(len(y) * (1 - cfg.validation_share))
        theta, history = self._train(x[:cut], y[:cut], cfg.max_epochs, (x[cut:], y[cut:]))
        epochs = 1 + int(np.argmin(history)) if history else cfg.max_epochs
        if cfg.refit and history:
            theta, _ = self._train(x, y, epochs)
        self.theta = theta
        self.fit_info = {**dataclasses.asdict(cfg), "epochs": epochs,
                         "validation_logloss": [round(v, 6) for v in history],
                         "train_samples": int(len(y)), "features": int(self.all_inputs),
                         "features_seen": int(len(self.inputs)),
                         "fit_s": round(time.perf_counter() - t0, 3),
                         "library": "numpy/scipy (nestpipe.trainer.baselines.FactorizationMachineBaseline)"}
        return self

    def _compact(self, x):
        """``x`` over the inputs seen in training only (columns renumbered in order; other inputs dropped)."""
        from scipy.sparse import csr_matrix

        seen = self.inputs
        pos = np.minimum(np.searchsorted(seen, x.indices), max(len(seen) - 1, 0))
        hit = seen[pos] == x.indices if len(seen) else np.zeros(len(x.indices), bool)
        indptr = np.concatenate([[0], np.cumsum(hit)])[x.indptr]
        return csr_matrix((x.data[hit], pos[hit], indptr), shape=(x.shape[0], len(seen)))

    def _scores(self, theta: np.ndarray, x) -> np.ndarray:
        return _sigmoid(fm_logits(theta, x, self.cfg.dim).astype(np.float64))

    def _train(self, x, y: np.ndarray, epochs: int, tail=None):
        """``epochs`` of lazy Adam on ``(x, y)`` from the seed's start. With ``tail``: stop early (``patience``),
        return the parameters of the epoch of least tail logloss and every epoch's tail logloss."""
        cfg = self.cfg
        dim, rows = cfg.dim, x.shape[1]
        rng = np.random.default_rng(cfg.seed)
        # one row per input: [v (dim) | w] then the Adam moments of both; row ``rows`` holds the global bias
        theta = np.zeros((rows + 1, dim + 1), np.float32)
        theta[:rows, :dim] = rng.standard_normal((rows, dim)) * cfg.init_scale
        state = np.zeros((rows + 1, 2, dim + 1), np.float32)
        last = np.zeros(rows, np.int64)
        mask, pos = np.zeros(rows, bool), np.zeros(rows, np.int64)
        keep = np.float32(1.0 - cfg.lr * cfg.weight_decay)
        step, history, best = 0, [], None

        def catch_up():
            theta[:rows] *= (keep ** (step - last).astype(np.float32))[:, None]
            last[:] = step

        n = x.shape[0]
        if tail is not None and tail[0].shape[0] == 0:  # too few samples for a tail: no early stopping
            tail = None
        for _ in range(epochs):
            order = rng.permutation(n)
            xs, ys = x[order], y[order]
            for s in range(0, n, cfg.batch_size):
                step += 1
                _lazy_adam_step(theta, state, last, mask, pos, xs[s:s + cfg.batch_size], ys[s:s + cfg.batch_size],
                                step, cfg.lr, keep)
            if tail is None:
                continue
            catch_up()
            history.append(logloss(tail[1], self._scores(theta, tail[0])))
            if best is None or history[-1] < min(history[:-1], default=np.inf):
                best = theta.copy()
            elif len(history) - 1 - int(np.argmin(history)) >= cfg.patience:
                break
        catch_up()
        return (theta if tail is None else best), history

    def predict(self, rec: Dict) -> np.ndarray:
        return self._scores(self.theta, self._compact(self._matrix(*self._sparse(rec))))


def fm_logits(theta: np.ndarray, x, dim: int) -> np.ndarray:
    """A factorization machine's logits for the rows of the CSR matrix ``x`` (columns: inputs): ``theta`` holds one
    row ``[v_i | w_i]`` per input and the bias in its last row's last value. ``sum_{i<j} <v_i, v_j> x_i x_j`` is
    computed as ``((sum_i v_i x_i)^2 - sum_i v_i^2 x_i^2) / 2``."""
    rows = x.shape[1]
    s = np.asarray(x @ theta[:rows])
    sq = np.asarray(x.multiply(x) @ np.square(theta[:rows, :dim]).sum(1))
    return s[:, dim] + theta[rows, dim] + 0.5 * (np.square(s[:, :dim]).sum(1) - sq)


def fm_gradient(th: np.ndarray, bias, x, x2, y: np.ndarray):
    """The gradient of the mean logloss of a minibatch: ``x`` its CSR matrix over the inputs it touches, ``x2`` the
    same with squared values, ``th`` those inputs' rows ``[v_i | w_i]``. Returns (gradient of ``th``, of ``bias``):
    ``d/dv_i = g x_i (sum_j v_j x_j) - g x_i^2 v_i``, ``d/dw_i = g x_i`` summed over the samples,
    ``g = (p - y) / b``."""
    dim = th.shape[1] - 1
    sw = x @ th
    z = sw[:, dim] + bias + 0.5 * (np.square(sw[:, :dim]).sum(1) - x2 @ np.square(th[:, :dim]).sum(1))
    g = ((_sigmoid(z) - y) / x.shape[0]).astype(th.dtype)
    sw[:, :dim] *= g[:, None]  # [g * sum_j v_j x_j | g]
    sw[:, dim] = g
    grad = x.T @ sw
    grad[:, :dim] -= (x2.T @ g)[:, None] * th[:, :dim]
    return grad, g.sum()


def _lazy_adam_step(theta: np.ndarray, state: np.ndarray, last: np.ndarray, mask: np.ndarray, pos: np.ndarray,
                    xb, yb: np.ndarray, step: int, lr: float, keep: np.float32) -> None:
    """One minibatch of the factorization machine's lazy Adam, in place: only the rows of the inputs the batch holds
    move (first the weight decay ``keep`` they are owed since ``last``), then the global bias (row ``rows``, plain
    Adam, no decay). ``theta`` / ``state`` rows are ``[v | w]`` and their two moments; ``mask`` and ``pos`` are
    all-False / scratch arrays of one entry per input row."""
    from scipy.sparse import csr_matrix

    b1, b2, eps = 0.9, 0.999, 1e-8
    rows, dim = theta.shape[0] - 1, theta.shape[1] - 1
    b = xb.shape[0]
    mask[xb.indices] = True
    u = np.flatnonzero(mask)
    mask[u] = False
    pos[u] = np.arange(len(u))
    # the decay a touched row is owed since it was last touched, then this step's
    th = theta.take(u, axis=0) * (keep ** (step - 1 - last[u]).astype(np.float32))[:, None]
    xl = csr_matrix((xb.data, pos[xb.indices], xb.indptr), shape=(b, len(u)))
    x2 = csr_matrix((np.square(xb.data), xl.indices, xl.indptr), shape=(b, len(u)))
    grad, gb = fm_gradient(th, theta[rows, dim], xl, x2, yb)
    st = state.take(u, axis=0)
    st[:, 0] = b1 * st[:, 0] + (1 - b1) * grad
    st[:, 1] = b2 * st[:, 1] + (1 - b2) * np.square(grad)
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    th = th * keep - (lr / c1) * st[:, 0] / (np.sqrt(st[:, 1] / c2) + eps)
    _put_rows(theta, u, th)
    _put_rows(state, u, st)
    last[u] = step
    state[rows, 0, dim] = b1 * state[rows, 0, dim] + (1 - b1) * gb
    state[rows, 1, dim] = b2 * state[rows, 1, dim] + (1 - b2) * gb * gb
    theta[rows, dim] -= (lr / c1) * state[rows, 0, dim] / (np.sqrt(state[rows, 1, dim] / c2) + eps)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` without overflow for large ``|z|``."""
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def _put_rows(a: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """``a[rows] = values`` for the rows of a C-contiguous array, as one fixed-size byte record per row (several
    times faster than numpy's fancy assignment of 2-D rows)."""
    rec = np.dtype((np.void, a[0].nbytes))
    values = np.ascontiguousarray(values, a.dtype).reshape(len(rows), -1)
    a.reshape(len(a), -1).view(rec)[:, 0][rows] = values.view(rec)[:, 0]


def cross_pairs(single_tables: Sequence[str], dot_pairs: Sequence[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """Every unordered pair of ``single_tables`` (sorted), then each of ``dot_pairs`` not already among them."""
    single = sorted(single_tables)
    out = [(single[i], single[j]) for i in range(len(single)) for j in range(i + 1, len(single))]
    seen = {frozenset(ab) for ab in out}
    for a, b in dot_pairs:
        if a != b and frozenset((a, b)) not in seen:
            out.append((a, b))
            seen.add(frozenset((a, b)))
    return out
