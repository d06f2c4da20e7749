"""Whole tensors from a checkpoint's rank slices (for `inspect`, exports and checks), as
numpy arrays: fp32 weights and moments, frozen parameters in their own dtype's bits."""
from __future__ import annotations

import math
from collections.abc import Sequence

from mpitailor.errors import CheckpointError
from mpitailor.formats.zero.layout import KINDS, Slot
from mpitailor.formats.zero.meta import CheckpointMeta
from mpitailor.formats.zero.shard import open_all_shards
from mpitailor.formats.zero.shard_protocol import Shard


def full_tensor(shards: Sequence[Shard], slot: Slot, kind: str):
    """The whole parameter `slot` of kind fp32/exp_avg/exp_avg_sq (float32, its shape), from
    all ranks' shards, each rank's real elements read straight into their place."""
    import numpy as np
    out = np.empty(slot.numel, dtype=np.float32)
    read_range(shards, slot, kind, 0, out)
    return out.reshape(slot.shape)


def read_range(shards: Sequence[Shard], slot: Slot, kind: str, lo: int, out) -> None:
    """Elements [lo, lo + out.size) of the whole parameter `slot` (flattened) into the
    float32 array `out`, from the ranks that hold them (layout.held)."""
    hi = lo + out.size
    for s in shards:
        at, first, n = s.meta.layout.held(slot, s.rank)
        a, b = max(lo, first), min(hi, first + n)
        if a < b:
            s.read_into(kind, slot.subgroup, at + a - first, out[a - lo: b - lo])


def frozen_tensor(shards: Sequence[Shard], name: str, shape: tuple[int, ...]):
    """(dtype, bits) of a frozen parameter: its fragments joined, padding cut, in its
    shape (bf16 as uint16 bits, see tensorref.Tensor.raw)."""
    import numpy as np
    frags = [s.model["frozen_param_fragments"][name] for s in shards]
    _one_dtype(frags, name)
    whole = np.concatenate([f.values() for f in frags])[:math.prod(shape)]
    return frags[0].dtype, whole.reshape(shape)


def _one_dtype(fragments, name: str) -> None:
    """The ranks' fragments of one frozen parameter join as bits of one dtype."""
    if len({f.dtype for f in fragments}) != 1:
        raise CheckpointError(f"frozen parameter {name}: its fragments have different dtypes "
                              f"({', '.join(sorted({f.dtype for f in fragments}))}) across "
                              f"the ranks' model states; files from different runs?")


def consolidate(meta: CheckpointMeta, kinds: Sequence[str] = KINDS) -> dict[str, dict]:
    """kind -> {name: whole float32 array}; frozen parameters appear under `fp32` only."""
    from mpitailor.formats.torch import cast
    with open_all_shards(meta) as shards:
        out: dict[str, dict] = {k: {} for k in kinds}
        for kind in kinds:
            for slot in meta.layout.slots:
                out[kind][slot.name] = full_tensor(shards, slot, kind)
        if "fp32" in out:
            for name, shape in meta.frozen_shapes:
                dtype, bits = frozen_tensor(shards, name, shape)
                out["fp32"][name] = cast(bits.reshape(-1), dtype, "fp32").reshape(shape)
        return out
