"""Copying finished files from one node's disk to others over MPI (node-local storage).

Used where a node needs files another node wrote: the exports of a node-local merge (every
node keeps its own copy of hf/ and the Universal files, since every rank loads all of them),
and the partitions the first node gathers to make those exports. Each file is read on its
node by one rank, sent in bounded chunks (exchange.py), written in place by one rank of each
destination node, and checked there against the CRC-32 its writer recorded.

Collective: call on every rank with the same arguments.
"""
from __future__ import annotations

from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.cluster.exchange import Request, exchange
from mpitailor.cluster.nodes import Nodes
from mpitailor.engine.storage import CrcWriter, close_all, create_sized, fsync_close
from mpitailor.errors import MergeFailed
from mpitailor.publish.staging import make_dirs_under


def replicate(comm: Comm, nodes: Nodes, root: Path, files: dict[str, dict],
              src: dict[str, int], dst: dict[str, list[int]]) -> dict:
    """Copy files (path under root -> manifest record {"bytes", "crc32"}) from node src[f]
    to every node of dst[f]. Returns this rank's {"bytes_mpi_sent", "bytes_mpi_received"}."""
    wanted: dict[int, list[Request]] = {}
    mine: list[tuple[str, dict]] = []  # key -> (file, record) this rank writes
    for i, (name, rec) in enumerate(sorted(files.items())):
        readers = nodes.ranks(src[name])
        for node in dst.get(name, []):
            writers = nodes.ranks(node)
            if writers[i % len(writers)] == comm.rank:
                wanted.setdefault(readers[i % len(readers)], []).append(
                    Request(len(mine), (name,), rec["bytes"]))
                mine.append((name, rec))
    fds: dict[int, int] = {}

    def create() -> None:
        for key, (name, rec) in enumerate(mine):
            path = root / name
            make_dirs_under(root, path.parent)
            fds[key] = create_sized(path, rec["bytes"])

    def read(what: tuple, off: int, n: int) -> bytes:
        with open(root / what[0], "rb") as f:
            f.seek(off)
            data = f.read(n)
        if len(data) != n:
            raise MergeFailed(f"{root / what[0]}: shorter than its record while sending it")
        return data

    received = CrcWriter(lambda key: (fds[key], 0))

    def finish(error) -> None:
        if error is not None:
            raise error
        for key, (name, rec) in enumerate(mine):
            if f"{received.crcs.get(key, 0):08x}" != rec["crc32"]:
                raise MergeFailed(f"{root / name}: the copy received over MPI fails its "
                                  f"CRC-32; nothing published")
        fsync_close(fds)
    try:
        comm.step(create)
        moved = exchange(comm, wanted, read, received.write)
        comm.step(finish, moved.error)
    finally:
        close_all(fds)
    return {"bytes_mpi_sent": moved.bytes_sent, "bytes_mpi_received": moved.bytes_received}
