"""The background half of DcpCheckpointer's asynchronous saves: at most one save in flight.

`save()` stages the state into host memory (dcp_state.stage) while training waits; a thread
then writes it with `dcp.save`, reads every rank's files back, fsyncs them, agrees the
record and publishes the dir by rename. The next save, or `wait()`, joins the thread first.

Which collectives run where (gloo groups are not safe under concurrent collectives from two
threads on one group): the thread's collectives (DCP's planning and its final agreement,
the records' allgather, every agreed step of the publish) run on a gloo group made for it
once (dcp_state.writer_group), and only there; training's, and the foreground part of a save
(the update measure, the save id, `get_state_dict`), stay on the default group in the main
thread. Each rank's thread runs the same sequence of collectives on its group, and a main
thread joins its thread only at a point every rank reaches (the next save, `wait`), so ranks
that finish their writes at different times never wait on each other across the two groups.
Every step of the thread is agreed across the ranks (a rank's failure raised on every rank:
DCP's save does so itself, the publish's steps through `agree`), so every rank's join raises
the same PartialSaveFailed, and none hangs in a collective another rank left.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from mpitailor.facade import Comm
from mpitailor.training import dcp_state
from mpitailor.training.distcomm import TorchDistWorld
from mpitailor.training.snapshot import PartialSaveFailed


class DcpWriter:
    def __init__(self) -> None:
        """Collective (creates the writer's process group)."""
        self.group = dcp_state.writer_group()
        self.comm = Comm(TorchDistWorld(self.group) if self.group is not None else None)
        self.stager = dcp_state.stager()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""
        self.background = float("nan")  # seconds the last save took in the thread

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, what: str, write: Callable[[Comm, object], None]) -> None:
        """write(comm, group) in the background: what: the save's dir, for a failure's
        message."""
        if self._thread is not None:
            raise RuntimeError("internal error: a DCP save is already in flight: join it first")
        self._what, self._error = what, None
        # Not a daemon: a script that ends normally waits for its last save.
        self._thread = threading.Thread(target=self._run, args=(write,),
                                        name="mpitailor-dcp-writer")
        self._thread.start()

    def _run(self, write) -> None:
        t0 = time.perf_counter()
        try:
            write(self.comm, self.group)
        except BaseException as e:  # noqa: BLE001 - raised at the next join, on every rank
            self._error = e
        finally:
            self.background = time.perf_counter() - t0

    def join(self) -> float:
        """Wait for the save in flight; seconds waited (0 when none). Raises
        PartialSaveFailed when it failed (on every rank alike: its steps were agreed)."""
        if self._thread is None:
            return 0.0
        t0 = time.perf_counter()
        self._thread.join()
        error, self._thread, self._error = self._error, None, None
        waited = time.perf_counter() - t0
        if isinstance(error, PartialSaveFailed):
            raise error
        if error is not None:
            raise PartialSaveFailed(f"save {self._what} not published: "
                                    f"{type(error).__name__}: {error}") from error
        return waited
