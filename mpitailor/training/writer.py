"""The background writer of asynchronous layer-wise saves: at most one save in flight.

Training blocks only while a save's small states are taken (snapshot.py); a thread then
copies its slices into host buffers while the next step runs (overlap.py; the optimizer
step waits for the copy), writes, fsyncs and publishes it, with collectives on a gloo group
of its own.
The next save (or `wait`) joins the thread first: a save that failed on any rank raises
PartialSaveFailed there, on every rank (the writers agreed on the failure), never lost.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from mpitailor.training.distcomm import writer_comm
from mpitailor.training.snapshot import HostBuffers, PartialSaveFailed, Snapshot, write


class BackgroundWriter:
    def __init__(self, max_host_bytes: int | None = None, reserve: int = 0) -> None:
        """Collective (creates the writer's process group). reserve: fp32 elements of host
        buffer to allocate now, within max_host_bytes (LayerwiseCheckpointer reserves none
        here: it sizes them at its first partial save, to the largest its policy can make)."""
        self.comm = writer_comm()
        self.host = HostBuffers(max_host_bytes)
        if reserve:
            self.host.reserve(reserve)
        self._thread: threading.Thread | None = None
        self._after_error: BaseException | None = None
        self._snap: Snapshot | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    @property
    def in_flight(self) -> Path | None:
        """The tag dir of the save being written, if any."""
        return self._snap.final if self._snap is not None else None

    def start(self, snap: Snapshot,
              after: Callable[[Snapshot], None] | None = None) -> None:
        """Write `snap` in the background (join the previous save first). after: run in the
        background too, once the save is published (the update statistics' saved copy); an
        error of it is raised at the join as it is (the save itself stands)."""
        if self._thread is not None:
            raise RuntimeError("a save is already in flight: join it first")
        self._snap, self._error, self._after_error = snap, None, None
        # Not a daemon: a training script that ends normally waits for its last save.
        self._thread = threading.Thread(target=self._run, args=(snap, after),
                                        name="mpitailor-writer")
        self._thread.start()

    def _run(self, snap: Snapshot, after) -> None:
        t0 = time.perf_counter()
        try:
            write(snap, self.comm)
        except BaseException as e:  # noqa: BLE001 - raised at the next join, on every rank
            self._error = e
        else:
            try:
                if after is not None:
                    after(snap)
            except BaseException as e:  # noqa: BLE001 - raised at the next join
                self._after_error = e
        finally:
            snap.seconds["background"] = time.perf_counter() - t0

    def join(self) -> Snapshot | None:
        """Wait for the save in flight; its snapshot (with the seconds waited), or None when
        there was none. Raises PartialSaveFailed when it failed (on every rank alike)."""
        if self._thread is None:
            return None
        t0 = time.perf_counter()
        self._thread.join()
        snap, error, after_error = self._snap, self._error, self._after_error
        self._thread, self._snap, self._error, self._after_error = None, None, None, None
        snap.seconds["waited"] = time.perf_counter() - t0
        if isinstance(error, PartialSaveFailed):
            raise error
        if error is not None:
            raise PartialSaveFailed(f"partial checkpoint {snap.final} not saved: "
                                    f"{type(error).__name__}: {error}") from error
        if after_error is not None:
            raise after_error
        return snap
