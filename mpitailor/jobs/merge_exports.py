"""What a merge writes besides the native checkpoint (jobs/merge.py): the base's 16-bit
weights rebuilt, the HF safetensors export, the Universal export; in the merge's own copy
program where every rank sees the sources and the output, else after it (node-local
output: on the first node, then copied to the others).

Collective throughout: every function here that takes a `comm` is called on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.cluster.nodes import Placement
from mpitailor.engine.hf_weights import (
    export_hf,
    export_plan,
    plan_sources,
    rebuild_plan,
    write_hf_weights,
    write_index,
    write_side_files,
)
from mpitailor.engine.replicate import replicate
from mpitailor.engine.universal import export_universal
from mpitailor.engine.weights_copy import Weights
from mpitailor.formats.zero import extras_dir, read_meta
from mpitailor.planning import program
from mpitailor.planning.plan import MergePlan


@dataclass(frozen=True)
class Exports:
    """What a merge writes besides the native checkpoint: the base's 16-bit weights rebuilt,
    the safetensors and the Universal exports."""

    plan: MergePlan
    root: Path
    rebuild: object            # hf_weights.BaseWeights | None
    export_dtype: str | None
    universal: bool
    max_shard_size: int
    # the weights (the 16-bit rebuild, the safetensors export) are read from the plan's
    # sources, as `export` reads them, not from the staged output
    from_sources: bool

    @property
    def wanted(self) -> bool:
        return self.rebuild is not None or self.export_dtype is not None or self.universal

    @property
    def reads_staged(self) -> bool:
        """Whether the exports read the staged partitions: the Universal export reads the
        staged rank-0 files, the weights do unless read from the sources."""
        return self.universal or not self.from_sources

    def planned(self, comm: Comm) -> tuple[Weights | None, dict]:
        """Collective, before the merge's copy program: the weights files it writes when
        they are read from the sources (rank 0 plans them), `--export hf`'s side files
        written; (the weights or None, {file: record} of the side files)."""
        if not self.from_sources:
            return None, {}
        meta, plans, files = self.plan.base_meta, [], {}
        if self.rebuild is not None:  # the base carried 16-bit weights: rebuild them
            plans.append(("", comm.root_step(rebuild_plan, meta, self.rebuild)))
        if self.export_dtype is not None:
            side = comm.root_step(write_side_files, meta, extras_dir(meta), self.root / "hf",
                                  self.export_dtype)
            files.update({f"hf/{name}": rec for name, rec in side.items()})
            plans.append(("hf", comm.root_step(export_plan, meta, self.export_dtype,
                                               self.max_shard_size)))
        return (Weights.of_merge(plans, self.plan) if plans else None), files

    def indexes(self, comm: Comm, weights: Weights) -> dict:
        """Collective, after the program: the index of each weights plan that has one."""
        return {program.weights_name(folder, name): rec for folder, wp in weights.plans
                for name, rec in comm.root_step(write_index, self.root / folder, wp).items()}

    def write(self, comm: Comm, weights_written: bool = False) -> dict:
        """Collective over the ranks that see the whole staged checkpoint (and, with
        from_sources, the sources): {file: record}. weights_written: the merge's program
        wrote the weights (planned): only the Universal export is left."""
        files = {}
        root, tag = self.root, self.plan.base_meta.files.tag
        staged = comm.root_step(read_meta, root / tag) if self.reads_staged else None
        meta, sources = (self.plan.base_meta, plan_sources(self.plan)) if self.from_sources \
            else (staged, None)
        if self.rebuild is not None and not weights_written:
            files.update(write_hf_weights(comm, meta, root, self.rebuild, sources))
        if self.export_dtype is not None and not weights_written:
            exported = export_hf(comm, meta, extras_dir(self.plan.base_meta), root / "hf",
                                 self.export_dtype, self.max_shard_size, sources)
            files.update({f"hf/{name}": rec for name, rec in exported.items()})
        if self.universal:
            files.update(export_universal(comm, staged, root))
        return files


def export_on_first_node(comm: Comm, place: Placement, exports: Exports,
                          by_rank: list[dict], files: dict) -> list[dict]:
    """Node-local output with exports, made on the first node: its ranks read the weights
    from the sources where they see them all (a shared file system); the staged partitions
    are read where the sources are node-local, and by the Universal export: then the other
    nodes' partitions are first copied to the first node over MPI, which drops them after.
    The exports (and the Universal files the copy program wrote there) are copied to every
    other node. Adds the exports to `files`; returns every rank's bytes moved over MPI."""
    nodes, tag, root = place.nodes, exports.plan.base_meta.files.tag, exports.root
    node = nodes.of_rank[comm.rank]
    writer_node = {name: nodes.of_rank[r] for r, part in enumerate(by_rank) for name in part}
    gathered = {f: rec for f, rec in files.items()
                if exports.reads_staged and writer_node.get(f, 0) != 0}
    moved = [replicate(comm, nodes, root, gathered, writer_node, {f: [0] for f in gathered})]
    first = comm.split(0 if node == 0 else 1)
    made = comm.step(lambda: exports.write(first) if node == 0 else None)
    made = comm.bcast(made)
    shared = {**made, **{f: rec for f, rec in files.items() if f.startswith(f"{tag}/zero/")}}
    others = list(range(1, len(nodes.names)))
    moved.append(replicate(comm, nodes, root, shared, {f: 0 for f in shared},
                           {f: others for f in shared}))

    def drop() -> None:
        if comm.rank == nodes.leader(0):
            for f in gathered:
                (root / f).unlink()
    comm.step(drop)
    files.update(made)
    mine = {k: sum(m[k] for m in moved) for k in moved[0]}
    return comm.allgather(mine)
