"""A merge job: recipe -> plan -> every rank runs its part of the copy program -> commit.

Collective throughout: every function here that takes a `comm` is called on every rank.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.cluster.nodes import Placement, output_is_shared, survey
from mpitailor.engine.execute import write_partitions
from mpitailor.engine.hf_weights import base_weights, has_config
from mpitailor.engine.replicate import carry_files
from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.io import write_synced
from mpitailor.formats.manifest import Manifest, MergeFields
from mpitailor.formats.torch import trust
from mpitailor.formats.zero import (
    LATEST,
    CheckpointMeta,
    Extras,
    read_extras,
    read_meta,
    resolve,
)
from mpitailor.jobs.merge_exports import Exports, export_on_first_node
from mpitailor.planning.hf_layout import DEFAULT_MAX_SHARD_SIZE
from mpitailor.planning.plan import MergePlan, make_plan
from mpitailor.planning.recipe import Recipe, load_recipe
from mpitailor.publish.staging import Staging, commit_on_leaders, staged

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MergeResult:
    output: Path
    bytes_written: int
    seconds: float
    ranks: int
    rank_stats: tuple[dict, ...]  # per MPI rank: partitions, bytes written, I/O, peak RSS
    layer_source: tuple[tuple[str, str], ...] = ()  # layer key -> the source it came from


@dataclass(frozen=True)
class Planned:
    """A merge planned, as every rank holds it: the recipe, the plan (made by rank 0, sent
    once) and where the sources' files lie (surveyed once, by every node together)."""

    recipe: Recipe
    plan: MergePlan
    place: Placement


def read_sources(comm: Comm, recipe: Recipe,
                 place: Placement) -> dict[str, CheckpointMeta] | None:
    """Collective: each source's metadata is read by one rank (round-robin; under node-local
    storage, a rank on a node that holds the source's rank-0 files) and sent to rank 0,
    which plans; the other ranks get None (the metadata reaches them once, in the plan)."""
    readers = comm.step(_meta_readers, comm, recipe, place)

    def mine() -> dict[str, CheckpointMeta]:
        return {name: read_meta(path, place.fs()) for name, path in recipe.sources
                if readers[name] == comm.rank}
    parts = comm.gather(comm.step(mine))
    if parts is None:
        return None
    metas: dict[str, CheckpointMeta] = {}
    for part in parts:
        metas.update(part)
    return {name: metas[name] for name, _ in recipe.sources}


def _meta_readers(comm: Comm, recipe: Recipe, place: Placement) -> dict[str, int]:
    """source -> the rank that reads its metadata."""
    if not place.node_local:
        return {name: i % comm.size for i, (name, _) in enumerate(recipe.sources)}
    readers = {}
    for i, (name, path) in enumerate(recipe.sources):
        try:
            files = resolve(path, place.view)
        except CheckpointError as e:
            raise CheckpointError(f"{e} (node-local storage: looked on every node of this job, "
                                  f"{', '.join(place.nodes.names)})") from None
        readers[name] = place.reader([files.model_path(0), files.optim_path(0)], i)
    return readers


def plan_merge(comm: Comm, recipe_path: str, output: str | None = None,
               world_size: int | None = None) -> Planned:
    """Collective: load and validate the recipe, read the sources, compute the plan."""
    return plan_recipe(comm, comm.root_step(load_recipe, recipe_path, output, world_size))


def plan_recipe(comm: Comm, recipe: Recipe, place: Placement | None = None) -> Planned:
    """Collective: survey where the recipe's sources lie (unless `place`, a survey that
    covers them, is given), read them, compute the plan."""
    if recipe.safe_globals:
        comm.step(trust, recipe.safe_globals)
    if place is None:
        place = survey(comm, [Path(path) for _, path in recipe.sources])
    metas = read_sources(comm, recipe, place)
    return Planned(recipe, comm.root_step(make_plan, recipe, metas), place)


def _write_merge(comm: Comm, planned: Planned, opts: MergeOptions) -> MergeResult:
    """Collective: write the merged checkpoint and publish it atomically, as opts say (checked
    by run_merge): verify the source records against their CRC-32 first (reads them whole);
    export consolidated HF safetensors weights to OUT/hf/ (in opts.export_dtype, default the
    sources'; shards of at most opts.max_shard_size bytes, HF's rule); write DeepSpeed's
    Universal layout into OUT/TAG/zero/; with node-local output, put output rank r's files
    on the (r // opts.ranks_per_node)-th node (default: where rank r of this job runs, at
    the same world size; else consecutive blocks)."""
    plan, place, recipe_text = planned.plan, planned.place, planned.recipe.text
    verify, progress, ranks_per_node = opts.verify, opts.progress, opts.ranks_per_node
    universal = "universal" in opts.export
    export_dtype = (opts.export_dtype or plan.base_meta.dtype) \
        if "hf" in opts.export else None
    max_shard_size = DEFAULT_MAX_SHARD_SIZE if opts.max_shard_size is None \
        else opts.max_shard_size
    t0 = time.perf_counter()
    out_nodes = comm.step(_output_nodes, comm, plan, place, ranks_per_node)
    # Who writes the files every node needs (latest, manifest, extras): each node's first
    # rank when every node keeps its own copy of the output, else rank 0.
    leaders = place.nodes.leaders() if out_nodes is not None else [0]
    tag = plan.base_meta.files.tag
    # What lies beside the base's tag dir is read where it is: under node-local storage,
    # on the node of the base's rank 0 (the one with `latest`, scripts, HF files).
    beside = place.reader([plan.base_meta.files.model_path(0)]) if place.node_local else 0
    rebuild = comm.step_on(beside, base_weights, plan.base_meta)
    with staged(comm, plan.output, leaders, tag) as staging:
        root = staging.dir
        # the sources are read where every rank sees them; node-local ones are not
        exports = Exports(plan, root, rebuild, export_dtype, universal, max_shard_size,
                           from_sources=not place.node_local)
        # weights read from the sources into an output every rank sees: in the merge's
        # own copy program (one pass, each source shard read once)
        weights, files = exports.planned(comm) if out_nodes is None else (None, {})
        records, mine = write_partitions(comm, plan, root, verify, progress, universal,
                                         place, out_nodes, weights)
        # each rank's node by name: a benchmark or a user sums bytes per node from it
        stats = [{**st, "node": place.nodes.names[place.nodes.of_rank[r]]}
                 for r, st in enumerate(comm.allgather(mine))]
        by_rank = comm.allgather(records)
        files.update({name: rec for part in by_rank for name, rec in part.items()})
        if weights is not None:
            files.update(exports.indexes(comm, weights))
        if exports.wanted and out_nodes is None:
            files.update(exports.write(comm, weights_written=weights is not None))
        elif exports.wanted:
            moved = export_on_first_node(comm, place, exports, by_rank, files)
            stats = [{**st, **{k: st[k] + m[k] for k in m}} for st, m in zip(stats, moved)]
        extras = comm.step_on(beside, read_extras, plan.base_meta)
        files.update(carry_files(comm, place, root, extras.carried, extras.folder, beside,
                                 out_nodes is not None))
        if out_nodes is None:
            written = commit_on_leaders(comm, staging, leaders, lambda: _write_metadata(
                plan, root, files, extras, recipe_text, comm.size))
        else:
            written = _finish_on_nodes(comm, plan, place, staging, files, extras, by_rank,
                                       leaders, recipe_text)
    return MergeResult(plan.output, written, time.perf_counter() - t0, comm.size, tuple(stats),
                       plan.layer_source)


def _write_metadata(plan: MergePlan, root: Path, files: dict, extras: Extras,
                    recipe_text: str, ranks: int, **more) -> Manifest:
    """The extras (read_extras) and `latest` into the staged output; returns the manifest
    that records them and every other file (written last, by the commit)."""
    files = dict(files)
    for name, data in extras.files:
        files[name] = write_synced(root / name, data)
    files[LATEST] = write_synced(root / LATEST, plan.base_meta.files.tag.encode())
    return merge_manifest(plan, files, recipe_text, ranks, left_out=list(extras.left_out),
                          **more)


def _output_nodes(comm: Comm, plan: MergePlan, place: Placement,
                  ranks_per_node: int | None) -> tuple[int, ...] | None:
    """Output partition -> the node whose disk holds its files; None when every node sees
    the output's directory (a shared file system, or one node)."""
    nodes = place.nodes
    if len(nodes.names) == 1 or output_is_shared(comm, nodes, plan.output):
        return None
    w2, n = plan.out_world_size, len(nodes.names)
    if ranks_per_node is not None:
        if -(-w2 // ranks_per_node) > n:
            raise UserError(f"--ranks-per-node {ranks_per_node}: {w2} output ranks need "
                            f"{-(-w2 // ranks_per_node)} nodes, this job has {n}")
        return tuple(p // ranks_per_node for p in range(w2))
    if comm.size == w2:  # the job that merges is laid out like the one that will load
        return nodes.of_rank
    return tuple(p * n // w2 for p in range(w2))


def _finish_on_nodes(comm: Comm, plan: MergePlan, place: Placement, staging: Staging,
                     files: dict, extras: Extras, by_rank: list[dict], leaders: list[int],
                     recipe_text: str) -> int:
    """Node-local output: every node's leader writes the extras, `latest` and the manifest
    beside its node's partitions; once every node is ready, each publishes its own."""
    base = plan.base_meta
    tag = base.files.tag
    nodes = place.nodes
    # Each node holds its partitions; every other file (metadata, exports) is on every node.
    node_files = {name: sorted(f for r in nodes.ranks(i) for f in by_rank[r]
                               if not f.startswith(f"{tag}/zero/"))
                  for i, name in enumerate(nodes.names)}

    def manifest() -> Manifest:
        return _write_metadata(plan, staging.dir, files, extras, recipe_text, comm.size,
                               node_local={"node": nodes.names[nodes.of_rank[comm.rank]],
                                           "files_of_node": node_files})
    return commit_on_leaders(comm, staging, leaders, manifest)


def merge_manifest(plan: MergePlan, files: dict, recipe_text: str, ranks: int,
                   **more) -> Manifest:
    """The manifest of a merge (more: the optional MergeFields, left_out and node_local)."""
    return Manifest("merge", files, MergeFields(
        recipe=recipe_text,
        tag=plan.base_meta.files.tag,
        world_size=plan.out_world_size,
        source_world_size=plan.source_world_size,
        base=plan.base,
        sources={name: {"path": str(m.path), "global_steps": m.global_steps,
                        "save_id": m.lineage.save_id if m.lineage else None}
                 for name, m in plan.sources},
        layers={key: {"source": src, "global_steps": plan.meta(src).global_steps}
                for key, src in plan.layer_source},
        subgroups=[{"step": sg.step, "step_source": sg.step_source, "rule": sg.step_rule,
                    "sources": sorted({r.source for r in sg.runs})}
                   for sg in plan.subgroups],
        mpi_ranks=ranks,
        **more,
    ))


@dataclass(frozen=True, slots=True)
class MergeOptions:
    """What a merge writes besides the native checkpoint, and how (the CLI's options)."""

    export: frozenset[str] = frozenset()  # "hf", "universal"
    export_dtype: str | None = None       # of the safetensors export; default: the sources'
    max_shard_size: int | None = None     # of the safetensors export; default: 5GB (HF's)
    verify: bool = False
    progress: bool = False
    ranks_per_node: int | None = None     # node-local output: output ranks per node

    def check(self, plan: MergePlan) -> None:
        """UserError for combinations that cannot be honoured, before anything is written."""
        unknown = self.export - {"hf", "universal"}
        if unknown:
            raise UserError(f"export {sorted(unknown)}: choose among hf, universal")
        if self.verify and plan.target is not None:
            raise UserError("--verify is not supported together with resharding (--world-size)")
        if self.export_dtype and "hf" not in self.export:
            raise UserError("--dtype applies to --export hf; add that option")
        check_shard_size(self.max_shard_size)
        if self.max_shard_size is not None and "hf" not in self.export:
            raise UserError("--max-shard-size applies to --export hf; add that option")
        if "universal" in self.export and plan.base_meta.layout.flat:
            raise UserError(f"a ZeRO stage {plan.base_meta.zero_stage} checkpoint: the Universal "
                            f"export is for ZeRO-3 checkpoints; reshard it natively with "
                            f"--world-size N (DeepSpeed resumes that at N ranks)")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise UserError(f"--ranks-per-node {self.ranks_per_node}: give a positive count")


def _warn_without_config(base: CheckpointMeta) -> None:
    """Rank 0 only. A safetensors export of a base without a config.json holds the weights,
    but from_pretrained cannot load it as it is: said, not refused (the weights are what
    some want)."""
    if not has_config(base):
        log.warning("%s: no config.json beside the base checkpoint: OUT/hf/ holds the weights "
                    "only, and from_pretrained needs a config; add the model's config.json "
                    "there, or export with `export OUT --format hf --config CONFIG`", base.path)


def check_shard_size(max_shard_size: int | None) -> None:
    if max_shard_size is not None and max_shard_size < 1:
        raise UserError(f"--max-shard-size {max_shard_size}: a safetensors file holds at least "
                        f"one byte; give a size such as 5GB or 500MB")


def run_merge(comm: Comm, planned: Planned, opts: MergeOptions) -> MergeResult:
    """Collective: the one way into a merge (the CLI, the API, export, the in-job resume):
    check the options against the plan, then merge as they say."""
    opts.check(planned.plan)
    if "hf" in opts.export:
        comm.root_step(_warn_without_config, planned.plan.base_meta)
    return _write_merge(comm, planned, opts)
