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
"""

from __future__ import annotations

import dataclasses
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from nestpipe.datasets.shards import table_offsets
from nestpipe.trainer.embedding.placement import to_vocab


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
    # sparse products reads, the fit's cost (demo data: the same C and AUC 0.63313 against 0.63308 in float64, the
    # fit 22.9-27.0 s against 37.1 s; docs/benchmarks.md).
    dtype: str = "float32"


class LogisticBaseline:
    """Logistic regression over the model's sparse rows (one-hot / multi-hot) and transformed dense features."""

    def __init__(self, tables: Sequence[str], vocabs: Dict[str, int], target_col: int,
                 cfg: Optional[LogisticConfig] = None):
        self.tables = list(tables)
        self.vocabs = vocabs
        self.k = target_col
        self.cfg = cfg or LogisticConfig()
        self.base = {}
        c = 0
        for t in self.tables:
            self.base[t] = c
            c += vocabs[t]
        self.sparse_cols = c

    def features(self, rec: Dict):
        from scipy.sparse import csr_matrix

        b = len(rec["labels"])
        rows, cols = [], []
        for t in self.tables:
            off = table_offsets(rec, t)
            rows.append(np.repeat(np.arange(b), np.diff(off)))
            cols.append(self.base[t] + to_vocab(rec[f"{t}.values"], self.vocabs[t]))
        r, c = np.concatenate(rows), np.concatenate(cols)
        sp = csr_matrix((np.ones(len(r)), (r, c)), shape=(b, self.sparse_cols))
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

        return hstack([sparse, csr_matrix((dense - self.mean) / self.std)]).tocsr().astype(self.cfg.dtype)

    def predict(self, rec: Dict) -> np.ndarray:
        return self.model.predict_proba(self._matrix(*self.features(rec)))[:, 1]
