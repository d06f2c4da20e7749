"""The copy program of a merge or reshard (and its Universal export): what every byte of
every output flat buffer is made of, and which MPI rank makes it. Pure: no torch, no MPI,
no I/O. ZeRO stages 1/2 (flat layouts) and 3 alike: the layout says where elements lie.

An output partition's optimizer file holds three fp32 flat buffers per sub-group (fp32
master, exp_avg, exp_avg_sq; one layout). Each buffer is a sequence of `Piece`s, element runs
copied from a source rank's buffer of the same kind, with zeros where nothing is copied (the
padding a reshard recomputes). A merge is the case where the output layout is the sources'
(piece = a run of the plan, same rank, same place); a reshard maps the elements of each
parameter to their source ranks (`reshard.pieces_for`). With the Universal export, every
parameter's whole fp32 / exp_avg / exp_avg_sq is one more buffer (its own file), made of the
slices its source's ranks hold (`param_pieces`). An HF weights file (safetensors: the
`export --format hf|fp32`, a merge's `--export`, the base's 16-bit weights rebuilt) is one
buffer too, cast: its data, after the header, is the fp32 elements of its tensors (the
master weights, a frozen parameter's fragments) written in the file's dtype
(`weights_buffers`, hf_layout.py's plan). Everything else in the files (pickled metadata,
small tensors, container headers) is small and computed by the file's home rank.

Work is the concatenation of every output buffer's bytes, partition by partition, cut into
one contiguous range per MPI rank, balanced by bytes. With fewer ranks than partitions a
rank's range covers whole consecutive partitions (at most two shared with a neighbour), so a
rank reads the source files of a block of consecutive partitions: the same block of training
ranks whose files a node keeps under node-local storage when Slurm places consecutive ranks
on a node. With more ranks than partitions, partitions are split and several ranks write
one file: every rank is busy for any rank count, a world-size-1 checkpoint included.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpitailor.formats.zero import ELEMENT, KINDS
from mpitailor.planning.hf_layout import WeightsPlan
from mpitailor.planning.plan import MergePlan
from mpitailor.planning.reshard import Piece, pieces_for


@dataclass(frozen=True, slots=True)
class Buffer:
    """Output bytes made of copies of `kind` buffers: a flat buffer of an output partition,
    a whole parameter's fp32 / exp_avg / exp_avg_sq file of the Universal export, or the
    data of an HF weights file (kind WEIGHTS: fp32 elements cast to its dtype)."""

    unit: int       # the files one home rank lays out: partition p, Universal file i at
    kind: str       # W2 + i (W2 the output world size), HF weights files after them
    subgroup: int   # the partition's sub-group; -1 for a Universal parameter or HF file
    nbytes: int
    param: str = ""  # the Universal parameter; an HF weights file's path under the output


WEIGHTS = "weights"  # the kind of an HF weights file's buffer


@dataclass(frozen=True, slots=True)
class Task:
    """Bytes [lo, hi) of buffers[buffer], made by one rank."""

    buffer: int
    lo: int
    hi: int


def buffers(plan: MergePlan, universal: bool = False) -> tuple[Buffer, ...]:
    """Every output flat buffer, partition by partition, in file order within one; then,
    with `universal`, every parameter's three Universal files, in model order."""
    layout = plan.target.layout if plan.target else plan.base_meta.layout
    out = [Buffer(p, kind, g, layout.buffer_size(kind, g, p) * ELEMENT)
           for p in range(layout.world_size)
           for g in range(len(layout.subgroup_sizes)) for kind in KINDS]
    if universal:
        files = [(s, kind) for s in plan.base_meta.layout.slots for kind in KINDS]
        out += [Buffer(layout.world_size + i, kind, -1, s.numel * ELEMENT, s.name)
                for i, (s, kind) in enumerate(files)]
    return tuple(out)


def weights_buffers(weights: WeightsPlan, first_unit: int = 0,
                    folder: str = "") -> tuple[Buffer, ...]:
    """The data of every file of an HF weights plan (after its header), file i unit
    first_unit + i, named by its path under the output dir (its plan's folder there)."""
    return tuple(Buffer(first_unit + i, WEIGHTS, -1, f.size - len(f.prefix),
                        weights_name(folder, f.name))
                 for i, f in enumerate(weights.files))


def weights_name(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def is_partition(b: Buffer) -> bool:
    return not b.param


def split(bufs: tuple[Buffer, ...], ranks: int) -> list[list[Task]]:
    """rank -> its tasks: the byte stream of all buffers cut into `ranks` contiguous ranges
    of (nearly) equal size, at multiples of 4 bytes: element boundaries of fp32 buffers,
    and of 16-bit ones (HF weights files, whose sizes are even) when they come last."""
    total = sum(b.nbytes for b in bufs)
    cuts = [total // ELEMENT * m // ranks * ELEMENT for m in range(ranks)] + [total]
    work: list[list[Task]] = [[] for _ in range(ranks)]
    start, first = 0, 0
    for i, b in enumerate(bufs):
        end = start + b.nbytes
        while first < ranks and cuts[first + 1] <= start:
            first += 1
        for m in range(first, ranks):
            if cuts[m] >= end:
                break
            lo, hi = max(cuts[m], start), min(cuts[m + 1], end)
            if lo < hi:
                work[m].append(Task(i, lo - start, hi - start))
        start = end
    return work


def split_by_node(bufs: tuple[Buffer, ...], node_of_unit: dict[int, int],
                  node_ranks: list[list[int]], ranks: int) -> list[list[Task]]:
    """rank -> its tasks, when each unit's files live on one node (node-local storage):
    each node's buffers cut among that node's ranks as `split` does."""
    work: list[list[Task]] = [[] for _ in range(ranks)]
    for node, members in enumerate(node_ranks):
        index = [i for i, b in enumerate(bufs) if node_of_unit[b.unit] == node]
        for rank, tasks in zip(members, split(tuple(bufs[i] for i in index), len(members))):
            work[rank] = [Task(index[t.buffer], t.lo, t.hi) for t in tasks]
    return work


def home_ranks(bufs: tuple[Buffer, ...], work: list[list[Task]],
               fallback: dict[int, int] | None = None) -> dict[int, int]:
    """unit -> the rank that builds its files (pickles, headers, model states): the one
    that makes the first byte of the unit's first non-empty buffer (for a unit without
    bytes, fallback[unit], else rank 0)."""
    homes: dict[int, int] = {}
    for rank, tasks in enumerate(work):
        for t in tasks:
            homes.setdefault(bufs[t.buffer].unit, rank)
    for b in bufs:
        homes.setdefault(b.unit, (fallback or {}).get(b.unit, 0))
    return dict(sorted(homes.items()))


def param_pieces(plan: MergePlan, name: str) -> list[Piece]:
    """The pieces of a whole parameter (Universal file), from the source it comes from:
    source rank r holds its elements [r * pn, min((r + 1) * pn, numel))."""
    src = dict(plan.param_source)[name]
    layout = plan.meta(src).layout
    s = layout.by_name()[name]
    held = [(r, *layout.held(s, r)) for r in range(layout.world_size)]
    return [Piece(src, r, s.subgroup, at, -1, first, n) for r, at, first, n in held if n > 0]


def pieces(plan: MergePlan, partition: int) -> dict[int, list[Piece]]:
    """Output sub-group -> the element pieces of output `partition`'s buffers, in order."""
    out: dict[int, list[Piece]] = {}
    if plan.target is None:
        layout = plan.base_meta.layout
        for g, sg in enumerate(plan.subgroups):
            # stage 3: runs are in every rank's coordinates; flat: in the group's, and
            # the partition is its window of them
            lo = layout.window(g, partition)
            hi = lo + layout.subgroup_sizes[g]
            out[g] = [Piece(r.source, partition, g, a - lo, g, a - lo, b - a)
                      for r in sg.runs
                      if (a := max(lo, r.start)) < (b := min(hi, r.start + r.length))]
        return out
    for p in pieces_for(plan.target, partition, plan.base_meta.layout, dict(plan.param_source)):
        out.setdefault(p.dst_group, []).append(p)
    for g in out:
        out[g].sort(key=lambda p: p.dst_start)
    return out


def clip(ps: list[Piece], lo: int, hi: int) -> list[Piece]:
    """The parts of pieces `ps` that fall in output elements [lo, hi)."""
    out = []
    for p in ps:
        a, b = max(lo, p.dst_start), min(hi, p.dst_start + p.length)
        if a < b:
            out.append(Piece(p.source, p.src_rank, p.src_group, p.src_start + a - p.dst_start,
                             p.dst_group, a, b - a))
    return out
