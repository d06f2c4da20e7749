"""The executor: runs the copy program of a merge or reshard on every MPI rank.

Collective throughout (`write_partitions` is called on every rank). Three steps:
1. Lay out: each partition's home rank builds its optimizer dict with placeholder flat
   buffers, lays out the torch zip container (`zero3/ptzip.py`), creates the file at its
   final size (zeros: the padding needs no write) and writes the small records; a Universal
   file (one whole parameter) is laid out the same way. The data offset of every buffer is
   shared with all ranks.
2. Copy: every rank fills its byte ranges of the flat buffers (program.split) straight at
   their final offsets, in bounded chunks: pread from the source, CRC-32, pwrite. No buffer
   larger than a chunk is ever held. Each range's CRC is shared.
3. Finish: the home rank joins the CRCs of each record in order (crc32_combine), writes the
   local headers, data descriptors and central directory, fsyncs, and writes the
   partition's model-states file.
Universal files are copied straight from the sources (the pieces of program.param_pieces),
not read back from the merged partitions.
The output bytes depend only on the program, never on how the ranks shared it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mpitailor import failpoints, program
from mpitailor.comm import Comm
from mpitailor.copyio import Copier, copy_unchanged, pwrite_all, sync_close
from mpitailor.crc import crc32, crc32_combine, crc32_zeros
from mpitailor.iostats import snapshot
from mpitailor.partition_states import (merged_model_states, merged_optim, placeholders,
                                        rank0_model_states, resharded_model_states,
                                        resharded_optim)
from mpitailor.plan import MergePlan
from mpitailor.zero3 import opaque, ptzip
from mpitailor.zero3.files import model_file, optim_file
from mpitailor.zero3.shard import open_shard

@dataclass
class _Laid:
    """A partition's optimizer file as its home rank laid it out."""

    name: str
    layout: ptzip.Layout
    crcs: list[int | None]            # per record; None where the copy step supplies it
    flat_records: dict[int, int]      # program buffer index -> record index
    model: dict | None                # the model states, written after the optimizer file
                                      # (None: a Universal file)


def write_partitions(comm: Comm, plan: MergePlan, tag_dir: Path, verify: bool = False,
                     progress: bool = False,
                     universal: bool = False) -> tuple[dict[str, dict], dict]:
    """Collective: write every output partition into tag_dir, fsynced (and, with
    `universal`, every parameter's files of the Universal export under tag_dir/zero/).
    Returns ({file name: manifest record} of the files this rank finished, its stats).
    verify: first check every source record read against its CRC (reads them whole).
    progress: a progress bar of rank 0's bytes."""
    before = snapshot()
    bufs = program.buffers(plan, universal)
    work = program.split(bufs, comm.size)
    homes = program.home_ranks(bufs, work)
    mine = [p for p, r in homes.items() if r == comm.rank]
    shards = _Shards(plan)
    try:
        return _write(comm, plan, tag_dir, verify, progress, bufs, work, mine, shards, before)
    finally:
        shards.close()


def _write(comm: Comm, plan: MergePlan, tag_dir: Path, verify: bool, progress: bool, bufs,
           work, mine, shards: _Shards, before) -> tuple[dict[str, dict], dict]:
    clock = [time.perf_counter()]

    def lap() -> float:  # seconds since the last lap: where a rank's time goes, in --stats
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 4)
    laid = comm.step(_lay_out, plan, bufs, mine, tag_dir, shards)
    t_lay_out = lap()
    offsets: dict[int, int] = {}   # buffer index -> data offset in its file
    for part in comm.allgather({b: lay.layout.entries[i].data_offset
                                for lay in laid.values() for b, i in lay.flat_records.items()}):
        offsets.update(part)
    crcs, (written, unchanged) = comm.step(_copy, plan, bufs, work[comm.rank], offsets,
                                           tag_dir, verify, progress and comm.rank == 0, shards)
    t_copy = lap()
    joined: dict[int, list[tuple[int, int, int]]] = {}
    for part in comm.allgather(crcs):
        for b, pieces in part.items():
            joined.setdefault(b, []).extend(pieces)
    records = comm.step(_finish, laid, bufs, joined, tag_dir)
    t_finish = lap()
    stats = {"seconds": {"lay_out": t_lay_out, "copy": t_copy, "finish": t_finish},"partitions": sorted({b.unit for t in work[comm.rank]
                                   if program.is_partition(b := bufs[t.buffer])}),
             "homes": mine, "bytes_written": written + sum(r["bytes"] for r in records.values()),
             "bytes_copied_unchanged": unchanged,
             **snapshot().since(before)}
    return records, stats


class _Shards:
    """The source shards this rank opened, by (source, rank): each parsed once per merge
    (home and copier of a partition are often the same rank); descriptors closed between
    partitions and reopened when needed, so that few are open at a time."""

    def __init__(self, plan: MergePlan) -> None:
        self.plan, self.open = plan, {}

    def get(self, source: str, rank: int):
        if (source, rank) not in self.open:
            self.open[source, rank] = open_shard(self.plan.meta(source), rank)
        shard = self.open[source, rank]
        shard.reopen()
        return shard

    def release(self) -> None:
        """Close every descriptor; the parsed shards stay."""
        for s in self.open.values():
            s.close()

    close = release


def _lay_out(plan: MergePlan, bufs, mine: list[int], tag_dir: Path,
             shards: _Shards) -> dict[int, _Laid]:
    """Home ranks: create the files of the units `mine`, their small records written."""
    out = {}
    first = {}  # unit -> its first buffer
    for i, b in enumerate(bufs):
        first.setdefault(b.unit, i)
    for u in mine:
        b = bufs[first[u]]
        if not program.is_partition(b):
            flats = {(b.kind, -1): torch.empty(b.nbytes // 4, dtype=torch.float32)}
            (tag_dir / "zero" / b.param).mkdir(parents=True, exist_ok=True)
            out[u] = _lay_out_one(bufs, u, tag_dir / _file(plan, b), flats,
                                  flats[b.kind, -1], None)
    mine = [u for u in mine if program.is_partition(bufs[first[u]])]
    if plan.target is not None and mine:  # what every partition of a reshard starts from
        base0 = shards.get(plan.base, 0)
        rank0 = rank0_model_states(plan)
        for p in mine:
            flats = placeholders(plan.target.layout.subgroup_sizes)
            out[p] = _lay_out_one(bufs, p, tag_dir / _file(plan, bufs[first[p]]), flats,
                                  resharded_optim(plan, base0, flats),
                                  resharded_model_states(plan, p, base0, rank0))
        shards.release()
        return out
    for p in mine:
        flats = placeholders(plan.base_meta.layout.subgroup_sizes)
        models = {name: shards.get(name, p) for name, _ in plan.sources}
        out[p] = _lay_out_one(bufs, p, tag_dir / _file(plan, bufs[first[p]]), flats,
                              merged_optim(plan, models[plan.base], flats),
                              merged_model_states(plan, models))
        shards.release()
    return out


def _lay_out_one(bufs, unit: int, path: Path, flats: dict, obj, model: dict | None) -> _Laid:
    """Lay out the torch file of `obj` (holding the placeholders `flats` of unit's buffers),
    create it at path, write its small records."""
    kwargs = {"pickle_module": opaque.pickle_module} if opaque.holds_opaque(obj) else {}
    tf = ptzip.describe(obj, **kwargs)
    layout = tf.layout()
    # Placeholders are found by their memory; empty ones (no bytes to copy, no memory to
    # tell them apart) are written like any small record.
    by_ptr = {t.untyped_storage().data_ptr(): key for key, t in flats.items() if t.numel()}
    index = {(b.kind, b.subgroup): i for i, b in enumerate(bufs) if b.unit == unit}
    crcs: list[int | None] = [None] * len(tf.records)
    flat_records = {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, layout.size)
        for i, rec in enumerate(tf.records):
            key = by_ptr.get(rec.storage.data_ptr()) if rec.storage is not None else None
            if key is not None:
                flat_records[index[key]] = i
                continue
            data = rec.data if rec.storage is None else ptzip.storage_bytes(rec.storage)
            pwrite_all(fd, data, layout.entries[i].data_offset)
            crcs[i] = crc32(data)
    finally:
        os.close(fd)
    return _Laid(path.name if model is not None else f"zero/{path.parent.name}/{path.name}",
                 layout, crcs, flat_records, model)


def _file(plan: MergePlan, b: program.Buffer) -> str:
    """The output file of buffer b, relative to the tag dir."""
    if program.is_partition(b):
        return optim_file(b.unit, plan.base_meta.files.bf16_prefix)
    return f"zero/{b.param}/{b.kind}.pt"


def _copy(plan: MergePlan, bufs, tasks: list[program.Task], offsets: dict[int, int],
          tag_dir: Path, verify: bool, progress: bool,
          opened: _Shards) -> tuple[dict[int, list[tuple[int, int, int]]], int]:
    """This rank's byte ranges: ({buffer: [(lo, hi, crc)]}, (bytes copied, of which whole
    source records copied unchanged))."""
    from tqdm import tqdm
    pieces_of: dict[int, dict] = {}
    shards: dict[tuple[str, int], object] = {}  # those this rank's tasks read
    outs: dict[str, int] = {}
    copier = Copier()
    crcs: dict[int, list[tuple[int, int, int]]] = {}
    written = unchanged = 0
    try:
        plans = []
        for t in tasks:
            b = bufs[t.buffer]
            if b.unit not in pieces_of:
                pieces_of[b.unit] = program.pieces(plan, b.unit) if program.is_partition(b) \
                    else {-1: program.param_pieces(plan, b.param)}
            ps = program.clip(pieces_of[b.unit].get(b.subgroup, []), t.lo // 4, t.hi // 4)
            for p in ps:
                if (p.source, p.src_rank) not in shards:
                    shards[p.source, p.src_rank] = opened.get(p.source, p.src_rank)
            plans.append((t, b, ps))
        if verify:
            _verify(shards, plans)
        failpoints.hit("read")
        opened.release()  # reopened partition by partition below: few descriptors at a time
        unit = None
        bar = tqdm(total=sum(t.hi - t.lo for t in tasks), unit="B", unit_scale=True,
                   desc="rank 0 copies", disable=not progress or None, leave=False)
        for t, b, ps in plans:
            if b.unit != unit:  # the previous unit's files are done: sync and close them
                sync_close(copier, outs)
                opened.release()
                unit = b.unit
            for p in ps:
                shards[p.source, p.src_rank].reopen()
            name = _file(plan, b)
            if name not in outs:
                outs[name] = os.open(tag_dir / name, os.O_WRONLY)
            base = offsets[t.buffer]  # file offset of the buffer's byte 0
            whole = _whole_record(b, t, ps, shards)
            if whole is not None:  # a source record copied unchanged: its CRC as it is
                shard = shards[ps[0].source, ps[0].src_rank]
                [(fd, off, n)] = shard.byte_ranges(b.kind, ps[0].src_group, 0, ps[0].length)
                copy_unchanged(fd, off, n, outs[name], base, copier, shard.path_of(fd))
                crcs.setdefault(t.buffer, []).append((t.lo, t.hi, whole))
                written += n
                unchanged += n
                bar.update(n)
                continue
            crc, pos = 0, t.lo
            for p in ps:
                start = p.dst_start * 4
                crc = crc32_zeros(start - pos, crc)  # padding: the file is zeros there
                shard = shards[p.source, p.src_rank]
                dst = base + start
                for fd, off, n in shard.byte_ranges(b.kind, p.src_group, p.src_start, p.length):
                    crc = copier.copy(fd, off, n, outs[name], dst, crc, shard.path_of(fd))
                    dst += n
                written += p.length * 4
                pos = start + p.length * 4
            crc = crc32_zeros(t.hi - pos, crc)
            crcs.setdefault(t.buffer, []).append((t.lo, t.hi, crc))
            bar.update(t.hi - t.lo)
        bar.close()
        sync_close(copier, outs)
    finally:
        copier.close()  # no write in flight when the descriptors close
        for fd in outs.values():
            os.close(fd)
        opened.release()
    return crcs, (written, unchanged)


def _whole_record(b: program.Buffer, t: program.Task, ps, shards) -> int | None:
    """The CRC-32 of the one source record that is all of buffer b unchanged, if it is."""
    if t.lo != 0 or t.hi != b.nbytes or len(ps) != 1:
        return None
    p = ps[0]
    if p.dst_start != 0 or p.src_start != 0 or p.length * 4 != b.nbytes:
        return None
    rec = shards[p.source, p.src_rank].whole_record(b.kind, p.src_group)
    return rec[0] if rec is not None and rec[1] == b.nbytes else None


def _verify(shards: dict, plans) -> None:
    used: dict[tuple[str, int], set] = {}
    for _, b, ps in plans:
        for p in ps:
            used.setdefault((p.source, p.src_rank), set()).add((b.kind, p.src_group))
    for key, kinds in used.items():
        if not shards[key].meta.files.partial:
            shards[key].verify(kinds)


def _finish(laid: dict[int, _Laid], bufs, joined: dict[int, list[tuple[int, int, int]]],
            tag_dir: Path) -> dict[str, dict]:
    """Home ranks: headers and central directory of each optimizer file, then its model
    states; {file name: manifest record}."""
    records = {}
    for p, lay in laid.items():
        crcs = list(lay.crcs)
        for b, i in lay.flat_records.items():
            crcs[i] = _join(joined.get(b, []), bufs[b].nbytes, lay.name)
        fd = os.open(tag_dir / lay.name, os.O_WRONLY)
        try:
            for offset, data in lay.layout.pieces(crcs):
                pwrite_all(fd, data, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        records[lay.name] = {"bytes": lay.layout.size, "crc32": f"{lay.layout.file_crc(crcs):08x}"}
        if lay.model is None:  # a Universal file
            failpoints.hit("export")
            continue
        failpoints.hit("write")
        name = model_file(p)
        kwargs = {"pickle_module": opaque.pickle_module} if opaque.holds_opaque(lay.model) else {}
        records[name] = ptzip.write_torch_file(tag_dir / name, lay.model, **kwargs)
    return records


def _join(pieces: list[tuple[int, int, int]], nbytes: int, name: str) -> int:
    """CRC-32 of a whole buffer from the CRCs of its ranges (which must tile it)."""
    crc, pos = 0, 0
    for lo, hi, c in sorted(pieces):
        if lo != pos:
            raise RuntimeError(f"internal error: {name}: bytes {pos}-{lo} of a buffer unwritten")
        crc, pos = crc32_combine(crc, c, hi - lo), hi
    if pos != nbytes:
        raise RuntimeError(f"internal error: {name}: a buffer ends at {pos}, not {nbytes}")
    return crc
