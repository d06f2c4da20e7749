"""`export --format hf|fp32` of a checkpoint whose files are node-local (DeepSpeed's
use_node_local_storage): no node holds every rank's files, and every rank of the export reads
slices of all of them.

So the export is made on one node, the one holding the base's rank-0 files (and `latest`,
and the save dir's config and tokenizer files): the other nodes' rank files are copied there
over MPI into the staging dir (replicate.gather_sources, CRC-checked; the node's own are
linked), that node's ranks write the export from them exactly as from a shared copy (the
same bytes), and the copies are dropped. The output goes where it goes for a merge: into a
shared directory once, or, when every node sees its own directory there, onto every node
(each a whole copy, sent over MPI and CRC-checked), each node publishing its own once all
have staged theirs.

Collective: every rank calls export_on_nodes.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.cluster.nodes import Placement, output_is_shared
from mpitailor.engine.replicate import drop_gathered, gather_sources, replicate
from mpitailor.formats.manifest import Manifest
from mpitailor.formats.zero import CheckpointMeta
from mpitailor.planning.plan import MergePlan
from mpitailor.publish.staging import commit_on_leaders, staged

SCRATCH = ".mpitailor-sources"  # under the staging dir, removed before it is published

# export(comm of the export node's ranks, base, {parameter: source}, staging dir) -> records
Export = Callable[[Comm, CheckpointMeta, dict[str, CheckpointMeta], Path], dict]


def export_on_nodes(comm: Comm, place: Placement, plan: MergePlan,
                    sources: dict[str, CheckpointMeta], export: Export,
                    manifest: Callable[[dict], Manifest]) -> int:
    """Collective: export the node-local sources of `plan` (sources: parameter -> its
    checkpoint) with `export` on one node, into plan.output; publish with the manifest
    `manifest(records)`. Returns the bytes the manifest records."""
    nodes = place.nodes
    base = plan.base_meta
    node = nodes.of_rank[place.reader([base.files.model_path(0), base.files.optim_path(0)])]
    on_node = nodes.of_rank[comm.rank] == node
    local_out = not output_is_shared(comm, nodes, plan.output)
    leaders = nodes.leaders() if local_out else [0]
    with staged(comm, plan.output, leaders) as staging:
        root, scratch = staging.dir, staging.dir / SCRATCH
        gathered = gather_sources(comm, place, node, [base, *sources.values()], scratch)
        near = comm.split(0 if on_node else 1)

        def make() -> dict | None:
            if not on_node:
                return None
            return export(near, gathered[str(base.path)],
                          {k: gathered[str(m.path)] for k, m in sources.items()}, root)
        made = comm.bcast(comm.step(make), nodes.leader(node))
        comm.step(lambda: drop_gathered(scratch) if comm.rank == nodes.leader(node) else None)
        if local_out:
            others = [n for n in range(len(nodes.names)) if n != node]
            replicate(comm, nodes, root, made, {f: node for f in made},
                      {f: others for f in made})

        return commit_on_leaders(comm, staging, leaders, lambda: manifest(made))
