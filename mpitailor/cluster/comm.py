"""The only module that touches mpi4py: guarded collectives that fail together.

Every collective step runs on every rank inside `Comm.step`: results and errors are
gathered, and if any rank failed, every rank raises the same error carrying every failed
rank's message, so one rank's bad file never leaves the others waiting. Without mpi4py, or when
started without a launcher, the world is one rank and every collective is trivial.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from mpitailor.errors import MergeFailed, MpitailorError, NothingToRecover, UserError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Launchers say how many processes they started; MPI must agree (see check_not_singleton).
_LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")
# A rank waiting for the others at a collective sleeps between polls, from 50 us up to 2 ms.
_POLL_FIRST_S, _POLL_MAX_S = 50e-6, 2e-3
# The communicator of `same_everywhere` (see there), one per process.
_ERRORS_COMM = None


class Comm:
    """COMM_WORLD, or a world of one when MPI is absent."""

    def __init__(self, mpi_comm=None) -> None:
        self._comm = mpi_comm
        self.rank = mpi_comm.Get_rank() if mpi_comm is not None else 0
        self.size = mpi_comm.Get_size() if mpi_comm is not None else 1
        self._errors = None  # set by world(): the communicator of same_everywhere
        self.nodes = None    # set by nodes.Nodes.of: which host each rank is on

    @classmethod
    def world(cls) -> "Comm":
        """Collective: COMM_WORLD (initialising MPI), checked against what the launcher
        said."""
        global _ERRORS_COMM
        try:
            from mpi4py import MPI
        except (ImportError, RuntimeError):
            # no mpi4py, or no MPI library for it to load (a core install on a machine
            # without MPI, no [mpi] extra): one process, which is all a plain run needs; a
            # launcher that started several is caught below
            comm = cls(None)
        else:
            comm = cls(MPI.COMM_WORLD)
            if _ERRORS_COMM is None and comm.size > 1:
                _ERRORS_COMM = MPI.COMM_WORLD.Dup()
            comm._errors = _ERRORS_COMM
        check_not_singleton(comm.size, os.environ)
        return comm

    # -- collectives: call on every rank -------------------------------------------------
    def step(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Collective: run fn on every rank; if any rank raised, raise on all ranks."""
        try:
            result, failure = fn(*args, **kwargs), None
        except Exception as e:  # noqa: BLE001 - every failure must reach every rank
            if not isinstance(e, MpitailorError):
                log.debug("unexpected error", exc_info=True)
            result, failure = None, _describe(e)
        failures = self.allgather(failure)
        _raise_all(failures)
        return result

    def root_step(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Collective: rank 0 runs fn; its result (or its error) reaches every rank."""
        return self.step_on(0, fn, *args, **kwargs)

    def step_on(self, root: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Collective: rank root runs fn; its result (or its error) reaches every rank."""
        result, failure = None, None
        if self.rank == root:
            try:
                result = fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                if not isinstance(e, MpitailorError):
                    log.debug("unexpected error", exc_info=True)
                failure = _describe(e)
        result, failure = self.bcast((result, failure), root)
        _raise_all([failure])
        return result

    def allgather(self, obj: T) -> list[T]:
        """Collective: every rank's obj, in rank order."""
        return [obj] if self._comm is None else self._mpi(self._comm.allgather, obj)

    def gather(self, obj: T, root: int = 0) -> list[T] | None:
        """Collective: every rank's obj, in rank order, on rank root (None elsewhere)."""
        return [obj] if self._comm is None else self._mpi(self._comm.gather, obj, root=root)

    def bcast(self, obj: T, root: int = 0) -> T:
        """Collective: rank root's obj."""
        return obj if self._comm is None else self._mpi(self._comm.bcast, obj, root=root)

    def alltoall(self, objs: list) -> list:
        """Collective: objs[r] goes to rank r; returns what every rank sent this one."""
        return list(objs) if self._comm is None else self._mpi(self._comm.alltoall, objs)

    def split(self, color: int) -> "Comm":
        """Collective: the ranks of the same color, as a world of their own."""
        return self if self._comm is None else Comm(self._comm.Split(color, self.rank))

    def barrier(self) -> None:
        if self._comm is not None:
            self._mpi(self._comm.Barrier)

    def _mpi(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """An MPI call; an MPI error (mpi4py raises one where MPI returns it: a peer died,
        its node went down) becomes CommFailed: one line, not MPI's error stack."""
        try:
            self._arrive()
            return call(*args, **kwargs)
        except Exception as e:
            if not _is_mpi_error(e):
                raise
            raise CommFailed(f"MPI communication failed on rank {self.rank} "
                             f"({_mpi_error_class(e)}): a rank of this job died or its node "
                             f"is unreachable; the merge stopped") from None

    def _arrive(self) -> None:
        """Wait, asleep, until every rank has reached this collective. MPI libraries wait
        by spinning a core: where ranks share cores (more ranks than cores, a Slurm prologue
        beside other work, emulated nodes on one host), the ranks that finished their part
        first took the CPU from those still copying; with 16 ranks on half a core a merge
        spent more CPU waiting than copying (bench/node_scaling.py). The cost where each
        rank has a core: a non-blocking barrier and up to 2 ms per collective. A world
        without a non-blocking barrier (training's torch.distributed one) waits in its call."""
        ibarrier = getattr(self._comm, "Ibarrier", None)
        if self.size == 1 or ibarrier is None:
            return
        request, pause = ibarrier(), _POLL_FIRST_S
        while not request.Test():
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)

    def same_everywhere(self, text: str, timeout_s: float) -> bool | None:
        """Bounded, call on every rank that failed: did every rank fail with this same text?
        None when not every rank came within timeout_s (one rank's own failure, the others
        busy or waiting elsewhere): then nothing is known and nothing is left to wait for.
        Ranks that arrive late may still learn the answer; a rank that gave up never
        waits again. It runs on a communicator of its own, so it never meets a collective
        that another rank is still in (MPI matches collectives by their order)."""
        if self._errors is None or self.size == 1:
            return True if self.size == 1 else None
        import hashlib

        from mpi4py import MPI
        mine = hashlib.blake2b(text.encode(), digest_size=8).digest()
        every = bytearray(8 * self.size)
        try:
            request = self._errors.Iallgather([mine, MPI.BYTE], [every, MPI.BYTE])
            deadline, pause = time.monotonic() + timeout_s, _POLL_FIRST_S
            while not request.Test():
                if time.monotonic() > deadline:
                    return None  # the request stays posted: the process ends without it
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        except Exception as e:  # noqa: BLE001 - MPI broken: say nothing is known
            if not _is_mpi_error(e):
                raise
            return None
        return all(every[i:i + 8] == mine for i in range(0, len(every), 8))

    def abort(self, code: int) -> None:
        """Kill every rank: for errors outside a guarded step, where peers could hang."""
        if self._comm is not None and self.size > 1:
            self._comm.Abort(code)


class CommFailed(MergeFailed):
    """MPI itself failed (a peer died, its node went down). The other ranks may be stuck in
    a collective with the dead one, so MPI cannot be finalised: the command line ends the
    process at once after its one line (os._exit), and the launcher ends the rest
    (srun --kill-on-bad-exit=1), or Slurm does once it finds the node down."""


def _is_mpi_error(e: BaseException) -> bool:
    """Only an MPI world can raise an MPI error; never imported here, as importing mpi4py's
    MPI starts MPI (in a training process whose world is torch.distributed, say) and can
    fail, hiding the error at hand."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(e, mpi.Exception)


def _mpi_error_class(e) -> str:
    try:
        from mpi4py import MPI
        return MPI.Get_error_string(e.Get_error_class())
    except Exception:  # noqa: BLE001 - only for the message
        return str(e).splitlines()[0] if str(e) else type(e).__name__


def check_not_singleton(mpi_size: int, env) -> None:
    """Refuse to run as N independent worlds of one (a launcher/MPI mismatch)."""
    if mpi_size != 1:
        return
    said = {v: env[v] for v in _LAUNCHER_SIZE_VARS if env.get(v, "1").isdigit()
            and int(env.get(v, "1")) > 1}
    if "SLURM_PROCID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1") or 1) > 1:
        said["SLURM_STEP_NUM_TASKS"] = env["SLURM_STEP_NUM_TASKS"]
    if said:
        var, n = next(iter(said.items()))
        raise UserError(
            f"{var}={n} says {n} processes were started, but MPI reports a world of 1: each "
            f"process would write the same output alone; launch with the PMI your MPI uses "
            f"(srun --mpi=pmi2 for MPICH, srun --mpi=pmix for Open MPI) or with its mpiexec")


def _describe(e: Exception) -> tuple[str, str, int]:
    """(kind, message, exit code) of a rank's failure, as it travels to the others: kind names
    the class of an mpitailor error (module.name), so that every rank raises the same one."""
    if isinstance(e, MpitailorError):
        return (_kind(type(e)), str(e), e.exit_code)
    return (_kind(MergeFailed), f"{type(e).__name__}: {e}".split("\n")[0], 1)


def _kind(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _error_class(kind: str, code: int) -> type[MpitailorError]:
    """The class a failure's kind names (a subclass of MpitailorError defined on this rank
    too, as the same program runs on every rank); else the base class of its exit code."""
    stack: list[type[MpitailorError]] = [MpitailorError]
    while stack:
        cls = stack.pop()
        if _kind(cls) == kind and cls.exit_code == code:
            return cls
        stack.extend(cls.__subclasses__())
    return _BY_EXIT_CODE.get(code, MergeFailed)


def _raise_all(failures: list) -> None:
    """Raise, on this rank, the error of every failed rank (as DCP's `_DistWrapper` keeps
    every rank's failure): ranks that failed alike share one clause, the first failed rank's
    kind of error is the one raised (its class, so that `except CheckpointError` holds on
    every rank), `.failures` keeps {rank: message}, and `.raised_on` the size of the world
    whose every rank raises it."""
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if not failed:
        return
    kind, _, code = failed[0][1]
    alike: dict[str, list[int]] = {}
    for rank, (_, message, _) in failed:
        alike.setdefault(message, []).append(rank)
    if len(failures) > 1:
        # which ranks failed, unless every rank failed alike (a list of every rank says no
        # more than "every rank", and grows with the job)
        message = "; ".join(m if len(ranks) == len(failures) else
                            f"{m} (on rank {','.join(map(str, ranks))})"
                            for m, ranks in alike.items())
    else:
        message = failed[0][1][1]
    error = _error_class(kind, code)(message)
    error.failures = {rank: f[1] for rank, f in failed}
    error.raised_on = len(failures)  # every rank of a world this size raises this same error
    raise error


_BY_EXIT_CODE = {2: UserError, 3: NothingToRecover}
