"""Progress reporting that suits where the output goes.

On a terminal: a tqdm bar. Anywhere else (a pipe, a batch job's log file): plain lines, at most one every
``interval`` seconds plus one at the end, and no carriage returns, so logs stay readable. Both have the part of
tqdm's interface the package uses: ``update(n)``, ``set_postfix(**kw)``, ``set_postfix_str(s)``, ``close()``.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

LOG_INTERVAL_S = 30.0


class LineProgress:
    """tqdm's interface, written as plain lines (see the module docstring)."""

    def __init__(self, total: Optional[int], desc: str, unit: str, file: TextIO, initial: int = 0,
                 interval: float = LOG_INTERVAL_S):
        self.total, self.desc, self.unit, self.file = total, desc, unit, file
        self.n, self.interval, self.postfix = initial, interval, ""
        self.t0 = self.last = time.monotonic()
        self.closed = False

    def set_postfix(self, **kw) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in kw.items())

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.interval:
            self._line()

    def _line(self) -> None:
        self.last = time.monotonic()
        el = self.last - self.t0
        of = f"/{self.total}" if self.total else ""
        rate = self.n / el if el > 0 else 0.0
        extra = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc + ': ' if self.desc else ''}{self.n}{of} {self.unit} ({el:.0f} s, {rate:.3g} {self.unit}/s"
              f"{extra})", file=self.file, flush=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line()


def progress(total: Optional[int], desc: str = "", unit: str = "it", enabled: bool = True, initial: int = 0,
             file: Optional[TextIO] = None, interval: float = LOG_INTERVAL_S, **tqdm_kw):
    """A tqdm bar on a terminal, :class:`LineProgress` elsewhere, or a disabled tqdm when not ``enabled``."""
    from tqdm import tqdm  # start-up time: only once progress is shown

    file = file if file is not None else sys.stderr
    if not enabled:
        return tqdm(total=total, disable=True)
    if not (hasattr(file, "isatty") and file.isatty()):
        return LineProgress(total, desc, unit, file, initial, interval)
    return tqdm(total=total, desc=desc or None, unit=unit, initial=initial, file=file, dynamic_ncols=True,
                mininterval=0.5, **tqdm_kw)
