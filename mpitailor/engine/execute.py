"""The executor: runs the copy program of a merge or reshard on every MPI rank.

Collective throughout (`write_partitions` is called on every rank). Three steps:
1. Lay out: each partition's home rank builds its optimizer dict with placeholder flat
   buffers, lays out the torch zip container (`formats/torch/zip_write.py`), creates the file at its
   final size (zeros: the padding needs no write) and writes the small records; a Universal
   file (one whole parameter) is laid out the same way. The data offset of every buffer is
   shared with all ranks.
2. Copy (copystep.py): every rank fills its byte ranges of the flat buffers (program.split) at
   their final offsets, in bounded chunks: pread from the source, CRC-32, pwrite. No buffer
   larger than a chunk is ever held. Each range's CRC is shared.
3. Finish: the home rank joins the CRCs of each record in order (copyio.join_crcs), writes the
   local headers, data descriptors and central directory, fsyncs, and writes the
   partition's model-states file.
Universal files are copied straight from the sources (the pieces of program.param_pieces),
not read back from the merged partitions.
HF weights files (`write_weights`) go through the same steps: the home rank creates the file
with its header, the ranks write their cast ranges of its data (weights_copy.py), the home
joins the CRCs from the header's on and syncs it.
The output bytes depend only on the program, never on how the ranks shared it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from mpitailor import failpoints
from mpitailor.cluster.comm import Comm
from mpitailor.cluster.exchange import Exchanged
from mpitailor.cluster.nodes import Placement, shard_paths
from mpitailor.engine.copyio import join_crcs
from mpitailor.engine.copystep import Copy, Shards, output_file, raise_error
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
from mpitailor.engine.storage import create_sized, fsync_close, pwrite_all, pwrite_synced
from mpitailor.engine.weights_copy import Weights
from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.io import crc32
from mpitailor.formats.torch import Tensor, zip_write
from mpitailor.formats.zero import ELEMENT, STAGE12_MODEL, ShardStates, model_file
from mpitailor.planning import program
from mpitailor.planning.plan import MergePlan
from mpitailor.publish.staging import make_dirs_under


@dataclass
class _Laid:
    """A partition's optimizer file as its home rank laid it out."""

    name: str
    layout: zip_write.ZipLayout
    crcs: list[int | None]            # per record; None where the copy step supplies it
    flat_records: dict[int, int]      # program buffer index -> record index
    model: dict | None                # the model states, written after the optimizer file
                                      # (None: a Universal file, or a stage 1/2 partition
    model_name: str | None = None     # but the first, which share partition 0's)


def write_partitions(comm: Comm, plan: MergePlan, tag_dir: Path, verify: bool = False,
                     progress: bool = False, universal: bool = False,
                     place: Placement | None = None,
                     out_nodes: tuple[int, ...] | None = None) -> tuple[dict[str, dict], dict]:
    """Collective: write every output partition into tag_dir, fsynced (and, with
    `universal`, every parameter's files of the Universal export under tag_dir/zero/).
    Returns ({file name: manifest record} of the files this rank finished, its stats).
    verify: first check every source record read against its CRC (reads them whole).
    progress: rank 0 shows the copy's progress (engine/progress.py).
    place: which node holds which source file (nodes.survey); a rank reads only files its
    node holds, and bytes held elsewhere come over MPI (exchange.py).
    out_nodes: output partition -> the node whose disk it goes to (node-local output;
    None: every rank sees tag_dir)."""
    before = snapshot()
    bufs = program.buffers(plan, universal)
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
    mine = [p for p, r in homes.items() if r == comm.rank]
    shards = Shards(dict(plan.sources), place, comm.rank)
    try:
        return _write(comm, plan, tag_dir, verify, progress, bufs, work, mine, shards, before)
    finally:
        shards.close()


def _write(comm: Comm, plan: MergePlan, tag_dir: Path, verify: bool, progress: bool, bufs,
           work, mine, shards: Shards, before) -> tuple[dict[str, dict], dict]:
    clock = [time.perf_counter()]

    def lap() -> float:  # seconds since the last lap: where a rank's time goes, in --stats
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 4)
    rank0 = _rank0_states(comm, plan, shards) if plan.target is not None else None
    laid = comm.step(_lay_out, plan, bufs, mine, tag_dir, shards, rank0)
    t_lay_out = lap()
    offsets: dict[int, int] = {}   # buffer index -> data offset in its file
    for part in comm.allgather({b: lay.layout.entries[i].data_offset
                                for lay in laid.values() for b, i in lay.flat_records.items()}):
        offsets.update(part)
    copy = comm.step(Copy, plan, bufs, work[comm.rank], offsets, tag_dir, verify, shards)
    try:
        moved = copy.fetch_remote(comm)
        comm.step(raise_error, moved.error)
        crcs, (written, unchanged) = comm.step(copy.run, moved, _progress(progress, comm, work))
    finally:
        copy.close()
    t_copy = lap()
    records = comm.step(_finish, laid, bufs, _gathered(comm, crcs), tag_dir)
    t_finish = lap()
    # the files this rank is home for, less their flat buffers (the copiers' `written`)
    flat = {lay.name: sum(bufs[b].nbytes for b in lay.flat_records) for lay in laid.values()}
    own = sum(r["bytes"] - flat.get(name, 0) for name, r in records.items())
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


def write_weights(comm: Comm, weights: Weights, dest: Path, verify: bool = False
                  ) -> dict[str, dict]:
    """Collective: the HF weights files of `weights` in dest, fsynced, each rank writing its
    share of the copy program's cast buffers (every source read where every rank sees it);
    {file name: manifest record} of every file, on every rank (the index not included).
    verify: first check every source record read against its CRC (reads them whole)."""
    bufs = program.weights_buffers(weights.plan)
    work = program.split(bufs, comm.size)
    mine = [u for u, r in program.home_ranks(bufs, work).items() if r == comm.rank]
    files = weights.plan.files
    comm.step(_create_weights, [files[u] for u in mine], dest)
    offsets = {i: len(f.prefix) for i, f in enumerate(files)}  # data after the header
    shards = Shards(weights.metas, None, comm.rank)
    try:
        copy = comm.step(Copy, None, bufs, work[comm.rank], offsets, dest, verify, shards,
                         weights)
        try:
            crcs, _ = comm.step(copy.run, Exchanged({}), None)
        finally:
            copy.close()
    finally:
        shards.close()
    records = comm.step(_finish_weights, {u: files[u] for u in mine}, _gathered(comm, crcs),
                        dest)
    return {name: rec for part in comm.allgather(records) for name, rec in part.items()}


def _create_weights(files, dest: Path) -> None:
    """Home ranks: each file at its full size, its header written and synced."""
    fds = {}
    try:
        for f in files:
            fds[f.name] = create_sized(dest / f.name, f.size, f.prefix)
    finally:
        fsync_close(fds)


def _finish_weights(files: dict, joined: dict[int, list[tuple[int, int, int]]],
                    dest: Path) -> dict[str, dict]:
    """Home ranks: each file's CRC joined from its header's (synced when created; every rank
    synced the data it wrote); {file name: manifest record}."""
    records = {}
    for u, f in files.items():
        ranges = [(len(f.prefix) + first, n, c) for first, n, c in joined.get(u, [])]
        crc = _join(ranges, f.size, f.name, crc32(f.prefix), len(f.prefix))
        records[f.name] = {"bytes": f.size, "crc32": f"{crc:08x}"}
    return records


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


def _lay_out(plan: MergePlan, bufs, mine: list[int], tag_dir: Path, shards: Shards,
             rank0_states: tuple[ShardStates, dict] | None) -> dict[int, _Laid]:
    """Home ranks: create the files of the units `mine`, their small records written."""
    out = {}
    first = {}  # unit -> its first buffer
    for i, b in enumerate(bufs):
        first.setdefault(b.unit, i)
    for u in mine:
        b = bufs[first[u]]
        if not program.is_partition(b):
            flats = {(b.kind, -1): Tensor.empty(b.nbytes // ELEMENT, "fp32")}
            make_dirs_under(tag_dir, tag_dir / "zero" / b.param)
            out[u] = _lay_out_one(bufs, u, tag_dir / output_file(plan, b), flats,
                                  flats[b.kind, -1], None, universal=True)
    mine = [u for u in mine if program.is_partition(bufs[first[u]])]
    if plan.target is not None and mine:  # what every partition of a reshard starts from
        base0, rank0 = rank0_states or (shards.get(plan.base, 0).states(),
                                        rank0_model_states(plan))
        for p in mine:
            flats = placeholders(plan.target.layout, p)
            model = resharded_model_states(plan, p, base0, rank0) \
                if _has_model_states(plan, p) else None
            out[p] = _lay_out_one(bufs, p, tag_dir / output_file(plan, bufs[first[p]]), flats,
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
        out[p] = _lay_out_one(bufs, p, tag_dir / output_file(plan, bufs[first[p]]), flats,
                              merged_optim(plan, models[plan.base], flats), model,
                              _model_name(plan, p))
        shards.release()
    return out


def _has_model_states(plan: MergePlan, p: int) -> bool:
    """Stage 3 writes model states per partition; stages 1/2 one file, with partition 0."""
    return p == 0 or not plan.base_meta.layout.flat


def _model_name(plan: MergePlan, p: int) -> str:
    return STAGE12_MODEL if plan.base_meta.layout.flat else model_file(p)


def _lay_out_one(bufs, unit: int, path: Path, flats: dict, obj, model: dict | None,
                 model_name: str | None = None, universal: bool = False) -> _Laid:
    """Lay out the torch file of `obj` (holding the placeholders `flats` of unit's buffers),
    create it at path, write its small records; `model`: the model states written after it
    (stage 3: every partition's; stage 1/2: partition 0's, for all)."""
    tf = zip_write.describe(obj)
    layout = tf.layout()
    # Placeholders are found by their storage; empty ones (no bytes to copy) are written
    # like any small record.
    by_storage = {id(t.storage): key for key, t in flats.items() if t.numel()}
    index = {(b.kind, b.subgroup): i for i, b in enumerate(bufs) if b.unit == unit}
    crcs: list[int | None] = [None] * len(tf.records)
    flat_records = {}
    fd = create_sized(path, layout.size)
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
    name = f"zero/{path.parent.name}/{path.name}" if universal else path.name
    return _Laid(name, layout, crcs, flat_records, model, model_name)


def _finish(laid: dict[int, _Laid], bufs, joined: dict[int, list[tuple[int, int, int]]],
            tag_dir: Path) -> dict[str, dict]:
    """Home ranks: headers and central directory of each optimizer file, then its model
    states; {file name: manifest record}."""
    records = {}
    for lay in laid.values():
        crcs = list(lay.crcs)
        for b, i in lay.flat_records.items():
            crcs[i] = _join(joined.get(b, []), bufs[b].nbytes, lay.name)
        pwrite_synced(tag_dir / lay.name, lay.layout.pieces(crcs))
        records[lay.name] = {"bytes": lay.layout.size, "crc32": f"{lay.layout.file_crc(crcs):08x}"}
        if lay.name.startswith("zero/"):  # a Universal file
            failpoints.hit("export")
            continue
        failpoints.hit("write")
        if lay.model is None:  # stage 1/2: partition 0 writes the model states
            continue
        name = lay.model_name
        records[name] = zip_write.write_torch_file(tag_dir / name, lay.model)
    return records


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
