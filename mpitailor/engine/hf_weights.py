"""Consolidated HF weights (safetensors) from a ZeRO-3 checkpoint, written by all ranks.

The files do not depend on how many ranks write them: hf_layout.py plans them (which files,
every tensor's byte offset) from names, shapes and the dtype. Rank 0 creates each file with
its header; every rank then casts its share of the model-order stream of elements (one
contiguous byte range of each file it touches) and writes it in place, reading the slices
from the partition files (byte ranges only) a bounded chunk at a time, through the engine's
one copy engine (copyio.Copier.cast: read, cast and CRC one chunk while the writer thread
writes the one before). A file's CRC-32 is
combined from the ranks' CRCs of their ranges. Tied aliases are left out, as
`save_pretrained` does.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.engine.copyio import Copier, join_crcs, sync_close
from mpitailor.engine.storage import close_all, create_sized, fsync_close, open_output
from mpitailor.errors import CheckpointError, MergeFailed
from mpitailor.formats import CheckpointMeta, Slot
from mpitailor.formats.boundedio import MAX_INDEX_BYTES, MAX_SIDE_FILE_BYTES, read_json, \
    read_small, shown
from mpitailor.formats.consolidate import read_range
from mpitailor.formats.crc import crc32
from mpitailor.formats.dtypes import DTYPES, from_safetensors
from mpitailor.formats.extras import weight_files
from mpitailor.formats.fileio import write_synced
from mpitailor.formats.hf_side import (  # noqa: F401 - has_config: the jobs' import point
    NO_CONFIG_HINT,
    has_config,
    read_config,
    side_files,
    warn_if_another_model,
)
from mpitailor.formats.safetensors_header import read_header
from mpitailor.formats.shard import RankShard, open_all_shards
from mpitailor.planning.hf_layout import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX,
    SINGLE,
    WeightsPlan,
    by_size,
    like_base,
    plan_weights,
    share,
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


def write_hf_weights(comm: Comm, meta: CheckpointMeta, dest: Path, base: BaseWeights,
                     sources: dict[str, CheckpointMeta] | None = None) -> dict:
    """Collective: rebuild the base's 16-bit weights from `meta` (the merged checkpoint, or
    the plan's base with `sources`: plan_sources) into dest, in the base's layout: one
    model.safetensors, or the base's shard files holding the same tensors each, with an
    index. Returns {file: manifest record}."""
    def plan() -> WeightsPlan:
        tensors = _tensors(meta)
        names = [n for n, _ in tensors]
        if base.weight_map is None:
            return plan_weights(tensors, base.dtype, [(SINGLE, names)], index=False)
        return plan_weights(tensors, base.dtype, like_base(names, dict(base.weight_map)),
                            index=True)
    return write_planned(comm, meta, dest, comm.root_step(plan), sources)


def write_planned(comm: Comm, meta: CheckpointMeta, dest: Path, plan: WeightsPlan,
                  sources: dict[str, CheckpointMeta] | None = None,
                  verify: bool = False) -> dict:
    """Collective: the files of `plan` in dest, each rank writing its share; {file: record}.
    sources: parameter -> the checkpoint its values come from (a composite exported without
    writing it first: saves of one run, one layout); default meta.
    verify: first check every source record this rank reads against its CRC (reads them
    whole), as merge --verify does."""
    comm.root_step(_create, plan, dest)
    mine = comm.step(_write_share, meta, plan, dest, comm.rank, comm.size, sources or {},
                     verify)
    gathered = comm.allgather(mine)

    def finish() -> dict[str, dict]:
        records = _records(plan, gathered)
        if plan.index is not None:
            records[INDEX] = write_synced(dest / INDEX, plan.index)
        return records
    return comm.root_step(finish)


def _create(plan: WeightsPlan, dest: Path) -> None:
    """Rank 0 only: every file at its full size, its header written."""
    files = {}
    try:
        for f in plan.files:
            files[f.name] = create_sized(dest / f.name, f.size, f.prefix)
    finally:
        fsync_close(files)


def _write_share(meta: CheckpointMeta, plan: WeightsPlan, dest: Path, rank: int,
                 size: int, sources: dict[str, CheckpointMeta], verify: bool
                 ) -> list[tuple[str, int, int, int]]:
    """This rank's share of the files: [(file, first byte, bytes, CRC-32 of those bytes)]."""
    work = list(share(plan, rank, size))
    if not work:
        return []
    slots, done = meta.layout.by_name(), []
    needed = {str(m.path): m for m in [meta, *sources.values()]}
    dtype = plan.dtype
    outs: dict[str, int] = {}
    with ExitStack() as stack:
        opened = {key: stack.enter_context(open_all_shards(m)) for key, m in needed.items()}
        if verify:
            _verify(work, slots, opened, sources, meta)
        stack.callback(close_all, outs)  # runs after the copier's close: no write in flight
        copier = Copier()
        stack.callback(copier.close)
        for f, runs in work:
            first = runs[0][0].offset + runs[0][1] * plan.itemsize
            outs[f.name] = fd = open_output(dest / f.name)
            pos, crc = first, 0
            for piece, a, b in runs:
                shards = opened[str(sources.get(piece.name, meta).path)]
                fill = _reader(shards, slots.get(piece.name), piece.name)
                crc = copier.cast(fill, a, b, dtype, fd, pos, crc)
                pos += (b - a) * plan.itemsize
            sync_close(copier, outs)
            done.append((f.name, first, pos - first, crc))
    return done


def _verify(work, slots: dict[str, Slot], opened: dict[str, list[RankShard]],
            sources: dict[str, CheckpointMeta], meta: CheckpointMeta) -> None:
    """Check, whole, every fp32 record this rank's share reads a slice of."""
    used: dict[tuple[str, int], set[tuple[str, int]]] = {}
    for _, runs in work:
        for piece, a, b in runs:
            slot = slots.get(piece.name)
            if slot is None:  # frozen: from the model-states file, as merge --verify
                continue
            key = str(sources.get(piece.name, meta).path)
            for s in opened[key]:
                _, first, n = s.meta.layout.held(slot, s.rank)
                if max(a, first) < min(b, first + n):
                    used.setdefault((key, s.rank), set()).add(("fp32", slot.subgroup))
    for (key, rank), kinds in sorted(used.items()):
        opened[key][rank].verify(kinds)


def _reader(shards: Sequence[RankShard], slot: Slot | None, name: str
            ) -> Callable[[int, object], None]:
    """fill(first, into) for Copier.cast: elements of parameter `name` (flattened) from
    `first` on into the float32 array `into`, the fp32 master weights of a trainable one, a
    frozen one's fragments as saved (cast to fp32 exactly, to be cast back)."""
    if slot is None:
        return lambda lo, into: _frozen_range(shards, name, lo, into)
    return lambda lo, into: read_range(shards, slot, "fp32", lo, into)


def _frozen_range(shards: Sequence[RankShard], name: str, a: int, into) -> None:
    from mpitailor.formats.casts import cast
    b, pos = a + into.size, 0
    for s in shards:  # the fragments in rank order, padded at the end
        frag = s.model["frozen_param_fragments"][name]
        x, y = max(a, pos), min(b, pos + frag.numel())
        if x < y:
            cast(frag.raw(x - pos, y - x), frag.dtype, "fp32", out=into[x - a: y - a])
        pos += frag.numel()


def _records(plan: WeightsPlan, gathered: list[list[tuple[str, int, int, int]]]
             ) -> dict[str, dict]:
    """Each file's manifest record, its CRC-32 combined from the header's and the ranks'."""
    ranges: dict[str, list[tuple[int, int, int]]] = {f.name: [] for f in plan.files}
    for part in gathered:
        for name, first, n, crc in part:
            ranges[name].append((first, n, crc))
    records = {}
    for f in plan.files:
        crc, pos = join_crcs(ranges[f.name], crc32(f.prefix), len(f.prefix))
        if pos != f.size:
            raise MergeFailed(f"{f.name}: bytes from {pos} on were written by no rank "
                              f"(a bug in the work split)")
        records[f.name] = {"bytes": f.size, "crc32": f"{crc:08x}"}
    return records


def export_hf(comm: Comm, staged: CheckpointMeta, side_dir: Path | None, dest: Path,
              dtype: str, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
              sources: dict[str, CheckpointMeta] | None = None, config: Path | None = None,
              verify: bool = False) -> dict:
    """Collective: `--export safetensors`: consolidated weights in `dtype` into dest, in
    shards of at most max_shard_size bytes as `save_pretrained` cuts them (one
    model.safetensors if they fit, else an index too), plus config and tokenizer files from
    side_dir and `config` (side_files). sources, verify: as write_planned's."""
    def prepare() -> dict:
        dest.mkdir(exist_ok=True)
        records = {}
        for name, src in side_files(side_dir, config).items():
            if name == "config.json":  # the config says which dtype the weights are in
                config_json = read_config(src, NO_CONFIG_HINT, follow=config is not None)
                warn_if_another_model(src, config_json, _tensors(staged))
                for key in ("torch_dtype", "dtype"):
                    if key in config_json or key == "dtype":
                        config_json[key] = DTYPES[dtype].torch
                records[name] = write_synced(dest / name,
                                             json.dumps(config_json, indent=2).encode())
            else:  # a link of a user's dir comes resolved (given_dir_files): none followed
                records[name] = write_synced(dest / name, read_small(
                    src, MAX_SIDE_FILE_BYTES, "a model's tokenizer file"))
        return records

    def plan() -> WeightsPlan:
        tensors = _tensors(staged)
        sizes = [(n, math.prod(shape) * DTYPES[dtype].itemsize) for n, shape in tensors]
        files = by_size(sizes, max_shard_size)
        return plan_weights(tensors, dtype, files, index=len(files) > 1)
    records = comm.root_step(prepare)
    records.update(write_planned(comm, staged, dest, comm.root_step(plan), sources, verify))
    return records
