"""PNG Gantt charts: one row per lane, one bar per span, one colour per legend entry.

The one drawing routine behind both charts of the package: the simulator's predicted schedule
(:func:`nestpipe.planning.timeline.write_gantt`, lanes are resources) and the trainer's measured trace
(:func:`nestpipe.trainer.pipeline.timeline.write_gantt`, lanes are a rank's threads). Each converts its own data
into :class:`Bar` s; this module knows nothing of either.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Iterable, Optional, Sequence, Tuple

# matplotlib's tab10 colours by name, for legends that are a sequence (steps) rather than fixed categories
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan")


@dataclasses.dataclass(frozen=True)
class Bar:
    """One span on the chart: ``lane`` (a name in the chart's lanes), ``start`` / ``end`` in the x unit, the text
    written on it, and the legend entry that gives its colour."""

    lane: str
    start: float
    end: float
    label: str
    legend: str


def draw(path: str, bars: Iterable[Bar], lanes: Sequence[str], legend: Dict[str, str], *, title: str,
         xlabel: str = "ms", xlim: Optional[Tuple[float, float]] = None, min_label_width: float = 0.0,
         legend_loc: str = "upper right") -> str:
    """Write the chart to ``path`` (PNG, atomically: a temporary file renamed over it) and return ``path``.

    ``lanes`` are the rows, top to bottom; ``legend`` maps each entry to its colour, in legend order; a bar is
    labelled when it is wider than ``min_label_width``. Bars of zero or negative width are not drawn."""
    import matplotlib  # optional, slow to import: only when a chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {lane: i for i, lane in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(14, max(3.6, 0.45 * len(lanes) + 1.5)))
    for bar in bars:
        width = bar.end - bar.start
        if width <= 0:
            continue
        y = rows[bar.lane]
        ax.broken_barh([(bar.start, width)], (y - 0.35, 0.7), facecolors=legend[bar.legend], edgecolors="black",
                       linewidth=0.3)
        if width > min_label_width:
            ax.text(bar.start + width / 2, y, bar.label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.invert_yaxis()
    if xlim is not None:
        ax.set_xlim(*xlim)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in legend.values()]
    ax.legend(handles, list(legend), loc=legend_loc, fontsize=7, ncol=min(len(legend), 4) or 1)
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"  # the suffix tells matplotlib the format
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        plt.close(fig)
    return path
