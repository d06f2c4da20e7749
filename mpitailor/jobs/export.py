"""`python -m mpitailor export SRC -o OUT --format hf|fp32|universal`: a checkpoint straight to
another format, on any number of MPI ranks.

SRC is a checkpoint (tag dir, save dir, HF `checkpoint-N/`) or a save dir of layer-wise saves,
whose newest copy of every layer (`recover`'s chain) is exported without assembling it first.
- hf:   consolidated HF safetensors weights in the model's dtype (or --dtype), sharded as
        `save_pretrained` cuts them, with the source's config and tokenizer files, or
        --config's (a plain DeepSpeed save has none: refused without --config);
- fp32: the fp32 master weights as safetensors (what DeepSpeed's `zero_to_fp32.py
        --safe_serialization` writes), weights only;
Both are written straight from the source's partition files, every rank casting and writing
its share of every file in bounded chunks (the copy program's cast buffers,
engine/weights_copy.py): no native copy, no consolidated model in memory.
- universal: DeepSpeed's Universal checkpoint. `load_universal` also reads the model-states
        files of the tag dir, so this writes the checkpoint (native files included) as
        `merge --export universal` does.
Published like a merge: staged beside OUT, one rename, a manifest.

Collective: every rank calls run_export.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.cluster.nodes import Placement
from mpitailor.engine.hf_weights import export_hf, has_config, plan_sources
from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.hf import given_dir_files, read_config
from mpitailor.formats.io import shown
from mpitailor.formats.manifest import ExportFields, Manifest
from mpitailor.formats.zero import (
    PARTIAL_MANIFEST,
    CheckpointMeta,
    extras_dir,
    is_tag_dir,
    resolve,
)
from mpitailor.jobs.export_nodes import export_on_nodes
from mpitailor.jobs.merge import (
    MergeOptions,
    Planned,
    check_shard_size,
    plan_recipe,
    run_merge,
)
from mpitailor.jobs.recovery import recover_chain
from mpitailor.planning.hf_layout import DEFAULT_MAX_SHARD_SIZE
from mpitailor.planning.recipe import Recipe, recipe_from
from mpitailor.publish.staging import commit_on_leaders, staged

FORMATS = ("hf", "fp32", "universal")


@dataclass(frozen=True, slots=True)
class ExportResult:
    output: Path
    bytes_written: int
    seconds: float
    step: int = 0  # of the newest save exported
    saves: tuple[str, ...] = ()  # the saves the layers came from, by name


def source_recipe(comm: Comm, source: Path, output: Path) -> tuple[Recipe, Placement | None]:
    """Collective: the recipe whose plan says where every parameter comes from: the one
    checkpoint SRC names, or the chain `recover` would assemble from a save dir of
    layer-wise saves; and, for a save dir, where its files lie (surveyed by the recovery,
    reused by plan_recipe), else None."""
    def single() -> bool:
        try:
            files = resolve(source)
        except UserError:
            if is_tag_dir(source):
                raise  # a tag dir that is damaged: say what is wrong with it
            return False  # not one checkpoint: a save dir of several (recover decides)
        if files.partial:
            return False
        # A tag dir is one checkpoint; a save dir may hold layer-wise saves newer than the
        # full save its `latest` names: then recover's chain takes each layer's newest copy.
        return files.tag_dir == source or not any(
            (c / PARTIAL_MANIFEST).exists() for c in source.iterdir() if c.is_dir())
    if comm.root_step(single):
        return comm.root_step(recipe_from, {"sources": {"src": str(source)},
                                            "layers": {"rest": "src"}, "output": str(output)},
                              origin=f"export {source}"), None
    recipe, _, place = recover_chain(comm, source, output)
    return recipe, place


def run_export(comm: Comm, source: Path, output: Path, fmt: str, dtype: str | None,
               max_shard_size: int | None, progress: bool = False,
               config: Path | None = None, verify: bool = False) -> ExportResult:
    """Collective: export SRC to OUT.
    config: `--config`, a config.json or a model dir whose config and tokenizer files go
    with --format hf in place of the source's. verify: check every source record read
    against its zip CRC-32 first, as merge --verify does."""
    t0 = time.perf_counter()
    if config is not None:
        if fmt != "hf":
            raise UserError(f"--config goes with --format hf; --format {fmt} writes no config")
        comm.root_step(check_config, config)
    partial_hf = source.name.startswith("checkpoint-") and any(
        source.glob(f"global_step*/{PARTIAL_MANIFEST}"))  # an HF checkpoint-N of a partial save
    if (source / PARTIAL_MANIFEST).exists() or partial_hf:
        raise UserError(f"{source}: one partial save holds only some layers; export its save "
                        f"dir ({source.parent}) to take every layer's newest copy")
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: choose among {', '.join(FORMATS)}")
    check_shard_size(max_shard_size)
    if fmt == "fp32" and dtype not in (None, "fp32"):
        raise UserError(f"--format fp32 writes fp32; --dtype {dtype} goes with --format hf")
    planned = plan_recipe(comm, *source_recipe(comm, source, output))
    plan = planned.plan
    if fmt == "universal":
        if dtype is not None or max_shard_size is not None:
            raise UserError("--dtype and --max-shard-size go with --format hf or fp32")
        result = run_merge(comm, planned, MergeOptions(
            frozenset({"universal"}), verify=verify, progress=progress))
        return _said(plan, ExportResult(result.output, result.bytes_written,
                                        time.perf_counter() - t0))
    if fmt == "hf" and config is None:
        comm.root_step(_require_config, source, plan.base_meta)
    return _said(plan, _export_weights(comm, planned, fmt, dtype, max_shard_size, t0, config,
                                       verify))


def _said(plan, result: ExportResult) -> ExportResult:
    """The result with the step and the saves its summary names."""
    return dataclasses.replace(result, step=plan.base_meta.global_steps, saves=tuple(
        dict.fromkeys(Path(str(m.path)).name for _, m in plan.sources)))


def check_config(config: Path) -> None:
    """Rank 0 only. `--config` names a config.json, or a dir that holds one: UserError
    unless it is there, is a JSON object, and every side file of the dir may be read (a
    regular file of bounded size; a link only inside it or a Hub cache's blobs/)."""
    what = "give a model's config.json or the model dir that holds it"
    if not os.path.lexists(config):
        raise UserError(f"--config {shown(config)}: no such file or directory; {what}")
    try:
        if config.is_dir():
            found = given_dir_files(config).get("config.json")  # links checked, resolved
            if found is None:
                raise UserError(f"--config {shown(config)}: a directory without config.json; "
                                f"{what}")
            read_config(found, what, follow=False)
        else:
            read_config(config, what, follow=True)
    except CheckpointError as e:
        raise UserError(f"--config {e}") from None


def _require_config(source: Path, base: CheckpointMeta) -> None:
    """Rank 0 only. An HF export without a config.json does not load (`from_pretrained`
    needs one): a plain DeepSpeed save carries none, so one must be given."""
    if not has_config(base):
        raise UserError(f"{source}: no config.json beside the checkpoint, and from_pretrained "
                        f"needs one; pass --config with the model's config.json or model dir")


def _export_weights(comm: Comm, planned: Planned, fmt: str, dtype: str | None,
                    max_shard_size: int | None, t0: float, config: Path | None,
                    verify: bool) -> ExportResult:
    plan, place = planned.plan, planned.place
    base = plan.base_meta
    dtype = "fp32" if fmt == "fp32" else (dtype or base.dtype)
    sources = plan_sources(plan)
    side_dir = extras_dir(base) if fmt == "hf" else None  # the source's, wherever it is read

    def export(c: Comm, meta: CheckpointMeta, srcs: dict, root: Path) -> dict:
        return export_hf(c, meta, side_dir, root, dtype,
                         DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size,
                         srcs, config, verify)

    def manifest(files: dict) -> Manifest:
        return Manifest("export", files, ExportFields(
            format=fmt, dtype=dtype,
            sources={name: {"path": str(m.path), "global_steps": m.global_steps}
                     for name, m in plan.sources},
            layers={k: s for k, s in plan.layer_source},
            mpi_ranks=comm.size))
    if place.node_local:  # no node holds every rank's files: made on one (export_nodes.py)
        written = export_on_nodes(comm, place, plan, sources, export, manifest)
        return ExportResult(plan.output, written, time.perf_counter() - t0)
    with staged(comm, plan.output, [0]) as staging:
        files = export(comm, base, sources, staging.dir)
        written = commit_on_leaders(comm, staging, [0], lambda: manifest(files))
    return ExportResult(plan.output, written, time.perf_counter() - t0)
