"""Small files in each public format's published layout, written from one set of interactions (MovieLens 100K, 1M
and the CSV releases, atomic files, Amazon ratings CSV and review JSON lines of 2014 and 2023): what the format
converters are tested on, and what the fault campaign fuzzes (``benchmarks/chaos_ingest.py``). Not real data: ids,
ratings and times drawn from a seed."""

from __future__ import annotations

import gzip
import json
import os
from typing import Dict

import numpy as np

from nestpipe.ingest.formats.movielens import GENRES_100K, OCCUPATIONS_100K, age_group

GENRES = ["Action", "Children's", "Comedy", "Drama", "Film-Noir", "Sci-Fi"]  # a subset of GENRES_100K, in its order
USERS, ITEMS = 30, 50


def sample_events(seed: int = 7) -> Dict:
    """(user, item, rating, seconds) rows in a shuffled file order; every user's times distinct; per item its genres
    in GENRES_100K order; per user (age, gender, occupation)."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(1, USERS + 1):
        n = int(rng.integers(8, 26))
        items = rng.choice(np.arange(1, ITEMS + 1), size=n, replace=False)
        times = 880_000_000 + np.sort(rng.choice(5_000_000, size=n, replace=False))
        rows += [(u, int(i), int(rng.integers(1, 6)), int(t)) for i, t in zip(items, times)]
    rows = [rows[k] for k in rng.permutation(len(rows))]
    genres = {i: sorted(rng.choice(len(GENRES), size=int(rng.integers(1, 4)), replace=False).tolist())
              for i in range(1, ITEMS + 1)}
    genres = {i: [GENRES[k] for k in g] for i, g in genres.items()}
    people = {u: (int(rng.integers(7, 70)), "FM"[int(rng.integers(0, 2))], OCCUPATIONS_100K[int(rng.integers(0, 21))])
              for u in range(1, USERS + 1)}
    return {"rows": rows, "genres": genres, "people": people}


def _write(path, lines, encoding="utf-8", gz=False):
    data = "".join(line + "\n" for line in lines).encode(encoding)
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(data)


def write_ml100k(d, ev):
    os.makedirs(d, exist_ok=True)
    _write(os.path.join(d, "u.data"), [f"{u}\t{i}\t{r}\t{t}" for u, i, r, t in ev["rows"]], "latin-1")
    _write(os.path.join(d, "u.item"), [
        "|".join([str(i), f"Movie {i} (1995)", "01-Jan-1995", "", "http://x"]
                 + ["1" if g in ev["genres"][i] else "0" for g in GENRES_100K]) for i in range(1, ITEMS + 1)],
        "latin-1")
    _write(os.path.join(d, "u.user"), [f"{u}|{a}|{g}|{o}|00000" for u, (a, g, o) in ev["people"].items()])
    return d


def write_ml1m(d, ev):
    os.makedirs(d, exist_ok=True)
    _write(os.path.join(d, "ratings.dat"), [f"{u}::{i}::{r}::{t}" for u, i, r, t in ev["rows"]], "latin-1")
    _write(os.path.join(d, "movies.dat"), [f"{i}::Cité {i}, The (1995)::{'|'.join(ev['genres'][i])}"
                                           for i in range(1, ITEMS + 1)], "latin-1")
    starts = (1, 18, 25, 35, 45, 50, 56)
    _write(os.path.join(d, "users.dat"), [f"{u}::{g}::{starts[age_group(a)]}::{OCCUPATIONS_100K.index(o)}::00000"
                                          for u, (a, g, o) in ev["people"].items()], "latin-1")
    return d


def write_ml_csv(d, ev):
    os.makedirs(d, exist_ok=True)
    _write(os.path.join(d, "ratings.csv"), ["userId,movieId,rating,timestamp"]
           + [f"{u},{i},{r:.1f},{t}" for u, i, r, t in ev["rows"]])
    _write(os.path.join(d, "movies.csv"), ["movieId,title,genres"]
           + [f'{i},"Movie {i}, The (1995)",{"|".join(ev["genres"][i])}' for i in range(1, ITEMS + 1)])
    return d


def _tok(kind, x):
    return f"{kind}{x:03d}"


def write_atomic(d, ev):
    os.makedirs(d, exist_ok=True)
    _write(os.path.join(d, "mini.inter"), ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
           + [f"{_tok('u', u)}\t{_tok('i', i)}\t{r}\t{t}" for u, i, r, t in ev["rows"]])
    _write(os.path.join(d, "mini.item"), ["item_id:token\tmovie_title:token_seq\tclass:token_seq"]
           + [f"{_tok('i', i)}\tMovie {i}\t{' '.join(ev['genres'][i])}" for i in range(1, ITEMS + 1)])
    _write(os.path.join(d, "mini.user"), ["user_id:token\tage:token\tgender:token\toccupation:token"]
           + [f"{_tok('u', u)}\t{a}\t{g}\t{o}" for u, (a, g, o) in ev["people"].items()])
    return d


def _meta(d, ev, gz=False):
    _write(os.path.join(d, "meta_Mini.jsonl" + (".gz" if gz else "")), [
        json.dumps({"parent_asin": _tok("i", i), "main_category": ev["genres"][i][0],
                    "categories": [ev["genres"][i]]}) for i in range(1, ITEMS + 1)], gz=gz)


def write_amazon_csv(d, ev):
    os.makedirs(d, exist_ok=True)
    _write(os.path.join(d, "ratings_Mini.csv"), [f"{_tok('u', u)},{_tok('i', i)},{r}.0,{t}"
                                                 for u, i, r, t in ev["rows"]])
    _meta(d, ev)
    return d


def write_amazon_jsonl_2014(d, ev):
    os.makedirs(d, exist_ok=True)
    _write(os.path.join(d, "reviews_Mini_5.json"), [
        json.dumps({"reviewerID": _tok("u", u), "asin": _tok("i", i), "overall": float(r), "unixReviewTime": t,
                    "reviewText": "fine, really"}) for u, i, r, t in ev["rows"]])
    _meta(d, ev)
    return d


def write_amazon_jsonl_2023(d, ev):
    os.makedirs(d, exist_ok=True)
    _write(os.path.join(d, "Mini.jsonl.gz"), [
        json.dumps({"rating": float(r), "title": "ok", "asin": "X" + _tok("i", i), "parent_asin": _tok("i", i),
                    "user_id": _tok("u", u), "timestamp": t * 1000}) for u, i, r, t in ev["rows"]], gz=True)
    _meta(d, ev, gz=True)
    return d


WRITERS = {
    ("movielens", "ml-100k"): write_ml100k, ("movielens", "ml-1m"): write_ml1m,
    ("movielens", "ml-latest"): write_ml_csv, ("atomic", "mini"): write_atomic,
    ("amazon", "ratings-csv"): write_amazon_csv, ("amazon", "reviews-jsonl"): write_amazon_jsonl_2014,
    ("amazon", "reviews-jsonl-2023"): write_amazon_jsonl_2023,
}
