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
step (RANK as above, default 0; "all": every rank at its own N-th step, each counting its
own). MPITAILOR_CRASH_LOG=FILE appends one tab-separated line per step, "RANK N WHAT" then
KEY=VALUE fields: path= (the file or dir, absolute), to= (a rename's destination), size=
(the file's size then: for an fsync, the bytes it makes durable), at=OFFSET+LENGTH (a
write's range), thread= (a step of a thread other than the main one: the async writer),
absent=1 (a removal of nothing), kept= (a rename over an existing file: a hard link to the
file it replaces, FILE.kept/PID-N, so that a power-loss emulation can put it back). A clean
run enumerates the steps (bench/crash_points.py); bench/power_loss.py replays a killed
run's. `io_done` after an fsync logs "RANK - done": the fsync returned. Unset, two
environment lookups per step (one after an fsync).
"""
from __future__ import annotations

import errno
import itertools
import os
import signal
import threading
import time
from pathlib import Path

ENV = "MPITAILOR_FAILPOINT"
CRASH_AT = "MPITAILOR_CRASH_AT"
CRASH_LOG = "MPITAILOR_CRASH_LOG"
_steps = itertools.count(1)  # next() is atomic: the copy engine's writer thread steps too


def io_step(what: str, path=None, to=None, *, fd: int | None = None,
            at: tuple[int, int] | None = None) -> None:
    """One step of the I/O seam, about to be taken: counted; the process killed before it
    when it is the chosen one. path, to, fd (whose path and size are looked up) and at (a
    write's offset and length) only go to the crash log."""
    crash, log = os.environ.get(CRASH_AT), os.environ.get(CRASH_LOG)
    if not crash and not log:
        return
    n = next(_steps)
    if log:
        _log(log, n, what, path, to, fd, at)
    if crash:
        step, _, rank = crash.partition(":")
        if int(step) == n and (rank == "all" or int(rank or 0) == _rank()):
            os.kill(os.getpid(), signal.SIGKILL)


def io_done() -> None:
    """The step this thread took last (an fsync) is done: logged, for the crash log's reader
    to know that it was taken when another thread or rank was killed later."""
    log = os.environ.get(CRASH_LOG)
    if log:
        with open(log, "a") as f:
            f.write("\t".join([str(_rank()), "-", "done", *_thread()]) + "\n")


def _thread() -> list[str]:
    if threading.current_thread() is threading.main_thread():
        return []
    return [f"thread={threading.get_ident()}"]  # the async writer's steps


def _log(log: str, n: int, what: str, path, to, fd: int | None,
         at: tuple[int, int] | None) -> None:
    fields = [str(_rank()), str(n), what, *_thread()]
    if fd is not None:  # the call site holds a descriptor: the kernel knows its path
        path = os.readlink(f"/proc/self/fd/{fd}")
        fields.append(f"size={os.fstat(fd).st_size}")
    if path is not None:
        fields.append(f"path={os.path.abspath(path)}")
    if to is not None:
        fields.append(f"to={os.path.abspath(to)}")
        if os.path.isfile(to) and not os.path.islink(to):
            # a machine crash may undo the rename and bring the replaced file back: keep it
            kept = Path(f"{log}.kept") / f"{os.getpid()}-{n}"
            kept.parent.mkdir(exist_ok=True)
            os.link(to, kept)
            fields.append(f"kept={kept}")
    if at is not None:
        fields.append(f"at={at[0]}+{at[1]}")
    if what == "remove" and path is not None and not os.path.lexists(path):
        fields.append("absent=1")  # nothing to remove: nothing a crash could bring back
    with open(log, "a") as f:
        f.write("\t".join(fields) + "\n")


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
