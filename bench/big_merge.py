"""A merge of a checkpoint pair larger than this machine's memory (issue 24, part 1).

    python -m bench.big_merge [--size 1b|small] [--world 2] [--root DIR] [--reps 1]
        [--keep] [--json NAME]

Input: two saves (steps 1 and 2) of a Llama trained with real DeepSpeed ZeRO-3 on CPU (bf16,
world size W) by dev.tinytrain, built under --root (default .cache/big) and removed
at the end unless --keep:
  1b     TinyLlama-1.1B's shape (22 layers, hidden 2048, intermediate 5632, 32 heads, 4 KV
         heads, vocab 32000): 1.1B parameters, 13.2 GB of ZeRO-3 state per save, 26.4 GB
         (24.6 GiB) the pair. Training it holds 22 bytes per parameter (measured: 11.99 GB a
         rank at 0.55B parameters each when the OOM killer stopped it): 26 GB with the
         processes, more than this machine's 23.5 GiB — the reason a pair larger than memory
         cannot be trained in it. So `--swap-gb 12` (root) adds a swap file for the build
         only (221 s, ~2 GB of it used), removed before anything is measured; without
         enough memory and swap the build is refused in one line.
  small  the same code path at 4 layers x 256 (minutes, to try the bench).
Cases, side by side, cold (every input dropped from the page cache before the run) and warm:
  merge    parity merge of the two saves on W ranks (bench/merge_bench.py's recipe)
  reshard  the same merge written for 2W ranks
  copy     copying one save's files on W ranks (each byte read once and written once)
The first merge and reshard outputs are checked against the sources by tests/merge_check.py's
independent reader, parameter slice by parameter slice over memory-mapped files (never a
whole partition in memory); the reshard's slices are compared range by range with the
source slices they overlap.
Needs free disk for the pair and one output at a time (~3 saves and a margin): refused in
one line, exit 2, when --root's file system has less. Prints a table and the goals (merge
<= 1.0x copy cold; peak RSS of every rank <= 0.5 GB), writes bench/out/big_merge.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.merge_bench import MPIEXEC, RECIPE, REPO, dir_bytes, drop_cache, run

OUT = REPO / "bench" / "out"
SIZES = {
    "1b": dict(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4, vocab=32000),
    "small": dict(layers=4, hidden=256, intermediate=688, heads=4, kv_heads=4, vocab=4096),
}
# Sub-groups of 1e8 elements (DeepSpeed's default is 1e9) bound the fp32 gradient DeepSpeed
# makes for one sub-group at a time in the optimizer step: 0.4 GB instead of the partition's.
# DeepSpeed's default buckets (5e8 elements to reduce, 1e9 live gathered parameters) would
# hold ~3 GB a rank of a 1B model's gradients and gathered weights beside its state.
TRAIN = dict(dtype="bf16", steps=2, save_at=(1, 2), seq_len=8, micro_batch=1,
             sub_group_size=100_000_000,
             extra={"zero_optimization": {
                 "reduce_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                 "stage3_max_live_parameters": 100_000_000,
                 "stage3_max_reuse_distance": 100_000_000}})
STATE_BYTES = 12      # per parameter in a ZeRO-3 save: fp32 master and two fp32 moments
TRAIN_BYTES = 22     # per parameter while training, measured (11.99 GB a rank at 0.55B each)
RSS_GOAL = 0.5e9      # bytes, every rank
MARGIN = 2e9          # bytes of free disk kept beyond what the bench writes


def parameters(m: dict) -> int:
    """Parameters of a Llama of this shape (untied embeddings, no biases)."""
    h, kv = m["hidden"], m["hidden"] * m["kv_heads"] // m["heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * m["intermediate"] + 2 * h
    return m["layers"] * layer + 2 * m["vocab"] * h + h


def check_space(root: Path, save_bytes: int, built: bool, swap_gb: int) -> None:
    """Two saves and one output at a time must fit (and the build's swap file); the pair may
    already be there."""
    need = (1 if built else 3) * save_bytes + (0 if built else swap_gb * 2**30) + MARGIN
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < need:
        print(f"bench.big_merge: needs {need / 1e9:.0f} GB free under {root} (has "
              f"{free / 1e9:.0f} GB); free space or pass --root DIR on a larger disk",
              file=sys.stderr)
        raise SystemExit(2)


def memory_bytes(field: str = "MemTotal") -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def check_memory(params: int, world: int) -> None:
    """Training holds TRAIN_BYTES a parameter, and ~1 GB a process besides: refused up front
    rather than killed by the kernel half-way."""
    need = TRAIN_BYTES * params + world * 1e9
    free = memory_bytes("MemAvailable") + memory_bytes("SwapFree")
    if free < need:
        print(f"bench.big_merge: training the pair needs ~{need / 1e9:.0f} GB of free memory "
              f"and swap (has {free / 1e9:.0f} GB); add --swap-gb N (root), stop other work, "
              f"or try --size small", file=sys.stderr)
        raise SystemExit(2)


@contextlib.contextmanager
def swap(root: Path, gb: int):
    """A swap file for the time of the build only: training the 1b pair holds more than this
    machine's memory (that is what makes the pair larger than memory). Removed before any
    measurement."""
    if gb <= 0:
        yield
        return
    path = root / "build.swap"
    subprocess.run(["fallocate", "-l", f"{gb}G", str(path)], check=True)
    path.chmod(0o600)
    try:
        subprocess.run(["mkswap", str(path)], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["swapon", str(path)], check=True)
        yield
    finally:
        subprocess.run(["swapoff", str(path)], stderr=subprocess.DEVNULL)
        path.unlink()


def build(root: Path, size: str, world: int, swap_gb: int) -> Path:
    pair = root / f"llama-{size}-w{world}"
    if (pair / "DONE").exists():
        return pair
    from dev.tinytrain import TrainSpec, launch

    shutil.rmtree(pair, ignore_errors=True)
    t = time.perf_counter()
    with swap(root, swap_gb):
        check_memory(parameters(SIZES[size]), world)
        launch(TrainSpec(save_dir=str(pair), world_size=world, **SIZES[size], **TRAIN),
               timeout=3 * 3600)
    (pair / "DONE").write_text("ok")
    print(f"built {pair} in {time.perf_counter() - t:.0f}s ({dir_bytes(pair) / 1e9:.1f} GB)",
          flush=True)
    return pair


def timed(case: str, pair: Path, world: int, out: Path, cold: bool, scratch: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    stats = scratch / "stats.json"
    stats.unlink(missing_ok=True)
    if cold:
        drop_cache(pair)
    new, old = pair / "global_step2", pair / "global_step1"
    env = {"NEW": str(new), "OLD": str(old), "OUT": str(out)}
    if case == "copy":
        cmd = [MPIEXEC, "-n", str(world), sys.executable, "-m", "bench.copy_ranks", str(new),
               str(out), "--stats", str(stats)]
    else:
        cmd = [MPIEXEC, "-n", str(world), sys.executable, "-m", "mpitailor", str(RECIPE),
               "--no-progress", "-q", "--stats", str(stats)]
        cmd += ["--world-size", str(2 * world)] if case == "reshard" else []
    r = run(cmd, env, stats, scratch / "log.txt")
    return {"case": case, "cold": cold, "seconds": r["seconds"], "wall": r["wall"],
            "bytes_written": r["bytes_written"], "other_cores": r["other_cores"],
            "peak_rss_ranks": [x["peak_rss_bytes"] for x in r["ranks"]],
            "launch_peak_rss": r["launch_peak_rss"]}


def check(case: str, out: Path, pair: Path, layers: int) -> str:
    """The output against the sources, by tests/merge_check.py's own reader."""
    sys.path.insert(0, str(REPO / "tests"))
    from merge_check import Ckpt, check_merge, parity

    new, old = pair / "global_step2", pair / "global_step1"
    expected = parity(new, old, layers)
    if case == "merge":
        check_merge(out, expected, new)
        return "every slice equal to its source's"
    merged, sources = Ckpt(out), {p: Ckpt(p) for p in (new, old)}
    compared = 0
    for r in range(merged.world_size):
        for name, (first, got) in merged.pieces(r).items():
            src = sources[expected[layer_key(name)]]
            compared += _compare_ranges(name, first, got, src)
    return f"{compared / 1e9:.2f} G elements compared by range"


def layer_key(name: str) -> str:
    from merge_check import layer_key as key
    return key(name)


def _compare_ranges(name: str, first: int, got: dict, src) -> int:
    """Every element of an output slice equals the source slice that holds it."""
    from merge_check import KINDS, assert_same

    end, done = first + got["fp32"].numel(), 0
    for rs in range(src.world_size):
        if name not in src.pieces(rs):
            continue
        s_first, want = src.pieces(rs)[name]
        lo, hi = max(first, s_first), min(end, s_first + want["fp32"].numel())
        if lo >= hi:
            continue
        for k in KINDS:
            assert_same(got[k][lo - first: hi - first], want[k][lo - s_first: hi - s_first],
                        f"{name} {k} [{lo}, {hi})")
        done += hi - lo
    assert done == end - first, f"{name}: {end - first - done} elements not found in a source"
    return done


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--root", type=Path, default=REPO / ".cache" / "big")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the pair for another run")
    ap.add_argument("--swap-gb", type=int, default=0,
                    help="a swap file of this size under --root while the pair is trained")
    ap.add_argument("--json", default="big_merge.json")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    model = SIZES[args.size]
    save_bytes = STATE_BYTES * parameters(model)
    check_space(args.root, save_bytes,
                (args.root / f"llama-{args.size}-w{args.world}" / "DONE").exists(), args.swap_gb)
    pair = build(args.root, args.size, args.world, args.swap_gb)
    scratch = args.root / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    out, rows, checks = scratch / "out", [], {}
    pair_bytes = dir_bytes(pair / "global_step1") + dir_bytes(pair / "global_step2")
    try:
        for rep in range(args.reps):
            for cold in (True, False):
                for case in ("merge", "reshard", "copy"):
                    row = timed(case, pair, args.world, out, cold, scratch)
                    if case != "copy" and case not in checks:
                        checks[case] = check(case, out, pair, model["layers"])
                    rows.append({**row, "rep": rep})
                    print(f"{case:<8} {'cold' if cold else 'warm'} {row['seconds']:7.1f}s  "
                          f"peak RSS {max(row['peak_rss_ranks']) / 1e9:.2f} GB  "
                          f"other {row['other_cores']:.2f} cores", flush=True)
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(pair, ignore_errors=True)
    summary = summarize(rows)
    memory = memory_bytes()
    print_table(summary, pair_bytes, memory, checks)
    OUT.mkdir(exist_ok=True)
    path = OUT / args.json
    path.write_text(json.dumps({
        "command": " ".join(["python -m bench.big_merge", *sys.argv[1:]]),
        "model": {**model, **TRAIN, "world": args.world, "parameters": parameters(model)},
        "pair_bytes": pair_bytes, "memory_bytes": memory, "checks": checks,
        "summary": summary, "rows": rows}, indent=2))
    print(f"wrote {path}")


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for cold in (True, False):
        copy = _median(rows, "copy", cold)
        for case in ("merge", "reshard", "copy"):
            mine = [r for r in rows if r["case"] == case and r["cold"] == cold]
            s = _median(rows, case, cold)
            out.append({"case": case, "cold": cold, "seconds": s, "reps": len(mine),
                        "gb_written": mine[0]["bytes_written"] / 1e9,
                        "over_copy": (s / mine[0]["bytes_written"]) /
                                     (copy / _written(rows, "copy", cold)),
                        "peak_rss_gb": max(max(r["peak_rss_ranks"]) for r in mine) / 1e9,
                        "other_cores": max(r["other_cores"] for r in mine)})
    return out


def _median(rows: list[dict], case: str, cold: bool) -> float:
    import statistics
    return statistics.median(r["seconds"] for r in rows if r["case"] == case
                             and r["cold"] == cold)


def _written(rows: list[dict], case: str, cold: bool) -> int:
    return next(r["bytes_written"] for r in rows if r["case"] == case and r["cold"] == cold)


def print_table(summary: list[dict], pair_bytes: int, memory: int, checks: dict) -> None:
    print(f"pair {pair_bytes / 1e9:.1f} GB, memory {memory / 1e9:.1f} GB: the pair is "
          f"{pair_bytes / memory:.2f}x the machine's memory")
    print(f"{'case':<8}{'cache':<6}{'s':>8}{'GB':>7}{'s/GB vs copy':>14}{'RSS GB':>8}"
          f"{'other':>7}")
    for x in summary:
        print(f"{x['case']:<8}{'cold' if x['cold'] else 'warm':<6}{x['seconds']:>8.1f}"
              f"{x['gb_written']:>7.1f}{x['over_copy']:>14.2f}{x['peak_rss_gb']:>8.2f}"
              f"{x['other_cores']:>7.2f}")
    merge = next(x for x in summary if x["case"] == "merge" and x["cold"])
    rss = max(x["peak_rss_gb"] for x in summary if x["case"] != "copy")
    print(f"goal merge <= 1.0x copy, cold: {merge['over_copy']:.2f}x "
          f"{'met' if merge['over_copy'] <= 1.0 else 'NOT met'}")
    print(f"goal peak RSS <= {RSS_GOAL / 1e9:.1f} GB every rank: {rss:.2f} GB "
          f"{'met' if rss * 1e9 <= RSS_GOAL else 'NOT met'}")
    for case, what in checks.items():
        print(f"check {case}: {what}")


if __name__ == "__main__":
    main()
