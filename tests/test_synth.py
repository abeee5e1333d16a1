"""Synthetic KuaiRand generator: exact format, determinism, shuffled rows, and the planted structure (each structural
check comes with a negative control that switches the structure off and shows the check then fails)."""

import dataclasses
import datetime as dt
import hashlib
import os

import numpy as np
import polars as pl
import pytest

from nestpipe.cli import main as cli_main
from nestpipe.datasets import kuairand, synth

BEIJING = dt.timezone(dt.timedelta(hours=8))


def _generate(tmp_path_factory, name, **overrides):
    out = tmp_path_factory.mktemp(name) / "raw"
    cfg = synth.SynthConfig.for_scale(overrides.pop("scale", "tiny"), **overrides)
    result = synth.generate(str(out), config=cfg, progress=False)
    return out, cfg, result


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _generate(tmp_path_factory, "tiny")


def _read(out, kind):
    k = kuairand.FILE_KINDS_BY_NAME[kind]
    return pl.concat([pl.read_csv(out / n, schema=k.dtypes) for n in k.names["27k"]])


def _digest(out):
    return {n: hashlib.sha256((out / n).read_bytes()).hexdigest() for n in synth.ALL_FILES}


# --------------------------------------------------------------------------------------------- measurements
def in_community_share(log: pl.DataFrame, cfg) -> float:
    """Share of interactions whose video lies in the catalogue of the user's planted community."""
    users = synth.user_communities(cfg)[log["user_id"].to_numpy()]
    return float(np.mean(synth.video_communities(cfg, log["video_id"].to_numpy()) == users))


def popularity_slope(log: pl.DataFrame, lo=5, hi=500) -> float:
    """Least-squares slope of log(count) against log(rank) over popularity ranks lo..hi."""
    counts = np.sort(log["video_id"].value_counts()["count"].to_numpy())[::-1]
    rank = np.arange(1, len(counts) + 1)
    sel = (rank >= lo) & (rank <= min(hi, len(counts)))
    return float(np.polyfit(np.log(rank[sel]), np.log(counts[sel]), 1)[0])


def click_rates(log: pl.DataFrame, cfg):
    users = synth.user_communities(cfg)[log["user_id"].to_numpy()]
    match = synth.video_communities(cfg, log["video_id"].to_numpy()) == users
    click = log["is_click"].to_numpy()
    return float(click[match].mean()), float(click[~match].mean())


def successor_pairs(log: pl.DataFrame, cfg) -> np.ndarray:
    """For each consecutive pair of a user's chronological history: is the next item the planted successor?"""
    s = log.sort(["user_id", "time_ms"])
    slots = synth.video_slots(cfg, s["video_id"].to_numpy())
    same_user = s["user_id"].to_numpy()[1:] == s["user_id"].to_numpy()[:-1]
    is_succ = synth._successor(cfg, slots[:-1]) == slots[1:]
    return is_succ[same_user]


def fraction_ascending(values: np.ndarray) -> float:
    return float(np.mean(np.diff(values) >= 0))


def is_unsorted(values: np.ndarray) -> bool:
    """Neither ascending nor descending, and adjacent pairs ascend about half of the time (a shuffled column)."""
    f = fraction_ascending(values)
    return 0.35 < f < 0.65


# --------------------------------------------------------------------------------------------- format
def test_generate_returns_paths_and_counts_matching_the_files(tiny):
    out, cfg, result = tiny
    assert sorted(os.listdir(out)) == sorted(synth.ALL_FILES)  # nothing else left behind (no temp files)
    found = kuairand.discover(str(out))
    assert {k: [os.path.abspath(p) for p in v] for k, v in result["files"].items()} == found.files
    c = result["counts"]
    assert _read(out, "log_standard").height == c["log_standard_rows"]
    assert _read(out, "log_random").height == c["log_random_rows"]
    assert c["interactions"] == cfg.interactions == 30_000
    assert c["log_random_rows"] == round(cfg.interactions * cfg.random_fraction)
    for name, n in c["rows_per_log_file"].items():
        assert pl.read_csv(out / name, schema=kuairand.LOG_DTYPES).height == n > 0
    assert _read(out, "user_features").height == cfg.num_users
    assert _read(out, "video_features_basic").height == cfg.num_videos
    assert _read(out, "video_features_statistic").height == cfg.num_videos


def test_log_values_have_the_published_formats(tiny):
    out, cfg, _ = tiny
    for kind in ("log_standard", "log_random"):
        log = _read(out, kind)
        assert log.null_count().sum_horizontal().item() == 0
        assert log["user_id"].min() >= 0 and log["user_id"].max() < cfg.num_users
        assert log["video_id"].min() >= 0 and log["video_id"].max() < cfg.num_videos
        sample = log.sample(500, seed=0)
        for date, hourmin, t in sample.select("date", "hourmin", "time_ms").iter_rows():
            local = dt.datetime.fromtimestamp(t / 1000, BEIJING)
            assert date == int(local.strftime("%Y%m%d")) and hourmin == local.hour * 100
        assert log["hourmin"].is_in([h * 100 for h in range(24)]).all()
        for flag in kuairand.ACTION_FLAGS + ["is_rand"]:
            assert log[flag].is_in([0, 1]).all(), flag
        assert (log["play_time_ms"] >= 0).all() and (log["duration_ms"] > 0).all()
        assert log["tab"].min() >= 0 and log["tab"].max() <= 14
    std, rnd = _read(out, "log_standard"), _read(out, "log_random")
    assert (std["is_rand"] == 0).all() and (rnd["is_rand"] == 1).all()
    assert rnd["date"].min() >= 20220422 and rnd["date"].max() <= 20220508
    assert std["date"].min() == 20220408 and std["date"].max() == 20220508
    # play_time_ms sometimes exceeds duration_ms (replays), but not always.
    assert 0.05 < (std["play_time_ms"] > std["duration_ms"]).mean() < 0.7
    # The standard logs are split by their date ranges.
    for name in kuairand.FILE_KINDS_BY_NAME["log_standard"].names["27k"]:
        d = pl.read_csv(out / name, schema=kuairand.LOG_DTYPES)["date"]
        lo, hi = (20220408, 20220421) if "4_08_to_4_21" in name else (20220422, 20220508)
        assert d.min() >= lo and d.max() <= hi, name
    # A raw line: integers only.
    line = (out / "log_standard_4_08_to_4_21_27k_part1.csv").read_text().split("\n")[1]
    assert all(v.isdigit() for v in line.split(",")) and len(line.split(",")) == 19


def test_duration_in_logs_matches_video_basic_table(tiny):
    out, _, _ = tiny
    log = _read(out, "log_standard").select("video_id", "duration_ms").unique()
    basic = _read(out, "video_features_basic").select("video_id", "video_duration")
    joined = log.join(basic, on="video_id", how="left")
    assert joined["video_duration"].null_count() < 0.05 * joined.height  # ~1% of durations are empty cells
    have = joined.drop_nulls()
    assert (have["video_duration"] == have["duration_ms"].cast(pl.Float64)).all()


def test_user_features_have_range_strings_categories_and_empty_cells(tiny):
    out, cfg, _ = tiny
    raw = (out / "user_features_27k.csv").read_text()
    assert '"(10,50]"' in raw  # ranges with a comma are quoted, like the published file
    u = _read(out, "user_features")
    assert sorted(u["user_id"].to_list()) == list(range(cfg.num_users))
    assert set(u["user_active_degree"].unique()) <= {"high_active", "full_active", "middle_active", "UNKNOWN"}
    assert u["user_active_degree"].n_unique() == 4
    assert set(u["follow_user_num_range"].unique()) <= set(synth._FOLLOW_BINS[1])
    assert "500+" in synth._FOLLOW_BINS[1] and "61-90" in synth._REGISTER_BINS[1]
    assert u["register_days_range"].n_unique() >= 5
    assert u["onehot_feat4"].null_count() > 0 and u["fans_user_num_range"].null_count() > 0
    for i, card in enumerate(kuairand.USER_ONEHOT_CARDINALITY):
        col = u[f"onehot_feat{i}"].drop_nulls()
        assert col.min() >= 0 and col.max() < card, i
    for c in ("is_lowactive_period", "is_live_streamer", "is_video_author"):
        assert u[c].is_in([0, 1]).all()


def test_video_basic_has_quoted_tags_types_and_empty_float_durations(tiny):
    out, cfg, _ = tiny
    raw = (out / "video_features_basic_27k.csv").read_text()
    assert raw.count('"') > 100  # multi-tag cells are quoted
    v = _read(out, "video_features_basic")
    assert sorted(v["video_id"].to_list()) == list(range(cfg.num_videos))
    assert set(v["video_type"].unique()) == {"NORMAL", "AD"}
    assert 0 < v["video_duration"].null_count() < 0.05 * v.height
    assert v["video_duration"].dtype == pl.Float64 and ".0," in raw
    tags = v["tag"].str.split(",")
    assert (tags.list.len() >= 2).sum() > 0.2 * v.height and v["tag"].null_count() == 0
    ids = tags.explode().cast(pl.Int64)
    assert ids.min() >= 0 and ids.max() < synth.NUM_TAGS
    assert v["upload_dt"].str.contains(r"^\d{4}-\d{2}-\d{2}$").all()


def test_video_statistics_are_plausible(tiny):
    out, _, _ = tiny
    s = _read(out, "video_features_statistic")
    assert s.null_count().sum_horizontal().item() == 0
    assert (s["show_cnt"] >= s["play_cnt"]).all()
    assert (s["play_cnt"] >= s["valid_play_cnt"]).all() and (s["play_cnt"] >= s["complete_play_cnt"]).all()
    assert (s["valid_play_cnt"] >= s["long_time_play_cnt"]).all()
    assert (s["play_cnt"] >= s["long_time_play_cnt"] + s["short_time_play_cnt"]).all()
    assert (s["play_cnt"] >= s["like_cnt"]).all()
    assert (s["like_cnt"] == s["click_like_cnt"] + s["double_click_cnt"]).all()
    assert (s["comment_cnt"] == s["direct_comment_cnt"] + s["reply_comment_cnt"]).all()
    assert (s["share_all_cnt"] >= s["share_cnt"]).all()
    for c in kuairand.VIDEO_STAT_COLUMNS:
        if c.endswith("_user_num"):
            cnt = c.replace("_user_num", "_cnt")
            if cnt in s.columns:
                assert (s[c] <= s[cnt]).all(), c
    assert s["play_progress"].dtype == pl.Float64 and s["play_progress"].max() <= 1.3
    assert (s["comment_stay_duration"] >= 0).all()
    # Popular (head) videos are shown more.
    cfg = synth.SynthConfig.for_scale("tiny")
    head = synth.video_communities(cfg, s["video_id"].to_numpy()) == -1
    assert s["show_cnt"].to_numpy()[head].mean() > 3 * s["show_cnt"].to_numpy()[~head].mean()


def test_interactions_override(tmp_path):
    r = synth.generate(str(tmp_path / "o"), scale="tiny", interactions=1_234, progress=False)
    assert r["counts"]["interactions"] == 1_234
    total = sum(pl.read_csv(p, schema=kuairand.LOG_DTYPES).height
                for p in r["files"]["log_standard"] + r["files"]["log_random"])
    assert total == 1_234


def test_config_validation_errors_name_the_argument():
    with pytest.raises(ValueError, match="unknown scale 'huge'"):
        synth.SynthConfig.for_scale("huge")
    with pytest.raises(ValueError, match="in_community_prob"):
        synth.SynthConfig.for_scale("tiny", in_community_prob=1.5)
    with pytest.raises(ValueError, match="interactions"):
        synth.SynthConfig.for_scale("tiny", interactions=-1)
    with pytest.raises(ValueError, match="session_topics must be in"):
        synth.SynthConfig.for_scale("tiny", session_topics=-2)
    with pytest.raises(ValueError, match="topic_prob"):
        synth.SynthConfig.for_scale("tiny", session_topics=8, topic_prob=1.2)


def test_27k_scale_uses_the_real_vocabulary():
    cfg = synth.SynthConfig.for_scale("27k")
    assert (cfg.num_users, cfg.num_videos) == (kuairand.VOCAB["27k"]["users"], kuairand.VOCAB["27k"]["videos"])
    assert cfg.interactions == 50_000_000
    assert synth.SynthConfig.for_scale("27k", interactions=7).interactions == 7


# --------------------------------------------------------------------------------------------- determinism, order
def test_same_seed_gives_identical_bytes_and_another_seed_differs(tiny, tmp_path):
    out, _, _ = tiny
    again = tmp_path / "again"
    synth.generate(str(again), scale="tiny", seed=0, progress=False)
    assert _digest(again) == _digest(out)
    other = tmp_path / "other"
    synth.generate(str(other), scale="tiny", seed=1, progress=False)
    a, b = _digest(out), _digest(other)
    assert all(a[n] != b[n] for n in synth.ALL_FILES)


def test_chunked_generation_is_deterministic_with_small_chunks(tmp_path):
    """Many chunks and spill buckets (the 27k code path) also reproduce byte for byte."""
    cfg = synth.SynthConfig.for_scale("tiny", chunk_rows=2_000, bucket_rows=3_000, video_chunk_rows=700)
    a, b = tmp_path / "a", tmp_path / "b"
    ra = synth.generate(str(a), config=cfg, progress=False)
    synth.generate(str(b), config=cfg, progress=False)
    assert _digest(a) == _digest(b)
    assert ra["counts"]["interactions"] == cfg.interactions
    assert _read(a, "video_features_statistic")["video_id"].n_unique() == cfg.num_videos
    assert sorted(os.listdir(a)) == sorted(synth.ALL_FILES)


def test_log_rows_are_not_sorted_by_user_or_time(tiny):
    out, _, _ = tiny
    for name in synth.LOG_FILES:
        log = pl.read_csv(out / name, schema=kuairand.LOG_DTYPES)
        for col in ("user_id", "time_ms", "video_id"):
            assert is_unsorted(log[col].to_numpy()), (name, col)
    # Negative control: the check flags sorted and user-blocked files.
    log = _read(out, "log_standard")
    assert not is_unsorted(log.sort("user_id")["user_id"].to_numpy())
    assert not is_unsorted(log.sort("time_ms")["time_ms"].to_numpy())
    assert not is_unsorted(log.sort(["user_id", "time_ms"])["user_id"].to_numpy())


# --------------------------------------------------------------------------------------------- planted structure
def test_in_community_share_is_near_the_configured_value(tiny, tmp_path_factory):
    out, cfg, _ = tiny
    share = in_community_share(_read(out, "log_standard"), cfg)
    assert abs(share - cfg.in_community_prob) < 0.03, share
    # Negative control: with communities disabled the measured share collapses to about 0.8 / num_communities.
    off, cfg_off, _ = _generate(tmp_path_factory, "nocomm", communities=False)
    share_off = in_community_share(_read(off, "log_standard"), cfg_off)
    assert share_off < 0.25 and abs(share_off - cfg_off.in_community_prob) > 0.5, share_off


def test_popularity_follows_zipf_with_exponent_about_1_2(tiny, tmp_path_factory):
    out, cfg, _ = tiny
    slope = popularity_slope(_read(out, "log_standard"))
    assert abs(slope + cfg.zipf_exponent) < 0.2, slope
    # Negative control: uniform popularity inside catalogues gives a much flatter curve.
    flat, _, _ = _generate(tmp_path_factory, "flat", zipf_exponent=0.0)
    slope_flat = popularity_slope(_read(flat, "log_standard"))
    assert abs(slope_flat + 1.2) > 0.5, slope_flat


def test_feedback_is_more_positive_in_community(tiny, tmp_path_factory):
    out, cfg, _ = tiny
    log = _read(out, "log_standard")
    inside, outside = click_rates(log, cfg)
    assert inside > outside + 0.15, (inside, outside)
    users = synth.user_communities(cfg)[log["user_id"].to_numpy()]
    match = synth.video_communities(cfg, log["video_id"].to_numpy()) == users
    for col in ("long_view", "is_like"):
        x = log[col].to_numpy()
        assert x[match].mean() > x[~match].mean() + 0.05, col
    hate = log["is_hate"].to_numpy()
    assert hate[match].mean() < hate[~match].mean()
    # Negative control: without the click boost the click-rate gap disappears.
    off, cfg_off, _ = _generate(tmp_path_factory, "noboost", click_community_boost=0.0)
    inside_off, outside_off = click_rates(_read(off, "log_standard"), cfg_off)
    assert inside_off < outside_off + 0.05, (inside_off, outside_off)


def test_taste_match_is_a_cross_and_moves_clicks_only(tiny, tmp_path_factory):
    """``click_taste_boost``: clicks follow the latent taste match ``t_uv`` (a user x video cross: it varies inside
    every user and every video), the item sequences stay the same; negative control: the default data (the term off,
    ``click_taste_boost = 0``) does not follow it, by the per-video nor by the author's match."""
    out, cfg, _ = tiny
    assert cfg.click_taste_boost == 0.0  # the default: the click model without the taste term
    cfg_video = dataclasses.replace(cfg, click_taste_of="video")
    log = _read(out, "log_standard").sort(["user_id", "time_ms", "video_id"])
    u, v = log["user_id"].to_numpy(), log["video_id"].to_numpy()
    t = synth.taste_match(cfg_video, u, v)
    assert abs(t.mean()) < 0.1 and abs(t.std() - 1) < 0.1  # the logged pairs repeat the popular videos
    # not a function of the user alone, nor of the video alone: most of its variance is inside each
    within_user = pl.DataFrame({"g": u, "t": t}).group_by("g").agg(pl.col("t").var())["t"].drop_nulls().mean()
    within_video = pl.DataFrame({"g": v, "t": t}).group_by("g").agg(pl.col("t").var())["t"].drop_nulls().mean()
    assert within_user > 0.8 and within_video > 0.5, (within_user, within_video)

    def gap(lg, c):
        x = synth.taste_match(c, lg["user_id"].to_numpy(), lg["video_id"].to_numpy())
        y = lg["is_click"].to_numpy()
        return y[x > 0.7].mean() - y[x < -0.7].mean()

    assert abs(gap(log, cfg_video)) < 0.03 and abs(gap(log, cfg)) < 0.03  # negative control: the default, term off
    on, cfg_on, _ = _generate(tmp_path_factory, "taste", click_taste_boost=1.0, click_taste_of="video")
    log_on = _read(on, "log_standard").sort(["user_id", "time_ms", "video_id"])
    assert gap(log_on, cfg_on) > 0.2
    assert log_on["video_id"].to_list() == log["video_id"].to_list()  # the same items, only the clicks move


def test_author_taste_is_a_user_x_author_cross(tmp_path_factory):
    """``click_taste_of = "author"`` (with ``--set click_taste_boost=1.0``): a video's taste vector is its author's
    (the ``author_id`` the basic feature table lists), so ``t_uv`` is one value per (user, author) and still varies
    inside every user and every author's audience; clicks follow it. Negative control: the per-video match of the same
    data does not explain the clicks."""
    out, cfg, _ = _generate(tmp_path_factory, "taste-author", click_taste_boost=1.0)
    assert cfg.click_taste_of == "author"
    basic = _read(out, "video_features_basic")
    assert (synth.video_authors(cfg, basic["video_id"].to_numpy()) == basic["author_id"].to_numpy()).all()
    log = _read(out, "log_standard")
    u, v = log["user_id"].to_numpy(), log["video_id"].to_numpy()
    t = synth.taste_match(cfg, u, v)
    a = synth.video_authors(cfg, v)
    per_pair = pl.DataFrame({"u": u, "a": a, "t": t}).group_by(["u", "a"]).agg(pl.col("t").n_unique())["t"]
    assert per_pair.max() == 1  # one value per (user, author)
    within_author = pl.DataFrame({"g": a, "t": t}).group_by("g").agg(pl.col("t").var())["t"].drop_nulls().mean()
    assert within_author > 0.5, within_author
    y = log["is_click"].to_numpy()
    gap = y[t > 0.7].mean() - y[t < -0.7].mean()
    by_video = synth.taste_match(dataclasses.replace(cfg, click_taste_of="video"), u, v)
    gap_video = y[by_video > 0.7].mean() - y[by_video < -0.7].mean()
    assert gap > 0.2 and abs(gap_video) < 0.05, (gap, gap_video)
    with pytest.raises(ValueError, match="click_taste_of 'tag'"):
        synth.taste_match(dataclasses.replace(cfg, click_taste_of="tag"), u, v)


def test_sessions_contain_fixed_successor_transitions(tiny, tmp_path_factory):
    out, cfg, _ = tiny
    log = _read(out, "log_standard")
    succ = successor_pairs(log, cfg)
    expected = cfg.successor_prob * (1 - 1 / cfg.mean_session_length)
    assert abs(succ.mean() - expected) < 0.04, succ.mean()
    # Successor transitions get more clicks than fresh draws.
    s = log.sort(["user_id", "time_ms"])
    same_user = s["user_id"].to_numpy()[1:] == s["user_id"].to_numpy()[:-1]
    click_next = s["is_click"].to_numpy()[1:][same_user]
    assert click_next[succ].mean() > click_next[~succ].mean() + 0.05
    # Negative control: with successor_prob = 0 the measured rate falls to chance.
    off, cfg_off, _ = _generate(tmp_path_factory, "nosucc", successor_prob=0.0)
    assert successor_pairs(_read(off, "log_standard"), cfg_off).mean() < 0.05


def _hit_rates(log: pl.DataFrame, k=10):
    """Leave-last-out next-item HR@k: global most-popular vs a trained bigram + personal-history model."""
    s = log.sort(["user_id", "time_ms"])
    users, items = s["user_id"].to_numpy(), s["video_id"].to_numpy()
    last = np.flatnonzero(np.r_[users[1:] != users[:-1], True])
    train = np.ones(len(s), dtype=bool)
    train[last] = False
    pop = np.bincount(items[train], minlength=items.max() + 1)
    top_pop = np.argsort(-pop, kind="stable")[:k]
    # "Training": transition counts prev -> next over training pairs of the same user.
    pair = train[1:] & train[:-1] & (users[1:] == users[:-1])
    trans = pl.DataFrame({"a": items[:-1][pair], "b": items[1:][pair]}).group_by("a", "b").len()
    trans = trans.sort(["a", "len", "b"], descending=[False, True, False])
    by_prev = {a: g["b"].to_list() for (a,), g in trans.group_by("a")}
    hit_pop = hit_seq = 0
    start = 0
    for end in last:
        hist = items[start:end]
        target = items[end]
        hit_pop += target in top_pop
        cands = list(by_prev.get(items[end - 1], []))[:k] if end > start else []
        if len(cands) < k:  # back-fill with the items most frequent in the user's own history, then popularity
            vals, cnt = np.unique(hist, return_counts=True)
            for v in list(vals[np.argsort(-cnt, kind="stable")]) + list(top_pop):
                if len(cands) >= k:
                    break
                if v not in cands:
                    cands.append(v)
        hit_seq += target in cands
        start = end + 1
    return hit_pop / len(last), hit_seq / len(last)


def test_sequential_model_beats_most_popular(tmp_path_factory):
    out, _, _ = _generate(tmp_path_factory, "small", scale="small")
    hr_pop, hr_seq = _hit_rates(_read(out, "log_standard"))
    assert hr_seq > 2 * hr_pop and hr_seq > 0.1, (hr_pop, hr_seq)
    # Negative control: with no communities and no transitions the trained model loses its edge.
    off, _, _ = _generate(tmp_path_factory, "small_off", scale="small", communities=False, successor_prob=0.0)
    hr_pop_off, hr_seq_off = _hit_rates(_read(off, "log_standard"))
    assert hr_seq_off < 1.3 * hr_pop_off, (hr_pop_off, hr_seq_off)


def _cluster_users(log: pl.DataFrame, cfg):
    """k-means over users' item-count vectors (TF-IDF, L2); adjusted Rand index against the planted communities."""
    from sklearn.cluster import KMeans
    from sklearn.feature_extraction.text import TfidfTransformer
    from sklearn.metrics import adjusted_rand_score
    from scipy.sparse import csr_matrix

    agg = log.group_by("user_id", "video_id").len()
    x = csr_matrix((agg["len"].to_numpy(), (agg["user_id"].to_numpy(), agg["video_id"].to_numpy())),
                   shape=(cfg.num_users, cfg.num_videos))
    x = TfidfTransformer().fit_transform(x)
    labels = KMeans(cfg.num_communities, n_init=5, random_state=0).fit_predict(x)
    return adjusted_rand_score(synth.user_communities(cfg), labels)


def test_user_communities_are_recoverable_by_clustering(tiny, tmp_path_factory):
    out, cfg, _ = tiny
    ari = _cluster_users(_read(out, "log_standard"), cfg)
    assert ari > 0.8, ari
    off, cfg_off, _ = _generate(tmp_path_factory, "nocomm2", communities=False)
    ari_off = _cluster_users(_read(off, "log_standard"), cfg_off)
    assert ari_off < 0.2, ari_off


def test_community_helpers_are_consistent(tiny):
    _, cfg, _ = tiny
    comm = synth.user_communities(cfg)
    assert comm.shape == (cfg.num_users,) and comm.min() >= 0 and comm.max() < cfg.num_communities
    assert np.array_equal(comm, synth.user_communities(cfg))
    cat = synth.community_catalogue(cfg, 3)
    assert len(cat) == cfg.catalogue_size and (synth.video_communities(cfg, cat) == 3).all()
    assert (synth.video_communities(cfg, synth.head_catalogue(cfg)) == -1).all()
    ids = np.arange(cfg.num_videos)
    assert np.array_equal(np.sort(synth._Layout.build(cfg).slot_to_video(ids)), ids)  # a bijection


# --------------------------------------------------------------------------------------------- CLI
def test_synth_command_writes_and_refuses_a_foreign_directory(tmp_path, capsys):
    out = tmp_path / "raw"
    assert cli_main(["synth", "--out", str(out), "--scale", "tiny", "--seed", "3", "--quiet"]) == 0
    assert "wrote 10 KuaiRand-27K files" in capsys.readouterr().out
    kuairand.discover(str(out))
    # Rerunning into its own output is allowed (it holds only generated files).
    assert cli_main(["synth", "--out", str(out), "--scale", "tiny", "--interactions", "500", "--quiet"]) == 0
    assert sum(1 for _ in open(out / synth.LOG_FILES[0])) < 500
    # Leftovers of an interrupted run are its own files too.
    (out / (synth.LOG_FILES[4] + ".partial")).write_text("truncated")
    assert cli_main(["synth", "--out", str(out), "--scale", "tiny", "--quiet"]) == 0
    assert not (out / (synth.LOG_FILES[4] + ".partial")).exists()
    # A directory with other files is refused unless --force, and the foreign file is named.
    (out / "notes.txt").write_text("keep me")
    assert cli_main(["synth", "--out", str(out), "--scale", "tiny", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "notes.txt" in err and "--force" in err
    assert cli_main(["synth", "--out", str(out), "--scale", "tiny", "--quiet", "--force"]) == 0
    assert (out / "notes.txt").read_text() == "keep me"


def test_synth_set_applies_a_generator_setting_and_refuses_others(tmp_path, tiny, capsys):
    out = tmp_path / "taste"
    assert cli_main(["synth", "--out", str(out), "--scale", "tiny", "--quiet", "--set", "click_taste_boost=0.5"]) == 0
    want = tmp_path / "want"
    synth.generate(str(want), config=synth.SynthConfig.for_scale("tiny", click_taste_boost=0.5), progress=False)
    assert _digest(out) == _digest(want) != _digest(tiny[0])  # the setting applied (the default data differs)
    # a word setting: the per-video taste (the same weight; the author's taste above)
    assert cli_main(["synth", "--out", str(tmp_path / "video"), "--scale", "tiny", "--quiet",
                     "--set", "click_taste_boost=0.5", "--set", "click_taste_of=video"]) == 0
    synth.generate(str(tmp_path / "want-video"),
                   config=synth.SynthConfig.for_scale("tiny", click_taste_boost=0.5, click_taste_of="video"),
                   progress=False)
    assert _digest(tmp_path / "video") == _digest(tmp_path / "want-video") != _digest(out)
    assert cli_main(["synth", "--out", str(tmp_path / "x"), "--scale", "tiny", "--quiet",
                     "--set", "click_taste_of=tag"]) == 1
    assert "click_taste_of 'tag'" in capsys.readouterr().err and not (tmp_path / "x").exists()
    for bad, why in (("nope=1", "not a generator setting"), ("seed=3", "have their own options"),
                     ("num_communities=2.5", "expected int"), ("communities=1", "expected bool"),
                     ("click_taste_boost", "expected KEY=VALUE")):
        with pytest.raises(SystemExit, match=why):
            cli_main(["synth", "--out", str(tmp_path / "x"), "--scale", "tiny", "--quiet", "--set", bad])


def test_synth_help_explains_the_options(capsys):
    with pytest.raises(SystemExit):
        cli_main(["synth", "--help"])
    text = capsys.readouterr().out
    for word in ("--out", "--scale", "--seed", "--interactions", "--force", "32,038,725", "docs/synthetic-data.md"):
        assert word in text
