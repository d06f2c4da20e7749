"""DcpCheckpointer's saves inside an FSDP2 loop: synchronous and asynchronous, full and parity.

    python -m bench.dcp_save_bench [--layers 16] [--hidden 256] [--vocab 2048]
                                   [--world-size 2] [--steps 16] [--every 4] [--reps 1]

A random-init Llama trained with FSDP2 on CPU (gloo, dev/tinytrain/fsdp2_worker.py), per
case `--steps` steps with a save every `--every` steps, the cases interleaved and repeated:
no saves (the baseline); every save full, synchronous (`Parity(full_every=1)`: DCP's
`dcp.save`, every file read back and fsynced, the record, the rename: the reference);
parity partial saves, synchronous; and both asynchronous (`asynchronous=True`: staged into
host memory while training waits, written and published by a background thread). Per case
and save, rank 0's figures:
- blocked: seconds the loop stood still for the saves: inside `save()` (its wait for the
  save before included) and the wait for the last one after the loop;
- overhead: the loop's wall time minus the baseline's (the same repetition): what the saves
  cost, the background writer's competition for the cores included;
both also as ratios of the synchronous full save's blocked seconds. MB/save: what the
saves' records list (every rank's files). Each case is one launch (process start-up is
outside the loop's time). Writes bench/out/dcp_save_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from dev.tinytrain import TrainSpec, launch
from mpitailor.formats.dcp import read_dcp_save_record

OUT = Path(__file__).resolve().parent / "out"
CASES = {  # name -> (policy, asynchronous)
    "none": (None, False),
    "full-sync": ({"name": "parity", "full_every": 1}, False),
    "parity-sync": ({"name": "parity"}, False),
    "full-async": ({"name": "parity", "full_every": 1}, True),
    "parity-async": ({"name": "parity"}, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    save_at = tuple(range(args.every, args.steps + 1, args.every))
    rows = []
    OUT.mkdir(exist_ok=True)
    for rep in range(args.reps):
        for case, (policy, asynchronous) in CASES.items():
            with tempfile.TemporaryDirectory(prefix="mpitailor-dcpbench-", dir=OUT) as tmp:
                spec = TrainSpec(save_dir=f"{tmp}/run", world_size=args.world_size,
                                 layers=args.layers, hidden=args.hidden,
                                 intermediate=2 * args.hidden, vocab=args.vocab,
                                 steps=args.steps, save_at=save_at if policy else (),
                                 policy=policy, async_save=asynchronous,
                                 extra={"flatten_optimizer": True})
                r = launch(spec, module="dev.tinytrain.fsdp2_worker", timeout=3600)
                saved = [read_dcp_save_record(Path(tmp) / "run" / s) for s in r["saved"]]
            rows.append({"case": case, "rep": rep, "wall": r["loop_seconds"],
                         "saves": len(saved),
                         "blocked": sum(t["blocked"] for t in r["save_timings"])
                         + r["last_wait"],
                         "background": [t["background"] for t in r["save_timings"]],
                         "bytes": sum(f["bytes"] for s in saved for f in s.files.values())})
            print(f"rep {rep} {case}: {rows[-1]['wall']:.2f} s", flush=True)
    table(args, rows)


def table(args, rows: list[dict]) -> None:
    base = {r["rep"]: r["wall"] for r in rows if r["case"] == "none"}
    summary = {}
    for case in CASES:
        mine = [r for r in rows if r["case"] == case]
        if case == "none":
            continue
        summary[case] = {
            "mb_per_save": statistics.mean(r["bytes"] / r["saves"] for r in mine) / 1e6,
            "blocked_per_save": statistics.mean(r["blocked"] / r["saves"] for r in mine),
            "overhead_per_save": statistics.mean((r["wall"] - base[r["rep"]]) / r["saves"]
                                                 for r in mine),
            "saves": mine[0]["saves"], "reps": len(mine)}
    full = summary["full-sync"]["blocked_per_save"]
    print(f"{args.layers}-layer Llama, hidden {args.hidden}, FSDP2 world size "
          f"{args.world_size} (CPU, gloo): {args.steps} steps, a save every {args.every}, "
          f"{args.reps} repetition(s); the loop without saves: "
          f"{statistics.mean(base.values()):.2f} s")
    print(f"{'case':<14}{'MB/save':>9}{'blocked s':>11}{'overhead s':>12}"
          f"{'blocked/full-sync':>19}{'overhead/full-sync':>20}")
    for case, s in summary.items():
        s["blocked_vs_full_sync"] = s["blocked_per_save"] / full
        s["overhead_vs_full_sync"] = s["overhead_per_save"] / full
        print(f"{case:<14}{s['mb_per_save']:>9.1f}{s['blocked_per_save']:>11.3f}"
              f"{s['overhead_per_save']:>12.3f}{s['blocked_vs_full_sync']:>19.3f}"
              f"{s['overhead_vs_full_sync']:>20.3f}")
    out = OUT / "dcp_save_bench.json"
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
