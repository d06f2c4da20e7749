"""Copying files from one node's disk to others over MPI (node-local storage).

Used where a node needs files another node holds: the exports of a node-local merge (every
node keeps its own copy of hf/ and the Universal files, since every rank loads all of them),
the partitions the first node gathers to make those exports, the source files an export
gathers on one node (gather_sources), and Accelerate's files carried into every node's output
(carry_files). Each file is read on its node by one rank, sent in bounded chunks
(exchange.py), written in place by one rank of each destination node, and checked there
against the CRC-32 its writer recorded, or, for a file nobody recorded, the CRC-32 its sender
took of the bytes it sent.

Collective: call on every rank with the same arguments.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.cluster.exchange import Request, exchange
from mpitailor.cluster.nodes import Nodes, Placement
from mpitailor.errors import CheckpointError, MergeFailed
from mpitailor.formats.io import (
    CrcWriter,
    close_all,
    copy_synced,
    crc32,
    create_sized,
    fsync_close,
    open_regular,
)
from mpitailor.formats.zero import CheckpointMeta, partial_files
from mpitailor.publish.staging import make_dirs_under


def replicate(comm: Comm, nodes: Nodes, root: Path, files: dict[str, dict],
              src: dict[str, int], dst: dict[str, list[int]],
              origin: dict[str, Path] | None = None) -> dict:
    """Copy files (path under root -> manifest record {"bytes", "crc32"}; "crc32" may be
    left out) from node src[f] to every node of dst[f], as root/f there. origin: where the
    source node reads f, if not at root/f. Returns this rank's {"bytes_mpi_sent",
    "bytes_mpi_received"}."""
    origin = origin or {}
    wanted: dict[int, list[Request]] = {}
    mine: list[tuple[str, dict]] = []  # key -> (file, record) this rank writes
    for i, (name, rec) in enumerate(sorted(files.items())):
        readers = nodes.ranks(src[name])
        for node in dst.get(name, []):
            writers = nodes.ranks(node)
            if writers[i % len(writers)] == comm.rank:
                wanted.setdefault(readers[i % len(readers)], []).append(
                    Request(len(mine), (name, comm.rank, len(mine)), rec["bytes"]))
                mine.append((name, rec))
    fds: dict[int, int] = {}
    sent: dict[tuple[int, int], int] = {}  # (writer, key) -> CRC-32 of the bytes sent so far

    def create() -> None:
        for key, (name, rec) in enumerate(mine):
            path = root / name
            make_dirs_under(root, path.parent)
            fds[key] = create_sized(path, rec["bytes"])

    def read(what: tuple, off: int, n: int) -> bytes:
        path = origin.get(what[0], root / what[0])
        with open(path, "rb") as f:
            f.seek(off)
            data = f.read(n)
        if len(data) != n:
            raise MergeFailed(f"{path}: shorter than its record while sending it")
        sent[what[1:]] = crc32(data, sent.get(what[1:], 0))  # a request's chunks go in order
        return data

    received = CrcWriter(lambda key: (fds[key], 0))

    def finish(error, senders: dict) -> None:
        if error is not None:
            raise error
        for key, (name, rec) in enumerate(mine):
            want = rec.get("crc32") or f"{senders.get((comm.rank, key), 0):08x}"
            if f"{received.crcs.get(key, 0):08x}" != want:
                raise MergeFailed(f"{root / name}: the copy received over MPI fails its "
                                  f"CRC-32; nothing published")
        fsync_close(fds)
    try:
        comm.step(create)
        moved = exchange(comm, wanted, read, received.write)
        senders = {k: c for part in comm.allgather(sent) for k, c in part.items()}
        comm.step(finish, moved.error, senders)
    finally:
        close_all(fds)
    return {"bytes_mpi_sent": moved.bytes_sent, "bytes_mpi_received": moved.bytes_received}


def rank_files(meta: CheckpointMeta, rank: int) -> list[Path]:
    """Every file a reader of rank `rank` of a checkpoint opens (shard.open_shard)."""
    files = meta.files
    if files.partial:
        return [files.tag_dir / name for name in partial_files(rank).values()]
    return [files.model_path(rank), files.optim_path(rank)]


def gather_sources(comm: Comm, place: Placement, node: int, metas: list[CheckpointMeta],
                   scratch: Path) -> dict[str, CheckpointMeta]:
    """Collective: every rank file of `metas` (node-local sources) on node `node`, under
    scratch/<i>/<tag>/ there: those another node holds copied over MPI (CRC-checked), the
    node's own linked there (copied where scratch is on another file system). Returns
    {str(source path): the same checkpoint read from there}; the sources stay as they are."""
    moved: dict[str, dict] = {}
    src: dict[str, int] = {}
    origin: dict[str, Path] = {}
    own: dict[str, Path] = {}
    out: dict[str, CheckpointMeta] = {}
    for i, meta in enumerate({str(m.path): m for m in metas}.values()):
        tag_dir = scratch / str(i) / meta.files.tag
        out[str(meta.path)] = replace(meta, files=replace(meta.files, tag_dir=tag_dir,
                                                          save_dir=None))
        for rank in range(meta.world_size):
            for p in rank_files(meta, rank):
                name = str(tag_dir.relative_to(scratch) / p.name)
                holders = place.nodes_holding(p)
                if node in holders:
                    own[name] = p
                elif holders:
                    moved[name] = {"bytes": place.view.entries[str(p)].size}
                    src[name], origin[name] = holders[0], p
                else:  # the survey found every rank's files on some node
                    raise CheckpointError(f"{p}: on no node of this job "
                                          f"({', '.join(place.nodes.names)})")

    def link_own() -> None:
        if comm.rank != place.nodes.leader(node):
            return
        for name, p in sorted(own.items()):
            make_dirs_under(scratch, (scratch / name).parent)
            try:
                os.link(p, scratch / name, follow_symlinks=True)
            except OSError:  # another file system: a copy, a bounded chunk at a time
                copy_file(p, scratch / name, follow=True)
    comm.step(lambda: make_dirs_under(scratch.parent, scratch)
              if comm.rank == place.nodes.leader(node) else None)
    comm.step(link_own)
    replicate(comm, place.nodes, scratch, moved, src, {f: [node] for f in moved}, origin)
    return out


def drop_gathered(scratch: Path) -> None:
    """What gather_sources put under scratch (links and copies only)."""
    shutil.rmtree(scratch, ignore_errors=True)


def copy_file(src: Path, dst: Path, what: str = "a checkpoint file",
              follow: bool = False) -> dict:
    """Copy regular file src (a link refused unless follow) to the new file dst
    (fileio.copy_synced: fsynced, a bounded chunk at a time); its manifest record."""
    fd = open_regular(src, what, follow=follow)
    try:
        with os.fdopen(fd, "rb", closefd=False) as fi:
            return copy_synced(fi, dst)
    finally:
        os.close(fd)


def carry_files(comm: Comm, place: Placement, root: Path, names: tuple[str, ...],
                folder: Path | None, reader: int, on_nodes: bool) -> dict[str, dict]:
    """Collective: files `names` of the base's save dir `folder` (Accelerate's: as large as
    the run made them) into root, the staging dir, copied as files a bounded chunk at a time:
    never whole in memory, never sent to every rank. reader: the rank that listed them. A
    shared output (on_nodes False): copied by `reader`. Node-local output: every node's
    leader copies its node's own copy (the same path), and a node without one gets the
    reader's node's over MPI (CRC-checked). Returns {name: record} of what this rank's node
    holds on the ranks that write the manifest (rank 0; each node's leader), {} elsewhere."""
    if not names:
        return {}
    what = "a file of the base's save dir"
    if not on_nodes:
        def copy() -> dict[str, dict]:
            return {n: copy_file(folder / n, root / n, what) for n in names}
        return comm.step_on(reader, copy)
    nodes = place.nodes
    leaders = nodes.leaders()

    def own() -> dict[str, dict] | None:
        if comm.rank not in leaders:
            return None
        return {n: copy_file(folder / n, root / n, what) for n in names
                if os.path.isfile(folder / n) and not os.path.islink(folder / n)}
    copied = comm.allgather(comm.step(own))
    src = nodes.of_rank[reader]
    first = copied[nodes.leader(src)]  # the reader's node holds every one of them
    need = {n: [i for i, lead in enumerate(leaders) if n not in copied[lead]] for n in names}
    replicate(comm, nodes, root, {n: first[n] for n in names if need[n]},
              {n: src for n in names}, need)
    if comm.rank not in leaders:
        return {}
    return {n: copied[comm.rank].get(n, first[n]) for n in names}
