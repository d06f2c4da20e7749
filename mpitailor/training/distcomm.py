"""The training ranks as an MPI-like world, so mpitailor's collectives run inside training.

`Comm` makes a handful of mpi4py calls; torch.distributed (the group DeepSpeed trains on)
offers each of them. With it, `recover` runs collectively on the ranks of an HF Trainer or
DeepSpeed job that was started without MPI (torchrun, the deepspeed launcher).
"""
from __future__ import annotations

import os

import torch.distributed as dist

from mpitailor.cluster.comm import Comm


class TorchDistWorld:
    """torch.distributed's default group, answering the calls `Comm` makes of mpi4py."""

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's spelling
        return dist.get_rank()

    def Get_size(self) -> int:  # noqa: N802
        return dist.get_world_size()

    def allgather(self, obj):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def bcast(self, obj, root: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src=root)
        return box[0]

    def alltoall(self, objs: list) -> list:
        # torch.distributed has no object all-to-all: every rank gathers every list and keeps
        # its column (fine for what the training side sends: metadata, and node-local
        # bytes only when a resume reshards across nodes)
        rank = dist.get_rank()
        return [row[rank] for row in self.allgather(objs)]

    def Barrier(self) -> None:  # noqa: N802
        dist.barrier()

    def Abort(self, code: int) -> None:  # noqa: N802
        os._exit(code)  # the launcher sees the exit and ends the other ranks


def training_comm() -> Comm:
    """The training ranks (a world of one when torch.distributed is not initialised)."""
    return Comm(TorchDistWorld()) if dist.is_available() and dist.is_initialized() else Comm(None)
