"""One rank's files of a checkpoint, opened memory-mapped and checked against its metadata."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mpitailor.errors import CheckpointError
from mpitailor.zero3.meta import CheckpointMeta
from mpitailor.zero3.safeload import load

MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = ("fp32",) + MOMENTS


@dataclass
class RankShard:
    """The memory-mapped contents of rank `rank`'s model and optimizer files.

    `flat(kind, g)` is the rank's flat buffer of sub-group g for kind fp32, exp_avg or
    exp_avg_sq; slicing it reads only the pages of that slice.
    """

    meta: CheckpointMeta
    rank: int
    model: dict
    optim: dict

    @property
    def inner(self) -> dict:
        return self.optim["optimizer_state_dict"]["optimizer_state_dict"]

    def flat(self, kind: str, g: int) -> torch.Tensor:
        if kind == "fp32":
            return self.optim["optimizer_state_dict"]["fp32_flat_groups"][g]
        return self.inner["state"][g][kind]


def open_shard(meta: CheckpointMeta, rank: int) -> RankShard:
    """Open rank `rank`'s files; raise CheckpointError if they disagree with rank 0's."""
    model_path, optim_path = meta.files.model_path(rank), meta.files.optim_path(rank)
    model, optim = load(model_path), load(optim_path)
    if rank != 0:
        shapes = [{n: tuple(s) for n, s in g.items()} for g in model.get("param_shapes", [])]
        expect = [{s.name: s.shape for s in meta.layout.subgroup_slots(g)}
                  for g in range(len(meta.layout.subgroup_sizes))]
        if shapes != expect or int(model.get("global_steps", -1)) != meta.global_steps:
            raise CheckpointError(f"{model_path}: disagrees with rank 0's model states "
                                  f"(param_shapes or global_steps); files from different runs?")
    shard = RankShard(meta, rank, model, optim)
    try:
        for g, size in enumerate(meta.layout.subgroup_sizes):
            for kind in KINDS:
                t = shard.flat(kind, g)
                if t.dtype != torch.float32 or t.numel() != size:
                    raise CheckpointError(
                        f"{optim_path}: sub-group {g} {kind} is {t.dtype} x {t.numel()}, "
                        f"expected float32 x {size}; files from different runs?")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise CheckpointError(f"{optim_path}: optimizer state incomplete (sub-group "
                              f"buffers missing); not a DeepSpeed ZeRO-3 optim file") from None
    return shard
