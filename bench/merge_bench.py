"""Merge speed against the physical limit and a naive baseline, and scaling with ranks.

    python -m bench.merge_bench [--world-sizes 4 8] [--ranks 1 2 4] [--reps 3] [--quick]

Inputs: two checkpoints (steps 1 and 2) of a random-init 12-layer Llama (hidden 1024,
vocab 16384: 185M parameters, 2.2 GB of ZeRO-3 state per checkpoint) trained with real
DeepSpeed on CPU at world sizes 4 and 8 (16 training processes of it do not fit in 24 GiB:
world size 16 is the world-4 run resharded by mpitailor), cached in .cache/bench. Cases, run
side by side and repeated, cold (inputs dropped from the page cache with
POSIX_FADV_DONTNEED before each run) and warm:
  merge   mpitailor parity merge of the two checkpoints, with M MPI ranks
  copy    copying one checkpoint's files with M ranks (each byte read once, written once)
  naive   torch.load every source rank file whole, rebuild, torch.save (one process)
Times are measured inside the programs (start-up excluded) and every write is fsynced.
Prints a table, writes bench/out/merge_bench.json and bench/out/merge_bench.png.
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

from mpitailor.tinytrain import TrainSpec, launch

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
CACHE = REPO / ".cache" / "bench"
RECIPE = REPO / "recipes" / "parity.yml"
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
MODEL = dict(layers=12, hidden=1024, intermediate=2816, heads=16, kv_heads=16, vocab=16384,
             dtype="bf16", steps=2, save_at=(1, 2), seq_len=16, micro_batch=1)


def checkpoints(world: int, quick: bool) -> Path:
    model = dict(MODEL, layers=4, hidden=512, intermediate=1024, vocab=4096) if quick else MODEL
    root = CACHE / (f"llama-w{world}" + ("-quick" if quick else ""))
    if not (root / "DONE").exists():
        shutil.rmtree(root, ignore_errors=True)
        t = time.perf_counter()
        if world <= 8:
            launch(TrainSpec(save_dir=str(root), world_size=world, **model), timeout=3600)
        else:  # 16 training processes of this model do not fit in 24 GiB: reshard W=4's
            reshard(checkpoints(4, quick), root, world)
        (root / "DONE").write_text("ok")
        print(f"built {root} in {time.perf_counter() - t:.0f}s", flush=True)
    return root


def reshard(src: Path, root: Path, world: int) -> None:
    """Both saves of src, rewritten by mpitailor for `world` ranks (an identity merge)."""
    root.mkdir(parents=True)
    for tag in ("global_step1", "global_step2"):
        tmp = root / f"tmp-{tag}"
        recipe = root / "identity.yml"
        recipe.write_text(f"layers: {{rest: '{src / tag}'}}\noutput: '{tmp}'\n")
        subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpitailor", str(recipe),
                        "--world-size", str(world), "-q", "--no-progress"], check=True,
                       timeout=3600)
        (tmp / tag).rename(root / tag)
        shutil.rmtree(tmp)
        recipe.unlink()


def drop_cache(root: Path) -> None:
    os.sync()
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def run(cmd: list[str], env: dict, stats: Path) -> dict:
    t = time.perf_counter()
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=3600, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    out = json.loads(stats.read_text())
    out["wall"] = time.perf_counter() - t
    return out


def one(case: str, ranks: int, root: Path, scratch: Path, cold: bool) -> dict:
    out, stats = scratch / "out", scratch / "stats.json"
    shutil.rmtree(out, ignore_errors=True)
    if cold:
        drop_cache(root)
    env = {"NEW": str(root / "global_step2"), "OLD": str(root / "global_step1"),
           "OUT": str(out)}
    py = [sys.executable, "-m"]
    if case == "merge":
        cmd = [MPIEXEC, "-n", str(ranks), *py, "mpitailor", str(RECIPE), "--no-progress",
               "-q", "--stats", str(stats)]
    elif case == "copy":
        cmd = [MPIEXEC, "-n", str(ranks), *py, "bench.copy_ranks", env["NEW"], str(out),
               "--stats", str(stats)]
    else:
        cmd = [*py, "bench.naive_merge", str(RECIPE), "--stats", str(stats)]
    result = run(cmd, env, stats)
    shutil.rmtree(out, ignore_errors=True)
    r0 = result["ranks"]
    return {"case": case, "ranks": ranks, "cold": cold, "seconds": result["seconds"],
            "wall": result["wall"], "bytes_written": result["bytes_written"],
            "peak_rss": max(r["peak_rss_bytes"] for r in r0),
            "max_rank_written": max(r["bytes_written"] for r in r0),
            "read_calls_bytes": max(r["read_calls_bytes"] for r in r0),
            "storage_read_bytes": max(r["storage_read_bytes"] for r in r0)}


def largest_shard(root: Path) -> int:
    return max(p.stat().st_size for p in (root / "global_step2").glob("*optim_states.pt"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small model (smoke test)")
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    scratch = OUT / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    rows = []
    for wi, world in enumerate(args.world_sizes):
        root = checkpoints(world, args.quick)
        shard = largest_shard(root)
        main_world = wi == 0  # copy and naive baselines at the first world size
        for rep in range(args.reps):
            for cold in ((True, False) if main_world else (False,)):
                cases = [("merge", m) for m in args.ranks]
                if main_world:
                    cases += [("copy", m) for m in args.ranks] + [("naive", 1)]
                for case, m in cases:
                    row = one(case, m, root, scratch, cold)
                    row.update(world=world, rep=rep, shard_bytes=shard)
                    rows.append(row)
                    print(f"w{world} {case:<6} ranks={m} {'cold' if cold else 'warm'} "
                          f"{row['seconds']:.2f}s", flush=True)
    summary = summarize(rows)
    print_table(summary)
    (OUT / "merge_bench.json").write_text(json.dumps({"args": vars(args), "model": MODEL,
                                                      "summary": summary, "rows": rows},
                                                     indent=2))
    plot(summary, OUT / "merge_bench.png")
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {OUT / 'merge_bench.json'} and {OUT / 'merge_bench.png'}")


def summarize(rows: list[dict]) -> list[dict]:
    keys = sorted({(r["world"], r["case"], r["ranks"], r["cold"]) for r in rows})
    out = []
    for world, case, ranks, cold in keys:
        mine = [r for r in rows if (r["world"], r["case"], r["ranks"], r["cold"]) ==
                (world, case, ranks, cold)]
        s = statistics.median(r["seconds"] for r in mine)
        out.append({"world": world, "case": case, "ranks": ranks, "cold": cold,
                    "seconds": s, "spread": max(r["seconds"] for r in mine) -
                    min(r["seconds"] for r in mine),
                    "gb_per_s": mine[0]["bytes_written"] / s / 1e9,
                    "peak_rss_gb": max(r["peak_rss"] for r in mine) / 1e9,
                    "rss_over_shard": max(r["peak_rss"] for r in mine) / mine[0]["shard_bytes"],
                    "read_over_written": max(r["read_calls_bytes"] / r["max_rank_written"]
                                             for r in mine)})
    by = {(x["world"], x["case"], x["ranks"], x["cold"]): x for x in out}
    for x in out:

        copy = by.get((x["world"], "copy", x["ranks"], x["cold"]))
        one_rank = by.get((x["world"], x["case"], 1, x["cold"]))
        if x["case"] == "merge" and copy:
            x["merge_over_copy"] = x["seconds"] / copy["seconds"]
        if x["case"] == "naive" and by.get((x["world"], "merge", 1, x["cold"])):
            x["naive_over_merge1"] = x["seconds"] / by[(x["world"], "merge", 1, x["cold"])][
                "seconds"]
        if one_rank:
            x["speedup_vs_1_rank"] = one_rank["seconds"] / x["seconds"]
    return out


def print_table(summary: list[dict]) -> None:
    print(f"{'W':>3} {'case':<6}{'ranks':>6} {'cache':<5}{'s':>8}{'GB/s':>7}{'x1rank':>8}"
          f"{'vs copy':>9}{'naive/m':>9}{'RSS GB':>8}{'RSS/shard':>10}{'read/wr':>8}")
    for x in summary:
        print(f"{x['world']:>3} {x['case']:<6}{x['ranks']:>6} {'cold' if x['cold'] else 'warm':<5}"
              f"{x['seconds']:>8.2f}{x['gb_per_s']:>7.2f}{x.get('speedup_vs_1_rank', 0):>8.2f}"
              f"{x.get('merge_over_copy', float('nan')):>9.2f}"
              f"{x.get('naive_over_merge1', float('nan')):>9.2f}{x['peak_rss_gb']:>8.2f}"
              f"{x['rss_over_shard']:>10.2f}{x['read_over_written']:>8.2f}")


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"W{x['world']} {x['case']} {x['ranks']}r {'cold' if x['cold'] else 'warm'}"
              for x in summary]
    colors = {"merge": "tab:blue", "copy": "tab:gray", "naive": "tab:red"}
    ax.bar(range(len(summary)), [x["seconds"] for x in summary],
           color=[colors[x["case"]] for x in summary])
    ax.set_xticks(range(len(summary)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("seconds (median)")
    ax.set_title("mpitailor parity merge vs copy (physical-limit proxy) vs naive")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
