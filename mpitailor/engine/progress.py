"""Progress of the copy step, shown by rank 0: a bar on a terminal, a log line every few
seconds where stderr is a file or a pipe (mpiexec, srun, a batch job's log), where a bar
only piles up carriage returns.

Rank 0 counts its own bytes only (counting every rank's would take messages in the middle
of the copy); ranks copy near-equal shares (program.split), so its fraction done, times
every rank's bytes, estimates the job's. The line says so.
"""
from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger(__name__)

ENV = "MPITAILOR_PROGRESS_INTERVAL"  # seconds between lines (default 5); for tests and logs
INTERVAL_S = 5.0
FIRST_S = 2.0  # a copy done sooner says nothing


class Progress:
    """Rank 0 only: bytes copied so far of `mine` (this rank's share) and `total` (every
    rank's), on `ranks` ranks."""

    def __init__(self, mine: int, total: int, ranks: int) -> None:
        self.mine, self.total, self.ranks = max(mine, 1), total, ranks
        self.done = 0
        self.start = time.monotonic()
        self.interval = _interval()
        self.next = self.start + min(FIRST_S, self.interval)
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=mine, unit="B", unit_scale=True, desc="rank 0 copies",
                            leave=False)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now >= self.next:
            self.next = now + self.interval
            log.info("%s", self.line(now - self.start))

    def line(self, seconds: float) -> str:
        """What the log says after `seconds` of copying."""
        fraction = min(self.done / self.mine, 1.0)
        done = fraction * self.total
        rate = done / seconds if seconds > 0 else 0.0
        eta = f"{(self.total - done) / rate:.0f} s" if rate > 0 else "unknown"
        whose = "" if self.ranks == 1 else \
            f" (estimated from rank 0's share, of {self.ranks} ranks)"
        return (f"copied {_size(done)} of {_size(self.total)} ({100 * fraction:.0f}%), "
                f"{_size(rate)}/s, ETA {eta}{whose}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _interval() -> float:
    text = os.environ.get(ENV, "")
    try:
        seconds = float(text) if text else INTERVAL_S
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # NaN too
        log.warning("%s=%r: not a number of seconds >= 0; using %g", ENV, text, INTERVAL_S)
        return INTERVAL_S
    return seconds


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
