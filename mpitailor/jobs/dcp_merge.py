"""`merge RECIPE` of PyTorch Distributed Checkpoints (issue 43): a layer-wise composite
written as a DCP checkpoint that `dcp.load` reads (planning/dcp_plan.py says what comes
from where).

Rank 0 reads every source's `.metadata` (formats/dcp) and plans; the output's data files
are shared among the ranks, balanced by bytes, each written whole by one rank: every item
copied from its source's data file (checked first: a tensor chunk's item parses as the
tensor its metadata says, a bytes entry's through the torch reader's allow-list; the
output file's size and CRC-32 taken on the way), fsynced. Rank 0
then writes the `.metadata` (formats/dcp: metadata_bytes) and the manifest, and the output
is published as every output is (publish/staging.py): whole or not at all.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mpitailor import failpoints
from mpitailor.cluster.comm import Comm
from mpitailor.errors import CheckpointError
from mpitailor.formats.dcp import (
    METADATA,
    check_bytes_item,
    locate,
    metadata_bytes,
    read_metadata,
)
from mpitailor.formats.io import FILE_CHUNK, FileRecord, created, open_regular, read_into
from mpitailor.formats.manifest import Manifest
from mpitailor.planning.dcp_plan import Copy, DcpPlan, plan_dcp
from mpitailor.planning.recipe import Recipe
from mpitailor.publish.staging import commit_on_leaders, staged


@dataclass(frozen=True, slots=True)
class DcpMergeResult:
    output: Path
    files: int
    bytes: int


def read_dcp_sources(recipe: Recipe) -> dict:
    return {name: read_metadata(path) for name, path in recipe.sources}


def run_dcp_merge(comm: Comm, recipe: Recipe) -> DcpMergeResult:
    """Collective: plan (rank 0), copy (every rank its files), publish (rank 0)."""
    plan = comm.bcast(comm.root_step(lambda: plan_dcp(recipe, read_dcp_sources(recipe))))
    sizes = plan.files()
    mine = _share(sizes, comm.size)[comm.rank]
    with staged(comm, recipe.output, [0]) as staging:
        records = comm.step(_write_files, plan, recipe, staging.dir, mine)
        failpoints.hit("write")
        files = {k: v for part in comm.allgather(records) for k, v in part.items()}

        def manifest() -> Manifest:
            files[METADATA] = _write_metadata(plan, staging.dir)
            return _manifest(plan, recipe, files, comm.size)
        written = commit_on_leaders(comm, staging, [0], manifest)
    return DcpMergeResult(recipe.output, len(files), written)


def _share(sizes: dict[str, int], ranks: int) -> list[list[str]]:
    """Output files to ranks, largest first to the least loaded (each file whole on one
    rank: its items are copied in order)."""
    load, out = [0] * ranks, [[] for _ in range(ranks)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = load.index(min(load))
        out[r].append(name)
        load[r] += sizes[name]
    return out


def _write_files(plan: DcpPlan, recipe: Recipe, root: Path, names: list[str]) -> dict:
    """This rank's output data files, each item copied from its source; their records."""
    by_file: dict[str, list[Copy]] = {}
    for c in plan.copies:
        by_file.setdefault(c.file, []).append(c)
    records = {}
    fds: dict[tuple[str, str], int] = {}
    try:
        for name in names:
            records[name] = _write_file(root / name, by_file[name], plan, recipe, fds)
    finally:
        for fd in fds.values():
            os.close(fd)
    return records


def _write_file(path: Path, copies: list[Copy], plan: DcpPlan, recipe: Recipe,
                fds: dict) -> dict:
    rec = FileRecord()
    buf = memoryview(bytearray(FILE_CHUNK))
    with created(path) as f:
        for c in copies:  # (in offset order: the output's items one after the other)
            key = (c.source, c.item.file)
            folder = recipe.source_path(c.source)
            if key not in fds:
                fds[key] = open_regular(folder / c.item.file, "a DCP data file")
            _check_item(plan, c, folder, fds[key])
            pos, end = c.item.offset, c.item.offset + c.item.length
            while pos < end:
                n = min(len(buf), end - pos)
                try:
                    read_into(fds[key], pos, buf[:n])
                except EOFError:
                    raise CheckpointError(
                        f"{recipe.source_path(c.source) / c.item.file}: ends before the "
                        f"item of {c.fqn!r:.80} its metadata places at byte {c.item.offset} "
                        f"({c.item.length} bytes); the file is truncated") from None
                rec.update(buf[:n])
                f.write(buf[:n])
                pos += n
    return rec.record()


def _check_item(plan: DcpPlan, c: Copy, folder: Path, fd: int) -> None:
    """What is copied is what the metadata says: a tensor chunk's item a torch.save of a
    contiguous tensor of its dtype and shape, a bytes entry's item a torch.save the torch
    reader's allow-list reads (no payload carried into the output)."""
    entry = plan.output.tensors.get(c.fqn)
    if entry is None:
        check_bytes_item(folder, fd, c.item)
        return
    sizes = next(ch.sizes for ch in entry.chunks if ch.offsets == c.offsets)
    locate(folder, fd, c.item, entry, sizes)


def _write_metadata(plan: DcpPlan, root: Path) -> dict:
    rec = FileRecord()
    data = metadata_bytes(plan.output)
    with created(root / METADATA) as f:
        rec.update(data)
        f.write(data)
    return rec.record()


def _manifest(plan: DcpPlan, recipe: Recipe, files: dict, ranks: int) -> Manifest:
    metas = dict(plan.sources)
    writers = len(plan.files())
    return Manifest("merge", files, {
        "recipe": recipe.text, "tag": "", "world_size": writers,
        "source_world_size": writers, "base": plan.base,
        "sources": {n: {"path": str(recipe.source_path(n)), "save_id": metas[n].save_id,
                        "format": "dcp"} for n, _ in plan.sources},
        "layers": {k: {"source": s} for k, s in plan.layer_source},
        "subgroups": [], "mpi_ranks": ranks})
