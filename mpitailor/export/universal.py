"""`--export universal`: DeepSpeed's Universal Checkpoint layout, written by all ranks.

What DeepSpeed's own offline converter (`ds_to_universal`) writes for a ZeRO-3 checkpoint,
and what `load_universal` reads back at any world size, next to the native files of the
same tag (the model-states file `load_universal` reads is already there):

    TAG/zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt   whole parameter, 1-D fp32
    TAG/zero/optimizer_state.pt      rank 0's optimizer state without its flat buffers
    latest_universal                 names TAG (DeepSpeed reads it when tag=None)

Parameters are split, in model order, into one contiguous chunk per MPI rank of about equal
bytes; each rank reads its parameters' slices from every partition file (byte ranges only)
and writes their files.
"""
from __future__ import annotations

import logging
from pathlib import Path

from mpitailor.comm import Comm
from mpitailor.commit import write_synced
from mpitailor.export import contiguous_chunks
from mpitailor.zero3 import CheckpointMeta, open_shard
from mpitailor.zero3.consolidate import full_tensor
from mpitailor.zero3.shard import KINDS
from mpitailor.zero3.writer import save_synced

log = logging.getLogger(__name__)
LATEST = "latest_universal"
OPTIMIZER_STATE = "optimizer_state.pt"


def export_universal(comm: Comm, staged: CheckpointMeta, root: Path) -> dict:
    """Collective: the Universal layout of the checkpoint `staged` (the merged tag dir under
    root); returns {path relative to root: manifest record}."""
    tag = staged.files.tag
    zero = staged.path / "zero"
    records = {f"{tag}/zero/{k}": v for k, v in comm.root_step(_write_common, staged, zero)
               .items()}
    chunks = contiguous_chunks([(s.name, s.numel) for s in staged.layout.slots], comm.size)

    def write_mine() -> dict[str, dict]:
        return _write_params(staged, chunks[comm.rank], zero) if comm.rank < len(chunks) else {}

    for part in comm.allgather(comm.step(write_mine)):
        records.update({f"{tag}/zero/{k}": v for k, v in part.items()})
    records[LATEST] = comm.root_step(write_synced, root / LATEST, tag.encode())
    return records


def _write_common(staged: CheckpointMeta, zero: Path) -> dict[str, dict]:
    """Rank 0: zero/ and its optimizer_state.pt (counters, loss scaler, param groups, steps),
    as ds_to_universal writes it but without the flat buffers nobody reads from there."""
    _warn_about_loader(staged)
    zero.mkdir()
    with open_shard(staged, 0) as shard:
        osd = {k: v for k, v in shard.optim["optimizer_state_dict"].items()
               if k != "fp32_flat_groups"}
        inner = shard.inner
        groups = inner["param_groups"]
        osd["optimizer_state_dict"] = {
            "state": {g: {"step": st["step"]} for g, st in inner["state"].items()},
            "param_groups": groups}
        osd["param_groups"] = groups  # ds_to_universal puts them at the top level too
        return {OPTIMIZER_STATE: save_synced(osd, zero / OPTIMIZER_STATE)}


def _write_params(staged: CheckpointMeta, names: list[str], zero: Path) -> dict[str, dict]:
    slots = staged.layout.by_name()
    shards = [open_shard(staged, r) for r in range(staged.world_size)]
    records = {}
    try:
        for name in names:
            (zero / name).mkdir()
            for kind in KINDS:
                t = full_tensor(shards, slots[name], kind).reshape(-1)
                records[f"{name}/{kind}.pt"] = save_synced(t, zero / name / f"{kind}.pt")
    finally:
        for s in shards:
            s.close()
    return records


def _warn_about_loader(meta: CheckpointMeta) -> None:
    """DeepSpeed 0.19.8's ZeRO-3 `load_universal` is exact only for one param group and one
    sub-group, and never restores frozen parameters (measured and read from its code; see
    the README). Say so rather than let a resume drift silently."""
    limits = []
    if len(meta.param_groups) > 1:
        limits.append(f"{len(meta.param_groups)} param groups (it gives every group the "
                      f"hyper-parameters of group 0)")
    if len(meta.layout.subgroup_sizes) > 1:
        limits.append(f"{len(meta.layout.subgroup_sizes)} optimizer sub-groups at world size "
                      f"{meta.world_size} (it gives all sub-groups one shared Adam step, "
                      f"advanced once per sub-group per step)")
    if meta.frozen_shapes:
        limits.append(f"{len(meta.frozen_shapes)} frozen parameter(s) (it leaves them as "
                      f"the model was built)")
    if limits:
        log.warning("--export universal: the files are complete, but DeepSpeed's "
                    "load_universal restores this checkpoint inexactly: %s. A native "
                    "checkpoint resharded with --world-size N resumes exactly.",
                    "; ".join(limits))
