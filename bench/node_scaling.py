"""Node scaling: the same node-local merge (and recover) on 1, 2 and 4 nodes with their own disks.

    python -m bench.node_scaling [--nodes 1 2 4] [--rpn 1 4 16] [--recover-rpn 4 16]
        [--disk-mbps 6] [--node-cpus 0.5] [--disk-size 2] [--json node_scaling.json]

Runs on `slurm/start-cluster.sh --nodes 4 --disk-mbps M --node-cpus C` (started here in its
own dir, /var/tmp/mpitailor-nodescale, and stopped at the end): each node's node-local dir is
its own ext4 on its own loop device, reads and writes throttled to M MB/s per node, each a
budget of its own (see the top of slurm/start-cluster.sh for how), and each node's processes
capped at C cores (default: this host's cores / 4), so that the 4 emulated nodes do not take
CPU from each other and a node of a 1-node run has what a node of a 4-node run has. First a
probe on n1 (dd, cold): the disk's read, write and read-while-writing rates as the node sees
them. Input: the W=4 bench checkpoints of
bench/merge_bench.py --quick (.cache/bench/llama-w4-quick: a Llama of 4 layers, hidden 512,
trained 2 steps by real DeepSpeed on 4 CPU ranks; saves global_step1 and global_step2, 175 MB
each; built on first use, ~1 min). For N nodes the save dir is laid out as DeepSpeed's
use_node_local_storage leaves it on N nodes: rank r's files on node r * N // 4 + 1, `latest` and
the scripts on n1. Cases, each one srun over the nodes `-N N -n N*R --ntasks-per-node R`:
  merge    recipes/parity.yml over the node-local saves, output node-local
           (--ranks-per-node 4/N: output rank r on the node that holds input rank r)
  recover  `mpitailor recover` of the node-local save dir, output node-local
Every run is cold: the inputs are dropped from the page cache (POSIX_FADV_DONTNEED) first, so
every byte is read from the throttled disks. mpitailor runs from a snapshot of HEAD's package
(bench/out/node-scaling-engine; its commit is in the JSON). Recorded per run: `seconds` (inside mpitailor,
--stats: planning to publication, start-up excluded), `wall` (the srun command: start-up of
every rank included), bytes over MPI (--stats, per rank, from mpitailor/cluster/exchange.py),
bytes read per node (the sum of --stats bytes_read_files of the node's ranks, by the node each
rank's record names: what the copy program read), bytes written per node (the output files on
each node's disk), what each node's disk device moved (/sys/block/loopK/stat before and after:
file system metadata and journal included) and the CPU seconds of each node's ranks (--stats
cpu_seconds, the partition work). Every output
file is checked byte-identical to a 1-rank merge (recover) of a shared copy on the host; a
mismatch stops the bench. Prints a table and the goal (time on N nodes <= 1.2 x (1-node time /
N), same ranks per node), writes bench/results/node_scaling.json (or --json NAME).
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.cluster_bench import RANK_FILE, busy_cores, node_dir, start_cluster
from bench.merge_bench import OUT, REPO, checkpoints, dir_bytes, drop_cache

RESULTS = REPO / "bench" / "results"
ENGINE = OUT / "node-scaling-engine"  # HEAD's mpitailor: others edit the working tree meanwhile
STOP = REPO / "slurm" / "stop-cluster.sh"
RECIPE = REPO / "recipes" / "parity.yml"
CLUSTER_DIR = "/var/tmp/mpitailor-nodescale"
MAX_NODES = 4
WORLD = 4  # the input's DeepSpeed world size
GOAL = 1.2  # time on N nodes <= GOAL x (1-node time / N)
MANIFEST = "mpitailor_manifest.json"  # names its node: the one file that differs per node


def snapshot_engine() -> str:
    """HEAD's mpitailor package in ENGINE (every rank runs it from there: `python -m` finds
    the package in its working dir first); HEAD's commit."""
    shutil.rmtree(ENGINE, ignore_errors=True)
    ENGINE.mkdir(parents=True)
    tar = subprocess.run(["git", "archive", "HEAD", "mpitailor"], cwd=REPO, check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(ENGINE)], input=tar, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, check=True, text=True,
                          capture_output=True).stdout.strip()


def place(src: Path, env: dict, nodes: int, name: str) -> None:
    """src's save dir as `nodes` nodes with use_node_local_storage leave it."""
    for i in range(1, MAX_NODES + 1):
        shutil.rmtree(node_dir(env, i) / name, ignore_errors=True)
    for p in sorted(src.rglob("*")):
        if not p.is_file() or p.name == "DONE":
            continue
        m = RANK_FILE.search(p.name)
        node = int(m.group(1)) * nodes // WORLD + 1 if m else 1
        dest = node_dir(env, node) / name / p.relative_to(src)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest)
    os.sync()


def reference(src: Path, scratch: Path, case: str) -> Path:
    """The case's output by one process on the host from the shared copy."""
    out = scratch / f"ref-{case}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mpitailor", *args_of(case, str(src), str(out)), "-q",
           "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ENGINE,
                       env={**os.environ, "NEW": str(src / "global_step2"),
                            "OLD": str(src / "global_step1"), "OUT": str(out)})
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return out


def args_of(case: str, save: str, out: str) -> list[str]:
    return [str(RECIPE)] if case == "merge" else ["recover", save, "-o", out]


def check_identical(ref: Path, env: dict, nodes: int, name: str) -> int:
    """Every node's output files equal the reference's, and together they are all of them.
    The number of files compared."""
    want = {p.relative_to(ref) for p in ref.rglob("*") if p.is_file()}
    seen, compared = set(), 0
    for i in range(1, nodes + 1):
        root = node_dir(env, i) / name
        for p in root.rglob("*") if root.exists() else ():
            rel = p.relative_to(root)
            if not p.is_file() or rel.name == MANIFEST:
                continue
            if rel not in want or not filecmp.cmp(ref / rel, p, shallow=False):
                raise SystemExit(f"n{i}:{rel} differs from the 1-rank output {ref / rel}")
            seen.add(rel)
            compared += 1
    missing = {r for r in want if r.name != MANIFEST} - seen
    if missing:
        raise SystemExit(f"no node holds {sorted(map(str, missing))[:3]} of the 1-rank output")
    return compared


def device_bytes(env: dict, nodes: int) -> list[tuple[int, int]]:
    """(bytes read, bytes written) so far by each node's disk device (/sys/block/loopK/stat:
    sectors of 512 bytes, fields 3 and 7)."""
    out = []
    for i in range(1, nodes + 1):
        loop = Path(env["MPITAILOR_CLUSTER_DIR"], "nodes", f"n{i}", "loop").read_text().strip()
        f = Path("/sys/block", Path(loop).name, "stat").read_text().split()
        out.append((int(f[2]) * 512, int(f[6]) * 512))
    return out


PROBE = """set -e
cd "$MPITAILOR_NODE_LOCAL"; rm -f probe-a probe-b
drop() { python3 -c 'import os, sys
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "$@"; }
now() { python3 -c 'import time; print(time.time())'; }
a=$(now); dd if=/dev/zero of=probe-a bs=4M count=$1 status=none; b=$(now); echo write $a $b
sync; drop probe-a
a=$(now); dd if=probe-a of=/dev/null bs=4M status=none; b=$(now); echo read $a $b
drop probe-a
a=$(now); dd if=probe-a of=/dev/null bs=4M status=none & dd if=/dev/zero of=probe-b bs=4M count=$1 status=none; wait; b=$(now)
echo both $a $b; rm -f probe-a probe-b
"""


def probe_disk(env: dict, mb: int = 48) -> dict:
    """n1's disk as its tasks see it, cold: MB/s of a write, a read, and of a read and a write
    of the same size at once (read + written over the time of both)."""
    chunks = mb // 4
    r = subprocess.run(["srun", "-N", "1", "-n", "1", "-w", "n1", "bash", "-c", PROBE, "probe",
                        str(chunks)], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"the disk probe on n1 failed:\n{r.stderr[-2000:]}")
    spans = {w: float(b) - float(a) for w, a, b in (ln.split() for ln in r.stdout.split("\n")
                                                     if ln)}
    size = chunks * 4 * 2**20 / 1e6
    return {"write_MBps": size / spans["write"], "read_MBps": size / spans["read"],
            "read_and_write_MBps": 2 * size / spans["both"], "probe_MB": size}


def one(case: str, env: dict, nodes: int, rpn: int, name: str, scratch: Path,
        ref: Path) -> dict:
    local = env["MPITAILOR_NODE_LOCAL"]
    out_name = f"{name}-out"
    for i in range(1, MAX_NODES + 1):
        shutil.rmtree(node_dir(env, i) / out_name, ignore_errors=True)
    stats = scratch / "stats.json"
    stats.unlink(missing_ok=True)
    save, out = f"{local}/{name}", f"{local}/{out_name}"
    hosts = ",".join(f"n{i}" for i in range(1, nodes + 1))
    cmd = ["srun", "--immediate=60", "--kill-on-bad-exit=1", "-N", str(nodes), "-n", str(nodes * rpn),
           f"--ntasks-per-node={rpn}", "-w", hosts, sys.executable, "-m", "mpitailor",
           *args_of(case, save, out), "--no-progress", "-q", "--stats", str(stats),
           "--ranks-per-node", str(WORLD // nodes)]
    for i in range(1, nodes + 1):
        drop_cache(node_dir(env, i) / name)
    load = busy_cores(1.0)
    dev0 = device_bytes(env, nodes)
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ENGINE,
                       env={**env, "NEW": f"{save}/global_step2", "OLD": f"{save}/global_step1",
                            "OUT": out})
    wall = time.perf_counter() - t
    dev = [(r1 - r0, w1 - w0) for (r0, w0), (r1, w1) in zip(dev0, device_bytes(env, nodes))]
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-4000:]}")
    ranks = json.loads(stats.read_text())["ranks"]
    files = check_identical(ref, env, nodes, out_name)
    written = [dir_bytes(node_dir(env, i) / out_name) for i in range(1, nodes + 1)]
    # per node, by the node each rank's --stats record names (not by srun's layout)
    of_node = [[x for x in ranks if x["node"] == f"n{i}"] for i in range(1, nodes + 1)]
    if sum(map(len, of_node)) != len(ranks):
        raise SystemExit(f"--stats names nodes {sorted({x['node'] for x in ranks})}, "
                         f"not n1..n{nodes}")
    read = [sum(x["bytes_read_files"] for x in mine) for mine in of_node]
    mpi_in = [sum(x["bytes_mpi_received"] for x in mine) for mine in of_node]
    cpu = [sum(x["cpu_seconds"] for x in mine) for mine in of_node]
    for i in range(1, MAX_NODES + 1):
        shutil.rmtree(node_dir(env, i) / out_name, ignore_errors=True)
    return {"case": case, "nodes": nodes, "ranks_per_node": rpn, "ranks": nodes * rpn,
            "seconds": json.loads(stats.read_text())["seconds"], "wall": wall,
            "bytes_mpi_sent": sum(x["bytes_mpi_sent"] for x in ranks),
            "node_bytes_read": read, "node_bytes_written": written,
            "node_bytes_mpi_received": mpi_in, "node_device_read": [d[0] for d in dev],
            "node_device_written": [d[1] for d in dev], "node_cpu_seconds": cpu,
            "files_identical": files,
            "busy_before": load, "command": " ".join(cmd[:cmd.index(sys.executable)])}


def goal_lines(rows: list[dict]) -> list[str]:
    lines = []
    by = {(r["case"], r["nodes"], r["ranks_per_node"]): r for r in rows}
    for r in rows:
        base = by.get((r["case"], 1, r["ranks_per_node"]))
        if r["nodes"] == 1 or not base:
            continue
        for key in ("seconds", "wall"):
            ratio = r[key] / (base[key] / r["nodes"])
            r[f"{key}_over_ideal"] = ratio
        met = "met" if r["seconds_over_ideal"] <= GOAL else "NOT met"
        lines.append(f"{r['case']} {r['nodes']}x{r['ranks_per_node']}: "
                     f"{r['seconds_over_ideal']:.2f}x the 1-node time / {r['nodes']} inside "
                     f"mpitailor, {r['wall_over_ideal']:.2f}x srun wall (goal <= {GOAL}: {met})")
    return lines


def print_table(rows: list[dict]) -> None:
    print(f"{'case':<8}{'N':>2}{'R/N':>4}{'ranks':>6}{'s':>8}{'wall s':>8}{'MB MPI':>8}"
          f"{'MB read/node':>16}{'MB written/node':>16}{'device MB r+w/node':>20}"
          f"{'CPU s/node':>16}{'busy':>6}")
    for r in rows:
        rd = "/".join(f"{b / 1e6:.0f}" for b in r["node_bytes_read"])
        wr = "/".join(f"{b / 1e6:.0f}" for b in r["node_bytes_written"])
        dv = "/".join(f"{(a + b) / 1e6:.0f}"
                      for a, b in zip(r["node_device_read"], r["node_device_written"]))
        cpu = "/".join(f"{c:.1f}" for c in r["node_cpu_seconds"])
        print(f"{r['case']:<8}{r['nodes']:>2}{r['ranks_per_node']:>4}{r['ranks']:>6}"
              f"{r['seconds']:>8.2f}{r['wall']:>8.2f}{r['bytes_mpi_sent'] / 1e6:>8.1f}"
              f"{rd:>16}{wr:>16} {dv:>19} {cpu:>15}{r['busy_before']:>6.2f}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", nargs="+", type=int, choices=(1, 2, 4), default=[1, 2, 4])
    ap.add_argument("--rpn", nargs="+", type=int, default=[1, 4, 16],
                    help="ranks per node of the merges")
    ap.add_argument("--recover-rpn", nargs="*", type=int, default=[4, 16],
                    help="ranks per node of the recovers (none: no recover)")
    ap.add_argument("--disk-mbps", type=int, default=6, help="each node's disk, read and write")
    ap.add_argument("--node-cpus", type=float, default=(os.cpu_count() or 2) / MAX_NODES,
                    help="cores each node's processes may use (default: this host's / 4)")
    ap.add_argument("--disk-size", type=int, default=2, help="GiB per node disk")
    ap.add_argument("--json", default="node_scaling.json", help="output name under bench/results")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    src = checkpoints(WORLD, True)
    commit = snapshot_engine()
    os.chdir(REPO)
    os.environ["MPITAILOR_CLUSTER_DIR"] = CLUSTER_DIR
    # Each node advertises as many CPUs as the most ranks per node: else srun waits forever.
    os.environ["MPITAILOR_SLURM_CPUS"] = str(max(8, *args.rpn, *args.recover_rpn))
    cpus = f"{args.node_cpus:g}"
    env, started = start_cluster(MAX_NODES, ["--disk-mbps", str(args.disk_mbps),
                                             "--disk-size", str(args.disk_size),
                                             "--node-cpus", cpus])
    if (env.get("MPITAILOR_DISK_MBPS"), env.get("MPITAILOR_NODE_CPUS")) != \
            (str(args.disk_mbps), cpus):
        raise SystemExit(f"the cluster in {CLUSTER_DIR} runs without --disk-mbps "
                         f"{args.disk_mbps} --node-cpus {cpus}: stop it first "
                         f"(bash {STOP} --nodes {MAX_NODES})")
    OUT.mkdir(exist_ok=True)
    scratch = OUT / "node-scaling-scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    name, rows = "ns-in", []
    cases = [("merge", r) for r in args.rpn] + [("recover", r) for r in args.recover_rpn]
    try:
        probe = probe_disk(env)
        print("n1's disk: " + ", ".join(f"{k} {v:.1f}" for k, v in probe.items()), flush=True)
        refs = {c: reference(src, scratch, c) for c in sorted({c for c, _ in cases})}
        for nodes in args.nodes:
            place(src, env, nodes, name)
            for case, rpn in cases:
                row = one(case, env, nodes, rpn, name, scratch, refs[case])
                rows.append(row)
                print(f"{case:<8}{nodes}x{rpn:<3}: {row['seconds']:.2f}s inside, "
                      f"{row['wall']:.2f}s srun, {row['files_identical']} files identical to "
                      f"the 1-rank output", flush=True)
    finally:
        for i in range(1, MAX_NODES + 1):
            shutil.rmtree(node_dir(env, i) / name, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
        if started:
            subprocess.run(["bash", str(STOP), "--nodes", str(MAX_NODES)], timeout=300,
                           env={**os.environ, "MPITAILOR_CLUSTER_DIR": CLUSTER_DIR})
    goals = goal_lines(rows)
    print_table(rows)
    for line in goals:
        print(line)
    if max(r["busy_before"] for r in rows) > 0.3:
        print("note: other work kept cores busy in the second before some runs (column busy)")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / args.json
    path.write_text(json.dumps({
        "command": " ".join(["python -m bench.node_scaling", *sys.argv[1:]]),
        "args": vars(args), "engine_commit": commit, "input": str(src), "input_bytes": dir_bytes(src),
        "disk_mbps": args.disk_mbps, "node_cpus": args.node_cpus, "disk_probe": probe,
        "cpus": os.cpu_count(), "rows": rows, "goals": goals},
        indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
