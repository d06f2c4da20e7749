"""The quality table's blocked time of asynchronous layer-wise saves (issue 35).

    nice -n 10 python -m bench.quality.blocked [--out bench/quality/results] [--seed 0]

Replays one seed of a finished study: the same model, data and 1500 steps, every policy
saving at exactly the steps it saved at in the study (`runs/seed{S}.json`), the full ones
synchronously as there, the layer-wise ones asynchronously (LayerwiseCheckpointer(
asynchronous=True): their slices copied while the next step runs, written in the
background; the same bytes, tests/test_async_save.py). Blocked per save: the save call
(the wait for the save before included) plus the optimizer steps held for its copy. Writes
OUT/blocked.json; the study's table (`--report-only` rebuilds it) then shows it beside the
synchronous figure of the study itself.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from bench.quality.report import rewrite
from bench.quality.spec import Job, Model, Saver
from bench.quality.study import WORKER, save_json
from dev.tinytrain import launch

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = ROOT / "bench" / "out" / "quality" / "blocked"
log = logging.getLogger("bench.quality")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "quality" / "results",
                    help="a finished study's results (plan.json, runs/)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.chdir(ROOT)  # the training process runs `python -m bench.quality.worker`
    saved = json.loads((args.out / "plan.json").read_text())
    plan = saved["plan"]
    model = Model(**plan["model"])
    study = json.loads((args.out / "runs" / f"seed{args.seed}.json").read_text())["train"]
    shutil.rmtree(SCRATCH, ignore_errors=True)
    savers = tuple(Saver(name, policy, str(SCRATCH / name), every=k,
                         at=tuple(study["saves"][name]["steps"]),
                         asynchronous=policy != "full")
                   for name, policy, k in plan["savers"])
    started = time.time()
    r = launch(Job("train", str(SCRATCH / "job"), model, seed=args.seed, steps=plan["steps"],
                   savers=savers), module=WORKER, timeout=3 * 3600)
    steps = plan["steps"]
    rows = {}
    for s in savers:
        got, was = r["saves"][s.name], study["saves"][s.name]
        if got["steps"] != was["steps"]:
            raise SystemExit(f"{s.name}: saved at other steps than the study's")
        rows[s.name] = {
            "asynchronous": s.asynchronous, "saves": len(got["steps"]),
            "blocked_s": sum(got["seconds"]) + got["held"], "held_s": got["held"],
            "blocked_s_per_1k": (sum(got["seconds"]) + got["held"]) * 1000 / steps,
            "study_blocked_s_per_1k": sum(was["seconds"]) * 1000 / steps}
    print(f"seed {args.seed}, {steps} steps, the study's save steps; s blocked per 1000 steps")
    print(f"{'saver':<14}{'saves':>6}{'study (sync)':>14}{'replay':>10}{'held s':>8}")
    for name, row in rows.items():
        print(f"{name:<14}{row['saves']:>6}{row['study_blocked_s_per_1k']:>14.2f}"
              f"{row['blocked_s_per_1k']:>10.2f}{row['held_s']:>8.2f}"
              + ("  (async)" if row["asynchronous"] else ""))
    save_json(args.out / "blocked.json", {
        "command": "nice -n 10 python -m bench.quality.blocked " + " ".join(sys.argv[1:]),
        "seed": args.seed, "steps": steps, "wall_seconds": time.time() - started,
        "train_seconds": r["seconds"], "rows": rows})
    shutil.rmtree(SCRATCH, ignore_errors=True)
    rewrite(args.out)  # the table with its new column
    return 0


if __name__ == "__main__":
    sys.exit(main())
