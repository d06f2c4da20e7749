"""`inspect DIR` of a PyTorch Distributed Checkpoint (FSDP2, torchtitan, Accelerate FSDP):
what it holds, layer by layer, from its `.metadata` alone (formats/dcp)."""
from __future__ import annotations

import math
import re
from pathlib import Path

from mpitailor.formats.dcp import (
    DcpMetadata,
    is_megatron,
    is_stacked,
    is_torchtitan,
    layer_key,
    optimizer_sharding,
    split_keys,
    split_megatron,
)
from mpitailor.planning.layers import LayerClassifier, sort_keys

# DCP's data file names; `s<i>` before one: a link mode composite's (planning/dcp_link.py)
_DATA_FILE = re.compile(r"(?:s\d+)?__(\d+)_(\d+)\.distcp")


def dcp_report(folder: Path, meta: DcpMetadata) -> dict:
    """A JSON-able summary: the writing world size, the key layout, and per layer the model
    tensors, their elements and bytes, and the optimizer state saved for them."""
    if is_megatron(meta):
        return megatron_report(folder, meta)
    classify = LayerClassifier({})
    layers: dict[str, dict] = {}
    other, dtypes = [], set()
    groups_by_index = False
    split = split_keys((*meta.tensors, *meta.bytes_entries))
    for fqn, key in split.items():
        if key.role == "other":
            other.append(fqn)
            continue
        if key.role == "param_group":
            groups_by_index |= key.param.isdigit()
            if key.param.isdigit():
                continue
        row = layers.setdefault(classify(key.param), _row())
        t = meta.tensors.get(fqn)
        if key.role == "model" and t is not None:
            row["params"] += 1
            row["elements"] += math.prod(t.size)
            row["model_bytes"] += t.nbytes
            dtypes.add(t.dtype)
        elif key.role == "optim_state":
            row["optimizer_state"].add(key.field)
            row["optimizer_bytes"] += t.nbytes if t is not None else 0
    ranks = {int(m.group(1)) for f in meta.files if (m := _DATA_FILE.fullmatch(f))}
    return {
        "path": str(folder), "kind": "dcp",
        "layout": _layout(meta, split),
        "world_size": max(ranks) + 1 if ranks else None,
        "data_files": len(meta.files), "dtype": ",".join(sorted(dtypes)) or None,
        "version": meta.version, "save_id": meta.save_id,
        "param_groups": "by index (torch's default)" if groups_by_index else "by parameter",
        "bytes": sum(t.nbytes for t in meta.tensors.values()),
        "other_entries": sorted(other),
        "layers": {k: {**layers[k], "optimizer_state": sorted(layers[k]["optimizer_state"])}
                   for k in sort_keys(layers)},
    }


def _layout(meta: DcpMetadata, split: dict) -> str:
    if not any(split[k].role == "model" for k in meta.tensors):
        return "other keys"
    if is_torchtitan(split):
        return "torchtitan (parameters by name, optimizer, lr_scheduler, dataloader, train_state)"
    return "model + optim (get_state_dict + dcp.save: FSDP2)"


def _row() -> dict:
    return {"params": 0, "elements": 0, "model_bytes": 0, "optimizer_bytes": 0,
            "optimizer_state": set()}


def megatron_report(folder: Path, meta: DcpMetadata) -> dict:
    """dcp_report of a Megatron-Core torch_dist checkpoint (formats/dcp/megatron.py): a
    stacked tensor counted in every layer, with the bytes of its chunks at that layer's
    offset; dp_reshardable's flat buckets belong to no layer (their map is stored nowhere)."""
    layers: dict[str, dict] = {}
    other, dtypes, flat, stacked = [], set(), 0, set()
    for fqn in meta.bytes_entries:
        if split_megatron(fqn).role not in ("model", "optim_state"):
            other.append(fqn)
    for fqn, t in meta.tensors.items():
        key = split_megatron(fqn)
        if key.role not in ("model", "optim_state"):
            flat += t.nbytes if key.role == "optim_flat" else 0
            other += [] if key.role == "optim_flat" else [fqn]
            continue
        if is_stacked(key.param):
            stacked.add(key.param)
        seen: set[str] = set()  # layers this tensor was counted in (TP: several chunks)
        for c in t.chunks:
            layer = layer_key(fqn, c.offsets, t) or "other"
            row = layers.setdefault(layer, _row())
            nbytes = c.numel * (t.nbytes // max(1, math.prod(t.size)))
            if key.role == "model":
                row["params"] += layer not in seen
                row["elements"] += c.numel
                row["model_bytes"] += nbytes
                dtypes.add(t.dtype)
            else:
                row["optimizer_state"].add(key.field)
                row["optimizer_bytes"] += nbytes
            seen.add(layer)
    sharding = optimizer_sharding(meta)
    keys = "stacked layers (decoder.layers.*, a leading layer axis)" if stacked else \
        "per-layer keys (decoder.layers.<i>.*)"
    ranks = {int(m.group(1)) for f in meta.files if (m := _DATA_FILE.fullmatch(f))}
    return {
        "path": str(folder), "kind": "dcp", "producer": "Megatron-Core",
        "layout": f"Megatron-Core torch_dist; {keys}; optimizer {sharding or 'not saved'}",
        "stacked_layers": bool(stacked), "optimizer_sharding": sharding,
        # Megatron lists every rank's SavePlan: a rank holding only replicas writes no file
        "world_size": meta.ranks or (max(ranks) + 1 if ranks else None),
        "data_files": len(meta.files), "dtype": ",".join(sorted(dtypes)) or None,
        "version": meta.version, "save_id": meta.save_id,
        "param_groups": "in common_state" + (f" (plus {flat} bytes of dp_reshardable flat "
                                             f"buckets, in no layer)" if flat else ""),
        "optimizer_flat_bytes": flat,
        "bytes": sum(t.nbytes for t in meta.tensors.values()),
        "other_entries": sorted(other),
        "layers": {k: {**layers[k], "optimizer_state": sorted(layers[k]["optimizer_state"])}
                   for k in sort_keys(layers)},
    }


def saved_as(record) -> dict | None:
    """What mpitailor's record of a DCP save says (None: no record, not a save of its
    DcpCheckpointer): full or partial, its step, the layers a partial one holds, its chain."""
    if record is None:
        return None
    return {"kind": "partial" if record.partial else "full", "step": record.global_steps,
            "layers": sort_keys(record.layers) if record.partial else None,
            "chain": record.lineage.chain, "save_id": record.lineage.save_id}


def saves_report(save_dir: Path) -> dict:
    """`inspect SAVE_DIR` of a dir of DCP saves: every save found (step, full or partial,
    the layers a partial one holds, whether it is usable and why not), and what `recover`
    would take from where now, or why it would refuse. Read as recover reads the saves,
    less the CRC-32 pass (inspect reads metadata, not data)."""
    from mpitailor.cluster.comm import Comm
    from mpitailor.errors import MpitailorError
    from mpitailor.jobs.dcp_recovery import find_dcp_saves, survey_dcp_saves
    from mpitailor.planning.chain import recovery_recipe, rolled_back_words
    rows = [{"name": s.name, "step": s.step,
             "kind": "-" if s.meta is None else "partial" if s.partial else "full",
             "layers": sort_keys(s.meta.held_layers) if s.partial else None,
             "problem": s.problem, "unreadable": s.unreadable}
            for s in find_dcp_saves(save_dir)]
    try:
        _, chain, _ = survey_dcp_saves(Comm(), save_dir, crc=False)
        # what recover's recipe takes from where: a save whose every layer a newer one
        # holds again supplies nothing, and every entry outside the layers comes from the
        # base (made here: what recover refuses in it, inspect says as a refusal)
        recipe = recovery_recipe(save_dir, chain)
    except MpitailorError as e:
        return {"path": str(save_dir), "kind": "dcp-saves", "saves": rows,
                "recover": {"refused": str(e).split("\n")[0]}}
    newest, taken = chain.full, {}
    for s in (chain.full, *chain.partials):
        newest = s
        for k in s.meta.held_layers if s.partial else ():
            taken[k] = s.name
    return {"path": str(save_dir), "kind": "dcp-saves", "saves": rows,
            "recover": {"step": newest.step, "full": chain.full.name,
                        "partials": [s.name for s in chain.partials],
                        "sources": [n for n, _ in recipe.sources], "base": recipe.base,
                        "layers": {k: taken[k] for k in sort_keys(taken)},
                        "skipped": dict(chain.skipped), "pruned": list(chain.pruned),
                        "rolled_back": rolled_back_words(chain)}}
