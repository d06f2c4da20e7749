"""Fault injection at named points, for the fault tests (tests/fault/).

MPITAILOR_FAILPOINT="POINT:RANK[:ACTION]" makes MPI rank RANK, on reaching POINT, die by
SIGKILL (ACTION "kill", the default: a real kill -9, not an exception) or sleep (ACTION
"sleep=SECONDS"). Points: "read" (sources opened, nothing copied), "write" (an optimizer
file written, its model-states file not), "export" (a parameter's Universal files written,
the rest not), "commit" (rank 0, staged tree complete, not yet published). Unset, it costs
one environment lookup per point.
"""
from __future__ import annotations

import os
import signal
import time

ENV = "MPITAILOR_FAILPOINT"


def hit(point: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, rank, *action = spec.split(":")
    if name != point or int(rank) != _mpi_rank():
        return
    act = action[0] if action else "kill"
    if act == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif act.startswith("sleep="):
        time.sleep(float(act.removeprefix("sleep=")))


def _mpi_rank() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0
