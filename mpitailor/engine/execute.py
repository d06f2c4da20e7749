"""The executor: runs a copy program (planning/program.py) on every MPI rank.

Collective throughout. One driver (`_run`) for every program, whatever its buffers: the
output partitions of a merge or reshard, the Universal files of its export, the HF weights
files of an export or of a merge's `--export hf` and 16-bit rebuild (one program: the
partitions and the weights are written in one pass, each source shard read once). Three steps:
1. Lay out: each unit's home rank creates its file at its final size (zeros: the padding
   needs no write) and writes what only it computes. A partition's optimizer file (and a
   Universal file) is a torch zip laid out around placeholder flat buffers
   (`formats/torch/zip_write.py`), its small records written; an HF weights file is its
   safetensors header. The data offset of every buffer is shared with all ranks.
2. Copy (copystep.py): every rank fills its byte ranges of the buffers (program.split) at
   their final offsets, in bounded chunks, each buffer kind by its own fill: a flat or
   Universal buffer by piece copies (pread from the source, CRC-32, pwrite), an HF weights
   buffer by casts (weights_copy.py). No buffer larger than a chunk is ever held. Each
   range's CRC is shared.
3. Finish: the home rank joins the CRCs of each record in order (copyio.join_crcs); an
   optimizer file gets its local headers, data descriptors and central directory and its
   partition's model-states file; every file is fsynced.
Universal files and HF weights are made straight from the sources (the pieces of
program.param_pieces, the cast runs of weights_copy), never read back from the output.
The output bytes depend only on the program, never on how the ranks shared it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from mpitailor import failpoints
from mpitailor.cluster.comm import Comm
from mpitailor.cluster.nodes import Placement, shard_paths
from mpitailor.engine.copyio import join_crcs
from mpitailor.engine.copystep import Copy, Program, Shards, output_file, raise_error
from mpitailor.engine.iostats import snapshot
from mpitailor.engine.partition_states import (
    merged_model_states,
    merged_optim,
    placeholders,
    rank0_model_states,
    resharded_model_states,
    resharded_optim,
)
from mpitailor.engine.progress import Progress
from mpitailor.engine.weights_copy import Weights
from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.io import (
    crc32,
    create_sized,
    fsync_close,
    pwrite_all,
    pwrite_synced,
)
from mpitailor.formats.torch import Tensor, zip_write
from mpitailor.formats.zero import ELEMENT, STAGE12_MODEL, ShardStates, model_file
from mpitailor.planning import program
from mpitailor.planning.hf_layout import OutFile
from mpitailor.planning.plan import MergePlan
from mpitailor.publish.staging import make_dirs_under


@dataclass
class _Laid:
    """A torch file (a partition's optimizer file, a Universal file) as its home rank laid
    it out."""

    name: str                         # under the output dir
    layout: zip_write.ZipLayout
    crcs: list[int | None]            # per record; None where the copy step supplies it
    flat_records: dict[int, int]      # program buffer index -> record index
    model: dict | None                # the model states, written after the optimizer file
                                      # (None: a Universal file, or a stage 1/2 partition
    model_name: str | None = None     # but the first, which share partition 0's)
    universal: bool = False

    def offsets(self) -> dict[int, int]:
        return {b: self.layout.entries[i].data_offset for b, i in self.flat_records.items()}

    def finish(self, bufs, joined: dict[int, list[tuple[int, int, int]]],
               root: Path) -> dict[str, dict]:
        """Headers and central directory, synced; then the partition's model states."""
        crcs = list(self.crcs)
        for b, i in self.flat_records.items():
            crcs[i] = _join(joined.get(b, []), bufs[b].nbytes, self.name)
        pwrite_synced(root / self.name, self.layout.pieces(crcs))
        records = {self.name: {"bytes": self.layout.size,
                               "crc32": f"{self.layout.file_crc(crcs):08x}"}}
        if self.universal:
            failpoints.hit("export")
            return records
        failpoints.hit("write")
        if self.model is not None:  # stage 1/2: partition 0 writes the model states
            records[self.model_name] = zip_write.write_torch_file(root / self.model_name,
                                                                  self.model)
        return records


@dataclass
class _LaidWeights:
    """An HF weights file created by its home rank: its header written and synced."""

    name: str                         # under the output dir
    file: OutFile
    buffer: int                       # its data's buffer

    def offsets(self) -> dict[int, int]:
        return {self.buffer: len(self.file.prefix)}

    def finish(self, bufs, joined: dict[int, list[tuple[int, int, int]]],
               root: Path) -> dict[str, dict]:
        """The file's CRC, joined from its header's (every rank synced the data it wrote)."""
        f, at = self.file, len(self.file.prefix)
        ranges = [(at + first, n, c) for first, n, c in joined.get(self.buffer, [])]
        crc = _join(ranges, f.size, self.name, crc32(f.prefix), at)
        return {self.name: {"bytes": f.size, "crc32": f"{crc:08x}"}}


def write_partitions(comm: Comm, plan: MergePlan, root: Path, verify: bool = False,
                     progress: bool = False, universal: bool = False,
                     place: Placement | None = None,
                     out_nodes: tuple[int, ...] | None = None,
                     weights: Weights | None = None) -> tuple[dict[str, dict], dict]:
    """Collective: write every output partition into root/TAG, fsynced (with `universal`,
    every parameter's files of the Universal export under root/TAG/zero/; with `weights`,
    the HF weights files under root, their folders there made). Returns ({file name under
    root: manifest record} of the files this rank finished, its stats).
    verify: first check every source record read against its CRC (reads them whole).
    progress: rank 0 shows the copy's progress (engine/progress.py).
    place: which node holds which source file (nodes.survey); a rank reads only files its
    node holds, and bytes held elsewhere come over MPI (exchange.py).
    out_nodes: output partition -> the node whose disk it goes to (node-local output;
    None: every rank sees root). weights: only where every rank sees root and the sources."""
    bufs = program.buffers(plan, universal)
    if weights is not None:
        if out_nodes is not None or (place is not None and place.node_local):
            raise RuntimeError("internal error: HF weights in a node-local program")
        bufs += weights.buffers(first_unit=bufs[-1].unit + 1)
    if out_nodes is None:
        work = program.split(bufs, comm.size)
        homes = program.home_ranks(bufs, work)
    else:
        nodes = place.nodes
        # a partition on its node; the Universal files (a merge with exports) on the first
        # node, which makes the exports and copies them to the others (replicate.py)
        node_of = {b.unit: out_nodes[b.unit] if program.is_partition(b) else 0 for b in bufs}
        work = program.split_by_node(bufs, node_of, [nodes.ranks(n) for n in
                                                     range(len(nodes.names))], comm.size)
        homes = program.home_ranks(bufs, work, {u: nodes.leader(n) for u, n in node_of.items()})
    prog = Program(bufs, plan, weights, root)
    shards = Shards(dict(plan.sources), place, comm.rank)
    try:
        return _run(comm, prog, work, homes, shards, verify, progress)
    finally:
        shards.close()


def write_weights(comm: Comm, weights: Weights, dest: Path, verify: bool = False
                  ) -> dict[str, dict]:
    """Collective: the HF weights files of `weights` in dest, fsynced, each rank writing its
    share of the copy program's cast buffers (every source read where every rank sees it);
    {file name: manifest record} of every file, on every rank (the index not included).
    verify: first check every source record read against its CRC (reads them whole)."""
    bufs = weights.buffers()
    work = program.split(bufs, comm.size)
    shards = Shards(weights.metas, None, comm.rank)
    try:
        records, _ = _run(comm, Program(bufs, None, weights, dest), work,
                          program.home_ranks(bufs, work), shards, verify, False)
    finally:
        shards.close()
    return {name: rec for part in comm.allgather(records) for name, rec in part.items()}


def _run(comm: Comm, prog: Program, work, homes: dict[int, int], shards: Shards,
         verify: bool, progress: bool) -> tuple[dict[str, dict], dict]:
    """The driver: lay out, copy, finish. ({file under prog.root: record} of the files this
    rank is home for, its stats)."""
    before = snapshot()
    clock = [time.perf_counter()]

    def lap() -> float:  # seconds since the last lap: where a rank's time goes, in --stats
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 4)
    bufs, plan = prog.bufs, prog.plan
    mine = [u for u, r in homes.items() if r == comm.rank]
    rank0 = _rank0_states(comm, plan, shards) \
        if plan is not None and plan.target is not None else None
    laid = comm.step(_lay_out, prog, mine, shards, rank0)
    t_lay_out = lap()
    offsets: dict[int, int] = {}   # buffer index -> data offset in its file
    for part in comm.allgather({b: at for lay in laid.values()
                                for b, at in lay.offsets().items()}):
        offsets.update(part)
    copy = comm.step(Copy, prog, work[comm.rank], offsets, verify, shards)
    try:
        moved = copy.fetch_remote(comm)
        comm.step(raise_error, moved.error)
        crcs, (written, unchanged) = comm.step(copy.run, moved, _progress(progress, comm, work))
    finally:
        copy.close()
    t_copy = lap()
    joined = _gathered(comm, crcs)
    records = comm.step(lambda: {name: rec for lay in laid.values()
                                 for name, rec in lay.finish(bufs, joined, prog.root).items()})
    t_finish = lap()
    # the files this rank is home for, less their buffers (the copiers' `written`)
    copied = {lay.name: sum(bufs[b].nbytes for b in lay.offsets()) for lay in laid.values()}
    own = sum(r["bytes"] - copied.get(name, 0) for name, r in records.items())
    stats = {"seconds": {"lay_out": t_lay_out, "copy": t_copy, "finish": t_finish},
             "partitions": sorted({b.unit for t in work[comm.rank]
                                   if program.is_partition(b := bufs[t.buffer])}),
             "homes": mine, "bytes_written": written + own,
             "bytes_copied_unchanged": unchanged,
             # what crossed a node boundary, and what this rank read from its node's files
             "bytes_mpi_sent": moved.bytes_sent, "bytes_mpi_received": moved.bytes_received,
             "bytes_read_files": written - moved.bytes_received + moved.bytes_sent,
             "shards_read": sorted(f"{s}:{r}" for s, r in shards.used),
             **snapshot().since(before)}
    return records, stats


def _progress(wanted: bool, comm: Comm, work) -> Progress | None:
    """Rank 0's progress of the copy: its share of every rank's bytes (`work`, the same
    split on every rank)."""
    if not wanted or comm.rank != 0:
        return None
    share = [sum(t.hi - t.lo for t in tasks) for tasks in work]
    return Progress(share[0], sum(share), comm.size)


def _rank0_states(comm: Comm, plan: MergePlan,
                  shards: Shards) -> tuple[ShardStates, dict] | None:
    """A reshard starts every output partition from the sources' rank-0 states. Under
    node-local storage they are read on a node that holds them and sent to every rank:
    (the base's rank-0 shard's states, every source's rank-0 model states). None: every
    rank reads them itself."""
    if shards.place is None:
        return None
    if plan.frozen_source:
        raise UserError("resharding a checkpoint with frozen parameters from node-local "
                        "storage is not supported; merge at the same world size, or copy "
                        "the checkpoint to a shared file system first")
    holder = shards.place.reader([p for name, _ in plan.sources
                                  for p in shard_paths(plan.meta(name), 0)])

    def read() -> tuple:
        base0 = shards.get(plan.base, 0)
        for name, _ in plan.sources:
            shards.get(name, 0)
        states = (base0.states(), rank0_model_states(plan))
        shards.release()
        return states
    return comm.step_on(holder, read)


def _lay_out(prog: Program, mine: list[int], shards: Shards,
             rank0_states: tuple[ShardStates, dict] | None) -> dict[int, _Laid | _LaidWeights]:
    """Home ranks: create the files of the units `mine`, what only they compute written."""
    out: dict[int, _Laid | _LaidWeights] = {}
    first = {}  # unit -> its first buffer
    for i, b in enumerate(prog.bufs):
        first.setdefault(b.unit, i)
    plan, bufs, root = prog.plan, prog.bufs, prog.root
    if prog.weights is not None:
        files = prog.weights.files
        fds = {}
        try:
            for u in mine:
                b = bufs[first[u]]
                if b.kind == program.WEIGHTS:
                    f = files[b.param][1]
                    fds[b.param] = create_sized(root / b.param, f.size, f.prefix)
                    out[u] = _LaidWeights(b.param, f, first[u])
        finally:
            fsync_close(fds)
    for u in mine:
        b = bufs[first[u]]
        if b.kind != program.WEIGHTS and not program.is_partition(b):
            name = output_file(prog, b)
            flats = {(b.kind, -1): Tensor.empty(b.nbytes // ELEMENT, "fp32")}
            make_dirs_under(root / _tag(plan), (root / name).parent)
            out[u] = _lay_out_one(bufs, u, root, name, flats, flats[b.kind, -1], None,
                                  universal=True)
    mine = [u for u in mine if program.is_partition(bufs[first[u]])]
    if plan is not None and plan.target is not None and mine:
        # what every partition of a reshard starts from
        base0, rank0 = rank0_states or (shards.get(plan.base, 0).states(),
                                        rank0_model_states(plan))
        for p in mine:
            flats = placeholders(plan.target.layout, p)
            model = resharded_model_states(plan, p, base0, rank0) \
                if _has_model_states(plan, p) else None
            out[p] = _lay_out_one(bufs, p, root, output_file(prog, bufs[first[p]]), flats,
                                  resharded_optim(plan, base0, flats, p), model,
                                  _model_name(plan, p))
        shards.release()
        return out
    for p in mine:
        flats = placeholders(plan.base_meta.layout, p)
        for name, _ in plan.sources:
            if not shards.local(name, p):
                raise CheckpointError(
                    f"{plan.meta(name).files.optim_path(p)}: not on node "
                    f"{shards.place.nodes.names[shards.node]}, which writes partition {p}; "
                    f"merge in place with the layout the checkpoint was saved with (the "
                    f"same ranks per node), or pass --ranks-per-node")
        models = {name: shards.get(name, p) for name, _ in plan.sources}
        model = merged_model_states(plan, models) if _has_model_states(plan, p) else None
        out[p] = _lay_out_one(bufs, p, root, output_file(prog, bufs[first[p]]), flats,
                              merged_optim(plan, models[plan.base], flats), model,
                              _model_name(plan, p))
        shards.release()
    return out


def _tag(plan: MergePlan) -> str:
    return plan.base_meta.files.tag


def _has_model_states(plan: MergePlan, p: int) -> bool:
    """Stage 3 writes model states per partition; stages 1/2 one file, with partition 0."""
    return p == 0 or not plan.base_meta.layout.flat


def _model_name(plan: MergePlan, p: int) -> str:
    return f"{_tag(plan)}/{STAGE12_MODEL if plan.base_meta.layout.flat else model_file(p)}"


def _lay_out_one(bufs, unit: int, root: Path, name: str, flats: dict, obj,
                 model: dict | None, model_name: str | None = None,
                 universal: bool = False) -> _Laid:
    """Lay out the torch file of `obj` (holding the placeholders `flats` of unit's buffers),
    create it at root/name, write its small records; `model`: the model states written
    after it (stage 3: every partition's; stage 1/2: partition 0's, for all)."""
    tf = zip_write.describe(obj)
    layout = tf.layout()
    # Placeholders are found by their storage; empty ones (no bytes to copy) are written
    # like any small record.
    by_storage = {id(t.storage): key for key, t in flats.items() if t.numel()}
    index = {(b.kind, b.subgroup): i for i, b in enumerate(bufs) if b.unit == unit}
    crcs: list[int | None] = [None] * len(tf.records)
    flat_records = {}
    fd = create_sized(root / name, layout.size)
    try:
        for i, rec in enumerate(tf.records):
            key = by_storage.get(id(rec.storage)) if rec.storage is not None else None
            if key is not None:
                flat_records[index[key]] = i
                continue
            data = rec.data if rec.storage is None else rec.storage.read()
            pwrite_all(fd, data, layout.entries[i].data_offset)
            crcs[i] = crc32(data)
    finally:
        os.close(fd)
    return _Laid(name, layout, crcs, flat_records, model, model_name, universal)


def _gathered(comm: Comm, crcs: dict[int, list[tuple[int, int, int]]]
              ) -> dict[int, list[tuple[int, int, int]]]:
    """Collective: every rank's CRCs of its ranges [lo, hi) of each buffer, as buffer ->
    [(first byte, bytes, CRC-32)] (what join_crcs takes)."""
    joined: dict[int, list[tuple[int, int, int]]] = {}
    for part in comm.allgather(crcs):
        for b, ranges in part.items():
            joined.setdefault(b, []).extend((lo, hi - lo, c) for lo, hi, c in ranges)
    return joined


def _join(ranges: list[tuple[int, int, int]], nbytes: int, name: str, crc: int = 0,
          pos: int = 0) -> int:
    """CRC-32 of a whole buffer from `crc` (of its bytes [0, pos)) and the CRCs of its
    ranges (first byte, bytes, CRC), which must tile the rest."""
    crc, end = join_crcs(ranges, crc, pos)
    if end != nbytes:
        raise RuntimeError(f"internal error: {name}: bytes from {end} on written by no rank "
                           f"(a bug in the work split)")
    return crc
