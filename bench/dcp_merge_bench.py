"""A parity merge of a DCP pair against `cp` of the same bytes, side by side (issue 43).

    python -m bench.dcp_merge_bench [--hidden 1024] [--layers 16] [--reps 2]
        [--json bench/results/dcp_merge_bench.json]

A real FSDP2 run (dev/tinytrain/fsdp2_worker.py: 2 ranks, CPU, gloo) saves step-1 and step-2
with dcp.save (a Llama of `--layers` layers, hidden `--hidden`, vocab 32000: ~2.9 GB a save
at the defaults; built once into bench/out/dcp_pair). Then, interleaved, `--reps` times:
- `cp`: `cp -r step-2 OUT` and `sync` of OUT's files (the output's bytes made durable);
- `merge 1 rank` / `merge 2 ranks`: `python -m mpitailor merge` of even layers from step-1,
  odd from step-2 (base step-2), as a whole process (start-up, planning, every item checked,
  copied, fsynced, published), under `mpiexec -n 2` for two ranks;
- `link 1 rank` / `link 2 ranks`: the same merge with `--link` (hard links, a new
  .metadata): over these plain dcp.save dirs each linked file is read once for the
  manifest's CRC-32 (the ranks share them);
- `link recorded`: `--link` over the same model's pair saved by mpitailor's DcpCheckpointer
  (bench/out/dcp_pair_rec_*), whose records carry every file's CRC-32: metadata only.
Prints each case's median wall seconds and the median of its ratios to `cp` in the same
repetition (a repetition whose `cp` stalls on the writeback of what came before skews a
mean); writes JSON with every row.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out"
PY = REPO / ".venv" / "bin" / "python"


def build_pair(hidden: int, layers: int, recorded: bool = False) -> Path:
    """The pair: plain dcp.save dirs, or (recorded) full saves of mpitailor's
    DcpCheckpointer, each with its record (every file's CRC-32)."""
    from dev.tinytrain import TrainSpec, launch
    run = OUT / f"dcp_pair{'_rec' if recorded else ''}_h{hidden}_l{layers}"
    if (run / "DONE").exists():
        return run
    shutil.rmtree(run, ignore_errors=True)
    launch(TrainSpec(save_dir=str(run), world_size=2, layers=layers, hidden=hidden,
                     intermediate=int(hidden * 2.75), heads=16, kv_heads=4, vocab=32000,
                     steps=2, save_at=(1, 2), extra={"flatten_optimizer": True},
                     policy={"name": "parity", "full_every": 1} if recorded else None),
           module="dev.tinytrain.fsdp2_worker", timeout=3600)
    (run / "DONE").write_text("ok\n")
    return run


def timed(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", type=Path, default=OUT / "dcp_merge_bench.json")
    args = ap.parse_args()
    run = build_pair(args.hidden, args.layers)
    recipe, recorded = OUT / "dcp_merge_bench.yml", OUT / "dcp_merge_bench_rec.yml"
    for path, pair in ((recipe, run), (recorded, build_pair(args.hidden, args.layers, True))):
        path.write_text(f"sources: {{s1: {pair}/step-1, s2: {pair}/step-2}}\n"
                        f"layers: {{even: s1, odd: s2}}\nbase: s2\n")
    size = sum(p.stat().st_size for p in (run / "step-2").iterdir())
    target = OUT / "dcp_merge_bench_out"
    cases = {
        "cp": lambda: timed(["sh", "-c", f"cp -r {run}/step-2 {target} && sync "
                                         f"{target}/* {target}/.metadata"]),
        "merge 1 rank": lambda: timed([str(PY), "-m", "mpitailor", "merge", str(recipe),
                                       "-o", str(target), "-q"]),
        "merge 2 ranks": lambda: timed([str(PY.parent / "mpiexec"), "-n", "2", str(PY),
                                        "-m", "mpitailor", "merge", str(recipe), "-o",
                                        str(target), "-q"]),
        "link 1 rank": lambda: timed([str(PY), "-m", "mpitailor", "merge", str(recipe),
                                      "-o", str(target), "-q", "--link"]),
        "link 2 ranks": lambda: timed([str(PY.parent / "mpiexec"), "-n", "2", str(PY), "-m",
                                       "mpitailor", "merge", str(recipe), "-o", str(target),
                                       "-q", "--link"]),
        "link recorded": lambda: timed([str(PY), "-m", "mpitailor", "merge", str(recorded),
                                        "-o", str(target), "-q", "--link"]),
    }
    rows = []
    for rep in range(args.reps):
        for case, go in cases.items():
            shutil.rmtree(target, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            rows.append({"rep": rep, "case": case, "seconds": go()})
            print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(target, ignore_errors=True)
    summary = {}
    for case in cases:
        ratios = [r["seconds"] / c["seconds"] for r in rows if r["case"] == case
                  for c in rows if c["case"] == "cp" and c["rep"] == r["rep"]]
        summary[case] = {"seconds": statistics.median(r["seconds"] for r in rows
                                                      if r["case"] == case),
                         "vs_cp": statistics.median(ratios), "vs_cp_each": ratios}
    print(f"DCP pair: 2 saves of {size / 1e9:.2f} GB (FSDP2, 2 ranks), parity merge, "
          f"{args.reps} reps, {os.cpu_count()} cores")
    print(f"{'case':<16}{'seconds':>9}{'vs cp':>8}")
    for case, s in summary.items():
        print(f"{case:<16}{s['seconds']:>9.2f}{s['vs_cp']:>7.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"bytes": size, "summary": summary, "rows": rows,
                                     "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
