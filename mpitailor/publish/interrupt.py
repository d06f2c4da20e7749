"""SIGTERM and SIGINT: every rank stops with one line, what it staged removed, exit non-zero.

When `scancel`, a timeout or Ctrl-C signals a merge, the main thread may be inside an MPI
collective or a long write, where a Python signal handler would not run until the call
returns (never, if the peers are already gone). So both signals are blocked in every thread
(before MPI starts any) and one watcher thread takes them with `sigwait`: it runs the
registered clean-ups (rank 0: remove the staging dir, release the lock), writes one line,
and ends the process at once with 128 + the signal's number.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

SIGNALS = {signal.SIGINT, signal.SIGTERM}
_cleanups: list[Callable[[], None]] = []
_prefix = [""]
_linger = [0.0]


def install() -> None:
    """Block SIGINT/SIGTERM in this and every later thread; watch for them. Call first."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    threading.Thread(target=_watch, name="mpitailor-signals", daemon=True).start()


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


def on_interrupt(fn: Callable[[], None]) -> Callable[[], None]:
    """Run fn if a signal ends the process; returns the function that unregisters it."""
    _cleanups.append(fn)
    return lambda: _cleanups.remove(fn) if fn in _cleanups else None


def _watch() -> None:
    sig = signal.sigwait(SIGNALS)
    for fn in list(_cleanups):
        try:
            fn()
        except Exception:  # noqa: BLE001 - the process ends next; nothing better to do
            pass
    name = signal.Signals(sig).name
    os.write(2, f"{_prefix[0]}mpitailor: interrupted by {name}: stopped, staged files "
                f"removed, nothing published\n".encode())
    time.sleep(_linger[0])
    os._exit(128 + sig)
