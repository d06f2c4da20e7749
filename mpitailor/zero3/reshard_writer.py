"""Build and write one output partition at a new world size (see reshard.py).

The partition's flat buffers are filled from every source rank whose slices overlap it,
byte range by byte range; padding is zero. Model states and the optimizer's other fields
come from the base's rank-0 files, rewritten for the new world size: parameter shapes per
new sub-group, renumbered param groups, re-sliced frozen fragments, tied aliases on rank 0.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import torch

from mpitailor import failpoints
from mpitailor.plan import MergePlan
from mpitailor.reshard import pieces_for
from mpitailor.zero3.files import model_file, optim_file
from mpitailor.zero3.safeload import load
from mpitailor.zero3.shard import KINDS, open_shard
from mpitailor.zero3.writer import flat_buffers, merged_model_states, save_synced, step_like


def new_target_buffers(plan: MergePlan) -> dict[str, list[torch.Tensor]]:
    return flat_buffers(plan.target.layout.subgroup_sizes)


def write_resharded_partition(plan: MergePlan, rank: int, tag_dir: Path,
                              buffers: dict[str, list[torch.Tensor]]) -> dict[str, dict]:
    target = plan.target
    for bufs in buffers.values():
        for b in bufs:
            b.zero_()  # padding
    pieces = pieces_for(target, rank, plan.base_meta.layout, dict(plan.param_source))
    shards = {}
    try:
        for p in sorted(pieces, key=lambda p: (p.source, p.src_rank)):
            key = (p.source, p.src_rank)
            if key not in shards:
                shards[key] = open_shard(plan.meta(p.source), p.src_rank)
            for kind in KINDS:
                dst = buffers[kind][p.dst_group][p.dst_start: p.dst_start + p.length]
                shards[key].read_into(kind, p.src_group, p.src_start, dst)
        failpoints.hit("read")
        base = open_shard(plan.base_meta, 0) if (plan.base, 0) not in shards \
            else shards[plan.base, 0]
        shards[plan.base, 0] = base
        optim = _optim_dict(plan, base, buffers)
        model = _resharded_model(plan, rank, base)
    finally:
        for s in shards.values():
            s.close()
    bf16 = plan.base_meta.files.bf16_prefix
    records = {optim_file(rank, bf16): save_synced(optim, tag_dir / optim_file(rank, bf16))}
    failpoints.hit("write")
    records[model_file(rank)] = save_synced(model, tag_dir / model_file(rank))
    return records


def _optim_dict(plan: MergePlan, base, flats) -> dict:
    target = plan.target
    osd = dict(base.optim["optimizer_state_dict"])
    inner = dict(osd["optimizer_state_dict"])
    step_t = inner["state"][0]["step"]
    inner["state"] = {g: {"step": step_like(step_t, target.steps[g]),
                          "exp_avg": flats["exp_avg"][g], "exp_avg_sq": flats["exp_avg_sq"][g]}
                      for g in range(len(target.layout.subgroup_sizes))}
    inner["param_groups"] = [{**pg, "params": list(ids)}
                             for pg, ids in zip(inner["param_groups"], target.param_groups)]
    osd.update(optimizer_state_dict=inner, fp32_flat_groups=flats["fp32"],
               partition_count=target.world_size)
    return {**base.optim, "optimizer_state_dict": osd}


def _resharded_model(plan: MergePlan, rank: int, base) -> dict:
    target = plan.target
    # Only the model-states dicts are needed here (buffers; the base's fields): no optim.
    rank0 = {name: SimpleNamespace(model=load(meta.files.model_path(0), opaque_ok=True))
             for name, meta in plan.sources}
    model = merged_model_states(plan, rank0)
    model["param_shapes"] = [
        type(base.model["param_shapes"][0])((s.name, torch.Size(s.shape))
                                            for s in target.layout.subgroup_slots(g))
        for g in range(len(target.layout.subgroup_sizes))]
    model["dp_world_size"] = target.world_size
    if rank != 0:
        model["shared_params"] = {}
    if plan.frozen_source:
        states: dict[tuple[str, int], dict] = {}
        model["frozen_param_fragments"] = type(base.model["frozen_param_fragments"])(
            (name, _frozen_slice(plan, name, src, rank, states))
            for name, src in plan.frozen_source)
    return model


def _frozen_slice(plan: MergePlan, name: str, src: str, rank: int,
                  states: dict[tuple[str, int], dict]) -> torch.Tensor:
    """Rank `rank`'s fragment of a frozen parameter at the new world size (zero padded),
    copied from the source ranks whose fragments overlap it (memory-mapped: only those
    pages are read)."""
    meta = plan.meta(src)
    numel = math.prod(dict(meta.frozen_shapes)[name])
    pn1 = math.ceil(numel / meta.world_size)
    pn2 = math.ceil(numel / plan.target.world_size)
    lo, hi = rank * pn2, min((rank + 1) * pn2, numel)
    out = None
    e = lo
    while e < hi:
        r1, within = divmod(e, pn1)
        n = min(hi - e, pn1 - within)
        if (src, r1) not in states:
            states[src, r1] = load(meta.files.model_path(r1), opaque_ok=True)
        frag = states[src, r1]["frozen_param_fragments"][name].reshape(-1)
        if out is None:
            out = torch.zeros(pn2, dtype=frag.dtype)
        out[e - lo: e - lo + n] = frag[within: within + n]
        e += n
    if out is None:  # this rank holds only padding of it
        first = load(meta.files.model_path(0), opaque_ok=True)["frozen_param_fragments"][name]
        out = torch.zeros(pn2, dtype=first.dtype)
    return out
