"""Build and write one output ZeRO-3 partition (optim + model-states files) from a plan.

The output rank's flat buffers (fp32 master, exp_avg, exp_avg_sq of every sub-group) are
allocated once and filled by byte-range reads from the chosen sources' rank files; every
other field (param groups, loss scaler, counters, config) comes from the base source.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from mpitailor import failpoints
from mpitailor.commit import FileRecord
from mpitailor.plan import MergePlan
from mpitailor.zero3 import opaque
from mpitailor.zero3.files import model_file, optim_file
from mpitailor.zero3.shard import KINDS, RankShard, open_shard


def flat_buffers(sizes) -> dict[str, list[torch.Tensor]]:
    """Output flat buffers (per kind, per sub-group) for one partition. Every partition of a
    layout has the same sizes, so a rank that writes several reuses them (and pays the page
    faults of fresh memory once)."""
    return {k: [torch.empty(n, dtype=torch.float32) for n in sizes] for k in KINDS}


def new_buffers(plan: MergePlan) -> dict[str, list[torch.Tensor]]:
    return flat_buffers(plan.base_meta.layout.subgroup_sizes)


def build_partition(plan: MergePlan, rank: int,
                    buffers: dict[str, list[torch.Tensor]] | None = None,
                    verify: bool = False) -> tuple[dict, dict]:
    """(optim dict, model-states dict) of output partition `rank`, filled into `buffers`.
    verify: first check every source record read against its CRC (reads them whole)."""
    shards: dict[str, RankShard] = {}
    try:
        for name, meta in plan.sources:
            shards[name] = open_shard(meta, rank)
        if verify:
            for name, shard in shards.items():
                if not shard.meta.files.partial:
                    shard.verify({(k, g) for g, sg in enumerate(plan.subgroups)
                                  for run in sg.runs if run.source == name for k in KINDS})
        failpoints.hit("read")
        flats = _copy_flats(plan, shards, buffers or new_buffers(plan))
        return _optim_dict(plan, shards[plan.base], flats), merged_model_states(plan, shards)
    finally:
        for s in shards.values():
            s.close()


def _copy_flats(plan: MergePlan, shards: dict[str, RankShard],
                flats: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    for g, sg in enumerate(plan.subgroups):
        for run in sg.runs:
            for kind in KINDS:
                dst = flats[kind][g][run.start: run.start + run.length]
                shards[run.source].read_into(kind, g, run.start, dst)
    return flats


def _optim_dict(plan: MergePlan, base: RankShard, flats: dict[str, list[torch.Tensor]]) -> dict:
    osd = dict(base.optim["optimizer_state_dict"])
    inner = dict(osd["optimizer_state_dict"])
    state = {}
    for g, sg in enumerate(plan.subgroups):
        state[g] = {"step": step_like(inner["state"][g]["step"], sg.step), "exp_avg": flats["exp_avg"][g],
                    "exp_avg_sq": flats["exp_avg_sq"][g]}
    inner["state"] = state
    osd["optimizer_state_dict"] = inner
    osd["fp32_flat_groups"] = flats["fp32"]
    return {**base.optim, "optimizer_state_dict": osd}


def step_like(template, value: float):
    """An Adam step of `value` in the form the source stores it (0-d tensor, int or float)."""
    if isinstance(template, torch.Tensor):
        return torch.tensor(value, dtype=template.dtype)
    return type(template)(value)


def merged_model_states(plan: MergePlan, shards: dict[str, RankShard]) -> dict:
    base = shards[plan.base].model
    model = dict(base)
    if plan.frozen_source:
        model["frozen_param_fragments"] = type(base["frozen_param_fragments"])(
            (name, shards[src].model["frozen_param_fragments"][name])
            for name, src in plan.frozen_source)
    buffers = set(base.get("buffer_names") or ())
    if buffers:
        key_source = dict(plan.layer_source)
        classify = plan.classifier()
        module = type(base["module"])()
        for name, t in base["module"].items():
            src = key_source.get(classify(name), plan.base) if name in buffers else plan.base
            module[name] = shards[src].model["module"][name]
        model["module"] = module
    return model


def write_partition(plan: MergePlan, rank: int, tag_dir: Path,
                    buffers: dict[str, list[torch.Tensor]] | None = None,
                    verify: bool = False) -> dict[str, dict]:
    """Write output partition `rank` into `tag_dir`, fsynced: {file name: manifest record}."""
    optim, model = build_partition(plan, rank, buffers, verify)
    bf16 = plan.base_meta.files.bf16_prefix
    records = {optim_file(rank, bf16): save_synced(optim, tag_dir / optim_file(rank, bf16))}
    failpoints.hit("write")
    records[model_file(rank)] = save_synced(model, tag_dir / model_file(rank))
    return records


class _HashingWriter:
    """A file wrapper that hashes what torch.save streams through it (no re-read)."""

    def __init__(self, f) -> None:
        self.f, self.rec, self.error = f, FileRecord(), None

    def write(self, data) -> int:
        # All of it or an OSError, kept: torch's zip writer swallows exceptions from here and
        # reports only an opaque "unexpected pos", so save_synced re-raises the real one
        # (say, ENOSPC on a full disk).
        view = memoryview(data).cast("B")
        self.rec.update(view)
        try:
            while view:
                view = view[self.f.write(view):]
        except OSError as e:
            self.error = e
            raise
        return len(data)

    def flush(self) -> None:
        pass  # unbuffered


def save_synced(obj, path: Path) -> dict:
    """torch.save to a new file, fsync; return its manifest record (size, CRC-32)."""
    _refuse_meta(obj, path)
    with open(path, "xb", buffering=0) as f:
        w = _HashingWriter(f)
        try:
            # Stand-ins for untrusted objects are written back as their original globals.
            kwargs = {"pickle_module": opaque.pickle_module} if opaque.holds_opaque(obj) else {}
            torch.save(obj, w, **kwargs)
        except RuntimeError:
            if w.error is not None:
                raise w.error from None
            raise
        os.fsync(f.fileno())
    return w.rec.record()


def _refuse_meta(obj, path: Path) -> None:
    """A meta tensor here would be a bug: a buffer left unread. Never write it."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            raise RuntimeError(f"{path}: internal error: unread tensor in output")
    elif isinstance(obj, dict):
        for v in obj.values():
            _refuse_meta(v, path)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _refuse_meta(v, path)
