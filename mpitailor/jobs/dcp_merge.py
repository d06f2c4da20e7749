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
import time
from dataclasses import dataclass
from pathlib import Path

from mpitailor import failpoints
from mpitailor.cluster.comm import Comm
from mpitailor.engine.copyio import Copier, copy_unchanged
from mpitailor.engine.iostats import snapshot
from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.dcp import (
    METADATA,
    DcpMetadata,
    Located,
    metadata_bytes,
    zip_item,
)
from mpitailor.formats.io import (
    FileRecord,
    close_all,
    crc32_combine,
    crc32_range,
    create_sized,
    created,
    fsync_close,
    pwrite_all,
    read_small,
)
from mpitailor.formats.manifest import Manifest
from mpitailor.jobs.dcp_links import write_links
from mpitailor.jobs.dcp_sources import (
    Checked,
    check_item,
    read_dcp_sources,
    source_fd,
    source_saves,
)
from mpitailor.jobs.readable import refuse_inside_sources
from mpitailor.jobs.readlocks import hold_sources
from mpitailor.planning.dcp_link import LinkPlan, plan_links
from mpitailor.planning.dcp_plan import Copy, DcpPlan, plan_dcp
from mpitailor.planning.recipe import Recipe
from mpitailor.publish.staging import check_output_name, commit_on_leaders, staged


@dataclass(frozen=True, slots=True)
class DcpMergeResult:
    output: Path
    files: int
    bytes: int
    seconds: float = 0.0
    rank_stats: tuple[dict, ...] = ()  # per MPI rank: its files, bytes, seconds, I/O (--stats)

    @property
    def bytes_written(self) -> int:  # (the name --stats gives it, as for ZeRO)
        return self.bytes


@dataclass(frozen=True, slots=True)
class DcpMergePlan:
    """A DCP merge planned, as every rank holds it: the plan, the manifest's sources, the
    link plan (link mode) and which output data files each rank writes (copy mode)."""

    recipe: Recipe
    plan: DcpPlan
    saves: dict
    linked: LinkPlan | None
    shares: tuple[tuple[str, ...], ...]
    seconds: float = 0.0   # planning took (read, check, plan)


def plan_dcp_merge(comm: Comm, recipe: Recipe, link: bool = False,
                   checked: Checked | None = None) -> DcpMergePlan:
    """Collective: every check a merge makes before it writes (the sources' metadata and
    data files, link mode's readability), and the plan, on every rank. Nothing written:
    `--dry-run` stops here."""
    t0 = time.perf_counter()
    # its sources held (rank 0) as recover holds them: a prune meanwhile keeps them
    comm.root_step(hold_sources, [path for _, path in recipe.sources])
    if recipe.output is not None:
        comm.root_step(refuse_inside_sources, recipe.output, recipe.sources, "-o")
    plan, saves = comm.root_step(lambda: (
        plan_dcp(recipe, read_dcp_sources(recipe, checked or {})), source_saves(recipe)))
    if link:
        comm.step(_links_readable, recipe, plan)
    linked = plan_links(plan) if link else None
    shares = () if link else tuple(tuple(s) for s in _share(plan.files(), comm.size))
    return DcpMergePlan(recipe, plan, saves, linked, shares, time.perf_counter() - t0)


def check_output_free(planned: DcpMergePlan) -> None:
    """Rank 0: what a run would refuse of the output before it writes, for a dry run, which
    writes nothing: a name that is none, an existing output (publish/staging.py), and in
    link mode a source on another file system (a hard link cannot cross one)."""
    output = planned.recipe.output
    check_output_name(output)
    if os.path.lexists(output):
        raise UserError(f"{output}: output already exists; remove it or choose another "
                        f"output path (mpitailor never overwrites)")
    if planned.linked is None:
        return
    there = output.parent
    while not there.exists() and there != there.parent:
        there = there.parent  # (the run makes the missing folders: where they would lie)
    for link in planned.linked.links:
        src = planned.recipe.source_path(link.source) / link.file
        if os.stat(src).st_dev != os.stat(there).st_dev:
            raise UserError(f"{src}: on another file system than the output {output.parent}; "
                            f"--link makes hard links, which stay on one file system: write "
                            f"the output beside the sources, or merge without --link (a copy)")


def run_dcp_merge(comm: Comm, recipe: Recipe, link: bool = False,
                  checked: Checked | None = None,
                  planned: DcpMergePlan | None = None) -> DcpMergeResult:
    """Collective: plan (rank 0, unless `planned`), copy (every rank its files) or link
    (jobs/dcp_links.py), publish (rank 0). checked: the identities of the source files a
    recovery checked against their CRC-32s (dcp_chain): each is opened again only as that
    very file."""
    t0, before = time.perf_counter(), snapshot()
    checked = checked or {}
    if planned is None:
        planned = plan_dcp_merge(comm, recipe, link, checked)
    t0 -= planned.seconds  # (planned before: counted in)
    plan, linked = planned.plan, planned.linked
    t_plan = time.perf_counter()
    mine: tuple[str, ...] = ()
    with staged(comm, recipe.output, [0]) as staging:
        if linked is not None:
            comm.step(_check_linked_items, plan, recipe, comm.rank, comm.size, checked)
            files = write_links(comm, recipe, linked, staging.dir, checked)
        else:
            mine = planned.shares[comm.rank]
            records = comm.step(_write_files, plan, recipe, staging.dir, list(mine), checked)
            files = {k: v for part in comm.allgather(records) for k, v in part.items()}
        failpoints.hit("write")
        t_write = time.perf_counter()

        def manifest() -> Manifest:
            files[METADATA] = _write_metadata(plan.output if linked is None else linked.output,
                                              staging.dir)
            files.update(_copy_side_files(recipe.source_path(plan.base), staging.dir))
            return _manifest(plan, recipe, planned.saves, files, comm.size, linked is not None)
        written = commit_on_leaders(comm, staging, [0], manifest)
    t_end = time.perf_counter()
    return DcpMergeResult(recipe.output, len(files), written, t_end - t0, tuple(comm.allgather(
        _rank_stats(comm.rank, planned, files, mine, before,
                    (t_plan - t0, t_write - t_plan, t_end - t_write)))))


def _rank_stats(rank: int, planned: DcpMergePlan, files: dict, mine: tuple[str, ...],
                before, seconds: tuple[float, float, float]) -> dict:
    """One rank's line of --stats: the data files it wrote and the bytes of the sources'
    items copied into them, rank 0's small files (.metadata, side files) and links, where
    its time went, and its I/O counters (engine/iostats.py)."""
    data = sum(files[n]["bytes"] for n in mine)
    copied = sum(c.item.length for c in planned.plan.copies if c.file in mine)
    small = sum(rec["bytes"] for n, rec in files.items() if n == METADATA or n in SIDE_FILES) \
        if rank == 0 else 0
    out = {"rank": rank, "files": list(mine), "bytes_written": data + small,
           "bytes_copied_from_sources": copied,
           "seconds": dict(zip(("plan", "write", "publish"), (round(s, 4) for s in seconds)))}
    if planned.linked is not None and rank == 0:
        out["files_linked"] = len(planned.linked.links)
        out["bytes_linked"] = sum(files[x.name]["bytes"] for x in planned.linked.links)
    return {**out, **snapshot().since(before)}


def _check_linked_items(plan: DcpPlan, recipe: Recipe, rank: int, ranks: int,
                        checked: Checked) -> None:
    """This rank's share of the bytes entries a linked output uses, checked as a copy
    checks them (_check_item: through the allow-list): a link carries the source's bytes
    as they are, and dcp.load unpickles a bytes entry with weights_only=False, so a payload
    a copy refuses must not reach the output by a link either. (Tensor items it loads with
    weights_only=True; left unread, as link mode reads no tensor.)"""
    fds: dict[tuple[str, str], int] = {}
    passed: set = set()
    try:
        for c in [c for c in plan.copies if c.sizes is None][rank::ranks]:
            folder = recipe.source_path(c.source)
            check_item(plan, c, folder, source_fd(fds, c, folder, checked), passed)
    finally:
        close_all(fds)


def _links_readable(recipe: Recipe, plan: DcpPlan) -> None:
    """UserError where a linked output could not be loaded: chunks of a safetensors blob,
    which torch's dcp.load does not read (a copy writes them as torch.save items)."""
    c = next((c for c in plan.copies if c.item.safetensors), None)
    if c is not None:
        raise UserError(f"{recipe.origin}: {recipe.source_path(c.source)}: its chunks are "
                        f"safetensors (FileSystemWriter SAFETENSORS), which dcp.load does not "
                        f"read; --link would leave them so: merge without --link (a copy "
                        f"writes them as torch.save items)")


def _share(sizes: dict[str, int], ranks: int) -> list[list[str]]:
    """Output files to ranks, largest first to the least loaded (each file whole on one
    rank: its items are copied in order)."""
    load, out = [0] * ranks, [[] for _ in range(ranks)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = load.index(min(load))
        out[r].append(name)
        load[r] += sizes[name]
    return out


def _write_files(plan: DcpPlan, recipe: Recipe, root: Path, names: list[str],
                 checked: Checked) -> dict:
    """This rank's output data files, each item copied from its source; their records."""
    by_file: dict[str, list[Copy]] = {}
    for c in plan.copies:
        by_file.setdefault(c.file, []).append(c)
    records = {}
    fds: dict[tuple[str, str], int] = {}
    try:
        for name in names:
            records[name] = _write_file(root / name, by_file[name], plan, recipe, fds, checked)
    finally:
        for fd in fds.values():
            os.close(fd)
    return records


def _write_file(path: Path, copies: list[Copy], plan: DcpPlan, recipe: Recipe,
                fds: dict, checked: Checked) -> dict:
    """One output data file: each item checked, the file's CRC-32 continued over its bytes
    in the source (a read of what was just checked, mostly from the page cache), the item
    copied inside the kernel (copy_file_range; through the copier's buffers where the file
    systems cannot); the file fsynced."""
    size = max((c.offset + c.length for c in copies), default=0)
    out = {path.name: create_sized(path, size)}
    copier, crc, passed = Copier(), 0, set()
    try:
        for c in copies:  # (in offset order: the output's items one after the other)
            folder = recipe.source_path(c.source)
            fd = source_fd(fds, c, folder, checked)
            located = check_item(plan, c, folder, fd, passed)
            if c.item.safetensors:
                crc = _write_zip_item(c, plan.output.tensors[c.fqn].dtype, located, fd,
                                      out[path.name], copier, crc)
                continue
            crc, got = crc32_range(fd, c.item.offset, c.item.length, crc)
            if got < c.item.length:
                raise CheckpointError(
                    f"{folder / c.item.file}: ends before the item of {c.fqn!r:.80} its "
                    f"metadata places at byte {c.item.offset} ({c.item.length} bytes); the "
                    f"file is truncated")
            copy_unchanged(fd, c.item.offset, c.item.length, out[path.name],
                           c.offset, copier, str(folder / c.item.file))
        copier.drain()
        fsync_close(out)
    finally:
        copier.close()
        close_all(out)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def _write_zip_item(c: Copy, dtype: str, located: Located, fd: int, out: int,
                    copier: Copier, crc: int) -> int:
    """A chunk of a source's safetensors blob written at c.offset as the torch.save item
    the plan sized (zip_item): its bytes copied into the zip's storage record, the zip's
    headers written around them; the output file's CRC-32 continued over the item."""
    z = zip_item(dtype, c.sizes)
    data_crc, got = crc32_range(fd, located.offset, located.nbytes, 0)
    if got < located.nbytes:
        raise CheckpointError(f"{located.file}: ends before the bytes of {c.fqn!r:.80} at "
                              f"byte {located.offset} ({located.nbytes} bytes); the file is "
                              f"truncated")
    for at, data in z.pieces(data_crc):
        pwrite_all(out, data, c.offset + at)
    copy_unchanged(fd, located.offset, located.nbytes, out, c.offset + z.data_offset,
                   copier, str(located.file))
    return crc32_combine(crc, z.crc(data_crc), z.length)


def _write_metadata(output: DcpMetadata, root: Path) -> dict:
    rec = FileRecord()
    data = metadata_bytes(output)
    with created(root / METADATA) as f:
        rec.update(data)
        f.write(data)
    return rec.record()


# Small files a loader needs beside the DCP: Megatron's `metadata.json` (its backend name;
# dist_checkpointing.load refuses a dir without it). Copied from the base.
SIDE_FILES = ("metadata.json",)
MAX_SIDE_BYTES = 1 << 20


def _copy_side_files(base: Path, root: Path) -> dict:
    out = {}
    for name in SIDE_FILES:
        if os.path.lexists(base / name):
            data = read_small(base / name, MAX_SIDE_BYTES, "a checkpoint's side file")
            rec = FileRecord()
            with created(root / name) as f:
                rec.update(data)
                f.write(data)
            out[name] = rec.record()
    return out


def _manifest(plan: DcpPlan, recipe: Recipe, saves: dict[str, dict], files: dict, ranks: int,
              link: bool) -> Manifest:
    writers = len({c.file for c in plan.copies})
    return Manifest("merge", files, {
        "recipe": recipe.text, "tag": "", "world_size": writers,
        "source_world_size": writers, "base": plan.base,
        "sources": {n: {"path": str(recipe.source_path(n)), **saves[n], "format": "dcp"}
                    for n, _ in plan.sources},
        "layers": {k: {"source": s} for k, s in plan.layer_source},
        "subgroups": [], "mpi_ranks": ranks, **({"linked": True} if link else {})})
