"""Whole tensors from a checkpoint's rank slices (for `inspect`, exports and checks)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from mpitailor.formats.layout import KINDS, Slot
from mpitailor.formats.meta import CheckpointMeta
from mpitailor.formats.shard import open_all_shards
from mpitailor.formats.shard_protocol import Shard


def full_tensor(shards: Sequence[Shard], slot: Slot, kind: str) -> torch.Tensor:
    """The whole parameter `slot` of kind fp32/exp_avg/exp_avg_sq, from all ranks' shards,
    each rank's real elements read straight into their place (no per-rank copies)."""
    out = torch.empty(slot.numel, dtype=torch.float32)
    read_range(shards, slot, kind, 0, out)
    return out.view(slot.shape)


def read_range(shards: Sequence[Shard], slot: Slot, kind: str, lo: int,
               out: torch.Tensor) -> None:
    """Elements [lo, lo + out.numel()) of the whole parameter `slot` (flattened) into `out`,
    from the ranks that hold them (layout.held)."""
    hi = lo + out.numel()
    for s in shards:
        at, first, n = s.meta.layout.held(slot, s.rank)
        a, b = max(lo, first), min(hi, first + n)
        if a < b:
            s.read_into(kind, slot.subgroup, at + a - first, out[a - lo: b - lo])


def frozen_tensor(shards: Sequence[Shard], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    numel = torch.Size(shape).numel()
    parts = [s.model["frozen_param_fragments"][name].reshape(-1) for s in shards]
    return torch.cat(parts)[:numel].view(shape)


def consolidate(meta: CheckpointMeta, kinds: Sequence[str] = KINDS) -> dict[str, dict]:
    """kind -> {name: whole tensor}; frozen parameters appear under `fp32` only."""
    with open_all_shards(meta) as shards:
        out: dict[str, dict] = {k: {} for k in kinds}
        for kind in kinds:
            for slot in meta.layout.slots:
                out[kind][slot.name] = full_tensor(shards, slot, kind)
        if "fp32" in out:
            for name, shape in meta.frozen_shapes:
                out["fp32"][name] = frozen_tensor(shards, name, shape).float()
        return out
