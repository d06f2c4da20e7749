"""Consolidated HF weights (safetensors) from a ZeRO-3 checkpoint, written by all ranks:
what an HF export is (which files, in which dtype, with which config and tokenizer files)
and the base's 16-bit weights rebuilt in their own layout.

The files do not depend on how many ranks write them: hf_layout.py plans them (which files,
every tensor's byte offset) from names, shapes and the dtype, and the executor writes them
as buffers of the copy program (execute.write_weights, weights_copy.py).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.engine.execute import write_weights
from mpitailor.engine.weights_copy import Weights
from mpitailor.errors import CheckpointError
from mpitailor.formats.dtypes import DTYPES, from_safetensors
from mpitailor.formats.hf import (  # noqa: F401 - has_config: the jobs' import point
    NO_CONFIG_HINT,
    has_config,
    read_config,
    side_files,
    warn_if_another_model,
)
from mpitailor.formats.io import (
    MAX_INDEX_BYTES,
    MAX_SIDE_FILE_BYTES,
    read_json,
    read_small,
    shown,
    write_synced,
)
from mpitailor.formats.safetensors_header import read_header
from mpitailor.formats.zero import CheckpointMeta, weight_files
from mpitailor.planning.hf_layout import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX,
    SINGLE,
    WeightsPlan,
    by_size,
    like_base,
    plan_weights,
)
from mpitailor.planning.plan import MergePlan

_SHARD_FILE = re.compile(r"\w[\w.-]*\.safetensors")


@dataclass(frozen=True, slots=True)
class BaseWeights:
    """The base's 16-bit HF weights: their dtype and, if sharded, its index's weight_map."""

    dtype: str
    weight_map: tuple[tuple[str, str], ...] | None


def base_weights(base: CheckpointMeta) -> BaseWeights | None:
    """Rank 0 only. The 16-bit safetensors weights beside the base's tag dir, if any."""
    found = weight_files(base)
    if not found:
        return None
    index = next((p for p in found if p.name == INDEX), None)
    return BaseWeights(weights_dtype(found[0]), _weight_map(index) if index else None)


def _weight_map(path: Path) -> tuple[tuple[str, str], ...]:
    weight_map = read_json(path, MAX_INDEX_BYTES, "a safetensors index")
    try:
        weight_map = weight_map["weight_map"]
        ok = isinstance(weight_map, dict) and weight_map and all(
            isinstance(k, str) and isinstance(v, str) and _SHARD_FILE.fullmatch(v)
            for k, v in weight_map.items())
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{shown(path)}: not a safetensors index (a `weight_map` of tensor "
                              f"names to .safetensors files beside it); fix it or remove the "
                              f"base's 16-bit weights")
    return tuple(weight_map.items())


def weights_dtype(path: Path) -> str:
    """dtype ('bf16', 'fp16', 'fp32') of an existing safetensors file, or of an index's first
    (its first tensor's, from the header: read bounded, boundedio.py)."""
    if path.name.endswith(".index.json"):
        path = path.parent / _weight_map(path)[0][1]
    header = read_header(path, "the base's 16-bit weights file")
    rec = next((v for k, v in header.items() if k != "__metadata__"), None)
    return (from_safetensors(rec.get("dtype")) if isinstance(rec, dict) else None) or "fp32"


def _tensors(meta: CheckpointMeta) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, trainable then frozen: the order of the files."""
    return [(s.name, s.shape) for s in meta.layout.slots] + list(meta.frozen_shapes)


def plan_sources(plan: MergePlan) -> dict[str, CheckpointMeta]:
    """parameter -> the checkpoint the plan takes its values from (write_planned's
    `sources`): an export straight from the sources, without the merged checkpoint."""
    metas = dict(plan.sources)
    return {name: metas[src] for name, src in (*plan.param_source, *plan.frozen_source)}


def rebuild_plan(meta: CheckpointMeta, base: BaseWeights) -> WeightsPlan:
    """The base's 16-bit weights rebuilt from `meta`'s tensors, in the base's layout: one
    model.safetensors, or the base's shard files holding the same tensors each, with an
    index."""
    tensors = _tensors(meta)
    names = [n for n, _ in tensors]
    if base.weight_map is None:
        return plan_weights(tensors, base.dtype, [(SINGLE, names)], index=False)
    return plan_weights(tensors, base.dtype, like_base(names, dict(base.weight_map)),
                        index=True)


def export_plan(meta: CheckpointMeta, dtype: str,
                max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> WeightsPlan:
    """`--export hf`'s files: `meta`'s tensors in `dtype`, in shards of at most
    max_shard_size bytes as `save_pretrained` cuts them (one model.safetensors if they fit,
    else an index too)."""
    tensors = _tensors(meta)
    sizes = [(n, math.prod(shape) * DTYPES[dtype].itemsize) for n, shape in tensors]
    files = by_size(sizes, max_shard_size)
    return plan_weights(tensors, dtype, files, index=len(files) > 1)


def write_index(dest: Path, plan: WeightsPlan) -> dict:
    """Rank 0 only, after the files: the plan's index, if it has one; {file: record}."""
    return {} if plan.index is None else {INDEX: write_synced(dest / INDEX, plan.index)}


def write_side_files(staged: CheckpointMeta, side_dir: Path | None, dest: Path, dtype: str,
                     config: Path | None = None) -> dict:
    """Rank 0 only: an HF export's config and tokenizer files from side_dir and `config`
    (side_files) into dest (made), the config saying `dtype`; {file: record}."""
    dest.mkdir(exist_ok=True)
    records = {}
    for name, src in side_files(side_dir, config).items():
        if name == "config.json":  # the config says which dtype the weights are in
            config_json = read_config(src, NO_CONFIG_HINT, follow=config is not None)
            warn_if_another_model(src, config_json, _tensors(staged))
            for key in ("torch_dtype", "dtype"):
                if key in config_json or key == "dtype":
                    config_json[key] = DTYPES[dtype].torch
            records[name] = write_synced(dest / name, json.dumps(config_json, indent=2).encode())
        else:  # a link of a user's dir comes resolved (given_dir_files): none followed
            records[name] = write_synced(dest / name, read_small(
                src, MAX_SIDE_FILE_BYTES, "a model's tokenizer file"))
    return records


def write_hf_weights(comm: Comm, meta: CheckpointMeta, dest: Path, base: BaseWeights,
                     sources: dict[str, CheckpointMeta] | None = None) -> dict:
    """Collective: rebuild the base's 16-bit weights from `meta` (the merged checkpoint, or
    the plan's base with `sources`: plan_sources) into dest (rebuild_plan). Returns {file:
    manifest record}."""
    return write_planned(comm, meta, dest, comm.root_step(rebuild_plan, meta, base), sources)


def write_planned(comm: Comm, meta: CheckpointMeta, dest: Path, plan: WeightsPlan,
                  sources: dict[str, CheckpointMeta] | None = None,
                  verify: bool = False) -> dict:
    """Collective: the files of `plan` in dest, written by the copy program's cast buffers
    (execute.write_weights), and its index; {file: record}.
    sources: parameter -> the checkpoint its values come from (a composite exported without
    writing it first: saves of one run, one layout); default meta.
    verify: first check every source record read against its CRC (reads them whole), as
    merge --verify does."""
    records = write_weights(comm, Weights.of(plan, meta, sources), dest, verify)
    records.update(comm.root_step(write_index, dest, plan))
    return records


def export_hf(comm: Comm, staged: CheckpointMeta, side_dir: Path | None, dest: Path,
              dtype: str, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
              sources: dict[str, CheckpointMeta] | None = None, config: Path | None = None,
              verify: bool = False) -> dict:
    """Collective: `--export hf`: consolidated weights in `dtype` into dest (export_plan),
    plus config and tokenizer files (write_side_files). sources, verify: as write_planned's."""
    records = comm.root_step(write_side_files, staged, side_dir, dest, dtype, config)
    plan = comm.root_step(export_plan, staged, dtype, max_shard_size)
    records.update(write_planned(comm, staged, dest, plan, sources, verify))
    return records
