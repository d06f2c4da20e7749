"""Fault injection at named points, for the fault tests (tests/fault/, test_async_save.py).

MPITAILOR_FAILPOINT="POINT:RANK[:ACTION]" makes rank RANK, on reaching POINT, die by SIGKILL
(ACTION "kill", the default: a real kill -9, not an exception), sleep (ACTION
"sleep=SECONDS"), wait for a go-ahead (ACTION "pause=DIR": create DIR/reached, then wait
until DIR/go exists, at most 10 minutes: a test holds the run at a known point), or fail to
write as a full disk does (ACTION "enospc": OSError ENOSPC).
POINT may name a detail too, "POINT/DETAIL" (a partial save's tag): then only there.
Points: "read" (sources opened, nothing copied), "write" (an optimizer file written, its
model-states file not), "export" (a parameter's Universal files written, the rest not),
"commit" (a leader of any output: staged tree and manifest complete, not yet published;
detail: the output's name), "partial-write" (a partial
save's rank files about to be written), "partial-publish" (every rank's files written, the
manifest not), "snapshot-copy" (an overlapped asynchronous save: the writer about to copy
the live slices into host buffers while the next step runs; detail: the tag), "full-save" (a training loop's full save begun and not finished: the plain loop's before
DeepSpeed's files, Accelerate's in its empty checkpoint dir, HF's before the optimizer and
trainer state; detail: the checkpoint-N or tag name), "reclaim" (a stale lock taken by
`clean` or a run, its leftovers not yet removed; detail: the output's name). RANK is the MPI rank, or the training rank (RANK) in a training process.
Unset, it costs one environment lookup per point.

Crash points (issue 44): every step of the I/O seam (formats/io: a file created, written,
copied, fsynced; a directory fsynced; publish/staging.py: a rename, a removal) calls
`io_step`. MPITAILOR_CRASH_AT="N[:RANK]" kills the process by SIGKILL just before its N-th
step (RANK as above, default 0); MPITAILOR_CRASH_LOG=FILE appends "RANK N WHAT" per step, so
that a clean run enumerates them (bench/crash_points.py). Unset, two environment lookups
per step.
"""
from __future__ import annotations

import errno
import itertools
import os
import signal
import time
from pathlib import Path

ENV = "MPITAILOR_FAILPOINT"
CRASH_AT = "MPITAILOR_CRASH_AT"
CRASH_LOG = "MPITAILOR_CRASH_LOG"
_steps = itertools.count(1)  # next() is atomic: the copy engine's writer thread steps too


def io_step(what: str) -> None:
    """One step of the I/O seam, about to be taken: counted; the process killed before it
    when it is the chosen one."""
    at, log = os.environ.get(CRASH_AT), os.environ.get(CRASH_LOG)
    if not at and not log:
        return
    n = next(_steps)
    if log:
        with open(log, "a") as f:
            f.write(f"{_rank()} {n} {what}\n")
    if at:
        step, _, rank = at.partition(":")
        if int(step) == n and int(rank or 0) == _rank():
            os.kill(os.getpid(), signal.SIGKILL)


def hit(point: str, detail: str | None = None) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, rank, *action = spec.split(":")
    if name not in (point, f"{point}/{detail}") or int(rank) != _rank():
        return
    act = action[0] if action else "kill"
    if act == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif act.startswith("sleep="):
        time.sleep(float(act.removeprefix("sleep=")))
    elif act.startswith("pause="):
        _pause(act.removeprefix("pause="))
    elif act == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (failpoint {spec})")


def _pause(folder: str) -> None:
    (Path(folder) / "reached").touch()
    deadline = time.monotonic() + 600
    while not (Path(folder) / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0
