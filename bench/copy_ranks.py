"""The physical-limit proxy: MPI rank m copies files m, m+M, ... of a checkpoint (each byte
read once, written once, fsynced), as a merge's ranks share its partitions.

    mpiexec -n M python -m bench.copy_ranks SRC_TAG_DIR DST_DIR --stats FILE
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from mpitailor.comm import Comm
from mpitailor.iostats import snapshot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--stats", required=True)
    args = ap.parse_args()
    comm = Comm.world()
    src, dst = Path(args.src), Path(args.dst)
    files = sorted(p for p in src.iterdir() if p.is_file())
    if comm.rank == 0:
        dst.mkdir(parents=True)
    comm.barrier()
    before, t0 = snapshot(), time.perf_counter()
    written = 0
    for p in files[comm.rank::comm.size]:
        with open(p, "rb") as fi, open(dst / p.name, "xb") as fo:
            shutil.copyfileobj(fi, fo, 16 << 20)
            fo.flush()
            os.fsync(fo.fileno())
        written += p.stat().st_size
    stats = {"bytes_written": written, **snapshot().since(before)}
    comm.barrier()
    seconds = time.perf_counter() - t0
    ranks = comm.allgather(stats)
    if comm.rank == 0:
        Path(args.stats).write_text(json.dumps({"seconds": seconds, "ranks": ranks,
                                                "bytes_written": sum(written for written in
                                                                     (r["bytes_written"]
                                                                      for r in ranks))}))


if __name__ == "__main__":
    main()
