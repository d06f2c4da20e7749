"""`export DCP --format hf --verify`: the published HF weights read back and checked, after
publication, as a DCP merge's `--verify` checks its output (jobs/dcp_verify.py):

1. Every file the manifest records: its size and CRC-32 as recorded, and no file it does
   not record (jobs/verify.py). The weights' CRC-32s were taken from the bytes as they
   were written, so a byte that changed on its way to the disk, or after, differs.
2. Every weights file's safetensors header as planned (names, dtypes, shapes, offsets).
3. Every tensor's elements read back and compared byte for byte with the DCP chunks that
   hold them, read again where they lie (engine/dcp_weights.py's reader, the checkpoint's
   items checked again as they are located), cast again for --dtype (the same cast, bit
   for bit torch's `.to`), spread over the ranks as the export spreads its writing.

A difference is one line naming the file and the tensor (how many more differ), exit 1.
Collective: every rank calls verify_dcp_export.
"""
from __future__ import annotations

from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.display import shown
from mpitailor.engine.dcp_weights import (  # the export's own reader, reused
    ChunkSources,
    fill_fp32,
)
from mpitailor.formats.dcp import DcpMetadata
from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.io import close_all, open_regular, read_exact, read_upto
from mpitailor.jobs.dcp_verify import Verified, VerifyFailed
from mpitailor.jobs.verify import run_verify
from mpitailor.planning.dcp_hf import DcpHfPlan, pieces, shares
from mpitailor.planning.hf_layout import runs

STEP = 1 << 20  # elements compared at a time


def verify_dcp_export(comm: Comm, output: Path, source: Path, meta: DcpMetadata,
                      plan: DcpHfPlan, paths: dict[str, Path], checked: dict) -> Verified:
    """Collective: the checks of the module's doc on the published export in `output` of
    `source` (meta, plan, paths and checked as run_dcp_export wrote it)."""
    recorded = run_verify(comm, output)
    headers = comm.root_step(_headers_differ, output, plan)
    share = shares(plan.weights, comm.size)[comm.rank]
    found = comm.step(_compare_share, output, source, meta, plan, share, paths, checked)
    differ = [line for part in comm.allgather(found) for line in part]
    lines = [*differ, *headers, *recorded.differ]
    if lines:
        more = f" ({len(lines) - 1} more difference(s))" if len(lines) > 1 else ""
        raise VerifyFailed(f"--verify: {lines[0]}{more}; {shown(output)} was published but "
                           f"does not hold what was planned: delete it and export again")
    compared = sum(f.size - len(f.prefix) for f in plan.weights.files)
    return Verified(recorded.files, sum(len(f.pieces) for f in plan.weights.files),
                    recorded.bytes + compared)


def _headers_differ(output: Path, plan: DcpHfPlan) -> list[str]:
    """Rank 0: the weights files whose safetensors header is not the one planned."""
    out = []
    for f in plan.weights.files:
        fd = open_regular(output / f.name, "a weights file of the export")
        try:
            if read_upto(fd, len(f.prefix), 0) != f.prefix:
                out.append(f"{shown(output / f.name)}: its safetensors header differs from "
                           f"the one planned")
        finally:
            close_all({f.name: fd})
    return out


def _compare_share(output: Path, source: Path, meta: DcpMetadata, plan: DcpHfPlan,
                   share: list[tuple[int, int, int]], paths: dict, checked: dict) -> list[str]:
    """This rank's share of the files' elements compared with the checkpoint's; a line for
    each tensor that differs."""
    w = plan.weights
    size = w.itemsize
    src, fds, differ = ChunkSources(source, meta, paths, checked), {}, []
    try:
        for i, lo, hi in share:
            f = w.files[i]
            if f.name not in fds:
                fds[f.name] = open_regular(output / f.name, "a weights file of the export")
            for piece, a, b in runs(f, size, lo, hi):
                why = _compare_tensor(src, plan, piece.name, a, b, fds[f.name],
                                      piece.offset + a * size)
                if why is not None:
                    differ.append(f"{shown(output / f.name)}: tensor {piece.name!r:.100} "
                                  f"{why}")
    finally:
        close_all(fds)
        src.close()
    return differ


def _compare_tensor(src: ChunkSources, plan: DcpHfPlan, name: str, a: int, b: int, fd: int,
                    at: int) -> str | None:
    """Elements [a, b) of output tensor `name`, at byte `at` of fd, against the checkpoint's."""
    size = plan.weights.itemsize
    for lo in range(a, b, STEP):
        n = min(STEP, b - lo)
        want = _expected(src, plan, name, lo, n)
        got = read_upto(fd, n * size, at + (lo - a) * size)
        if got != want:
            if len(got) < len(want):
                return f"ends at element {lo + len(got) // size}: the file is truncated"
            k = next(j for j in range(len(got)) if got[j] != want[j]) // size
            return (f"element {lo + k} differs from DCP entry {plan.fqn_of[name]!r:.100} "
                    f"of the checkpoint" + (" (cast to --dtype)" if plan.source_dtype[name]
                                            != plan.weights.dtype else ""))
    return None


def _expected(src: ChunkSources, plan: DcpHfPlan, name: str, lo: int, n: int) -> bytes:
    """Elements [lo, lo + n) of output tensor `name` as the export writes them: the chunks'
    bytes as they are, or cast from fp32 as Copier.cast casts them."""
    fqn, dtype, have = plan.fqn_of[name], plan.weights.dtype, plan.source_dtype[name]
    rs, starts = src.tensor_runs(fqn)
    if have == dtype:
        size = DTYPES[dtype].itemsize
        parts = []
        for chunk, first, k in pieces(rs, starts, lo, lo + n):
            fd, loc = src.chunk(fqn, chunk)
            parts.append(read_exact(fd, k * size, loc.offset + first * size))
        return b"".join(parts)
    import numpy as np

    from mpitailor.formats.torch import cast, numpy_dtype
    into = np.empty(n, dtype=np.float32)
    fill_fp32(src, fqn, have, rs, starts, lo, into)
    if dtype == "fp32":
        return into.tobytes()
    out = np.empty(n, dtype=numpy_dtype(dtype))
    cast(into, "fp32", dtype, out=out)
    return out.tobytes()
