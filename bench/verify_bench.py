"""`mpitailor verify` against the disk's read speed (issue 44's goal: >= 0.8x), side by side.

    python -m bench.verify_bench [--gb 2.8] [--files 4] [--reps 2] [--ranks 1,2]
        [--json bench/out/verify_bench.json]

An output of --gb GB in --files files of random bytes (a composite's size; verify reads
bytes, whatever they hold) with a manifest recording each file's size and CRC-32, in a
scratch dir on the disk the bench runs from. Per rep, cold (every file's pages dropped with
posix_fadvise(DONTNEED) after a sync) and warm: the baseline `cat FILES > /dev/null` (the
disk's read speed as one reader sees it), then `mpitailor verify` at each rank count, the
whole process timed. Prints a table of GB/s and the ratio to the baseline of the same rep;
writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"


def make_output(root: Path, gb: float, files: int) -> int:
    each = int(gb * 1e9) // files
    records, chunk = {}, 64 << 20
    for i in range(files):
        path, crc, left = root / f"part_{i}.bin", 0, each
        with open(path, "wb") as f:
            while left:
                data = os.urandom(min(chunk, left))
                crc = zlib.crc32(data, crc)
                f.write(data)
                left -= len(data)
        records[path.name] = {"bytes": each, "crc32": f"{crc:08x}"}
    doc = {"format_version": "1.1", "kind": "merge", "files": records}
    (root / "mpitailor_manifest.json").write_text(json.dumps(doc))
    os.sync()
    return each * files


def drop(root: Path) -> None:
    os.sync()
    for p in root.iterdir():
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{cmd[:4]}: rc {r.returncode}: {r.stdout[-500:]} {r.stderr[-500:]}")
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.8)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--json", default=str(REPO / "bench" / "out" / "verify_bench.json"))
    a = ap.parse_args()
    ranks = [int(r) for r in a.ranks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="verify-bench-", dir=REPO / "bench") as tmp:
        root = Path(tmp) / "out"
        root.mkdir()
        nbytes = make_output(root, a.gb, a.files)
        parts = sorted(str(p) for p in root.glob("part_*"))
        for rep in range(a.reps):
            for cache in ("cold", "warm"):
                if cache == "cold":
                    drop(root)
                base = timed(["sh", "-c", 'cat "$@" > /dev/null', "cat", *parts])
                for n in ranks:
                    if cache == "cold":
                        drop(root)
                    cmd = [str(BIN / "python"), "-m", "mpitailor", "verify", str(root)]
                    if n > 1:
                        cmd = [str(BIN / "mpiexec"), "-n", str(n), *cmd]
                    s = timed(cmd)
                    rows.append({"rep": rep, "cache": cache, "ranks": n, "seconds": s,
                                 "cat_seconds": base, "gb_s": nbytes / s / 1e9,
                                 "cat_gb_s": nbytes / base / 1e9, "ratio": base / s})
    print(f"{'cache':<6} {'ranks':>5} {'verify GB/s':>12} {'cat GB/s':>9} {'verify/cat':>11}")
    summary = []
    for cache in ("cold", "warm"):
        for n in ranks:
            sel = [r for r in rows if r["cache"] == cache and r["ranks"] == n]
            row = {"cache": cache, "ranks": n,
                   "gb_s": statistics.median(r["gb_s"] for r in sel),
                   "cat_gb_s": statistics.median(r["cat_gb_s"] for r in sel),
                   "ratio": statistics.median(r["ratio"] for r in sel)}
            summary.append(row)
            print(f"{cache:<6} {n:>5} {row['gb_s']:>12.2f} {row['cat_gb_s']:>9.2f} "
                  f"{row['ratio']:>10.2f}x")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"bytes": nbytes, "date": time.strftime("%Y-%m-%d"),
                                        "summary": summary, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
