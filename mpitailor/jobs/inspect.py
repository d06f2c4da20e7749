"""`python -m mpitailor inspect CKPT`: what a ZeRO checkpoint holds, layer by layer."""
from __future__ import annotations

import os
from pathlib import Path

from mpitailor.formats.manifest import MANIFEST, Manifest, read_manifest
from mpitailor.formats.torch import carried_globals
from mpitailor.formats.zero import OPTIM_BYTES_PER_ELEMENT, CheckpointMeta
from mpitailor.planning.layers import LayerClassifier, sort_keys


def report(meta: CheckpointMeta, composite: Manifest | None = None) -> dict:
    """A JSON-able summary; per-layer bytes are per rank (stage 3: every rank holds the
    same; stages 1/2: the mean, as a rank's share of a flat group varies).
    composite: the manifest of a merged checkpoint (then each layer says where it came from).
    A partial checkpoint lists only the layers it saved."""
    classify_fn = LayerClassifier(dict(meta.layer_patterns))
    kind = "composite" if composite is not None else "partial" if meta.held_layers is not None else "full"
    layers: dict[str, dict] = {}
    for slot in meta.layout.slots:
        row = layers.setdefault(classify_fn(slot.name), _row())
        row["params"] += 1
        row["elements"] += slot.numel
        row["bytes_per_rank"] += (slot.numel / meta.world_size if meta.layout.flat
                                  else slot.length) * OPTIM_BYTES_PER_ELEMENT
        row["subgroups"].add(slot.subgroup)
    for name, shape in meta.frozen_shapes:
        row = layers.setdefault(classify_fn(name), _row())
        row["frozen"] += 1
        n = 1
        for d in shape:
            n *= d
        row["elements"] += n
    if meta.held_layers is not None:
        layers = {k: v for k, v in layers.items() if k in meta.held_layers}
    for key, row in layers.items():
        rec = composite.get("layers", {}).get(key) if composite is not None else None
        if isinstance(rec, dict):  # composite_manifest checked the mapping, not its records
            row["from"], row["from_step"] = rec.get("source"), rec.get("global_steps")
    return {
        "path": str(meta.path), "tag": meta.files.tag, "kind": kind, "world_size": meta.world_size,
        "zero_stage": meta.zero_stage,
        "dtype": meta.dtype, "global_steps": meta.global_steps,
        "global_samples": meta.global_samples, "ds_version": meta.ds_version,
        "param_groups": [list(g) for g in meta.param_groups],
        "subgroups": len(meta.layout.subgroup_sizes),
        "subgroup_steps": list(meta.subgroup_steps),
        "tied": dict(meta.shared_params),
        "globals": carried_globals(meta.files.model_path(0)),
        "optimizer_bytes_per_rank": sum(meta.layout.subgroup_sizes) * OPTIM_BYTES_PER_ELEMENT,
        "layers": {k: {**layers[k], "subgroups": sorted(layers[k]["subgroups"])}
                   for k in sort_keys(layers)},
    }


def newer_saves(path: Path, meta: CheckpointMeta) -> list[str]:
    """The usable saves of the save dir `path` newer than the one its `latest` names (the
    checkpoint inspected): a run's later partial saves, which `recover` assembles. Empty
    for a tag dir."""
    if meta.files.save_dir is None or Path(path).resolve() != meta.files.save_dir.resolve():
        return []
    from mpitailor.jobs.recovery import find_saves
    return [s.name for s in find_saves(meta.files.save_dir)
            if s.problem is None and s.step > meta.global_steps]


def composite_manifest(meta: CheckpointMeta) -> Manifest | None:
    """The merge manifest beside a checkpoint mpitailor assembled, if it is one: any
    manifest there whose `layers` (if it has them) is a mapping, whatever its kind (resolve
    has read it already, and refused a major version it does not read); None for an empty
    one, which says nothing."""
    for folder in (meta.files.save_dir, meta.files.tag_dir.parent):
        if folder is not None and os.path.lexists(folder / MANIFEST):
            m = read_manifest(folder / MANIFEST)
            ok = isinstance(m.get("layers", {}), dict) and m != _EMPTY
            return m if ok else None
    return None


# What a file holding `{}` (or only what reads as it: no key says anything) reads as.
_EMPTY = Manifest.from_json(b"{}", "{}")


def _row() -> dict:
    return {"params": 0, "frozen": 0, "elements": 0, "bytes_per_rank": 0, "subgroups": set()}
