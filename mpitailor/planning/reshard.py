"""Resharding: the ZeRO layout a checkpoint must have at another world size, and where
each output partition's elements live in the sources. Pure: no I/O.

Stage 3: at world size W a parameter of n elements has pn = ceil(n / W) elements per rank,
and DeepSpeed closes an optimizer sub-group (per param group, walking its parameters in
order) once the per-rank sizes add up to `sub_group_size`: sub-group boundaries move with W.
Stages 1/2: each param group stays one flat buffer, padded and cut for the new W. The target
keeps the parameter order and the param groups, and recomputes the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpitailor.formats.zero import CheckpointMeta, Layout, compute_layout


@dataclass(frozen=True, slots=True)
class Target:
    """The output layout at the new world size."""

    layout: Layout
    param_groups: tuple[tuple[int, ...], ...]  # new sub-group ids of each param group
    steps: tuple[float, ...]                   # Adam step of each new sub-group

    @property
    def world_size(self) -> int:
        return self.layout.world_size


@dataclass(frozen=True, slots=True)
class Piece:
    """Copy `length` elements of `kind`-independent flat data: source rank `src_rank`'s
    sub-group `src_group` at `src_start` -> output sub-group `dst_group` at `dst_start`."""

    source: str
    src_rank: int
    src_group: int
    src_start: int
    dst_group: int
    dst_start: int
    length: int


def target_layout(ref: CheckpointMeta, world_size: int, step_of) -> Target:
    """Sub-groups as DeepSpeed forms them at `world_size`; step_of(g_new, names) -> step.
    Stages 1/2 (flat layouts) keep one flat group per param group."""
    by_sub = [[s.name for s in ref.layout.subgroup_slots(g)]
              for g in range(len(ref.layout.subgroup_sizes))]
    shapes = {s.name: s.shape for s in ref.layout.slots}
    subs: list[list[str]] = []
    groups = []
    for old_ids in ref.param_groups:
        names = [n for g in old_ids for n in by_sub[g]]
        ids = []
        chunks = [names] if ref.layout.flat else close_subgroups(names, shapes, world_size,
                                                                 ref.sub_group_size)
        for chunk in chunks:
            ids.append(len(subs))
            subs.append(chunk)
        groups.append(tuple(ids))
    layout = compute_layout([{n: shapes[n] for n in chunk} for chunk in subs], world_size,
                            flat=ref.layout.flat)
    steps = tuple(step_of(g, chunk) for g, chunk in enumerate(subs))
    return Target(layout, tuple(groups), steps)


def close_subgroups(names, shapes, world_size, sub_group_size) -> list[list[str]]:
    """DeepSpeed stage 3 `_create_fp16_sub_groups`, on shapes instead of tensors."""
    sizes = [math.ceil(math.prod(shapes[n]) / world_size) for n in names]
    if sub_group_size >= sum(sizes):
        return [list(names)] if names else []
    out, cur, size = [], [], 0
    for i, (n, pn) in enumerate(zip(names, sizes)):
        cur.append(n)
        size += pn
        if size >= sub_group_size or i == len(names) - 1:
            out.append(cur)
            cur, size = [], 0
    return out


def pieces_for(target: Target, partition: int, src_layout: Layout,
               param_source: dict[str, str]) -> list[Piece]:
    """Every source range output partition `partition` needs (padding excluded)."""
    old = src_layout.by_name()
    out = []
    for s2 in target.layout.slots:
        s1 = old[s2.name]
        at, lo, n = target.layout.held(s2, partition)
        e, hi = lo, lo + n
        while e < hi:  # element e of the parameter, where the sources hold it
            r1, at1, run = src_layout.locate(s1, e)
            k = min(hi - e, run)
            out.append(Piece(param_source[s2.name], r1, s1.subgroup, at1, s2.subgroup,
                             at + (e - lo), k))
            e += k
    return out
