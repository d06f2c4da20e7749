"""Merge speed against the physical limit and a naive baseline, scaling with ranks, resharding
and memory per rank.

    python -m bench.merge_bench [--world-sizes 4 1 8 16] [--ranks 1 2 4] [--reps 3]
        [--cases merge copy reshard naive] [--cache cold warm] [--reshard-to 16]
        [--engine DIR] [--quick] [--json NAME]

Inputs, per world size W, two checkpoints (steps 1 and 2) of a random-init Llama trained with
real DeepSpeed on CPU, cached in .cache/bench:
  W=4     12 layers, hidden 1024, vocab 16384: 188M parameters, 2.25 GB of ZeRO-3 state each;
  W=1     16 layers (otherwise the same): 239M parameters, 2.87 GB each (one partition);
  W=8,16  the W=4 run resharded by mpitailor (8 or 16 training processes of it do not fit in
          24 GiB beside the page cache).
Cases, run side by side and repeated, cold (inputs dropped from the page cache with
POSIX_FADV_DONTNEED before each run) and warm:
  merge    mpitailor parity merge of the two checkpoints, with M MPI ranks
  reshard  the same merge written for --reshard-to ranks (skipped where W equals it)
  copy     copying one checkpoint's files with M ranks (each byte read once, written once;
           an equal byte share per rank)
  naive    torch.load every source rank file whole, rebuild, torch.save (one process)
Times are measured inside the programs (start-up excluded) and every write is fsynced. Peak
RSS per rank is what each rank reports (--stats); `life GB` is the peak RSS of the largest
process of the whole launch (start-up and commit included), from wait4 on the launcher;
`other` is how many cores anything else on the machine kept busy during a run (worst rep).
--engine DIR runs mpitailor from DIR (a tree holding an mpitailor/ package, such as
`git archive HEAD mpitailor | tar -x -C DIR && git rev-parse HEAD > DIR/COMMIT`) instead of
this working tree.
Prints a table and the goal block (bench/merge_goals.py), writes bench/out/merge_bench.json
(or --json NAME) and a PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.merge_goals import evaluate, print_goals

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
CACHE = REPO / ".cache" / "bench"
RECIPE = REPO / "recipes" / "parity.yml"
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
MODEL = dict(layers=12, hidden=1024, intermediate=2816, heads=16, kv_heads=16, vocab=16384,
             dtype="bf16", steps=2, save_at=(1, 2), seq_len=16, micro_batch=1)
BIG = dict(MODEL, layers=16)  # the world-size-1 input: >= 2.8 GB of ZeRO-3 state
QUICK = dict(MODEL, layers=4, hidden=512, intermediate=1024, vocab=4096)
CASES = ("merge", "copy", "reshard", "naive")
OTHER_WARN = 0.3  # cores kept busy by anything else during a run: the timing is suspect


def model_for(world: int, quick: bool) -> tuple[str, dict]:
    """(cache dir name, TrainSpec fields) of the input trained at `world`."""
    if quick:
        return f"llama-w{world}-quick", QUICK
    return (f"llama-w{world}-l{BIG['layers']}", BIG) if world == 1 else (f"llama-w{world}", MODEL)


def checkpoints(world: int, quick: bool) -> Path:
    name, model = model_for(world, quick)
    root = CACHE / name
    if not (root / "DONE").exists():
        from dev.tinytrain import TrainSpec, launch  # from --engine's tree when given

        shutil.rmtree(root, ignore_errors=True)
        t = time.perf_counter()
        if world <= 4:
            launch(TrainSpec(save_dir=str(root), world_size=world, **model), timeout=3600)
        else:  # 8 or 16 training processes of this model do not fit in 24 GiB with the
            reshard(checkpoints(4, quick), root, world)  # page cache: reshard W=4's
        (root / "DONE").write_text("ok")
        print(f"built {root} in {time.perf_counter() - t:.0f}s "
              f"({dir_bytes(root) / 1e9:.2f} GB)", flush=True)
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


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def drop_cache(root: Path) -> None:
    os.sync()
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def run(cmd: list[str], env: dict, stats: Path, log: Path) -> dict:
    """Run cmd; its --stats JSON plus wall time and the peak RSS of its largest process
    (wait4 on the launcher covers every descendant it and its proxies waited for)."""
    t, busy = time.perf_counter(), busy_seconds()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT)
        timer = threading.Timer(3600, p.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}")
    out = json.loads(stats.read_text())
    out["wall"] = time.perf_counter() - t
    out["launch_peak_rss"] = usage.ru_maxrss * 1024
    ours = usage.ru_utime + usage.ru_stime
    out["other_cores"] = max(0.0, busy_seconds() - busy - ours) / out["wall"]
    return out


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes, kernel threads too)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def one(case: str, ranks: int, root: Path, scratch: Path, cold: bool, target: int) -> dict:
    out, stats = scratch / "out", scratch / "stats.json"
    shutil.rmtree(out, ignore_errors=True)
    stats.unlink(missing_ok=True)
    if cold:
        drop_cache(root)
    env = {"NEW": str(root / "global_step2"), "OLD": str(root / "global_step1"),
           "OUT": str(out)}
    py = [sys.executable, "-m"]
    if case in ("merge", "reshard"):
        cmd = [MPIEXEC, "-n", str(ranks), *py, "mpitailor", str(RECIPE), "--no-progress",
               "-q", "--stats", str(stats)]
        cmd += ["--world-size", str(target)] if case == "reshard" else []
    elif case == "copy":
        cmd = [MPIEXEC, "-n", str(ranks), *py, "bench.copy_ranks", env["NEW"], str(out),
               "--stats", str(stats)]
    else:
        cmd = [*py, "bench.naive_merge", str(RECIPE), "--stats", str(stats)]
    result = run(cmd, env, stats, scratch / "log.txt")
    out_shard = max((p.stat().st_size for p in out.rglob("*optim_states.pt")), default=0)
    shutil.rmtree(out, ignore_errors=True)
    r0 = result["ranks"]
    return {"case": case, "ranks": ranks, "cold": cold, "seconds": result["seconds"],
            "wall": result["wall"], "bytes_written": result["bytes_written"],
            "peak_rss": max(r["peak_rss_bytes"] for r in r0),
            "peak_rss_ranks": [r["peak_rss_bytes"] for r in r0],
            "launch_peak_rss": result["launch_peak_rss"], "out_shard_bytes": out_shard,
            "other_cores": result["other_cores"],
            "max_rank_written": max(r["bytes_written"] for r in r0),
            "read_calls_bytes": max(r["read_calls_bytes"] for r in r0),
            "storage_read_bytes": max(r["storage_read_bytes"] for r in r0)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[4, 1, 8, 16])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--cache", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    ap.add_argument("--reshard-to", type=int, default=16, help="output world size of reshard")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--engine", help="run mpitailor from this tree instead of the working tree")
    ap.add_argument("--json", default="merge_bench.json", help="output name under bench/out")
    ap.add_argument("--quick", action="store_true", help="small models (smoke test)")
    return ap.parse_args()


def use_engine(engine: str | None) -> dict:
    """Make every mpitailor import (here and in every child) come from `engine`."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    if engine is None:
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "mpitailor"],
                               capture_output=True, text=True).stdout.strip()
        os.chdir(REPO)
        return {"dir": str(REPO), "repo_head": head, "mpitailor_modified": bool(dirty)}
    tree = Path(engine).resolve()
    if not (tree / "mpitailor" / "__init__.py").is_file():
        raise SystemExit(f"--engine {engine}: no mpitailor/__init__.py there; make one with "
                         f"`git archive HEAD mpitailor | tar -x -C {engine}`")
    os.chdir(tree)  # `python -m` puts the working directory first on sys.path
    sys.path.insert(0, str(tree))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(tree), str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    commit = tree / "COMMIT"  # written by whoever made the tree (see the module docstring)
    return {"dir": str(tree), "commit": commit.read_text().strip() if commit.is_file() else None,
            "repo_head": head}


def main() -> None:
    args = parse_args()
    engine = use_engine(args.engine)
    OUT.mkdir(exist_ok=True)
    scratch = OUT / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    rows, inputs = [], {}
    caches = [c == "cold" for c in args.cache]
    for world in args.world_sizes:
        root = checkpoints(world, args.quick)
        shard = largest_shard(root)
        inputs[world] = {"dir": str(root), "model": model_for(world, args.quick)[1],
                         "checkpoint_bytes": dir_bytes(root / "global_step2"),
                         "largest_shard_bytes": shard}
        cases = [(c, m) for c in args.cases if c != "naive" for m in args.ranks
                 if not (c == "reshard" and world == args.reshard_to)]
        cases += [("naive", 1)] if "naive" in args.cases else []
        for rep in range(args.reps):
            for cold in caches:
                for case, m in cases:
                    row = one(case, m, root, scratch, cold, args.reshard_to)
                    row.update(world=world, rep=rep, shard_bytes=shard,
                               out_world=args.reshard_to if case == "reshard" else world,
                               input_bytes=inputs[world]["checkpoint_bytes"])
                    rows.append(row)
                    print(f"w{world} {case:<7} ranks={m} {'cold' if cold else 'warm'} "
                          f"{row['seconds']:.2f}s  peak RSS {row['peak_rss'] / 1e9:.2f} GB  "
                          f"other {row['other_cores']:.2f} cores", flush=True)
    summary = summarize(rows)
    goals = evaluate(summary)
    print_table(summary)
    print_goals(goals)
    path = OUT / args.json
    command = " ".join(["python -m bench.merge_bench", *sys.argv[1:]])
    path.write_text(json.dumps({"args": vars(args), "command": command, "engine": engine,
                                "inputs": inputs, "summary": summary, "goals": goals,
                                "rows": rows}, indent=2))
    plot(summary, path.with_suffix(".png"))
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def largest_shard(root: Path) -> int:
    return max(p.stat().st_size for p in (root / "global_step2").glob("*optim_states.pt"))


def summarize(rows: list[dict]) -> list[dict]:
    keys = sorted({(r["world"], r["case"], r["ranks"], r["cold"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2], not k[3]))
    out = []
    for world, case, ranks, cold in keys:
        mine = [r for r in rows if (r["world"], r["case"], r["ranks"], r["cold"]) ==
                (world, case, ranks, cold)]
        s = statistics.median(r["seconds"] for r in mine)
        peak = max(r["peak_rss"] for r in mine)
        out_shard = max(r["out_shard_bytes"] for r in mine) or mine[0]["shard_bytes"]
        out.append({"world": world, "case": case, "ranks": ranks, "cold": cold,
                    "out_world": mine[0]["out_world"], "reps": len(mine),
                    "input_gb": mine[0]["input_bytes"] / 1e9,
                    "seconds": s, "spread": max(r["seconds"] for r in mine) -
                    min(r["seconds"] for r in mine),
                    "gb_written": mine[0]["bytes_written"] / 1e9,
                    "gb_per_s": mine[0]["bytes_written"] / s / 1e9,
                    "peak_rss_gb": peak / 1e9,
                    "peak_rss_ranks_gb": [max(r["peak_rss_ranks"][i] for r in mine) / 1e9
                                          for i in range(len(mine[0]["peak_rss_ranks"]))],
                    "launch_peak_rss_gb": max(r["launch_peak_rss"] for r in mine) / 1e9,
                    "out_shard_gb": out_shard / 1e9, "rss_over_shard": peak / out_shard,
                    "other_cores": max(r["other_cores"] for r in mine),
                    "read_over_written": max(r["read_calls_bytes"] / max(r["max_rank_written"], 1)
                                             for r in mine)})
    ratios(out)
    return out


def ratios(out: list[dict]) -> None:
    by = {(x["world"], x["case"], x["ranks"], x["cold"]): x for x in out}
    for x in out:
        key = (x["world"], x["ranks"], x["cold"])
        copy = by.get((key[0], "copy", *key[1:]))
        merge = by.get((key[0], "merge", *key[1:]))
        one_rank = by.get((x["world"], x["case"], 1, x["cold"]))
        if x["case"] in ("merge", "reshard") and copy:  # time to copy the same bytes
            x["merge_over_copy"] = copy["gb_per_s"] / x["gb_per_s"]
        if x["case"] == "reshard" and merge:
            x["reshard_over_merge"] = x["gb_per_s"] / merge["gb_per_s"]
        if x["case"] == "naive" and by.get((x["world"], "merge", 1, x["cold"])):
            x["naive_over_merge1"] = x["seconds"] / by[(x["world"], "merge", 1, x["cold"])][
                "seconds"]
        if one_rank:
            x["speedup_vs_1_rank"] = one_rank["seconds"] / x["seconds"]


def print_table(summary: list[dict]) -> None:
    nan = float("nan")
    print(f"{'W':>3} {'case':<8}{'ranks':>5} {'cache':<5}{'s':>7}{'GB/s':>6}{'x1rank':>7}"
          f"{'vs copy':>8}{'rs/m':>6}{'naive/m':>8}{'RSS GB':>7}{'life GB':>8}"
          f"{'RSS/shard':>10}{'read/wr':>8}{'other':>6}")
    for x in summary:
        case = f"rs->{x['out_world']}" if x["case"] == "reshard" else x["case"]
        print(f"{x['world']:>3} {case:<8}{x['ranks']:>5} {'cold' if x['cold'] else 'warm':<5}"
              f"{x['seconds']:>7.2f}{x['gb_per_s']:>6.2f}{x.get('speedup_vs_1_rank', nan):>7.2f}"
              f"{x.get('merge_over_copy', nan):>8.2f}{x.get('reshard_over_merge', nan):>6.2f}"
              f"{x.get('naive_over_merge1', nan):>8.2f}{x['peak_rss_gb']:>7.2f}"
              f"{x['launch_peak_rss_gb']:>8.2f}{x['rss_over_shard']:>10.2f}"
              f"{x['read_over_written']:>8.2f}{x['other_cores']:>6.2f}")
    busy = [x for x in summary if x["other_cores"] > OTHER_WARN]
    if busy:
        print(f"note: in {len(busy)} case(s) other work kept more than {OTHER_WARN} of a core "
              f"busy during a repetition (`other`): read those times with care")


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(9, len(summary) * 0.3), 4))
    labels = [f"W{x['world']} {x['case']} {x['ranks']}r {'cold' if x['cold'] else 'warm'}"
              for x in summary]
    colors = {"merge": "tab:blue", "reshard": "tab:green", "copy": "tab:gray",
              "naive": "tab:red"}
    ax.bar(range(len(summary)), [x["seconds"] for x in summary],
           color=[colors[x["case"]] for x in summary])
    ax.set_xticks(range(len(summary)), labels, rotation=90, fontsize=7)
    ax.set_ylabel("seconds (median)")
    ax.set_title("mpitailor parity merge and reshard vs copy (physical-limit proxy) vs naive")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
