"""`--export universal`: DeepSpeed's Universal Checkpoint layout, written by all ranks.

What DeepSpeed's own offline converter (`ds_to_universal`) writes for a ZeRO-3 checkpoint,
and what `load_universal` reads back at any world size, next to the native files of the
same tag (the model-states file `load_universal` reads is already there):

    TAG/zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt   whole parameter, 1-D fp32
    TAG/zero/optimizer_state.pt      rank 0's optimizer state without its flat buffers
    latest_universal                 names TAG (DeepSpeed reads it when tag=None)

The parameters' files are part of the merge's copy program (program.buffers with
`universal`): copied straight from the sources by every rank, byte range by byte range. This
module writes the rest, from the merged checkpoint once it is complete.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.formats.io import write_synced
from mpitailor.formats.torch import Tensor, same_values, write_torch_file
from mpitailor.formats.zero import (
    LATEST_UNIVERSAL,
    CheckpointMeta,
    open_shard,
    without_flat_buffers,
)
from mpitailor.planning.plan import MergePlan
from mpitailor.planning.reshard import close_subgroups

log = logging.getLogger(__name__)
OPTIMIZER_STATE = "optimizer_state.pt"


def export_universal(comm: Comm, staged: CheckpointMeta, root: Path) -> dict:
    """Collective: the Universal layout's optimizer_state.pt and `latest_universal`, for the
    checkpoint `staged` (the merged tag dir under root) whose zero/<param>/ files the copy
    program wrote; returns {path relative to root: manifest record}."""
    records = comm.root_step(_write_optimizer_state, staged, staged.path / "zero")
    tag = staged.files.tag
    out = {f"{tag}/zero/{name}": rec for name, rec in records.items()}
    out[LATEST_UNIVERSAL] = comm.root_step(write_synced, root / LATEST_UNIVERSAL, tag.encode())
    return out


def _write_optimizer_state(staged: CheckpointMeta, zero: Path) -> dict[str, dict]:
    """Rank 0: zero/ and its optimizer_state.pt (counters, loss scaler, param groups, Adam
    steps): what ds_to_universal writes there, less the flat buffers nobody reads from it."""
    zero.mkdir(exist_ok=True)  # the copy program made it, unless there are no parameters
    with open_shard(staged, 0) as shard:
        osd = without_flat_buffers(shard.optim["optimizer_state_dict"])
        groups = osd["optimizer_state_dict"]["param_groups"]
        osd["param_groups"] = groups  # unread by load_universal; ds_to_universal writes it
        limits = loader_limits(staged, shard, staged.subgroup_steps)
        record = write_torch_file(zero / OPTIMIZER_STATE, osd)
    if limits:
        log.warning("--export universal: the files are complete, but DeepSpeed's "
                    "load_universal restores this checkpoint inexactly: %s. A native "
                    "checkpoint resharded with --world-size N resumes exactly.",
                    "; ".join(limits))
    return {OPTIMIZER_STATE: record}


def loader_limits(meta: CheckpointMeta, rank0, steps: Sequence[float]) -> list[str]:
    """Why DeepSpeed 0.19.8's ZeRO-3 `load_universal` would not restore a checkpoint with
    meta's parameters, rank0's (an open rank-0 shard's) param groups and buffers, and these
    sub-group Adam steps exactly (read from its code; the step sharing measured, see
    docs/resharding.md). It gives every sub-group sub-group 0's Adam step, and with torch Adam the very
    same step tensor, which then advances once per sub-group per step; it gives every param
    group group 0's hyper-parameters; it restores neither frozen parameters nor buffers."""
    groups = rank0.inner["param_groups"]
    state = rank0.inner["state"]
    tensor_step = bool(state) and isinstance(state[min(state)]["step"], Tensor)
    buffers = len(rank0.model.get("buffer_names") or ())
    limits = []
    if len(set(steps)) > 1:
        limits.append(f"its sub-groups have different Adam steps ({min(steps):g} to "
                      f"{max(steps):g}): it gives all of them sub-group 0's ({steps[0]:g})")
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    differ = sorted({k for h in hyper[1:] for k in h.keys() | hyper[0].keys()
                     if not same_values(h.get(k), hyper[0].get(k))})
    if differ:
        limits.append(f"its {len(groups)} param groups differ in {', '.join(differ)}: it "
                      f"gives every group the values of group 0")
    if tensor_step:
        shared = "torch Adam's step tensor is shared by all sub-groups and advances once per " \
                 "sub-group per step"
        if len(groups) > 1:
            limits.append(f"{shared}, and {len(groups)} param groups are at least "
                          f"{len(groups)} sub-groups at any world size")
        elif (w := min_single_subgroup_world(meta)) is None:
            limits.append(f"{shared}, and the model is more than one sub-group "
                          f"(sub_group_size {meta.sub_group_size}) at any world size")
        elif w > 1:
            limits.append(f"{shared}: exact only at world sizes >= {w}, where the model is "
                          f"one sub-group (sub_group_size {meta.sub_group_size})")
    if meta.frozen_shapes:
        limits.append(f"it leaves the {len(meta.frozen_shapes)} frozen parameter(s) as the "
                      f"model was built")
    if buffers:
        limits.append(f"it leaves the {buffers} persistent buffer(s) as the model was built")
    return limits


def plan_limits(plan: MergePlan) -> list[str]:
    """loader_limits of what a merge by `plan` will write (for --dry-run)."""
    steps = plan.target.steps if plan.target is not None else \
        tuple(sg.step for sg in plan.subgroups)
    with open_shard(plan.base_meta, 0) as shard:
        return loader_limits(plan.base_meta, shard, steps)


def min_single_subgroup_world(meta: CheckpointMeta) -> int | None:
    """The smallest world size at which DeepSpeed makes all parameters one optimizer
    sub-group (per-rank sizes only shrink as the world grows), or None if none does."""
    names = [s.name for s in meta.layout.slots]
    shapes = {s.name: s.shape for s in meta.layout.slots}

    def one(world: int) -> bool:
        return len(close_subgroups(names, shapes, world, meta.sub_group_size)) <= 1

    hi = max((math.prod(s) for s in shapes.values()), default=1)
    if not one(hi):  # every parameter one element per rank already
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if one(mid) else (mid + 1, hi)
    return lo
