"""The training comm: the training ranks as an MPI-like world, so mpitailor's collectives run
inside training; and the one module of the training side that calls torch.distributed
(tests/test_layering.py holds it to that).

`Comm` makes a handful of mpi4py calls; torch.distributed (the group DeepSpeed trains on)
offers each of them. With it, `recover` runs collectively on the ranks of an HF Trainer or
DeepSpeed job that was started without MPI (torchrun, the deepspeed launcher). The few
tensor-level calls the training side makes itself (the update statistics' all-reduce,
leaving the process group at the end of a CPU run) are here too.
"""
from __future__ import annotations

import os
import uuid

from mpitailor.training import dependencies

with dependencies(__name__):
    import torch
    import torch.distributed as dist

from mpitailor.facade import Comm


class TorchDistWorld:
    """A torch.distributed group (the default one unless given), answering the calls `Comm`
    makes of mpi4py. Ranks are the group's; every member must be in it (DeepSpeed's data
    parallel world is the whole world here)."""

    def __init__(self, group=None) -> None:
        self.group = group

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's spelling
        return dist.get_rank(self.group)

    def Get_size(self) -> int:  # noqa: N802
        return dist.get_world_size(self.group)

    def allgather(self, obj):
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj, root: int = 0):
        # an allgather, which every backend has (what the training side sends is small)
        out = self.allgather(obj)
        return out if dist.get_rank(self.group) == root else None

    def bcast(self, obj, root: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, root)
                                   if self.group is not None else root, group=self.group)
        return box[0]

    def alltoall(self, objs: list) -> list:
        # torch.distributed has no object all-to-all: every rank gathers every list and keeps
        # its column (fine for what the training side sends: metadata, and node-local
        # bytes only when a resume reshards across nodes)
        rank = dist.get_rank(self.group)
        return [row[rank] for row in self.allgather(objs)]

    def Barrier(self) -> None:  # noqa: N802
        dist.barrier(group=self.group)

    def Abort(self, code: int) -> None:  # noqa: N802
        os._exit(code)  # the launcher sees the exit and ends the other ranks


def training_comm() -> Comm:
    """The training ranks (a world of one when torch.distributed is not initialised)."""
    return Comm(TorchDistWorld()) if dist.is_available() and dist.is_initialized() else Comm(None)


def agreed_save_id() -> str:
    """Collective: a fresh id, rank 0's on every rank."""
    save_id, comm = uuid.uuid4().hex, training_comm()
    return comm.bcast(save_id, 0) if comm.size > 1 else save_id


def writer_comm() -> Comm:
    """Collective (every training rank, once): a world of its own for a background writer, so
    that its collectives never interleave with training's on the default group. A gloo group
    (host objects, any backend training uses, as DCP's async_save does)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Comm(None)
    return Comm(TorchDistWorld(dist.new_group(backend="gloo")))


def sum_over_ranks(t) -> None:
    """Collective over the training ranks (the default group): the tensor t becomes its sum
    over them, in place; left as it is when torch.distributed is not initialised. A host
    tensor goes through this rank's GPU where the group has no host backend (NCCL alone, as
    `deepspeed.init_distributed("nccl")` makes it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    backend = str(dist.get_backend())
    if t.device.type == "cpu" and "gloo" not in backend and "mpi" not in backend:
        on_gpu = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_gpu)
        t.copy_(on_gpu.cpu())
        return
    dist.all_reduce(t)


def leave_process_group() -> None:
    """Every training rank, last (end_cpu_training): leave torch.distributed's default group,
    if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
