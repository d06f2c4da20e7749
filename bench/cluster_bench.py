"""Merges across the nodes of a Slurm cluster: the cross-node path against one node.

    python -m bench.cluster_bench [--reps 3] [--cache cold warm] [--cases 1x4 2x2-local ...]
        [--quick] [--keep-inputs] [--json NAME]

Runs on the 3-node Slurm that `slurm/start-cluster.sh --nodes 3` starts on this host (started
here if it is not running, and stopped again at the end then). Input: the cached W=4 bench
checkpoints of bench/merge_bench.py (.cache/bench/llama-w4: saves global_step1 and
global_step2, 4 ranks, 2.25 GB each; --quick: llama-w4-quick, 337 MB for both). Cases, each
`srun ... python -m mpitailor recipes/parity.yml` (2 sources, parity):
  1x4          1 node x 4 ranks (n1), input and output on the shared file system
  2x2-local    2 nodes x 2 ranks (n1, n2) over node-local input, as DeepSpeed's
               use_node_local_storage leaves it: rank r's files on node r // 2 + 1, `latest`
               and the scripts on n1; output node-local (in place: each node writes its ranks)
  2x2-shared   2 nodes x 2 ranks over the shared input, output shared (reference)
  rs-3x2       the node-local input resharded 4 -> 6 ranks on 3 nodes x 2 (n3 holds nothing:
               its partitions' bytes come over MPI), output node-local
Run side by side, alternating (every case once per repetition), cold (inputs dropped from
the page cache first: POSIX_FADV_DONTNEED after sync; every node shares this host's page
cache) and warm (the case's input read once just before). Times: `seconds`, measured inside
mpitailor (--stats, top level: planning to publication, start-up excluded), and `wall`, the
srun command's (start-up of every rank, MPI across nodes, imports included). Medians of the repetitions. Prints a table and the
ratio 2x2-local / 1x4, writes bench/out/cluster_bench.json (or --json NAME).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.merge_bench import CACHE, OUT, REPO, busy_seconds, dir_bytes, drop_cache

RECIPE = REPO / "recipes" / "parity.yml"
START = REPO / "slurm" / "start-cluster.sh"
STOP = REPO / "slurm" / "stop-cluster.sh"
NODES = 3
CASES = ("1x4", "2x2-local", "2x2-shared", "rs-3x2")
GOAL = 1.3  # the cross-node path (2x2-local) within 1.3x of one node (1x4)
# Variables of an outer MPI or Slurm job must not reach srun (tests/cluster_util.py).
_OUTER = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "SLURM_")
RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_(model|optim)_states\.pt$")


def start_cluster(nodes: int = NODES, extra: list[str] = ()) -> tuple[dict, bool]:
    """The cluster's environment (SLURM_CONF, MPITAILOR_NODE_LOCAL, MPITAILOR_CLUSTER_DIR) and
    whether this call started it; `extra`: more options of start-cluster.sh (--disk-mbps)."""
    r = subprocess.run(["bash", str(START), "--nodes", str(nodes), *extra], capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"slurm/start-cluster.sh --nodes {nodes} {' '.join(extra)} exited "
                         f"{r.returncode}:\n{r.stderr}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OUTER)}
    env.update(re.findall(r"^export (\w+)=(.*)$", r.stdout, re.M))
    return env, "started slurmctld" in r.stderr


def node_dir(env: dict, i: int) -> Path:
    """Node nI's node-local dir as this host sees it."""
    return Path(env["MPITAILOR_CLUSTER_DIR"]) / "nodes" / f"n{i}" / "local"


def place_node_local(src: Path, env: dict, name: str) -> None:
    """src's saves as 4 ranks with use_node_local_storage on n1, n2 leave them: every rank's
    files on its node (r // 2 + 1), `latest` and the scripts on n1 only (global rank 0)."""
    for i in (1, 2):
        shutil.rmtree(node_dir(env, i) / name, ignore_errors=True)
    for p in sorted(src.rglob("*")):
        if not p.is_file() or p.name == "DONE":
            continue
        rel = p.relative_to(src)
        m = RANK_FILE.search(p.name)
        node = int(m.group(1)) // 2 + 1 if m else 1
        dest = node_dir(env, node) / name / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest)
    os.sync()


def srun_cmd(case: str) -> list[str]:
    layout = {"1x4": ["-N", "1", "-n", "4", "-w", "n1"],
              "2x2-local": ["-N", "2", "-n", "4", "--ntasks-per-node=2", "-w", "n1,n2"],
              "2x2-shared": ["-N", "2", "-n", "4", "--ntasks-per-node=2", "-w", "n1,n2"],
              "rs-3x2": ["-N", "3", "-n", "6", "--ntasks-per-node=2", "-w", "n1,n2,n3"]}[case]
    return ["srun", "--kill-on-bad-exit=1", *layout]


def warm_up(roots: list[Path]) -> None:
    """Read every file under roots once: a warm run finds its input in the page cache."""
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file():
                with open(p, "rb", buffering=0) as f:
                    while f.read(1 << 23):
                        pass


def remove_output(env: dict, shared_out: Path, name: str) -> None:
    shutil.rmtree(shared_out, ignore_errors=True)
    for i in range(1, NODES + 1):
        for p in node_dir(env, i).glob(f"*{name}*"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()


def one(case: str, env: dict, src: Path, local_in: str, scratch: Path, cold: bool,
        cached: list[Path]) -> dict:
    out_name = "bench-out"
    shared_out = scratch / out_name
    local_out = f"{env['MPITAILOR_NODE_LOCAL']}/{out_name}"
    remove_output(env, shared_out, out_name)
    stats = scratch / "stats.json"
    stats.unlink(missing_ok=True)
    if case in ("2x2-local", "rs-3x2"):
        job_env = {"NEW": f"{local_in}/global_step2", "OLD": f"{local_in}/global_step1",
                   "OUT": local_out}
    else:
        job_env = {"NEW": str(src / "global_step2"), "OLD": str(src / "global_step1"),
                   "OUT": str(shared_out)}
    cmd = [*srun_cmd(case), sys.executable, "-m", "mpitailor", str(RECIPE), "--no-progress",
           "-q", "--stats", str(stats)]
    cmd += ["--world-size", "6"] if case == "rs-3x2" else []
    if cold:
        for root in cached:
            drop_cache(root)
    else:  # the previous case may have dropped or never read this case's input
        warm_up([Path(job_env["NEW"]), Path(job_env["OLD"])] if case == "1x4" or
                case == "2x2-shared" else [d for d in cached if d != src])
    others, load = foreign_jobs(env), busy_cores(1.0)
    t = time.perf_counter()
    r = subprocess.run(cmd, env={**env, **job_env}, capture_output=True, text=True,
                       timeout=3600, cwd=REPO)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-4000:]}")
    result = json.loads(stats.read_text())
    ranks = result["ranks"]
    written_on = {i: dir_bytes(node_dir(env, i) / out_name)
                  for i in range(1, NODES + 1) if (node_dir(env, i) / out_name).exists()}
    remove_output(env, shared_out, out_name)
    return {"case": case, "cold": cold, "seconds": result["seconds"], "wall": wall,
            "bytes_written": result["bytes_written"],
            "bytes_mpi_sent": sum(x["bytes_mpi_sent"] for x in ranks),
            "bytes_mpi_received": [x["bytes_mpi_received"] for x in ranks],
            "bytes_read_files": [x["bytes_read_files"] for x in ranks],
            "peak_rss": max(x["peak_rss_bytes"] for x in ranks),
            "phases": [x["seconds"] for x in ranks],
            "node_bytes_written": written_on, "foreign_jobs": others, "busy_before": load}


def busy_cores(seconds: float) -> float:
    """Cores the machine kept busy over `seconds` before a run (nothing of this bench runs
    then): other work that would share the 2 cores with the run."""
    b, t = busy_seconds(), time.perf_counter()
    time.sleep(seconds)
    return (busy_seconds() - b) / (time.perf_counter() - t)


def foreign_jobs(env: dict) -> int:
    """Jobs in the cluster's queue before a run: another user of the cluster (the host's
    2 cores are shared by every node) would make that run's times suspect."""
    r = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True,
                       timeout=30)
    return len(r.stdout.split())


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for cold in sorted({r["cold"] for r in rows}, reverse=True):
        for case in CASES:
            mine = [r for r in rows if r["case"] == case and r["cold"] == cold]
            if not mine:
                continue
            s = [r["seconds"] for r in mine]
            w = [r["wall"] for r in mine]
            out.append({"case": case, "cold": cold, "reps": len(mine),
                        "seconds": statistics.median(s), "seconds_spread": max(s) - min(s),
                        "wall": statistics.median(w), "wall_spread": max(w) - min(w),
                        "gb_written": mine[0]["bytes_written"] / 1e9,
                        "gb_mpi": mine[0]["bytes_mpi_sent"] / 1e9,
                        "gb_mpi_received_by_rank": [v / 1e9 for v in
                                                    mine[0]["bytes_mpi_received"]],
                        "peak_rss_gb": max(r["peak_rss"] for r in mine) / 1e9,
                        "foreign_jobs": max(r["foreign_jobs"] for r in mine),
                        "busy_before": max(r["busy_before"] for r in mine)})
    by = {(x["case"], x["cold"]): x for x in out}
    for x in out:
        base = by.get(("1x4", x["cold"]))
        if base:
            x["seconds_over_1x4"] = x["seconds"] / base["seconds"]
            x["wall_over_1x4"] = x["wall"] / base["wall"]
    return out


def print_table(summary: list[dict]) -> None:
    nan = float("nan")
    print(f"{'case':<11}{'cache':<6}{'reps':>4}{'s':>8}{'±':>6}{'/1x4':>6}{'wall s':>8}{'±':>6}"
          f"{'/1x4':>6}{'GB out':>7}{'GB MPI':>7}{'RSS GB':>7}")
    for x in summary:
        print(f"{x['case']:<11}{'cold' if x['cold'] else 'warm':<6}{x['reps']:>4}"
              f"{x['seconds']:>8.2f}{x['seconds_spread']:>6.2f}"
              f"{x.get('seconds_over_1x4', nan):>6.2f}{x['wall']:>8.2f}{x['wall_spread']:>6.2f}"
              f"{x.get('wall_over_1x4', nan):>6.2f}{x['gb_written']:>7.2f}{x['gb_mpi']:>7.2f}"
              f"{x['peak_rss_gb']:>7.2f}")
    if any(x["foreign_jobs"] for x in summary):
        print("note: other jobs were queued on the cluster during some runs: those times are "
              "suspect")
    busy = max(x["busy_before"] for x in summary)
    if busy > 0.3:
        print(f"note: other work kept up to {busy:.2f} of the 2 cores busy in the second "
              f"before a run: read those times with care")


def goal_lines(summary: list[dict]) -> list[str]:
    lines = []
    for x in summary:
        if x["case"] == "2x2-local" and "seconds_over_1x4" in x:
            cache = "cold" if x["cold"] else "warm"
            met = "met" if x["seconds_over_1x4"] <= GOAL else "NOT met"
            lines.append(f"2x2-local / 1x4 ({cache}): {x['seconds_over_1x4']:.2f}x inside "
                         f"mpitailor, {x['wall_over_1x4']:.2f}x srun wall (goal <= {GOAL}x: "
                         f"{met} inside mpitailor)")
    return lines


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--cache", nargs="+", choices=("cold", "warm"), default=["cold", "warm"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="the small input (.cache/bench/llama-w4-quick, 337 MB)")
    ap.add_argument("--keep-inputs", action="store_true",
                    help="leave the node-local copy of the input in the nodes' dirs")
    ap.add_argument("--json", default="cluster_bench.json", help="output name under bench/out")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    src = CACHE / ("llama-w4-quick" if args.quick else "llama-w4")
    if not (src / "DONE").exists():
        raise SystemExit(f"{src}: no cached input; build it with `python -m bench.merge_bench "
                         f"--world-sizes 4{' --quick' if args.quick else ''}` first")
    os.chdir(REPO)
    env, started = start_cluster()
    OUT.mkdir(exist_ok=True)
    scratch = OUT / "cluster-scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    name = "bench-in"
    try:
        t = time.perf_counter()
        place_node_local(src, env, name)
        print(f"copied {src} to n1/n2's node-local dirs in {time.perf_counter() - t:.0f}s",
              flush=True)
        local_in = f"{env['MPITAILOR_NODE_LOCAL']}/{name}"
        cached = [src, node_dir(env, 1) / name, node_dir(env, 2) / name]
        rows = []
        for rep in range(args.reps):
            for cold in [c == "cold" for c in args.cache]:
                for case in args.cases:
                    row = one(case, env, src, local_in, scratch, cold, cached)
                    row["rep"] = rep
                    rows.append(row)
                    print(f"{case:<11}{'cold' if cold else 'warm'} rep {rep}: "
                          f"{row['seconds']:.2f}s inside, {row['wall']:.2f}s srun, "
                          f"{row['bytes_mpi_sent'] / 1e9:.3f} GB over MPI", flush=True)
    finally:
        if not args.keep_inputs:
            for i in (1, 2):
                shutil.rmtree(node_dir(env, i) / name, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
        if started:
            subprocess.run(["bash", str(STOP), "--nodes", str(NODES)], timeout=300,
                           env={**os.environ, "MPITAILOR_CLUSTER_DIR": env[
                               "MPITAILOR_CLUSTER_DIR"]})
    summary = summarize(rows)
    print_table(summary)
    goals = goal_lines(summary)
    for line in goals:
        print(line)
    path = OUT / args.json
    command = " ".join(["python -m bench.cluster_bench", *sys.argv[1:]])
    path.write_text(json.dumps({"args": vars(args), "command": command, "input": str(src),
                                "input_bytes": dir_bytes(src / "global_step2"),
                                "summary": summary, "goals": goals, "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
