"""An HF export of a DCP checkpoint, planned: which tensors (the `model.` entries, named as
`save_pretrained` names them), in which files (hf_layout.py, as a ZeRO export), where each
output element comes from (a chunk of the DCP tensor), and each rank's share of the bytes.

Pure: no I/O, no MPI. The output files follow from names, shapes and the dtype only, and
every rank's share from the file sizes and the number of ranks, so the bytes written do not
depend on how many ranks write them.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.dcp import DcpMetadata, TensorEntry, split_key
from mpitailor.formats.dtypes import DTYPES
from mpitailor.planning.hf_layout import WeightsPlan, by_size, plan_weights

CASTABLE = ("fp32", "bf16", "fp16")  # what Copier.cast reads and writes
MAX_RUNS = 1 << 20  # contiguous runs one tensor's chunks may cut it into (see runs_of)


@dataclass(frozen=True, slots=True)
class DcpHfPlan:
    """What an export writes: the weights files, and each output tensor's DCP entry."""

    weights: WeightsPlan
    fqn_of: dict[str, str]          # output name -> the DCP entry (`model.<name>`)
    source_dtype: dict[str, str]    # output name -> its dtype in the checkpoint


@dataclass(frozen=True, slots=True)
class Run:
    """Elements [start, start + n) of a tensor (row-major) are elements [at, at + n) of its
    chunk `chunk` (the chunk's own row-major order)."""

    start: int
    chunk: int
    at: int
    n: int


def model_tensors(meta: DcpMetadata, where: str) -> list[tuple[str, str, TensorEntry]]:
    """(output name, DCP entry, entry) of every `model.` tensor, in the checkpoint's order
    (the model's, as DCP flattens it); CheckpointError if there is none."""
    out = [(split_key(fqn).param, fqn, e) for fqn, e in meta.tensors.items()
           if split_key(fqn).role == "model"]
    if not out:
        raise CheckpointError(f"{where}: no `model.` entries (an FSDP2/torchtitan save: "
                              f"dcp.save({{\"model\": ..., \"optim\": ...}})); nothing to "
                              f"export as HF weights")
    return out


def plan_dcp_hf(meta: DcpMetadata, where: str, dtype: str | None,
                max_shard_size: int) -> DcpHfPlan:
    """The export of meta's model tensors in `dtype` (default: theirs, when they share
    one), sharded as save_pretrained cuts them. UserError or CheckpointError, one line."""
    tensors = model_tensors(meta, where)
    dtypes = sorted({e.dtype for _, _, e in tensors})
    if dtype is None:
        if len(dtypes) > 1:
            raise UserError(f"{where}: the model's tensors are of several dtypes "
                            f"({', '.join(dtypes)}); pass --dtype to write them in one")
        dtype = dtypes[0]
    for name, fqn, e in tensors:
        if e.dtype != dtype and not (e.dtype in CASTABLE and dtype in CASTABLE):
            raise UserError(f"{where}: {fqn!r:.80} is {e.dtype}; --dtype {dtype} casts "
                            f"between {', '.join(CASTABLE)} only")
        count_runs(fqn, e, where)
    shapes = [(name, e.size) for name, _, e in tensors]
    sizes = [(n, math.prod(s) * DTYPES[dtype].itemsize) for n, s in shapes]
    files = by_size(sizes, max_shard_size)
    return DcpHfPlan(plan_weights(shapes, dtype, files, index=len(files) > 1),
                     {n: fqn for n, fqn, _ in tensors},
                     {n: e.dtype for n, _, e in tensors})


def _cut(chunk_sizes: tuple[int, ...], size: tuple[int, ...]) -> int:
    """The first dimension from which on the chunk spans the tensor whole (0: the whole
    tensor): its elements lie in runs of its sizes[m-1:] elements."""
    m = len(size)
    while m > 0 and chunk_sizes[m - 1] == size[m - 1]:
        m -= 1
    return m


def count_runs(fqn: str, e: TensorEntry, where: str) -> int:
    """How many contiguous runs e's chunks cut it into (FSDP2's dim-0 shards: one a chunk;
    a shard of a later dim: one per row of it); CheckpointError past MAX_RUNS."""
    total = 0
    for c in e.chunks:
        m = _cut(c.sizes, e.size)
        total += math.prod(c.sizes[:m - 1]) if m > 1 else 1
    if total > MAX_RUNS:
        raise CheckpointError(f"{where}: {fqn!r:.80} is sharded into {total} pieces of rows "
                              f"(a shard of a trailing dimension); mpitailor exports "
                              f"tensors cut into at most {MAX_RUNS}")
    return total


def runs_of(e: TensorEntry) -> list[Run]:
    """Every chunk's elements as runs of the tensor's row-major order, sorted by start.
    A chunk that spans dims m.. whole (and part of dim m-1) is, for each index of its
    dims before m-1, one run of sizes[m-1] * prod(size[m:]) elements."""
    size = e.size
    strides = [math.prod(size[j + 1:]) for j in range(len(size))]
    out = []
    for i, c in enumerate(e.chunks):
        m = _cut(c.sizes, size)
        if m == 0:
            out.append(Run(0, i, 0, c.numel))
            continue
        n = c.sizes[m - 1] * strides[m - 1]
        base = c.offsets[m - 1] * strides[m - 1]
        for k, idx in enumerate(itertools.product(*(range(s) for s in c.sizes[:m - 1]))):
            start = base + sum((c.offsets[j] + idx[j]) * strides[j] for j in range(m - 1))
            out.append(Run(start, i, k * n, n))
    out.sort(key=lambda r: r.start)
    pos = 0
    for r in out:
        if r.start != pos:
            raise RuntimeError(f"internal error: chunks leave elements {pos}-{r.start} of a "
                               f"tensor of size {size} uncovered")
        pos += r.n
    return out


def pieces(runs: Sequence[Run], starts: Sequence[int], lo: int, hi: int
           ) -> list[tuple[int, int, int]]:
    """Elements [lo, hi) of a tensor as (chunk, first element in it, count), in order;
    `starts`: the runs' starts (for bisect)."""
    out = []
    k = bisect.bisect_right(starts, lo) - 1
    while lo < hi:
        r = runs[k]
        n = min(hi, r.start + r.n) - lo
        out.append((r.chunk, r.at + lo - r.start, n))
        lo += n
        k += 1
    return out


def shares(plan: WeightsPlan, ranks: int) -> list[list[tuple[int, int, int]]]:
    """Each rank's share of the files' data, balanced by bytes: the files' elements one
    after the other, cut into `ranks` contiguous ranges; per rank [(file index, first
    element, end element)] of the files it touches."""
    sizes = [sum(p.numel for p in f.pieces) for f in plan.files]
    total, out = sum(sizes), []
    for r in range(ranks):
        lo, hi = total * r // ranks, total * (r + 1) // ranks
        mine, pos = [], 0
        for i, n in enumerate(sizes):
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                mine.append((i, a - pos, b - pos))
            pos += n
        out.append(mine)
    return out
