"""ZeRO partition arithmetic: where each parameter's elements live in a rank's flat buffers.

Stage 3: every parameter is partitioned on its own: with world size W and n elements, each
rank holds pn = ceil(n / W) elements, rank r the elements [r*pn, (r+1)*pn) of the
zero-padded parameter; the last ranks' slices end in pn*W - n padding elements of undefined
content. A rank's flat buffer for sub-group g is the concatenation of its slices of the
parameters of `param_shapes[g]`, in order. exp_avg and exp_avg_sq share that layout.

Stages 1 and 2 (`flat` layouts): each param group's parameters are concatenated, in
`param_shapes[g]` order, into one flat buffer of N elements, zero-padded to a multiple of
2W (DeepSpeed's nccl_start_alignment_factor times W) and cut into W equal partitions of P
elements: rank r holds flat elements [r*P, (r+1)*P). A parameter can straddle ranks; the
padding is at the end. The optimizer file keeps the Adam moments whole (P elements) but the
fp32 master partition without its padding (`lean_size`).

`held(slot, rank)` and `locate(slot, e)` answer "which elements where" for both.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpitailor.formats.dtypes import DTYPES

MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = ("fp32",) + MOMENTS  # the flat buffers of each sub-group, all fp32, one layout
ELEMENT = DTYPES["fp32"].itemsize  # bytes of one element of a flat buffer (every kind fp32)
OPTIM_BYTES_PER_ELEMENT = ELEMENT * len(KINDS)  # fp32 master + exp_avg + exp_avg_sq


@dataclass(frozen=True, slots=True)
class Slot:
    """One parameter's place in every rank's flat buffer of its sub-group."""

    name: str
    shape: tuple[int, ...]
    subgroup: int
    offset: int  # stage 3: start within every rank's sub-group buffer; flat: within the group
    length: int  # stage 3: pn, elements per rank, padding included; flat: numel

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def valid(self, partition: int) -> int:
        """How many of the partition's `length` elements are real (the rest is padding)."""
        return max(0, min(self.length, self.numel - partition * self.length))


@dataclass(frozen=True, slots=True)
class Layout:
    """The slot table of one checkpoint: parameters in optimizer order, per sub-group."""

    world_size: int
    slots: tuple[Slot, ...]
    subgroup_sizes: tuple[int, ...]  # elements per partition in each sub-group's flat buffer
    flat: bool = False               # stages 1/2: a group's parameters in one flat buffer

    def by_name(self) -> dict[str, Slot]:
        return {s.name: s for s in self.slots}

    def subgroup_slots(self, g: int) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.subgroup == g)

    def held(self, slot: Slot, partition: int) -> tuple[int, int, int]:
        """(offset in partition's buffer, first element of the parameter, count) of the part of
        `slot` that partition holds; count 0 when it holds none (padding excluded)."""
        if not self.flat:
            return slot.offset, partition * slot.length, slot.valid(partition)
        p = self.subgroup_sizes[slot.subgroup]
        lo = max(slot.offset, partition * p)
        hi = min(slot.offset + slot.numel, (partition + 1) * p)
        if lo >= hi:
            return 0, 0, 0
        return lo - partition * p, lo - slot.offset, hi - lo

    def span(self, slot: Slot, partition: int) -> tuple[int, int]:
        """(start, length) of partition's slice of `slot` in its sub-group buffer: stage 3 the
        slice with its padding; flat the part of the parameter the partition holds (maybe 0)."""
        if not self.flat:
            return slot.offset, slot.length
        at, _, n = self.held(slot, partition)
        return at, n

    def locate(self, slot: Slot, e: int) -> tuple[int, int, int]:
        """Element e of the parameter: (rank, offset in that rank's buffer, how many
        elements from there on are contiguous on that rank)."""
        if not self.flat:
            rank, within = divmod(e, slot.length)
            return rank, slot.offset + within, slot.length - within
        rank, within = divmod(slot.offset + e, self.subgroup_sizes[slot.subgroup])
        return rank, within, self.subgroup_sizes[slot.subgroup] - within

    def window(self, g: int, rank: int) -> int:
        """Where rank's buffer of sub-group g starts, in the coordinates of the slots'
        offsets: 0 for stage 3 (per-rank offsets), rank * P for flat layouts."""
        return rank * self.subgroup_sizes[g] if self.flat else 0

    def buffer_size(self, kind: str, g: int, rank: int) -> int:
        """Elements of rank's buffer of (kind, sub-group g) as the optimizer file stores it."""
        return self.lean_size(g, rank) if self.flat and kind == "fp32" else self.subgroup_sizes[g]

    def lean_size(self, g: int, rank: int) -> int:
        """Elements of rank's fp32 master partition of group g as a flat (stage 1/2) file
        stores it: the partition without its padding."""
        p = self.subgroup_sizes[g]
        used = sum(s.numel for s in self.subgroup_slots(g))
        return max(0, min(p, used - rank * p))


ALIGNMENT = 2  # DeepSpeed stage 1/2 nccl_start_alignment_factor: a group is padded to 2W


def compute_layout(param_shapes: Sequence[Mapping[str, Sequence[int]]], world_size: int,
                   flat: bool = False) -> Layout:
    """Slot table from `param_shapes` (one mapping per sub-group) and the world size.
    flat: stage 1/2, each group one flat buffer, padded to a multiple of 2W and split into W
    equal partitions."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    slots, sizes = [], []
    for g, shapes in enumerate(param_shapes):
        off = 0
        for name, shape in shapes.items():
            shape = tuple(int(d) for d in shape)
            n = math.prod(shape) if flat else math.ceil(math.prod(shape) / world_size)
            slots.append(Slot(name, shape, g, off, n))
            off += n
        align = ALIGNMENT * world_size
        sizes.append(math.ceil(off / align) * align // world_size if flat else off)
    return Layout(world_size, tuple(slots), tuple(sizes), flat=flat)
