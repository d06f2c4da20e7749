"""Start-up cost: whole process against in-process time, CPU seconds a rank, before and after
(issue 33).

    python -m bench.startup [--checkouts NAME=DIR ...] [--before-rev 2523bf6]
        [--ranks 1 2 4 8 16 64] [--repeat 3] [--cluster] [--big [--big-world 4|1]
        [--big-quick]] [--timeout 600] [--json startup.json]

Each checkout is a tree holding an mpitailor/ package; every command of it runs with
PYTHONPATH=DIR, this venv's python (.venv/bin/python) and mpiexec, from a temporary working
dir (so neither the repo nor the venv's editable install supplies mpitailor: the `import`
case checks which file was imported). Default checkouts: `before`, a git worktree of
--before-rev (created as /tmp/startup-before-REV if absent), and `after`, this working tree.
Cases, each run for every checkout side by side, interleaved (the checkouts' order reversed
every other round: A B, B A, ...), --repeat rounds, medians:
  import       python -c 'import mpitailor.cli.main'              (the CLI's start-up alone)
  help         python -m mpitailor --help
  importtime   python -X importtime -m mpitailor parity.yml       (1 rank; only the import
               time is read from it: the sum of the top-level imports' cumulative times)
  plain        python -m mpitailor parity.yml                     (1 rank, no mpiexec)
  merge N      mpiexec -n N python -m mpitailor parity.yml        (N in --ranks; MPICH's hydra
               runs more ranks than cores without an option)
  launcher N   mpiexec -n N true                                  (no checkout: MPI's share)
  cluster 64   srun -N 4 -n 64 --ntasks-per-node=16 ... parity.yml on the emulated Slurm of
               slurm/start-cluster.sh --nodes 4 (--cluster; skipped, saying why, when none
               runs with 4 nodes of >= 16 CPUs)
  big          python -m mpitailor parity.yml on 1 rank, warm, over the cached bench
               checkpoints of bench/merge_bench.py (--big; W=4: 2.25 GB a save, built on
               first use by real DeepSpeed training, minutes; --big-quick: 175 MB, a smoke test)
The small merges are recipes/parity.yml over the `w2_parity` test fixture (.cache/fixtures,
a LayerwiseTrainer run of the demo's shape: 4 layers, W=2): NEW its full save global_step2,
OLD its partial save global_step4 (the odd layers), so the merge reads a full and a partial
save. Recorded per run: `wall` (the whole command), `in` (the merge's own time, the top-level
`seconds` of --stats: planning to publication), `CPU/rank` (user + sys of the command and
every process it waited for, from wait4 on it, over N: the launcher's share included; for
srun, every task's from a `times` of a bash around it, plus srun's own), `start CPU/rank`
(CPU/rank less the merge's own CPU seconds, --stats cpu_seconds: interpreter, imports, MPI
start and finish, launcher), `other` (cores the rest of the machine kept busy meanwhile).
Prints a table with the ratios of every checkout to the first and the issue's goals
(start-up <= 0.3 CPU s a rank; the demo's merge, 2 ranks, <= 1.0 s wall; whole process <=
1.3x in-process for a parity merge of >= 1 GB on one rank), writes bench/results/startup.json
(or --json NAME) with every run.
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
import tempfile
import threading
import time
from pathlib import Path

from bench.cluster_bench import _OUTER, warm_up
from bench.merge_bench import MPIEXEC, RECIPE, REPO, busy_seconds, dir_bytes

RESULTS = REPO / "bench" / "results"
PY = str(REPO / ".venv" / "bin" / "python")
FIXTURES = Path(os.environ.get("MPITAILOR_FIXTURES", REPO / ".cache" / "fixtures"))
FIXTURE = "w2_parity"  # full save at step 2, partial saves (odd layers) at 4, 6, 8
FULL, PARTIAL = "global_step2", "global_step4"
CLUSTER_DIRS = ("/tmp/mpitailor-cluster", "/var/tmp/mpitailor-nodescale")
CLUSTER_NODES, CLUSTER_TASKS = 4, 64
STARTUP_CPU_GOAL = 0.3  # CPU s a rank
DEMO_WALL_GOAL = 1.0  # s, the demo's merge: mpiexec -n 2
DEMO_RANKS = 2
BIG_RATIO_GOAL = 1.3  # whole process / in-process, >= 1 GB, 1 rank
BIG_MIN_BYTES = 1e9
OTHER_WARN = 0.3
MIN_OTHER = 0.2  # s: the shortest run whose `other` means something
IMPORT_CHECK = ("import sys, mpitailor.cli.main; "
                "print(sys.modules['mpitailor.cli.main'].__file__)")
HEAVY = ("torch", "deepspeed", "numpy", "mpi4py", "safetensors", "transformers")
TIMES = re.compile(r"(\d+)m([\d.]+)s")
SUMMARY_SECONDS = re.compile(r" in ([0-9.]+) s\b")


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def worktree(rev: str) -> Path:
    """A git worktree of rev under /tmp, made if absent (an existing one must be at rev)."""
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = Path("/tmp") / f"startup-before-{commit[:7]}"
    if path.exists():
        if git("rev-parse", "HEAD", cwd=path) != commit:
            raise SystemExit(f"{path} exists but is not at {commit[:7]}: remove it "
                             f"(git worktree remove --force {path})")
        return path
    git("worktree", "add", "--detach", str(path), commit)
    return path


def checkouts(args: argparse.Namespace) -> dict[str, dict]:
    given = args.checkouts or [f"before={worktree(args.before_rev)}", f"after={REPO}"]
    out = {}
    for item in given:
        name, sep, d = item.partition("=")
        tree = Path(d).resolve()
        if not sep or not name or name in out:
            raise SystemExit(f"--checkouts {item}: want NAME=DIR, each NAME once")
        if not (tree / "mpitailor" / "__init__.py").is_file():
            raise SystemExit(f"--checkouts {item}: no mpitailor/__init__.py in {tree}")
        info = {"dir": str(tree)}
        try:
            info["commit"] = git("rev-parse", "HEAD", cwd=tree)
            info["mpitailor_modified"] = bool(git("status", "--porcelain", "mpitailor",
                                                  cwd=tree))
        except subprocess.CalledProcessError:
            info["commit"] = None
        out[name] = info
    return out


def fixture() -> Path:
    found = sorted(FIXTURES.glob(f"{FIXTURE}-*/DONE"))
    if not found:  # built once by the tests' own builder (real DeepSpeed, ~1 min)
        sys.path.insert(0, str(REPO / "tests"))
        from ckpt_fixtures import build
        return Path(build(FIXTURE))
    return found[-1].parent


def base_env(tree: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OUTER)}
    env.pop("PYTHONPATH", None)
    if tree:
        env["PYTHONPATH"] = tree
    return env


def timed(cmd: list[str], env: dict, cwd: Path, timeout: float) -> dict:
    """Run cmd: wall time, user + sys CPU seconds of it and every process it waited for
    (wait4), exit status, output, and the cores the rest of the machine kept busy."""
    out, err = cwd / "stdout.txt", cwd / "stderr.txt"
    busy = busy_seconds()
    t = time.perf_counter()
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=o, stderr=e)
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
    wall = time.perf_counter() - t
    cpu = usage.ru_utime + usage.ru_stime
    return {"wall": wall, "cpu": cpu, "user": usage.ru_utime, "sys": usage.ru_stime,
            "rc": os.waitstatus_to_exitcode(status), "max_rss": usage.ru_maxrss * 1024,
            "other_cores": max(0.0, busy_seconds() - busy - cpu) / wall if wall >= MIN_OTHER
            else 0.0,  # /proc/stat counts in ticks of 10 ms: no figure for shorter runs
            "stdout": out.read_text(errors="replace"), "stderr": err.read_text(errors="replace")}


def import_times(text: str) -> dict:
    """-X importtime's report: the sum of the top-level imports' cumulative times, the
    heaviest of them, and which heavy packages were imported at all."""
    top, names = [], set()
    for line in text.splitlines():
        if not line.startswith("import time:") or "imported package" in line:
            continue
        _, cum, name = line[len("import time:"):].split("|")
        names.add(name.strip())
        if not name[1:].startswith(" "):  # one space before a top-level name, more nested
            top.append((int(cum) / 1e6, name.strip()))
    top.sort(reverse=True)
    return {"import_s": sum(s for s, _ in top), "heaviest": top[:5],
            "heavy_imported": [h for h in HEAVY if h in names]}


def merge_stats(stats: Path, stdout: str) -> dict:
    """The merge's own time and CPU seconds: --stats, else the summary line's `in X s`."""
    if stats.is_file():
        s = json.loads(stats.read_text())
        return {"in_s": s["seconds"],
                "merge_cpu": sum(r.get("cpu_seconds", 0.0) for r in s["ranks"]),
                "peak_rss": max(r.get("peak_rss_bytes", 0) for r in s["ranks"]),
                "bytes_written": s.get("bytes_written")}
    m = SUMMARY_SECONDS.findall(stdout)
    return {"in_s": float(m[-1])} if m else {}


def task_cpu(cpu_dir: Path) -> list[float]:
    """Every srun task's CPU seconds: the children line of the `times` its bash wrote."""
    out = []
    for f in sorted(cpu_dir.iterdir()):
        lines = f.read_text().splitlines()
        out.append(sum(int(m) * 60 + float(s) for m, s in TIMES.findall(lines[-1])))
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, trees: dict, small: Path,
                 cluster: dict | None, big: Path | None):
        self.args, self.trees, self.small, self.cluster, self.big = args, trees, small, cluster, big
        self.scratch = Path(tempfile.mkdtemp(prefix="mpitailor-startup-"))

    def cmd_of(self, case: str, ranks: int, stats: Path) -> list[str]:
        merge = ["-m", "mpitailor", str(RECIPE), "--no-progress", "--stats", str(stats)]
        if case == "import":
            return [PY, "-c", IMPORT_CHECK]
        if case == "help":
            return [PY, "-m", "mpitailor", "--help"]
        if case == "importtime":
            return [PY, "-X", "importtime", *merge]
        if case in ("plain", "big"):
            return [PY, *merge]
        if case == "merge":
            return [MPIEXEC, "-n", str(ranks), PY, *merge]
        if case == "launcher":
            return [MPIEXEC, "-n", str(ranks), "true"]
        hosts = ",".join(f"n{i}" for i in range(1, CLUSTER_NODES + 1))
        wrap = '"$@"; rc=$?; times > "$STARTUP_CPU_DIR/$SLURM_PROCID"; exit $rc'
        return ["srun", "--immediate=60", "--kill-on-bad-exit=1", "-N", str(CLUSTER_NODES),
                "-n", str(ranks), f"--ntasks-per-node={ranks // CLUSTER_NODES}", "-w", hosts,
                "bash", "-c", wrap, "task", PY, *merge]

    def one(self, case: str, ranks: int, name: str | None) -> dict:
        tree = self.trees[name]["dir"] if name else None
        work = self.scratch / "work"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        stats, out, cpu_dir = work / "stats.json", work / "out", work / "cpu"
        src = self.big if case == "big" else self.small
        env = base_env(tree)
        if case == "cluster":  # srun passes its environment on to every task
            env = {**self.cluster, "PYTHONPATH": tree, "STARTUP_CPU_DIR": str(cpu_dir)}
            cpu_dir.mkdir()
        if case == "big":  # new, old: the bench checkpoints' steps 2 and 1, read once first
            env.update(NEW=str(src / "global_step2"), OLD=str(src / "global_step1"))
            warm_up([src / "global_step2", src / "global_step1"])
        else:
            env.update(NEW=str(src / FULL), OLD=str(src / PARTIAL))
        env["OUT"] = str(out)
        r = timed(self.cmd_of(case, ranks, stats), env, work, self.args.timeout)
        row = {"case": case, "ranks": ranks, "checkout": name, "wall": r["wall"],
               "cpu": r["cpu"], "user": r["user"], "sys": r["sys"], "rc": r["rc"],
               "launcher_max_rss": r["max_rss"], "other_cores": r["other_cores"]}
        if r["rc"] != 0:
            row["error"] = (r["stderr"] or r["stdout"])[-2000:]
        elif case == "import":
            imported = r["stdout"].strip()
            if not imported.startswith(tree + os.sep):
                row["error"] = f"imported {imported}, not the checkout's {tree}"
        elif case == "importtime":
            row.update(import_times(r["stderr"]))
        if case in ("plain", "importtime", "merge", "cluster", "big") and "error" not in row:
            row.update(merge_stats(stats, r["stdout"]))
            if "in_s" not in row:
                row["error"] = "no --stats file and no `in X s` in the output"
        if case == "cluster" and "error" not in row:
            tasks = task_cpu(cpu_dir)
            row.update(srun_cpu=r["cpu"], tasks_cpu=tasks, cpu=r["cpu"] + sum(tasks))
            if len(tasks) != ranks:
                row["error"] = f"{len(tasks)} of {ranks} tasks wrote their CPU times"
        row["cpu_per_rank"] = row["cpu"] / ranks
        if row.get("merge_cpu") is not None and case != "importtime":
            row["startup_cpu_per_rank"] = (row["cpu"] - row["merge_cpu"]) / ranks
        if "in_s" in row and case != "importtime":
            row["whole_over_in"] = row["wall"] / row["in_s"]
            row["outside_s"] = row["wall"] - row["in_s"]
        shutil.rmtree(work, ignore_errors=True)
        return row

    def plan(self) -> list[tuple[str, int, bool]]:
        """(case, ranks, per checkout) in the order of one round."""
        cases = [("import", 1, True), ("help", 1, True), ("importtime", 1, True),
                 ("plain", 1, True)]
        for n in self.args.ranks:
            cases += [("launcher", n, False), ("merge", n, True)]
        if self.cluster:
            cases.append(("cluster", CLUSTER_TASKS, True))
        if self.big:
            cases.append(("big", 1, True))
        return cases

    def run(self) -> list[dict]:
        rows, names = [], list(self.trees)
        try:
            for rnd in range(self.args.repeat):
                order = names if rnd % 2 == 0 else names[::-1]
                for case, ranks, per in self.plan():
                    for name in (order if per else [None]):
                        row = self.one(case, ranks, name)
                        row["round"] = rnd
                        rows.append(row)
                        print(progress(row), flush=True)
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        return rows


def progress(row: dict) -> str:
    head = f"round {row['round']} {row['case']:<10}{row['ranks']:>3} {row['checkout'] or '-':<8}"
    if "error" in row:
        return f"{head} FAILED (exit {row['rc']}): {row['error'].strip().splitlines()[-1:]}"
    extra = f", in {row['in_s']:.3f}s" if "in_s" in row else ""
    extra += f", imports {row['import_s']:.3f}s" if "import_s" in row else ""
    return (f"{head} wall {row['wall']:.3f}s{extra}, CPU {row['cpu_per_rank']:.3f}s a rank, "
            f"other {row['other_cores']:.2f} cores")


METRICS = ("wall", "in_s", "whole_over_in", "outside_s", "cpu_per_rank",
           "startup_cpu_per_rank", "import_s", "peak_rss")


def summarize(rows: list[dict], names: list[str]) -> list[dict]:
    keys = []
    for r in rows:
        if (r["case"], r["ranks"]) not in keys:
            keys.append((r["case"], r["ranks"]))
    out = []
    for case, ranks in keys:
        group = []
        for name in ([None] if case == "launcher" else names):
            mine = [r for r in rows if (r["case"], r["ranks"], r["checkout"]) ==
                    (case, ranks, name)]
            good = [r for r in mine if "error" not in r]
            x = {"case": case, "ranks": ranks, "checkout": name, "reps": len(good),
                 "failed": len(mine) - len(good),
                 "other_cores": max((r["other_cores"] for r in mine), default=0.0)}
            for m in METRICS:
                vals = [r[m] for r in good if r.get(m) is not None]
                if vals:
                    x[m] = statistics.median(vals)
            if case == "importtime" and good:
                x["heavy_imported"] = good[-1]["heavy_imported"]
                x["heaviest"] = good[-1]["heaviest"]
            if mine and len(good) < len(mine):
                x["error"] = next(r["error"] for r in mine if "error" in r)
            group.append(x)
        base = group[0]
        for x in group[1:]:
            x["ratio_to"] = base["checkout"]
            x["ratios"] = {m: x[m] / base[m] for m in METRICS if m in x and base.get(m)}
        out += group
    return out


def fmt(v, spec: str) -> str:
    return format(v, spec) if v is not None else "-"


def print_table(summary: list[dict]) -> None:
    cols = [("wall s", "wall", ".3f"), ("in s", "in_s", ".3f"), ("whole/in", "whole_over_in",
            ".2f"), ("CPU s/rank", "cpu_per_rank", ".3f"),
            ("start CPU/rank", "startup_cpu_per_rank", ".3f"), ("import s", "import_s", ".3f"),
            ("RSS GB", "peak_rss", ".2f")]
    print(f"{'case':<11}{'ranks':>5} {'checkout':<14}{'reps':>4}"
          + "".join(f"{h:>{max(len(h) + 2, 9)}}" for h, _, _ in cols) + f"{'other':>7}")
    for x in summary:
        vals = [x.get(k) / 1e9 if k == "peak_rss" and x.get(k) else x.get(k) for _, k, _ in cols]
        print(f"{x['case']:<11}{x['ranks']:>5} {x['checkout'] or '-':<14}{x['reps']:>4}"
              + "".join(f"{fmt(v, s):>{max(len(h) + 2, 9)}}" for (h, _, s), v in
                        zip(cols, vals)) + f"{x['other_cores']:>7.2f}"
              + (f"  ({x['failed']} failed)" if x["failed"] else ""))
        if "ratios" in x:
            label = f"{x['checkout']}/{x['ratio_to']}"
            print(f"{'':<11}{'':>5} {label:<14}{'':>4}"
                  + "".join(f"{fmt(x['ratios'].get(k), '.2f'):>{max(len(h) + 2, 9)}}"
                            for h, k, _ in cols))
    for x in summary:
        if x["case"] == "importtime" and x.get("heaviest"):
            heavy = ", ".join(f"{n} {s:.2f}s" for s, n in x["heaviest"][:4])
            print(f"imports of {x['checkout']}: {heavy}; heavy packages imported: "
                  f"{', '.join(x['heavy_imported']) or 'none'}")
    for x in summary:
        if x.get("error"):
            print(f"failed: {x['case']} {x['ranks']} {x['checkout']}: "
                  f"{x['error'].strip().splitlines()[-1] if x['error'].strip() else '?'}")
    busy = max((x["other_cores"] for x in summary), default=0.0)
    if busy > OTHER_WARN:
        print(f"note: other work kept up to {busy:.2f} cores busy during some runs (`other`): "
              f"read those times with care")


def goal_lines(summary: list[dict], names: list[str], big_bytes: int | None) -> list[str]:
    lines = []
    for name in names:
        mine = {(x["case"], x["ranks"]): x for x in summary if x["checkout"] == name}
        starts = {f"{c} {n}": x["startup_cpu_per_rank"] for (c, n), x in mine.items()
                  if c in ("plain", "merge", "cluster") and "startup_cpu_per_rank" in x}
        if starts:
            worst = max(starts, key=starts.get)
            imp = mine.get(("import", 1), {}).get("cpu_per_rank")
            met = "met" if starts[worst] <= STARTUP_CPU_GOAL else "NOT met"
            lines.append(f"{name}: start-up <= {STARTUP_CPU_GOAL} CPU s a rank: "
                         f"{starts[worst]:.3f} at worst ({worst}), "
                         f"{min(starts.values()):.3f} at best; the import alone "
                         f"{fmt(imp, '.3f')} ({met})")
        demo = mine.get(("merge", DEMO_RANKS))
        if demo and "wall" in demo:
            met = "met" if demo["wall"] <= DEMO_WALL_GOAL else "NOT met"
            lines.append(f"{name}: the demo's merge (mpiexec -n {DEMO_RANKS}, W=2 4-layer "
                         f"fixture) <= {DEMO_WALL_GOAL} s wall: {demo['wall']:.3f} s ({met})")
        big = mine.get(("big", 1))
        if big and "whole_over_in" in big:
            size = "" if (big_bytes or 0) >= BIG_MIN_BYTES else \
                f"; the input is {big_bytes / 1e9:.2f} GB, under the goal's 1 GB"
            met = "met" if big["whole_over_in"] <= BIG_RATIO_GOAL else "NOT met"
            lines.append(f"{name}: whole process <= {BIG_RATIO_GOAL}x in-process, 1 rank: "
                         f"{big['whole_over_in']:.2f}x ({big['wall']:.2f} s / "
                         f"{big['in_s']:.2f} s) ({met}{size})")
    return lines


def find_cluster(given: str | None) -> tuple[dict | None, str]:
    """The running emulated cluster's environment, or why there is none to use."""
    how = (f"start one with `MPITAILOR_SLURM_CPUS=16 bash slurm/start-cluster.sh --nodes "
           f"{CLUSTER_NODES}` (root; stop it after with `bash slurm/stop-cluster.sh --nodes "
           f"{CLUSTER_NODES}`)")
    dirs = [given] if given else [os.environ.get("MPITAILOR_CLUSTER_DIR"), *CLUSTER_DIRS]
    for d in filter(None, dirs):
        pid = Path(d, "slurmctld.pid")
        try:
            alive = Path(f"/proc/{int(pid.read_text())}/comm").read_text().strip() == \
                "slurmctld"
        except (OSError, ValueError):
            alive = False
        if not alive or not Path(d, "slurm.conf").is_file():
            continue
        env = {k: v for k, v in os.environ.items() if not k.startswith(_OUTER)}
        env["SLURM_CONF"] = str(Path(d, "slurm.conf"))
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %c"], env=env,
                           capture_output=True, text=True, timeout=30)
        nodes = {n: (state, int(c)) for n, state, c in (ln.split() for ln in
                                                        r.stdout.splitlines() if ln.strip())}
        want = [f"n{i}" for i in range(1, CLUSTER_NODES + 1)]
        missing = [n for n in want if n not in nodes]
        if missing:
            return None, (f"the cluster in {d} has no node(s) {', '.join(missing)}: stop it "
                          f"and {how}")
        few = {n: nodes[n][1] for n in want if nodes[n][1] < CLUSTER_TASKS // CLUSTER_NODES}
        if few:
            return None, (f"the cluster in {d} advertises {min(few.values())} CPUs a node; "
                          f"{CLUSTER_TASKS // CLUSTER_NODES} tasks a node need more: stop it "
                          f"and {how}")
        return env, d
    return None, f"no emulated Slurm cluster is running ({', '.join(filter(None, dirs))}): {how}"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkouts", nargs="+", metavar="NAME=DIR",
                    help="trees holding mpitailor/ (default: before=a worktree of "
                         "--before-rev, after=this working tree); ratios are to the first")
    ap.add_argument("--before-rev", default="2523bf6")
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4, 8, 16, 64])
    ap.add_argument("--repeat", type=int, default=3, help="rounds (medians)")
    ap.add_argument("--cluster", action="store_true",
                    help=f"also srun -N {CLUSTER_NODES} -n {CLUSTER_TASKS} on the running "
                         f"emulated Slurm")
    ap.add_argument("--cluster-dir", help="its dir (default: $MPITAILOR_CLUSTER_DIR, "
                    + ", ".join(CLUSTER_DIRS) + ")")
    ap.add_argument("--big", action="store_true", help="also the >= 1 GB 1-rank merge")
    ap.add_argument("--big-world", type=int, choices=(1, 4), default=4,
                    help="its input: merge_bench's W=4 (2.25 GB a save) or W=1 (2.87 GB)")
    ap.add_argument("--big-quick", action="store_true",
                    help="merge_bench's --quick input instead (175 MB: a smoke test)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a command")
    ap.add_argument("--json", default="startup.json", help="output name under bench/results")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    trees = checkouts(args)
    names = list(trees)
    for name, info in trees.items():
        print(f"{name}: {info['dir']} at {(info.get('commit') or '?')[:7]}"
              f"{' (mpitailor/ modified)' if info.get('mpitailor_modified') else ''}")
    small = fixture()
    warm_up([small])
    cluster = None
    if args.cluster:
        cluster, where = find_cluster(args.cluster_dir)
        print(f"cluster: {'using ' + where if cluster else 'skipped: ' + where}", flush=True)
    big = big_bytes = None
    if args.big:
        from bench.merge_bench import checkpoints  # builds it on first use (minutes)
        big = checkpoints(args.big_world, args.big_quick)
        big_bytes = dir_bytes(big / "global_step2")
        print(f"big: {big} ({big_bytes / 1e9:.2f} GB a save)", flush=True)
    rows = Bench(args, trees, small, cluster, big).run()
    summary = summarize(rows, names)
    print_table(summary)
    goals = goal_lines(summary, names, big_bytes)
    for line in goals:
        print(line)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / args.json
    path.write_text(json.dumps({
        "command": " ".join(["python -m bench.startup", *sys.argv[1:]]), "args": vars(args),
        "checkouts": trees, "python": PY, "mpiexec": MPIEXEC,
        "fixture": {"dir": str(small), "new": FULL, "old": PARTIAL},
        "big": {"dir": str(big), "save_bytes": big_bytes} if big else None,
        "cluster": (cluster or {}).get("SLURM_CONF") if args.cluster else None,
        "cpus": os.cpu_count(), "summary": summary, "goals": goals, "rows": rows},
        indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
