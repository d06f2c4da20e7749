"""Full DeepSpeed saves against selective layer-wise saves, on one engine, side by side.

    python -m bench.save_bench [--layers 32] [--hidden 256] [--reps 3] [--world-size 2] [--stats]

A 32-layer random-init Llama trained one step with DeepSpeed ZeRO-3 on CPU; then, repeated,
a full `save_checkpoint` (as DeepSpeed leaves it, and fsynced like mpitailor's saves), parity
partial saves (one cycle: 2 saves) and filter partial saves
(first 2 and last 2 layers every save, the others every 4th: one cycle of 4 saves), each
synchronous and asynchronous (`-async`: seconds are the time training is blocked; the
background write is reported apart). Reports mean bytes and seconds per save and the ratios
against the fsynced full save. Writes bench/out/save_bench.json.

`--stats` measures instead what `stats=` costs: LayerwiseCheckpointer's partial saves (parity,
adaptive; synchronous and asynchronous) with and without a stats log, side by side on the same
engine: seconds training is blocked per save and the ratio against the same case without stats.
Writes bench/out/save_bench_stats.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from dev.tinytrain import TrainSpec, launch

OUT = Path(__file__).resolve().parent / "out"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--stats", action="store_true", help="the cost of stats= (see above)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mpitailor-savebench-", dir=OUT.parent) as tmp:
        spec = TrainSpec(save_dir=tmp, world_size=args.world_size, layers=args.layers,
                         hidden=args.hidden, intermediate=2 * args.hidden, vocab=args.vocab,
                         grouping="per_layer", steps=1, save_at=(),
                         extra={"reps": args.reps, "stats": args.stats})
        result = launch(spec, module="bench.save_worker", timeout=3600)
    rows = result["rows"]
    if args.stats:
        stats_table(args, rows)
        return
    summary = {}
    for case in ("full", "full+fsync", "parity", "filter", "parity-async", "filter-async"):
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
    (OUT / "save_bench.json").write_text(json.dumps(
        {"args": vars(args), "summary": summary, "rows": rows}, indent=2))
    print(f"wrote {OUT / 'save_bench.json'}")


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
