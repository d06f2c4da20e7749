"""Where a job's ranks run, and which node holds which checkpoint file.

With a shared file system every rank sees every file, and any rank may read or write
anything. Under DeepSpeed's `use_node_local_storage` (HF Trainer: `save_on_each_node`) each
node keeps only its own ranks' files, on a disk no other node sees: a rank may then read
only what its node holds, and what it needs from elsewhere comes over MPI. `survey` finds
out which case a job is in from what each node actually sees, not from a flag: every
node's leader lists the sources (fsview.listing), and the listings are compared.

Collective where it takes a `comm`.
"""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.io import LINK, LOCAL, Entry, UnionView, crc32_of, listing, open_regular


@dataclass(frozen=True, slots=True)
class Nodes:
    """The nodes of a job, in the order of their lowest rank, and each rank's node."""

    names: tuple[str, ...]
    of_rank: tuple[int, ...]

    @classmethod
    def of(cls, comm: Comm) -> "Nodes":
        """Collective (the first time for a comm; then its answer again): ranks on the same
        host form a node."""
        if comm.nodes is not None:
            return comm.nodes
        hosts = comm.allgather(socket.gethostname())
        names: list[str] = []
        for h in hosts:
            if h not in names:
                names.append(h)
        comm.nodes = cls(tuple(names), tuple(names.index(h) for h in hosts))
        return comm.nodes

    def ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.of_rank) if n == node]

    def leader(self, node: int) -> int:
        return self.of_rank.index(node)

    def leaders(self) -> list[int]:
        return [self.leader(n) for n in range(len(self.names))]


@dataclass(frozen=True, slots=True)
class Placement:
    """Which nodes hold each source file. `view is None`: every node sees the same files
    (shared storage, or one node); else the sources are node-local and `view` is the union
    of what the nodes see, `holders` the nodes that hold each file."""

    nodes: Nodes
    view: UnionView | None = None
    holders: dict[str, tuple[int, ...]] | None = None

    @property
    def node_local(self) -> bool:
        return self.view is not None

    def fs(self):
        """Where checkpoint files are looked up (fsview): the union, or this process's."""
        return self.view if self.view is not None else LOCAL

    def nodes_holding(self, path: Path) -> tuple[int, ...]:
        if self.holders is None:
            return tuple(range(len(self.nodes.names)))
        return self.holders.get(str(path), ())

    def holds(self, node: int, path: Path) -> bool:
        return node in self.nodes_holding(path)

    def reader(self, paths: list[Path], spread: int = 0) -> int:
        """A rank on a node that holds all of `paths` (the `spread`-th such rank, modulo);
        UserError naming the first path no node holds whole."""
        common = set(range(len(self.nodes.names)))
        for p in paths:
            common &= set(self.nodes_holding(p))
            if not common:
                raise CheckpointError(
                    f"{p}: on no node of this job together with {paths[0].name} (nodes "
                    f"{', '.join(self.nodes.names)}); run on every node that holds the "
                    f"checkpoint's files")
        ranks = [r for r, n in enumerate(self.nodes.of_rank) if n in common]
        return ranks[spread % len(ranks)]


def shard_paths(meta, rank: int) -> list[Path]:
    """The files of one rank of a checkpoint (CheckpointMeta)."""
    files = meta.files
    return [files.model_path(rank), files.optim_path(rank)] + \
        ([files.layers_path(rank)] if files.partial else [])


def survey(comm: Comm, paths: list[Path], depth: int = 2) -> Placement:
    """Collective: list `paths` (`depth` levels down) on every node; shared if every node
    sees the same, else node-local with the union (a file two nodes hold with different
    bytes is an error)."""
    nodes = Nodes.of(comm)
    if len(nodes.names) == 1:
        return Placement(nodes)
    leaders = nodes.leaders()

    def mine():
        if comm.rank not in leaders:
            return None
        out: dict[str, Entry] = {}
        for p in paths:
            out.update(listing(Path(p), depth))
        return out
    seen = [s for s in comm.allgather(comm.step(mine)) if s is not None]  # in node order
    if all(s == seen[0] for s in seen):
        return Placement(nodes)
    union: dict[str, Entry] = {}
    holders: dict[str, list[int]] = {}
    for node, entries in enumerate(seen):
        for path, e in entries.items():
            first = union.setdefault(path, e)
            if not first.same_as(e):
                other = nodes.names[holders[path][0]]
                what = (f"{_describe(first)} vs {_describe(e)}" if first.size != e.size
                        or first.is_dir != e.is_dir else "same size, different bytes")
                raise CheckpointError(
                    f"{path}: nodes {other} and {nodes.names[node]} hold different copies "
                    f"({what}); remove the stale one")
            holders.setdefault(path, []).append(node)
    _check_copies(comm, nodes, union, holders)
    return Placement(nodes, UnionView(union), {p: tuple(n) for p, n in holders.items()})


def _check_copies(comm: Comm, nodes: Nodes, union: dict[str, Entry],
                  holders: dict[str, list[int]]) -> None:
    """Collective: a file several nodes hold, too large to travel whole in the listings
    (fsview.SMALL), is compared by the CRC-32 of all its bytes, each holder's leader
    reading its own copy (a size and a tail alone miss a flipped bit earlier on)."""
    big = sorted(p for p, hs in holders.items() if len(hs) > 1 and union[p].data is None
                 and not union[p].is_dir and union[p].odd in ("", LINK))
    if not big:
        return
    leaders = nodes.leaders()

    def mine() -> dict[str, int] | None:
        if comm.rank not in leaders:
            return None
        node = nodes.of_rank[comm.rank]
        return {p: file_crc(Path(p)) for p in big if node in holders[p]}
    seen = [s for s in comm.allgather(comm.step(mine)) if s is not None]  # in node order
    for p in big:
        first, *rest = holders[p]
        for node in rest:
            if seen[node][p] != seen[first][p]:
                raise CheckpointError(
                    f"{p}: nodes {nodes.names[first]} and {nodes.names[node]} hold different "
                    f"copies (same size, different bytes); remove the stale one")


_CRCS: dict[tuple, int] = {}  # (path, size, mtime, inode, device) -> CRC-32: once per job


def file_crc(path: Path) -> int:
    """CRC-32 of a whole file (a link followed; fileio.crc32_of); -1 if it cannot be read
    (the copies then differ, or fail when read)."""
    try:
        fd = open_regular(path, "a checkpoint file", follow=True)
    except CheckpointError:
        return -1
    try:
        st = os.fstat(fd)
        key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
        if key in _CRCS:
            return _CRCS[key]
        with os.fdopen(fd, "rb", closefd=False) as f:
            crc = crc32_of(f)
        _CRCS[key] = crc
        return crc
    except OSError:
        return -1
    finally:
        os.close(fd)


def _describe(e: Entry) -> str:
    return "a directory" if e.is_dir else f"{e.size} bytes"


def output_is_shared(comm: Comm, nodes: Nodes, output: Path) -> bool:
    """Collective: does every node see the same directory at output's parent? Rank 0 leaves
    a probe file there; each node's leader looks for it."""
    parent = output.parent
    probe = parent / f".{output.name}.mpitailor-probe-{uuid.uuid4().hex[:12]}"

    def plant() -> str:
        parent.mkdir(parents=True, exist_ok=True)
        probe.touch()
        return str(probe)
    name = Path(comm.root_step(plant))
    try:
        seen = comm.allgather(name.exists() if comm.rank in nodes.leaders() else None)
    finally:
        if comm.rank == 0:
            name.unlink(missing_ok=True)
    seen = [s for s in seen if s is not None]
    if all(seen):
        return True
    if any(seen[1:]):
        raise UserError(f"{parent}: some nodes share this directory with the first node and "
                        f"some do not; write the output where all nodes see the same files, "
                        f"or where each sees its own")
    return False
