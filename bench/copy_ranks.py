"""The physical-limit proxy: M MPI ranks copy one checkpoint's files, each byte read once and
written once (inside the kernel with copy_file_range, as `cp` does; every output file
fsynced), as a merge's ranks share its output.

    mpiexec -n M python -m bench.copy_ranks SRC_TAG_DIR DST_DIR --stats FILE [--split bytes]

--split bytes (default): rank m copies the m-th of M equal byte ranges of the files taken end
to end, so M ranks share even a checkpoint of one big file (world size 1).
--split files: rank m copies whole files m, m+M, ... (how a merge shares whole partitions).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.engine.iostats import snapshot

CHUNK = 64 << 20  # bytes per copy_file_range call (1 GiB was 10-30% slower here)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--stats", required=True)
    ap.add_argument("--split", choices=("bytes", "files"), default="bytes")
    args = ap.parse_args()
    comm = Comm.world()
    src, dst = Path(args.src), Path(args.dst)
    files = sorted(p for p in src.iterdir() if p.is_file())
    if comm.rank == 0:  # every output file exists before any rank writes into it
        dst.mkdir(parents=True)
        for p in files:
            (dst / p.name).touch(exist_ok=False)
    comm.barrier()
    before, t0 = snapshot(), time.perf_counter()
    if args.split == "files":
        written = sum(copy_range(p, dst / p.name, 0, p.stat().st_size)
                      for p in files[comm.rank::comm.size])
    else:
        written = copy_share(files, dst, comm.rank, comm.size)
    stats = {"bytes_written": written, **snapshot().since(before)}
    comm.barrier()
    seconds = time.perf_counter() - t0
    ranks = comm.allgather(stats)
    if comm.rank == 0:
        Path(args.stats).write_text(json.dumps({
            "seconds": seconds, "split": args.split, "ranks": ranks,
            "bytes_written": sum(r["bytes_written"] for r in ranks)}))


def copy_share(files: list[Path], dst: Path, rank: int, size: int) -> int:
    """Copy bytes [total*rank/size, total*(rank+1)/size) of the files taken end to end."""
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes)
    lo, hi = total * rank // size, total * (rank + 1) // size
    written, start = 0, 0
    for p, n in zip(files, sizes):
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            written += copy_range(p, dst / p.name, a - start, b - start)
        start += n
    return written


def copy_range(src: Path, dst: Path, begin: int, end: int) -> int:
    """Copy src[begin:end] to the same offsets of dst (which exists), then fsync dst."""
    fi, fo = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY)
    try:
        off = begin
        while off < end:
            n = os.copy_file_range(fi, fo, min(CHUNK, end - off), off, off)
            if n == 0:
                raise OSError(f"{src}: unexpected end of file at {off}")
            off += n
        os.fsync(fo)
    finally:
        os.close(fi)
        os.close(fo)
    return end - begin


if __name__ == "__main__":
    main()
