"""Synthetic KuaiRand-27K-format data with planted, documented, learnable structure.

:func:`generate` writes the ten files of the KuaiRand-27K release (same names, headers and value formats as the
published ones, see :mod:`nestpipe.datasets.kuairand`) into a directory. Every file is byte-identical for the same
:class:`SynthConfig` (scale, seed, interactions); a different seed gives different files. Generation streams in
chunks, so memory stays bounded (about 1 GiB) even at the real 27K vocabulary (32,038,725 videos).

Planted structure (all parameters are fields of :class:`SynthConfig`)
--------------------------------------------------------------------
*Catalogues.* The video id space is laid out in "slots": slots ``[0, head_size)`` are the **global popular head**;
then ``num_communities`` **community catalogues** of ``catalogue_size = (num_videos - head_size) //
num_communities`` slots each; the few remaining slots are cold videos that appear only in the feature tables. A
seeded affine bijection ``video_id = (A * slot + B) mod num_videos`` scatters slots over ids, so ids carry no
visible structure; :func:`video_slots` / :func:`video_communities` invert it.

*Communities.* Each user belongs to one latent community (uniform, seeded; :func:`user_communities` recomputes
the map from the config, nothing extra is written into the KuaiRand files). Each item a user starts from is drawn
with probability ``in_community_prob`` (0.8) from the user's community catalogue and otherwise from the global
head, in both cases with **Zipf popularity** ``P(rank r) ~ r ** -zipf_exponent`` (1.2) inside the catalogue. As all
catalogues share the exponent, the overall rank-frequency curve also has a log-log slope of about -1.2 over ranks
well above ``num_communities`` (at the top, items of equal rank in the equally sized catalogues form small plateaus).

*Sessions and transitions.* A user's history is cut into sessions (a new session starts with probability
``1 / mean_session_length``). Inside a session, with probability ``successor_prob`` (0.3) the next item is the
**fixed successor** of the previous one instead of a fresh draw: ``succ(slot)`` is the slot 1 to
``successor_max_offset`` ranks further down in the same catalogue (offset fixed per slot by a hash; the catalogue
wraps around). Successors stay in their catalogue, so the community share is unchanged, and being close in rank
they keep the Zipf curve. Sessions are laid out chronologically in the user's timeline (2022-04-08 .. 2022-05-08,
Beijing time), so a chronological sequence model sees successor pairs as consecutive items.

*Session topics* (off by default). With ``session_topics`` K > 0 every catalogue has K interleaved topics (in-catalogue
rank r is in topic ``r % K``); each session draws a topic uniformly, and its fresh in-community draws come with
probability ``topic_prob`` from that topic (Zipf over the topic's ranks ``z, z + K, ...``), else from the whole
catalogue. Nothing records the topic: it is a latent state a model infers from the session's items.

*Feedback* (clicks, watch time and the other actions as functions of the match) and the *random-policy log*:
:mod:`.generator`; the *files* and their order: :mod:`.writers`.

Negative controls: ``communities=False`` draws the catalogue of every non-head item from a random community instead
of the user's own (structure gone, popularity kept); ``successor_prob=0`` removes transitions;
``zipf_exponent=0`` makes popularity uniform; ``click_community_boost=0`` removes the feedback dependence;
``topic_prob=0`` leaves the session topics without effect.

Modules
-------
- :mod:`.config`: :class:`SynthConfig` and the scale presets (:data:`SCALES`), the seeded random streams.
- :mod:`.planted`: the planted structure as pure functions of the config (layout, catalogues, communities, authors,
  tastes, activity, durations, successors).
- :mod:`.generator`: the simulation (sessions, successor steps, feedback, the random-policy log) and
  :func:`generate`, which runs it and has the writers write the files.
- :mod:`.records`: one log row: the spill record and the Beijing-time calendar of the published columns.
- :mod:`.tables`: the user and video feature tables.
- :mod:`.writers`: files out: the file names, atomic writes, the shuffled log files, the feature tables.
- :mod:`.truth`: ``synth_truth.json`` (:class:`ClickTruth`, the Bayes ceiling of the clicks) and
  :class:`NextItemOracle` (:func:`next_item_oracle`), the generator's own next-item ranking.

This package re-exports every name the rest of the project uses, so ``from nestpipe.datasets import synth`` and
``synth.X`` read as before; a test that patches a name patches it where it is defined (``synth.writers.X``).
"""

from __future__ import annotations

from nestpipe.datasets.synth.config import SCALES, SynthConfig
from nestpipe.datasets.synth.generator import TAB_WEIGHTS, generate
from nestpipe.datasets.synth.planted import (
    TASTE_RANK, community_catalogue, head_catalogue, taste_match, user_communities, user_interaction_counts,
    user_tastes, video_authors, video_communities, video_duration_ms, video_slots, video_tastes,
)
from nestpipe.datasets.synth.records import (
    DAY_MS, FLAG_COLUMNS, SPILL_DTYPE, T_END_MS, T_SPLIT_MS, T_START_MS, TZ_OFFSET_MS,
)
from nestpipe.datasets.synth.tables import NUM_TAGS
from nestpipe.datasets.synth.truth import TRUTH_EVAL_DAYS, TRUTH_FILE, ClickTruth, NextItemOracle, next_item_oracle
from nestpipe.datasets.synth.writers import (
    ALL_FILES, LOG_FILES, TMP_DIR_NAME, USER_FILE, VIDEO_BASIC_FILE, VIDEO_STAT_FILES, check_output_dir,
)

# Internals the tests and research scripts read (the layout, successors, user biases, hashing, range bins).
from nestpipe.datasets.synth.planted import _hash_u64, _Layout, _slot_community, _successor, _user_bias  # noqa: F401
from nestpipe.datasets.synth.tables import _FOLLOW_BINS, _REGISTER_BINS  # noqa: F401

__all__ = [
    "ALL_FILES", "DAY_MS", "FLAG_COLUMNS", "LOG_FILES", "NUM_TAGS", "SCALES", "SPILL_DTYPE", "TAB_WEIGHTS",
    "TASTE_RANK", "TMP_DIR_NAME", "TRUTH_EVAL_DAYS", "TRUTH_FILE", "TZ_OFFSET_MS", "T_END_MS", "T_SPLIT_MS",
    "T_START_MS", "USER_FILE", "VIDEO_BASIC_FILE", "VIDEO_STAT_FILES", "ClickTruth", "NextItemOracle", "SynthConfig",
    "check_output_dir", "community_catalogue", "generate", "head_catalogue", "next_item_oracle", "taste_match",
    "user_communities", "user_interaction_counts", "user_tastes", "video_authors", "video_communities",
    "video_duration_ms", "video_slots", "video_tastes",
]
