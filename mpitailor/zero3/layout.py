"""ZeRO-3 partition arithmetic: where each parameter's slice lives in a rank's flat buffers.

Every parameter is partitioned on its own: with world size W and n elements, each rank
holds pn = ceil(n / W) elements, rank r the elements [r*pn, (r+1)*pn) of the zero-padded
parameter; the last ranks' slices end in pn*W - n padding elements of undefined content.
A rank's flat buffer for sub-group g is the concatenation of its slices of the parameters
of `param_shapes[g]`, in order. exp_avg and exp_avg_sq share that layout.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MOMENTS = ("exp_avg", "exp_avg_sq")
KINDS = ("fp32",) + MOMENTS  # the flat buffers of each sub-group, all fp32, one layout
BYTES_PER_ELEMENT = 4 * len(KINDS)  # fp32 master + exp_avg + exp_avg_sq, per element


@dataclass(frozen=True, slots=True)
class Slot:
    """One parameter's place in every rank's flat buffer of its sub-group."""

    name: str
    shape: tuple[int, ...]
    subgroup: int
    offset: int  # start within the sub-group's flat buffer (the same on every rank)
    length: int  # pn: elements per rank, padding included

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def valid(self, rank: int) -> int:
        """How many of rank `rank`'s `length` elements are real (the rest is padding)."""
        return max(0, min(self.length, self.numel - rank * self.length))


@dataclass(frozen=True, slots=True)
class Layout:
    """The slot table of one checkpoint: parameters in optimizer order, per sub-group."""

    world_size: int
    slots: tuple[Slot, ...]
    subgroup_sizes: tuple[int, ...]  # elements per rank in each sub-group's flat buffer

    def by_name(self) -> dict[str, Slot]:
        return {s.name: s for s in self.slots}

    def subgroup_slots(self, g: int) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.subgroup == g)


def compute_layout(param_shapes: Sequence[Mapping[str, Sequence[int]]],
                   world_size: int) -> Layout:
    """Slot table from `param_shapes` (one mapping per sub-group) and the world size."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    slots, sizes = [], []
    for g, shapes in enumerate(param_shapes):
        off = 0
        for name, shape in shapes.items():
            shape = tuple(int(d) for d in shape)
            pn = math.ceil(math.prod(shape) / world_size)
            slots.append(Slot(name, shape, g, off, pn))
            off += pn
        sizes.append(off)
    return Layout(world_size, tuple(slots), tuple(sizes))
