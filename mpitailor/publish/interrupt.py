"""SIGTERM and SIGINT: every rank stops with one line, what it staged removed, exit 128+sig.

When `scancel`, a timeout or Ctrl-C signals a merge, the main thread may be inside an MPI
collective or a long write, where a Python signal handler would not run until the call
returns (never, if the peers are already gone). So both signals are blocked in every thread
(before MPI starts any) and one watcher thread takes them with `sigwait`: it runs the
registered clean-ups (the staging dir's holder: remove it, release the lock; the other
ranks: wait until it is gone), writes one line, and ends the process with 128 + the
signal's number.

The main thread keeps running meanwhile, and a staging dir removed under it makes its next
write fail: such a failure is the signal's doing, not one to report. So the ways out of a
staging dir's scope call `settle()`, which parks the main thread for good once a signal
has come; the watcher ends the process.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from mpitailor.display import escaped

SIGNALS = {signal.SIGINT, signal.SIGTERM}
_cleanups: list[Callable[[], str | None]] = []
_waits: list[Callable[[], None]] = []
_prefix = [""]
_linger = [0.0]
_stopping = threading.Event()
_installed = threading.Event()


def install() -> None:
    """Block SIGINT/SIGTERM in this and every later thread; watch for them. Call first."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    threading.Thread(target=_watch, name="mpitailor-signals", daemon=True).start()
    _installed.set()


def restore() -> None:
    """Unblock the signals again: before exec'ing another program, which would inherit the
    blocked mask and could then not be stopped."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def set_rank(rank: int, size: int) -> None:
    """Once the rank is known: the line's prefix ("[rank 3] " under MPI), and how long a
    rank with nothing to clean up waits before it exits. A launcher that sees one rank exit
    kills the others (MPICH's mpiexec does), and rank 0 must first remove what it staged."""
    _prefix[0] = f"[rank {rank}] " if size > 1 else ""
    _linger[0] = 0.5 if rank > 0 else 0.0


def on_interrupt(fn: Callable[[], str | None]) -> Callable[[], None]:
    """Run fn if a signal ends the process; returns the function that unregisters it. What
    fn returns, if anything, replaces the line's "staged files removed, nothing published"
    (an output published just before the signal)."""
    _cleanups.append(fn)
    return lambda: _cleanups.remove(fn) if fn in _cleanups else None


def before_exit(fn: Callable[[], None]) -> Callable[[], None]:
    """Run fn after the line, before the process ends (a rank waiting for another rank's
    clean-up: its line is out first, in case the launcher kills it once that rank exits);
    returns the function that unregisters it."""
    _waits.append(fn)
    return lambda: _waits.remove(fn) if fn in _waits else None


def stopping() -> bool:
    """A signal has come for our watcher (which may not have woken yet: pending counts). In
    a process that never installed it (the Python API, training), never: a pending signal
    there is the program's own business."""
    return _installed.is_set() and (_stopping.is_set() or bool(signal.sigpending() & SIGNALS))


def settle() -> None:
    """In the main thread, on its way out of a staging dir's scope (an error or not): once a
    signal has come, never go on (to report an error the clean-up caused, to exit with
    another code, to write again where the clean-up removed): wait for the watcher to end
    the process."""
    if not stopping() or threading.current_thread() is not threading.main_thread():
        return
    while True:
        time.sleep(3600)


def _watch() -> None:
    sig = signal.sigwait(SIGNALS)
    _stopping.set()
    said = "staged files removed, nothing published"
    for fn in _cleanups[:]:  # a copy: each unregisters itself
        try:
            said = fn() or said
        except Exception:  # noqa: BLE001, S110 - the process ends next; nothing better to do
            pass
    name = signal.Signals(sig).name
    try:
        line = escaped(f"{_prefix[0]}mpitailor: interrupted by {name}: stopped, {said}")
        os.write(2, f"{line}\n".encode("utf-8", "backslashreplace"))
    except OSError:  # stderr gone with the launcher: still end with the signal's code
        pass
    for fn in _waits[:]:
        try:
            fn()
        except Exception:  # noqa: BLE001, S110
            pass
    time.sleep(_linger[0])
    os._exit(128 + sig)
