"""Files out: the names of the release's files, the refusal of a foreign output directory, files written under a
temporary name and renamed when complete, the log files (pass 2 of the external shuffle: each spill bucket
shuffled and appended as CSV, the click truth gathered on the way) and the feature tables.

*Files.* Standard-log rows go to ``4_08_to_4_21`` or ``4_22_to_5_08`` by their date and to ``part1``/``part2`` by
a seeded coin. All rows of every log are shuffled (seeded two-pass external shuffle through spill files), so no
log is sorted by user or time. The feature tables list videos and users in a seeded permuted order. Video
durations are a hash of the video id, so ``duration_ms`` in the logs equals ``video_duration`` in the basic table
(where that cell is not empty). Video tags come mostly from a small tag set of the video's community.
"""

from __future__ import annotations

import contextlib
import os
from typing import List, Tuple

import numpy as np

from nestpipe.datasets import kuairand
from nestpipe.datasets.synth.config import _S_SHUFFLE, SynthConfig, _rng
from nestpipe.datasets.synth.records import SPILL_DTYPE, _log_frame
from nestpipe.datasets.synth.tables import _user_frame, _video_basic_frame, _video_stat_frame
from nestpipe.datasets.synth.truth import TRUTH_FILE, ClickTruth

LOG_FILES = [  # index = destination code used by the spill files
    "log_standard_4_08_to_4_21_27k_part1.csv",
    "log_standard_4_08_to_4_21_27k_part2.csv",
    "log_standard_4_22_to_5_08_27k_part1.csv",
    "log_standard_4_22_to_5_08_27k_part2.csv",
    "log_random_4_22_to_5_08_27k.csv",
]
USER_FILE = "user_features_27k.csv"
VIDEO_BASIC_FILE = "video_features_basic_27k.csv"
VIDEO_STAT_FILES = [f"video_features_statistic_27k_part{i}.csv" for i in (1, 2, 3)]

ALL_FILES = LOG_FILES + [USER_FILE, VIDEO_BASIC_FILE] + VIDEO_STAT_FILES + [TRUTH_FILE]
TMP_DIR_NAME = ".synth-tmp"


def check_output_dir(out_dir: str, force: bool = False) -> None:
    """Refuse a directory holding files other than the ones this generator writes, unless ``force``."""
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir}: exists and is not a directory")
    own = set(ALL_FILES) | {n + ".partial" for n in ALL_FILES} | {TMP_DIR_NAME}  # incl. leftovers of a killed run
    foreign = sorted(set(os.listdir(out_dir)) - own)
    if foreign and not force:
        raise FileExistsError(
            f"{out_dir}: directory is not empty and holds files that are not synthetic KuaiRand output "
            f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); choose an empty directory or pass "
            f"--force to write the KuaiRand files beside them"
        )


@contextlib.contextmanager
def _atomic_file(path: str):
    """A binary file written as ``path.partial`` and renamed to ``path`` when the block ends without an error."""
    with open(path + ".partial", "wb") as out:
        yield out
    os.replace(path + ".partial", path)


def _write_log_files(cfg: SynthConfig, out_dir: str, tmp: str, n_buckets: int, bar) -> "ClickTruth":
    """Pass 2: per log file, shuffle each of its buckets and append it as CSV (rows in no user or time order).
    Returns the click truth of every row written."""
    truth = ClickTruth()
    for fi, name in enumerate(LOG_FILES):
        with _atomic_file(os.path.join(out_dir, name)) as out:
            out.write((",".join(kuairand.LOG_COLUMNS) + "\n").encode())
            for bucket in range(n_buckets):
                sp = os.path.join(tmp, f"spill-{fi * n_buckets + bucket:06d}.bin")
                if not os.path.exists(sp):
                    continue
                recs = np.fromfile(sp, dtype=SPILL_DTYPE)
                recs = recs[_rng(cfg, _S_SHUFFLE, fi, bucket).permutation(len(recs))]
                frame = _log_frame(recs)
                frame.write_csv(out, include_header=False)
                truth.add(frame["date"].to_numpy(), recs["p_click"], recs["is_click"])
                os.remove(sp)
                bar.update(len(recs))
    return truth


def _write_user_features(cfg: SynthConfig, model, out_dir: str, bar) -> None:
    with _atomic_file(os.path.join(out_dir, USER_FILE)) as out:
        _user_frame(cfg, model.std_counts).write_csv(out)
    bar.update(cfg.num_users)


def _write_video_features(cfg: SynthConfig, layout, out_dir: str, bar) -> Tuple[str, List[str]]:
    """Video basic and statistic features, chunk by chunk (rows in a seeded permuted id order); the statistic
    table is split over three files like the release's."""
    basic_path = os.path.join(out_dir, VIDEO_BASIC_FILE)
    stat_paths = [os.path.join(out_dir, n) for n in VIDEO_STAT_FILES]
    stat_bounds = [(cfg.num_videos * i) // 3 for i in range(4)]
    with _atomic_file(basic_path) as basic_out:
        header = True
        for r0 in range(0, cfg.num_videos, cfg.video_chunk_rows):
            rows = np.arange(r0, min(r0 + cfg.video_chunk_rows, cfg.num_videos), dtype=np.int64)
            _video_basic_frame(cfg, layout, rows).write_csv(basic_out, include_header=header)
            header = False
            bar.update(len(rows))
    for part, path in enumerate(stat_paths):
        lo, hi = stat_bounds[part], stat_bounds[part + 1]
        with _atomic_file(path) as out:
            out.write((",".join(kuairand.VIDEO_STAT_COLUMNS) + "\n").encode())
            for r0 in range(lo, hi, cfg.video_chunk_rows):
                rows = np.arange(r0, min(r0 + cfg.video_chunk_rows, hi), dtype=np.int64)
                _video_stat_frame(cfg, layout, rows).write_csv(out, include_header=False)
                bar.update(len(rows))
    return basic_path, stat_paths
