"""For the bytes I can afford to write, which checkpointing policy loses the least training?

    nice -n 10 python -m bench.quality.run [--quick] [--seeds 5] [--steps 1500]
        [--budgets 40 120] [--horizon 50] [--parallel 2] [--out bench/quality/results]

A byte-level Llama (6 layers, hidden 128) learns the Python standard library's own sources
(held-out files never trained on) with real DeepSpeed ZeRO-3 on CPU. Per byte budget (full
saves every K steps), each layer-wise policy saves as often as the same bytes allow, paced by
the measured size of its own saves (a short calibration run measures the first estimate).
Per seed, one uninterrupted run carries every policy's saves; failures early, mid and late in
training; for each, the saves made by then are recovered (`mpiexec -n 2 python -m mpitailor
recover`) and resumed by DeepSpeed's load_checkpoint. See bench/quality/README.md for the
method and the reading.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from bench.quality import corpus, report
from bench.quality.spec import POLICIES, Job, Model, Saver
from bench.quality.study import WORKER, Plan, run_seed, save_json
from dev.tinytrain import launch

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = ROOT / "bench" / "out" / "quality"
log = logging.getLogger("bench.quality")


def calibrate(model: Model, saves: int = 8) -> dict:
    """Bytes of one full save and the mean bytes of a policy's saves after its first
    (full) one, measured: every policy saves at each of `saves` + 1 steps."""
    d = SCRATCH / "calibrate"
    savers = [Saver("full", "full", str(d / "full"), every=1)]
    # A budget of one full save per step: a paced policy saves at every step.
    savers += [Saver(p, p, str(d / p), bytes_per_step=1e15) for p in POLICIES]
    r = launch(Job("train", str(d / "job"), replace(model, eval_every=10**9), seed=0,
                   steps=saves + 1, savers=tuple(savers)), module=WORKER, timeout=1800)
    full = statistics.fmean(r["saves"]["full"]["bytes"])
    out = {"full_bytes": full, "per_save": {}, "ratio": {}}
    for p in POLICIES:
        later = r["saves"][p]["bytes"][1:]
        out["per_save"][p] = r["saves"][p]["bytes"]
        out["ratio"][p] = statistics.fmean(later) / full
    shutil.rmtree(d, ignore_errors=True)
    return out


def saver_table(budgets: list[int]) -> list[tuple[str, str, int]]:
    """(name, policy, K) per budget: full every K steps, and each layer-wise policy paced to
    the same bytes per step (spec.Saver)."""
    return [(f"{p}@{k}", p, k) for k in budgets for p in ("full", *POLICIES)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run of about 2 minutes")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--budgets", type=int, nargs="+", default=[40, 120],
                    help="full-save intervals K; each is one byte budget")
    ap.add_argument("--horizon", type=int, default=50,
                    help="layer-wise resumes train to F + this")
    ap.add_argument("--failures", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--parallel", type=int, default=2, help="seeds at a time")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "quality" / "results")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the table and plots from OUT/plan.json and OUT/runs/")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.budgets, args.horizon = 2, 60, [20], 10
        args.failures = [0.5]
        args.out = SCRATCH / "quick-results"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.chdir(ROOT)  # the training processes run `python -m bench.quality.worker`
    if args.report_only:
        report.rewrite(args.out)
        return 0
    return study(args)


def study(args) -> int:
    started = time.time()
    text = corpus.load()
    model = Model(total_steps=args.steps, warmup=min(100, args.steps // 10))
    log.info("corpus: %s", text.info)
    cal = calibrate(model)
    log.info("calibration: full save %.1f MB; bytes per save vs full: %s", cal["full_bytes"] / 1e6,
             {k: round(v, 3) for k, v in cal["ratio"].items()})
    savers = saver_table(args.budgets)
    plan = Plan(model, args.steps, tuple(savers), tuple(args.failures), args.horizon,
                jitter=max(args.budgets), full_bytes=cal["full_bytes"],
                estimates=tuple((p, cal["ratio"][p] * cal["full_bytes"]) for p in POLICIES))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runs").mkdir(exist_ok=True)
    command = "nice -n 10 python -m bench.quality.run " + " ".join(sys.argv[1:])
    save_json(args.out / "plan.json", {"command": command.strip(), "plan": asdict(plan),
                                       "calibration": cal, "corpus": text.info,
                                       "seeds": args.seeds, "started": started})

    def one(seed: int) -> dict:
        t = time.time()
        record = run_seed(plan, seed, SCRATCH / f"seed{seed}")
        record["finished"] = time.time()
        save_json(args.out / "runs" / f"seed{seed}.json", record)
        log.info("seed %d done in %.0f s (%s)", seed, time.time() - t,
                 {k: round(v) for k, v in record["wall"].items()})
        return record

    with ThreadPoolExecutor(args.parallel) as pool:
        records = list(pool.map(one, range(args.seeds)))
    report.write(args.out, plan, cal, text.info, records, time.time() - started,
                 command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
