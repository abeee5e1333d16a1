"""The packed (user, time) sort key gives exactly the total order (user, time, video, src, line)."""

import numpy as np
import polars as pl
import pytest

from nestpipe.ingest import gr


def _frame(rng, n, user_hi, time_lo, time_hi):
    return pl.DataFrame({
        "user_id": rng.integers(0, user_hi, n), "time_ms": rng.integers(time_lo, time_hi, n),
        "video_id": rng.integers(0, 5, n), "src": rng.integers(0, 3, n).astype(np.int16),
        "line": rng.permutation(n).astype(np.int64), "payload": np.arange(n),
    })


@pytest.mark.parametrize("user_hi,time_lo,time_hi", [
    (50, 1_650_000_000_000, 1_650_000_000_040),  # packed path, many (user, time) ties
    ((1 << 21) + 5, 0, 30),                       # user ids too large: unpacked path
    (50, -20, 20),                                # negative times: unpacked path
    (50, 0, 1 << 40),                             # packed path without ties: the one-key sort is the order
])
def test_sort_interactions_equals_the_five_key_sort(user_hi, time_lo, time_hi):
    df = _frame(np.random.default_rng(0), 5000, user_hi, time_lo, time_hi)
    assert gr.sort_interactions(df).equals(df.sort(gr.SORT_KEYS))


def test_sort_interactions_negative_control_overlapping_fields_break_the_order(monkeypatch):
    df = _frame(np.random.default_rng(1), 5000, 50, 0, 1 << 20)
    monkeypatch.setattr(gr, "TIME_BITS", 8)  # times >= 2**8 now spill into the user bits
    monkeypatch.setattr(gr, "_packable", lambda _df: True)  # as if the range check were missing
    assert not gr.sort_interactions(df).equals(df.sort(gr.SORT_KEYS))


def test_byte_counts_equal_bytes_count_across_block_edges():
    from nestpipe.ingest import parse

    rng = np.random.default_rng(3)
    for n in (0, 1, parse._COUNT_BLOCK - 1, parse._COUNT_BLOCK, 2 * parse._COUNT_BLOCK + 17):
        data = bytes(rng.choice(np.frombuffer(b'ab,\n"', dtype=np.uint8), n).tolist())
        assert parse.byte_counts(data, (10, 44, 34)) == [data.count(b"\n"), data.count(b","), data.count(b'"')]
        assert parse.count_lines(data) == data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def test_sort_interactions_negative_control_one_key_sort_alone_misorders_ties(monkeypatch):
    df = _frame(np.random.default_rng(2), 5000, 50, 1_650_000_000_000, 1_650_000_000_040)  # many ties
    one_key = df.with_columns((pl.col("user_id") * (1 << gr.TIME_BITS) + pl.col("time_ms")).alias("k")).sort(
        "k", maintain_order=True).drop("k")
    assert not one_key.equals(df.sort(gr.SORT_KEYS))  # what the tie check falls back from
    assert gr.sort_interactions(df).equals(df.sort(gr.SORT_KEYS))
