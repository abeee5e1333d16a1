"""PNG Gantt charts: one row per lane, one bar per span, one colour per legend entry.

The one drawing routine behind both charts of the package: the simulator's predicted schedule
(:func:`nestpipe.planning.timeline.write_gantt`, lanes are resources) and the trainer's measured trace
(:func:`nestpipe.trainer.pipeline.timeline.write_gantt`, lanes are a rank's threads). Each converts its own data
into :class:`Bar` s; this module knows nothing of either.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

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


# the chart's geometry, shared by the drawing and the label-fitting rule
FIG_WIDTH_IN = 14.0
AXES_SHARE = 0.80  # of the figure's width left to the bars (lane names on the left, legend on the right)
LABEL_FONT_PT = 6.0
CHAR_PT = 0.62 * LABEL_FONT_PT  # mean advance of a character of the label font, with margin


def label_fits(label: str, width: float, x_span: float) -> bool:
    """Whether ``label`` fits inside a bar ``width`` wide on an x axis ``x_span`` wide (same unit): a label is only
    drawn inside its own bar, so labels of bars that do not overlap never overlap either."""
    axes_pt = FIG_WIDTH_IN * 72.0 * AXES_SHARE
    return x_span > 0 and width / x_span * axes_pt >= (len(label) + 1) * CHAR_PT


def draw(path: str, bars: Iterable[Bar], lanes: Sequence[str], legend: Dict[str, str], *, title: str,
         xlabel: str = "ms", xlim: Optional[Tuple[float, float]] = None, min_label_width: float = 0.0) -> List[Bar]:
    """Write the chart to ``path`` (PNG, atomically: a temporary file renamed over it); returns the bars whose label
    was written.

    ``lanes`` are the rows, top to bottom; ``legend`` maps each entry to its colour, in legend order (drawn outside
    the bars, right of the axes). A bar is labelled when it is wider than ``min_label_width`` and its label fits
    inside it (:func:`label_fits`). Bars of zero or negative width are not drawn."""
    import matplotlib  # optional, slow to import: only when a chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [b for b in bars if b.end > b.start]
    if xlim is None:
        xlim = (min((b.start for b in bars), default=0.0), max((b.end for b in bars), default=1.0))
    x_span = xlim[1] - xlim[0]
    rows = {lane: i for i, lane in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, max(3.6, 0.32 * len(lanes) + 1.5)))
    labelled = []
    for bar in bars:
        lo, hi = max(bar.start, xlim[0]), min(bar.end, xlim[1])
        width = bar.end - bar.start
        y = rows[bar.lane]
        ax.broken_barh([(bar.start, width)], (y - 0.35, 0.7), facecolors=legend[bar.legend], edgecolors="black",
                       linewidth=0.3)
        if hi - lo > min_label_width and label_fits(bar.label, hi - lo, x_span):
            ax.text((lo + hi) / 2, y, bar.label, ha="center", va="center", fontsize=LABEL_FONT_PT, clip_on=True)
            labelled.append(bar)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(*xlim)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in legend.values()]
    ax.legend(handles, list(legend), loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, borderaxespad=0)
    fig.subplots_adjust(left=0.11, right=0.11 + AXES_SHARE, top=0.9, bottom=max(0.08, 0.6 / fig.get_figheight()))
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
    return labelled
