"""Universal checkpoint export: mpitailor vs DeepSpeed's own converter, side by side.

    python -m bench.universal_bench [--ranks 1 2] [--reps 3] [--quick]

Input: the step-2 checkpoint of merge_bench's world-4 run (185M-parameter Llama, bf16,
2.2 GB of ZeRO-3 state; built on first use, cached in .cache/bench). Cases, alternated in
each repetition, cold (inputs dropped from the page cache) and warm:
  ds         python -m deepspeed.checkpoint.ds_to_universal with M extract and M merge
             workers: writes the Universal layout only (via a temp dir of fragments)
  mpitailor  an identity merge with --export universal on M MPI ranks: writes the native
             checkpoint AND the Universal layout (more bytes than ds)
  native     the same identity merge without the export: the export's own cost is the
             difference
Times are wall clock of the whole command (interpreter and imports included, both sides).
Prints a table, writes bench/out/universal_bench.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.merge_bench import MPIEXEC, OUT, REPO, checkpoints, drop_cache


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def one(case: str, ranks: int, tag_dir: Path, scratch: Path, cold: bool) -> dict:
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    if cold:
        drop_cache(tag_dir)
    if case == "ds":
        out = scratch / "ds" / tag_dir.name
        cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(tag_dir), "--output_folder", str(out), "--num_extract_workers", str(ranks),
               "--num_merge_workers", str(ranks)]
    else:
        out = scratch / "mpitailor"
        recipe = scratch / "identity.yml"
        recipe.write_text(f"layers: {{rest: '{tag_dir}'}}\noutput: '{out}'\n")
        cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpitailor", str(recipe),
               "-q", "--no-progress"] + (["--export", "universal"] if case == "mpitailor"
                                         else [])
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=REPO)
    seconds = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    universal = out / "zero" if case == "ds" else out / tag_dir.name / "zero"
    universal_bytes = du(universal) if universal.exists() else 0
    row = {"case": case, "ranks": ranks, "cold": cold, "seconds": seconds,
           "universal_bytes": universal_bytes, "bytes_written": du(out.parent if case == "ds"
                                                                 else out)}
    shutil.rmtree(scratch, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small model (smoke test)")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    tag_dir = checkpoints(4, args.quick) / "global_step2"
    scratch = OUT / "scratch-universal"
    rows = []
    for rep in range(args.reps):
        for cold in (True, False):
            for m in args.ranks:
                for case in ("ds", "mpitailor", "native"):
                    row = dict(one(case, m, tag_dir, scratch, cold), rep=rep)
                    rows.append(row)
                    print(f"{case:<10} ranks={m} {'cold' if cold else 'warm'} "
                          f"{row['seconds']:.2f}s", flush=True)
    summary = summarize(rows)
    print_table(summary)
    (OUT / "universal_bench.json").write_text(json.dumps(
        {"args": vars(args), "input": str(tag_dir), "summary": summary, "rows": rows},
        indent=2))
    print(f"wrote {OUT / 'universal_bench.json'}")


def summarize(rows: list[dict]) -> list[dict]:
    keys = sorted({(r["cold"], r["ranks"], r["case"]) for r in rows})
    out = []
    for cold, ranks, case in keys:
        mine = [r for r in rows if (r["cold"], r["ranks"], r["case"]) == (cold, ranks, case)]
        out.append({"case": case, "ranks": ranks, "cold": cold,
                    "seconds": statistics.median(r["seconds"] for r in mine),
                    "spread": max(r["seconds"] for r in mine) - min(r["seconds"] for r in mine),
                    "universal_gb": mine[0]["universal_bytes"] / 1e9,
                    "written_gb": mine[0]["bytes_written"] / 1e9})
    by = {(x["cold"], x["ranks"], x["case"]): x for x in out}
    for x in out:
        ds, native = by.get((x["cold"], x["ranks"], "ds")), \
            by.get((x["cold"], x["ranks"], "native"))
        if x["case"] == "mpitailor" and ds and native:
            x["ds_over_mpitailor"] = ds["seconds"] / x["seconds"]
            x["export_seconds"] = x["seconds"] - native["seconds"]
            x["ds_over_export"] = ds["seconds"] / max(x["export_seconds"], 1e-9)
    return out


def print_table(summary: list[dict]) -> None:
    nan = float("nan")
    print(f"{'case':<10}{'ranks':>6} {'cache':<6}{'s':>8}{'spread':>8}{'universal GB':>13}"
          f"{'written GB':>11}{'ds/ours':>9}{'export s':>9}{'ds/export':>10}")
    for x in summary:
        print(f"{x['case']:<10}{x['ranks']:>6} {'cold' if x['cold'] else 'warm':<6}"
              f"{x['seconds']:>8.2f}{x['spread']:>8.2f}{x['universal_gb']:>13.3f}"
              f"{x['written_gb']:>11.3f}{x.get('ds_over_mpitailor', nan):>9.2f}"
              f"{x.get('export_seconds', nan):>9.2f}{x.get('ds_over_export', nan):>10.2f}")


if __name__ == "__main__":
    main()
