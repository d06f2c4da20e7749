"""The copy step of the executor (execute.py): every rank fills its byte ranges of the output
flat buffers from the source pieces of the copy program. A piece held on this rank's node is
read from its file (pread, CRC-32, pwrite at its final offset, in bounded chunks; a whole
source record is copied in the kernel with its CRC as it is); a piece held only on another
node (node-local storage) is fetched over MPI first (exchange.py). An HF weights file's
ranges are cast on the way (weights_copy.py). Every range's CRC-32 is returned for the home
rank to join.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mpitailor import failpoints
from mpitailor.cluster.comm import Comm
from mpitailor.cluster.exchange import Exchanged, Request, exchange
from mpitailor.cluster.nodes import Placement, shard_paths
from mpitailor.engine.copyio import Copier, copy_unchanged, sync_close
from mpitailor.engine.progress import Progress
from mpitailor.engine.weights_copy import Weights
from mpitailor.formats.io import (
    CrcWriter,
    crc32_combine,
    crc32_zeros,
    open_output,
    pread_exact,
)
from mpitailor.formats.zero import (
    ELEMENT,
    CheckpointMeta,
    Shard,
    open_shard,
    optim_file,
)
from mpitailor.planning import program
from mpitailor.planning.plan import MergePlan


class Shards:
    """The source shards this rank opened, by (source, rank): each parsed once per merge
    (home and copier of a partition are often the same rank); descriptors closed between
    partitions and reopened when needed, so that few are open at a time."""

    def __init__(self, metas: dict[str, CheckpointMeta], place: Placement | None,
                 rank: int) -> None:
        self.metas, self.used = metas, set()
        self.open: dict[tuple[str, int], Shard] = {}
        self.place = place if place is not None and place.node_local else None
        self.node = self.place.nodes.of_rank[rank] if self.place else 0

    def local(self, source: str, rank: int) -> bool:
        """Does this rank's node hold rank `rank`'s files of `source`?"""
        return self.place is None or all(self.place.holds(self.node, p)
                                         for p in shard_paths(self.metas[source], rank))

    def reader(self, source: str, rank: int, spread: int) -> int:
        """A rank whose node holds them (the spread-th, modulo)."""
        return self.place.reader(shard_paths(self.metas[source], rank), spread)

    def get(self, source: str, rank: int) -> Shard:
        if (source, rank) not in self.open:
            if not self.local(source, rank):  # never reached by a correct program
                raise RuntimeError(f"internal error: {source} rank {rank}: read off-node")
            self.used.add((source, rank))
            self.open[source, rank] = open_shard(self.metas[source], rank)
        shard = self.open[source, rank]
        shard.reopen()
        return shard

    def release(self) -> None:
        """Close every descriptor; the parsed shards stay."""
        for s in self.open.values():
            s.close()

    close = release


@dataclass(frozen=True)
class Program:
    """What one run of the executor writes under `root`: its buffers, and what they are
    made of: the merge plan's pieces (partitions, Universal files; their files under
    root/TAG) and the casts of `weights` (HF weights files)."""

    bufs: tuple[program.Buffer, ...]
    plan: MergePlan | None
    weights: Weights | None
    root: Path


def output_file(prog: Program, b: program.Buffer) -> str:
    """The output file of buffer b, under the program's root."""
    if b.kind == program.WEIGHTS:
        return b.param
    tag = prog.plan.base_meta.files.tag
    if program.is_partition(b):
        return f"{tag}/{optim_file(b.unit, prog.plan.base_meta.files.bf16_prefix)}"
    return f"{tag}/zero/{b.param}/{b.kind}.pt"


class Copy:
    """This rank's byte ranges of the output buffers: planned (each buffer by its kind's
    fill: pieces clipped to its tasks, each local or held on another node; the casts of an
    HF weights file's tensors), then the remote pieces fetched over MPI, then the local
    ones copied or cast, every range's CRC-32 taken on the way."""

    def __init__(self, prog: Program, tasks: list[program.Task], offsets: dict[int, int],
                 verify: bool, opened: Shards) -> None:
        plan, bufs = prog.plan, prog.bufs
        self.prog, self.tasks, self.offsets = prog, tasks, offsets
        self.opened, self.weights = opened, prog.weights
        self.outs: dict[str, int] = {}
        self.copier = Copier()
        self.shards: dict[tuple[str, int], Shard] = {}   # the local ones these tasks read
        self.wanted: dict[int, list[Request]] = {}        # reader rank -> remote pieces
        self.remote: dict[tuple[int, int], int] = {}      # (plan, piece) -> request key
        self.dests: dict[int, tuple[str, int]] = {}       # key -> (out file, offset)
        self.plans = []
        pieces_of: dict[int, dict] = {}
        used: dict[tuple[str, int], set] = {}  # the source records read: --verify's
        casts = False
        for t in tasks:
            b = bufs[t.buffer]
            if b.kind == program.WEIGHTS:
                runs = self.weights.runs(b, t)
                self.weights.records_read(runs, used)
                self.plans.append((t, b, runs))
                casts = True
                continue
            if b.unit not in pieces_of:
                pieces_of[b.unit] = program.pieces(plan, b.unit) if program.is_partition(b) \
                    else {-1: program.param_pieces(plan, b.param)}
            ps = program.clip(pieces_of[b.unit].get(b.subgroup, []), t.lo // ELEMENT,
                              t.hi // ELEMENT)
            for j, p in enumerate(ps):
                if opened.local(p.source, p.src_rank):
                    if (p.source, p.src_rank) not in self.shards:
                        self.shards[p.source, p.src_rank] = opened.get(p.source, p.src_rank)
                    used.setdefault((p.source, p.src_rank), set()).add((b.kind, p.src_group))
                    continue
                key = len(self.dests)
                self.remote[len(self.plans), j] = key
                self.dests[key] = (output_file(prog, b),
                                   offsets[t.buffer] + p.dst_start * ELEMENT)
                reader = opened.reader(p.source, p.src_rank, t.buffer)
                self.wanted.setdefault(reader, []).append(Request(
                    key, (p.source, p.src_rank, b.kind, p.src_group, p.src_start, p.length),
                    p.length * ELEMENT))
            self.plans.append((t, b, ps))
        if casts:  # every rank of every checkpoint, in order: a damaged one is met, and
            self.weights.open_all(opened.get)  # named, by every rank that writes
        if verify:
            for key, kinds in used.items():
                opened.get(*key).verify(kinds)
        failpoints.hit("read")
        opened.release()  # reopened partition by partition below: few descriptors at a time

    def fetch_remote(self, comm: Comm) -> Exchanged:
        """Collective: the pieces held on other nodes, written in place; serve theirs."""
        def read(what: tuple, off: int, n: int) -> bytes:
            source, rank, kind, group, start, length = what
            shard = self.opened.get(source, rank)
            out = bytearray()
            for fd, pos, size in shard.byte_ranges(kind, group, start, length):
                lo, hi = max(off, 0), min(off + n, size)
                if lo < hi:
                    out += pread_exact(fd, hi - lo, pos + lo, shard.path_of(fd))
                off -= size
            return bytes(out)

        def place(key: int) -> tuple[int, int]:
            name, dst = self.dests[key]
            return self._out(name), dst
        try:
            moved = exchange(comm, self.wanted, read, CrcWriter(place).write)
            try:
                sync_close(self.copier, self.outs)
            except OSError as e:  # raised by the caller on every rank, like the others
                moved.error = moved.error or e
            return moved
        finally:
            self.opened.release()

    def _out(self, name: str) -> int:
        if name not in self.outs:
            self.outs[name] = open_output(self.prog.root / name)
        return self.outs[name]

    def run(self, moved: Exchanged, bar: Progress | None) -> tuple[dict, tuple[int, int]]:
        """The local pieces: ({buffer: [(lo, hi, crc)]}, (bytes written, of which whole
        source records copied unchanged)). bar: told of every range copied."""
        bar = bar or _SILENT
        crcs: dict[int, list[tuple[int, int, int]]] = {}
        written = unchanged = 0
        copier, outs, shards = self.copier, self.outs, self.shards
        unit = None
        for i, (t, b, ps) in enumerate(self.plans):
            if b.unit != unit:  # the previous unit's files are done: sync and close them
                sync_close(copier, outs)
                self.opened.release()
                unit = b.unit
            out = self._out(output_file(self.prog, b))
            base = self.offsets[t.buffer]  # file offset of the buffer's byte 0
            if b.kind == program.WEIGHTS:  # cast: every piece read from its checkpoint
                crc = self.weights.write(copier, self.opened.get, b, ps, out, base + t.lo)
                crcs.setdefault(t.buffer, []).append((t.lo, t.hi, crc))
                written += t.hi - t.lo
                bar.update(t.hi - t.lo)
                continue
            for p in ps:
                if (p.source, p.src_rank) in shards:
                    shards[p.source, p.src_rank].reopen()
            whole = None if (i, 0) in self.remote else _whole_record(b, t, ps, shards)
            if whole is not None:  # a source record copied unchanged: its CRC as it is
                shard = shards[ps[0].source, ps[0].src_rank]
                [(fd, off, n)] = shard.byte_ranges(b.kind, ps[0].src_group, 0, ps[0].length)
                copy_unchanged(fd, off, n, out, base, copier, shard.path_of(fd))
                crcs.setdefault(t.buffer, []).append((t.lo, t.hi, whole))
                written += n
                unchanged += n
                bar.update(n)
                continue
            crc, pos = 0, t.lo
            for j, p in enumerate(ps):
                start = p.dst_start * ELEMENT
                crc = crc32_zeros(start - pos, crc)  # padding: the file is zeros there
                if (i, j) in self.remote:  # written by fetch_remote: its CRC as received
                    crc = crc32_combine(crc, moved.crcs.get(self.remote[i, j], 0),
                                        p.length * ELEMENT)
                else:
                    shard = shards[p.source, p.src_rank]
                    dst = base + start
                    for fd, off, n in shard.byte_ranges(b.kind, p.src_group, p.src_start,
                                                        p.length):
                        crc = copier.copy(fd, off, n, out, dst, crc, shard.path_of(fd))
                        dst += n
                written += p.length * ELEMENT
                pos = start + p.length * ELEMENT
            crc = crc32_zeros(t.hi - pos, crc)
            crcs.setdefault(t.buffer, []).append((t.lo, t.hi, crc))
            bar.update(t.hi - t.lo)
        bar.close()
        sync_close(copier, outs)
        return crcs, (written, unchanged)

    def close(self) -> None:
        self.copier.close()  # no write in flight when the descriptors close
        for fd in self.outs.values():
            os.close(fd)
        self.outs.clear()
        self.opened.release()


class _Silent:
    """No progress shown (every rank but 0, --no-progress)."""

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


_SILENT = _Silent()


def raise_error(error: Exception | None) -> None:
    if error is not None:
        raise error


def _whole_record(b: program.Buffer, t: program.Task, ps,
                  shards: dict[tuple[str, int], Shard]) -> int | None:
    """The CRC-32 of the one source record that is all of buffer b unchanged, if it is."""
    if t.lo != 0 or t.hi != b.nbytes or len(ps) != 1:
        return None
    p = ps[0]
    if p.dst_start != 0 or p.src_start != 0 or p.length * ELEMENT != b.nbytes:
        return None
    rec = shards[p.source, p.src_rank].whole_record(b.kind, p.src_group)
    return rec[0] if rec is not None and rec[1] == b.nbytes else None
