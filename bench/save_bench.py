"""Full DeepSpeed saves against selective layer-wise saves, on one engine, side by side.

    python -m bench.save_bench [--layers 32] [--hidden 256] [--reps 3] [--world-size 2]
                               [--steps 8] [--every 2] [--device cpu|cuda]
                               [--isolated | --stats]

A 32-layer random-init Llama trained with DeepSpeed ZeRO-3 on CPU (gloo), or with `--device
cuda` on one GPU (NCCL, world size 1, bf16). By default, saves inside a training loop: per
case, `--steps` training steps with a save after steps 1, 1 + every, 1 + 2 * every, ... (the
last save followed by every - 1 steps; on a GPU, space the saves so that the writer can
persist one before the next comes, as a real run does), the cases interleaved and repeated
(after one unrecorded warm-up round): no saves (the baseline), a fsynced synchronous full save (`engine.save_checkpoint`,
then every file fsynced, as mpitailor's saves are), and LayerwiseCheckpointer's partial saves
under parity (a cycle of 2) and filter (first 2 and last 2 layers every save, the others
every 4th), synchronous and asynchronous (`-async`: the slices copied while the next step
runs, its optimizer step held until the copy is done). Two figures per save, both as ratios
of the fsynced synchronous full save's blocked time in the same run:
- blocked: the seconds the loop stands still because of the save: inside the save call, the
  optimizer steps held for an overlapped copy, the wait for the last save after the loop;
- overhead: the loop's wall time with saves minus without (the same repetition), per save:
  what the saves really cost, the background writer's competition for the cores included.
Beside them, what a save costs in CPU, per save, against the loop without saves: rank 0's
process (every thread: training's, the writer's) and the whole machine (every rank, the
kernel's writeback). Where training keeps every core busy, this CPU is the overhead's cause.
The JSON's summary gives per case `blocked_vs_full_fsync` and `overhead_vs_full_fsync`.
Writes bench/out/save_bench.json (`--device cuda`: save_bench_cuda.json).

`--isolated`: each save timed alone on a still engine, as versions before 4 measured it
(bench/out/save_bench_isolated.json), with one case more: `full+record`, a full save as
mpitailor's checkpointers make it (DeepSpeed's save, then each file read back for its CRC-32
and fsynced by the rank that wrote it, the records gathered: training/recorded_save.py),
against `full+fsync` (the same files fsynced, nothing read back). `--stats` measures instead what `stats=` costs:
LayerwiseCheckpointer's partial saves (parity, adaptive; synchronous and asynchronous) with
and without a stats log, side by side on the same engine: seconds training is blocked per
save and the ratio against the same case without stats. Writes bench/out/save_bench_stats.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from dev.tinytrain import TrainSpec, launch

OUT = Path(__file__).resolve().parent / "out"
# save_worker.cpu_seconds's counters, in each loop row: per save in the summary
CPU_COUNTERS = ("cpu_rank0", "sys_rank0", "faults_rank0", "cpu_machine", "steal")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="training steps per loop")
    ap.add_argument("--every", type=int, default=2, help="training steps between saves")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: one GPU, NCCL, world size 1, bf16 (the loop only)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--isolated", action="store_true", help="each save alone (see above)")
    mode.add_argument("--stats", action="store_true", help="the cost of stats= (see above)")
    args = ap.parse_args()
    extra = {"reps": args.reps, "stats": args.stats, "loop": not (args.isolated or args.stats),
             "loop_steps": args.steps, "loop_every": args.every}
    if args.device == "cuda":
        if args.isolated or args.stats or args.world_size != 1:
            ap.error("--device cuda measures the loop at --world-size 1 (one GPU)")
        extra.update(device="cuda", env={
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
            "DS_ACCELERATOR": "cuda", "OMP_NUM_THREADS": "4", "NCCL_SOCKET_IFNAME": "lo"})
    with tempfile.TemporaryDirectory(prefix="mpitailor-savebench-", dir=OUT.parent) as tmp:
        spec = TrainSpec(save_dir=tmp, world_size=args.world_size, layers=args.layers,
                         hidden=args.hidden, intermediate=2 * args.hidden, vocab=args.vocab,
                         seq_len=args.seq_len, grouping="per_layer", steps=1, save_at=(),
                         dtype="bf16" if args.device == "cuda" else "fp32", extra=extra)
        result = launch(spec, module="bench.save_worker", timeout=3 * 3600)
    rows = result["rows"]
    if args.stats:
        stats_table(args, rows)
        return
    if not args.isolated:
        loop_table(args, rows, result.get("about", {}))
        return
    summary = {}
    for case in ("full", "full+fsync", "full+record", "parity", "filter", "parity-async",
                 "filter-async"):
        mine = [r for r in rows if r["case"] == case]
        summary[case] = {"bytes_per_save": statistics.mean(r["bytes"] for r in mine),
                         "seconds_per_save": statistics.mean(r["seconds"] for r in mine),
                         "seconds_stdev": statistics.pstdev(r["seconds"] for r in mine),
                         "background_per_save": statistics.mean(r["background"] for r in mine)
                         if mine[0].get("background") is not None else None,
                         "host_bytes": max(r.get("host_bytes", 0) for r in mine),
                         "saves": len(mine)}
    full = summary["full+fsync"]  # save_layers fsyncs every file: compare like with like
    print(f"{args.layers}-layer Llama, hidden {args.hidden}, world size {args.world_size}, "
          f"{args.reps} repetitions (mean per save; partial cases averaged over a cycle)")
    print(f"{'case':<14}{'MB/save':>9}{'blocked s':>11}{'bg s':>8}{'bytes vs full':>15}"
          f"{'time vs full+fsync':>20}{'stall/full+fsync':>18}")
    for case, s in summary.items():
        s["bytes_ratio"] = full["bytes_per_save"] / s["bytes_per_save"]
        s["time_ratio"] = full["seconds_per_save"] / s["seconds_per_save"]
        s["stall_fraction"] = s["seconds_per_save"] / full["seconds_per_save"]
        bg = s["background_per_save"]
        print(f"{case:<14}{s['bytes_per_save'] / 1e6:>9.1f}{s['seconds_per_save']:>11.3f}"
              f"{'-' if bg is None else f'{bg:.3f}':>8}{s['bytes_ratio']:>14.2f}x"
              f"{s['time_ratio']:>19.2f}x{s['stall_fraction']:>18.3f}")
    OUT.mkdir(exist_ok=True)
    (OUT / "save_bench_isolated.json").write_text(json.dumps(
        {"args": vars(args), "summary": summary, "rows": rows}, indent=2))
    print(f"wrote {OUT / 'save_bench_isolated.json'}")


def loop_table(args, rows: list[dict], about: dict) -> None:
    """Per case: bytes, blocked and overhead seconds per save, and both as ratios of the
    fsynced synchronous full save's blocked seconds."""
    base = {r["rep"]: r for r in rows if r["case"] == "none"}

    def per_save(mine: list[dict], key: str) -> float:
        """The case's figure minus the loop without saves' (the same repetition), per save."""
        return statistics.mean((r[key] - base[r["rep"]][key]) / r["saves"] for r in mine)

    summary = {}
    for case in dict.fromkeys(r["case"] for r in rows if r["case"] != "none"):
        mine = [r for r in rows if r["case"] == case]
        summary[case] = {
            "bytes_per_save": statistics.mean(r["bytes"] for r in mine),
            "blocked_per_save": statistics.mean(r["blocked"] / r["saves"] for r in mine),
            "overhead_per_save": per_save(mine, "wall"),
            **{f"{key}_per_save": per_save(mine, key) for key in CPU_COUNTERS},
            "wall": statistics.mean(r["wall"] for r in mine), "saves": mine[0]["saves"],
            "reps": len(mine)}
    full = summary["full+fsync"]["blocked_per_save"]
    for s in summary.values():
        s["blocked_vs_full_fsync"] = s["blocked_per_save"] / full
        s["overhead_vs_full_fsync"] = s["overhead_per_save"] / full
    none = statistics.mean(r["wall"] for r in base.values())
    print(", ".join(f"{k} {v}" for k, v in about.items()))
    print(f"{args.layers}-layer Llama, hidden {args.hidden}, world size {args.world_size} "
          f"({args.device}): {args.steps} steps with {summary['full+fsync']['saves']} saves "
          f"per loop, "
          f"{args.reps} repetitions; the loop without saves: {none:.2f} s")
    print(f"{'case':<14}{'MB/save':>9}{'blocked s':>11}{'overhead s':>12}"
          f"{'blocked/full+fsync':>20}{'overhead/full+fsync':>21}"
          f"{'CPU s rank 0':>14}{'CPU s machine':>15}")
    for case, s in summary.items():
        print(f"{case:<14}{s['bytes_per_save'] / 1e6:>9.1f}{s['blocked_per_save']:>11.3f}"
              f"{s['overhead_per_save']:>12.3f}{s['blocked_vs_full_fsync']:>20.3f}"
              f"{s['overhead_vs_full_fsync']:>21.3f}{s['cpu_rank0_per_save']:>14.3f}"
              f"{s['cpu_machine_per_save']:>15.3f}")
    OUT.mkdir(exist_ok=True)
    out = OUT / ("save_bench_cuda.json" if args.device == "cuda" else "save_bench.json")
    out.write_text(json.dumps({"args": vars(args), "loop_without_saves_s": none,
                               "summary": summary, "rows": rows, "about": about}, indent=2))
    print(f"wrote {out}")


def stats_table(args, rows: list[dict]) -> None:
    """Blocked seconds per partial save with stats= beside the same case without it."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    mean = {c: statistics.mean(r["seconds"] for r in rows if r["case"] == c) for c in cases}
    print(f"{args.layers}-layer Llama, hidden {args.hidden}, world size {args.world_size}, "
          f"{2 * args.reps} partial saves per case (mean seconds training is blocked)")
    print(f"{'case':<16}{'no stats s':>12}{'stats s':>10}{'stats/no stats':>16}")
    summary = {}
    for c in cases:
        if c.endswith("+stats"):
            continue
        with_stats = mean[f"{c}+stats"]
        summary[c] = {"seconds": mean[c], "seconds_stats": with_stats,
                      "ratio": with_stats / mean[c]}
        print(f"{c:<16}{mean[c]:>12.3f}{with_stats:>10.3f}{with_stats / mean[c]:>15.2f}x")
    OUT.mkdir(exist_ok=True)
    (OUT / "save_bench_stats.json").write_text(json.dumps(
        {"args": vars(args), "summary": summary, "rows": rows}, indent=2))
    print(f"wrote {OUT / 'save_bench_stats.json'}")


if __name__ == "__main__":
    main()
