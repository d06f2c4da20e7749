"""A parity merge of a DCP pair against `cp` of the same bytes, side by side (issue 43).

    python -m bench.dcp_merge_bench [--hidden 1024] [--layers 16] [--reps 2]
        [--json bench/results/dcp_merge_bench.json] [--pairs DIR]
        [--cases "cp,link recorded"] [--baseline CHECKOUT]

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
- `link recorded` (and `link recorded 2 ranks`, under `mpiexec -n 2`): `--link` over the
  same model's pair saved by mpitailor's DcpCheckpointer (bench/out/dcp_pair_rec_*), whose
  records carry every file's CRC-32: metadata only.
Prints each case's median wall seconds and the median of its ratios to `cp` in the same
repetition (a repetition whose `cp` stalls on the writeback of what came before skews a
mean); writes JSON with every row.

`--cases` runs only the cases named (e.g. the link ones: metadata costs, no copying);
`--pairs DIR` takes the pairs already built in DIR (another checkout's bench/out), read
only; `--baseline CHECKOUT` runs each mpitailor case a second time, interleaved, with the
code of another checkout (e.g. `git archive <commit> | tar -x -C /tmp/base`): before and
after side by side in one run.
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


def build_pair(hidden: int, layers: int, recorded: bool = False, pairs: Path = OUT) -> Path:
    """The pair: plain dcp.save dirs, or (recorded) full saves of mpitailor's
    DcpCheckpointer, each with its record (every file's CRC-32); built in pairs, unless
    there already."""
    run = pairs / f"dcp_pair{'_rec' if recorded else ''}_h{hidden}_l{layers}"
    if (run / "DONE").exists():
        return run
    from dev.tinytrain import TrainSpec, launch
    shutil.rmtree(run, ignore_errors=True)
    launch(TrainSpec(save_dir=str(run), world_size=2, layers=layers, hidden=hidden,
                     intermediate=int(hidden * 2.75), heads=16, kv_heads=4, vocab=32000,
                     steps=2, save_at=(1, 2), extra={"flatten_optimizer": True},
                     policy={"name": "parity", "full_every": 1} if recorded else None),
           module="dev.tinytrain.fsdp2_worker", timeout=3600)
    (run / "DONE").write_text("ok\n")
    return run


def timed(argv: list[str], cwd: Path = REPO) -> float:
    """Wall seconds of argv, in cwd: a checkout, whose code `python -m mpitailor` runs."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, cwd=cwd, env=env)
    return time.perf_counter() - t


def _in(checkout: Path, go):
    """Case go, run with the code of another checkout."""
    return lambda: go(checkout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", type=Path, default=OUT / "dcp_merge_bench.json")
    ap.add_argument("--pairs", type=Path, default=OUT,
                    help="where the pairs are (built there if not)")
    ap.add_argument("--cases", help="comma-separated cases to run (default: all)")
    ap.add_argument("--baseline", type=Path,
                    help="a checkout whose code runs each mpitailor case again")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    run = build_pair(args.hidden, args.layers, pairs=args.pairs.resolve())
    recipe, recorded = OUT / "dcp_merge_bench.yml", OUT / "dcp_merge_bench_rec.yml"
    for path, pair in ((recipe, run), (recorded, build_pair(args.hidden, args.layers, True,
                                                            args.pairs.resolve()))):
        path.write_text(f"sources: {{s1: {pair}/step-1, s2: {pair}/step-2}}\n"
                        f"layers: {{even: s1, odd: s2}}\nbase: s2\n")
    size = sum(p.stat().st_size for p in (run / "step-2").iterdir())
    target = OUT / "dcp_merge_bench_out"
    mpiexec2 = [str(PY.parent / "mpiexec"), "-n", "2"]

    def merge(launcher: list[str], recipe_path: Path, *extra: str):
        """`python -m mpitailor merge` as a case: run with the code of checkout cwd."""
        return lambda cwd=REPO: timed([*launcher, str(PY), "-m", "mpitailor", "merge",
                                       str(recipe_path), "-o", str(target), "-q", *extra], cwd)

    cases = {
        "cp": lambda: timed(["sh", "-c", (f"cp -r {run}/step-2 {target} && sync "
                                          f"{target}/* {target}/.metadata")]),
        "merge 1 rank": merge([], recipe),
        "merge 2 ranks": merge(mpiexec2, recipe),
        "link 1 rank": merge([], recipe, "--link"),
        "link 2 ranks": merge(mpiexec2, recipe, "--link"),
        "link recorded": merge([], recorded, "--link"),
        "link recorded 2 ranks": merge(mpiexec2, recorded, "--link"),
    }
    if args.cases:
        wanted = [c.strip() for c in args.cases.split(",")]
        unknown = [c for c in wanted if c not in cases]
        if unknown:
            ap.error(f"--cases: {unknown} not among {list(cases)}")
        cases = {c: cases[c] for c in wanted}
    if args.baseline:
        base = args.baseline.resolve()
        cases = {k: v for case, go in cases.items() for k, v in (
            (case, go), *(((f"{case} (baseline)", _in(base, go)),) if case != "cp" else ()))}
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
        each = [r["seconds"] for r in rows if r["case"] == case]
        summary[case] = {"seconds": statistics.median(each), "each": each,
                         "vs_cp": statistics.median(ratios) if ratios else None,
                         "vs_cp_each": ratios}
    print(f"DCP pair: 2 saves of {size / 1e9:.2f} GB (FSDP2, 2 ranks), parity merge, "
          f"{args.reps} reps, {os.cpu_count()} cores"
          + (f"; baseline: {args.baseline}" if args.baseline else ""))
    print(f"{'case':<34}{'seconds':>9}{'vs cp':>8}     (each repetition: seconds)")
    for case, s in summary.items():
        vs = f"{s['vs_cp']:>7.2f}x" if s["vs_cp"] is not None else f"{'':>8}"
        print(f"{case:<34}{s['seconds']:>9.2f}{vs}     "
              + "  ".join(f"{x:.2f}" for x in s["each"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"bytes": size, "summary": summary, "rows": rows,
                                     "baseline": str(args.baseline or ""),
                                     "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
