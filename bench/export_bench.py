"""Consolidated fp32 weights out of a ZeRO-3 checkpoint: `mpitailor export --format fp32` on
1 and 2 MPI ranks against DeepSpeed's own `zero_to_fp32.py --safe_serialization`.

    python -m bench.export_bench [--quick] [--reps 3] [--json NAME]

Input: the W=4 bench checkpoint (.cache/bench/llama-w4, made by bench.merge_bench: a
random-init Llama of 188M parameters trained with real DeepSpeed on CPU, bf16, 2.25 GB of
ZeRO-3 state per save); --quick: the small one (llama-w4-quick). Both tools write fp32
safetensors of the newest save (`latest`). The runs alternate, repeated --reps times, the
page cache warm (one unmeasured run of each first). Time is the wall time of the whole
command (interpreter start included: zero_to_fp32 is a script too). mpitailor fsyncs what it
writes before publishing it; zero_to_fp32 does not, so it also runs followed by `sync -f` of its
output (the same durability); peak RSS is wait4's
ru_maxrss of the launch, the largest process it waited for (an mpiexec launch: the largest
rank); this process loads no tensors, so a forked child inherits none. The last repetition's
outputs are checked equal to zero_to_fp32's, tensor for tensor.
Prints a table, writes bench/out/export_bench.json (or --json NAME).
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

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out"
CACHE = REPO / ".cache" / "bench"
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes of the largest process the launch waited for)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    t = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    seconds = time.perf_counter() - t
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return seconds, usage.ru_maxrss * 1024


def commands(src: Path, out: Path) -> dict[str, list[str]]:
    py = sys.executable
    mine = [py, "-m", "mpitailor", "export", str(src), "--format", "fp32", "--no-progress",
            "-o"]
    return {
        "zero_to_fp32": [py, "-m", "deepspeed.utils.zero_to_fp32", str(src),
                         str(out / "zero_to_fp32"), "--safe_serialization"],
        # what mpitailor guarantees (fsync before publishing), for zero_to_fp32's output
        "zero_to_fp32+sync": ["sh", "-c", '"$0" -m deepspeed.utils.zero_to_fp32 "$1" "$2" '
                              '--safe_serialization && sync -f "$2"/*', py, str(src),
                              str(out / "zero_to_fp32-synced")],
        "mpitailor 1 rank": [*mine, str(out / "mpitailor-1")],
        "mpitailor 2 ranks": [MPIEXEC, "-n", "2", *mine, str(out / "mpitailor-2")],
    }


def check_equal(out: Path) -> None:
    """Every tensor of mpitailor's outputs equals zero_to_fp32's."""
    from safetensors.torch import load_file
    ref: dict = {}
    for f in sorted((out / "zero_to_fp32").glob("*.safetensors")):
        ref.update(load_file(f))
    for name in ("mpitailor-1", "mpitailor-2"):
        got: dict = {}
        for f in sorted((out / name).glob("*.safetensors")):
            got.update(load_file(f))
        missing = set(ref) - set(got)
        assert not missing or missing <= {"lm_head.weight"}, missing  # a tied alias at most
        for key, t in got.items():
            assert ref[key].equal(t), f"{name}: {key} differs from zero_to_fp32's"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default="export_bench.json")
    args = ap.parse_args()
    src = CACHE / ("llama-w4-quick" if args.quick else "llama-w4")
    if not (src / "latest").exists():
        raise SystemExit(f"{src}: missing; `python -m bench.merge_bench --world-sizes 4` "
                         f"{'--quick ' if args.quick else ''}makes it")
    work = REPO / ".cache" / "bench-export"
    runs: dict[str, list[tuple[float, int]]] = {}
    for rep in range(args.reps + 1):  # rep 0 warms the page cache and is not counted
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for name, cmd in commands(src, work).items():
            result = timed(cmd)
            if rep:
                runs.setdefault(name, []).append(result)
    # In a process of its own, after the timed runs: the tensors it loads would otherwise
    # count in the peak RSS of every command forked from this process later.
    subprocess.run([sys.executable, "-c", "import sys; from bench.export_bench import "
                    "check_equal; from pathlib import Path; check_equal(Path(sys.argv[1]))",
                    str(work)], cwd=REPO, check=True)
    shutil.rmtree(work, ignore_errors=True)
    base_t = statistics.median(t for t, _ in runs["zero_to_fp32"])
    base_m = statistics.median(m for _, m in runs["zero_to_fp32"])
    rows = []
    print(f"{'':<18}{'seconds':>9}{'x':>7}{'peak RSS GB':>13}{'x':>7}   (median of "
          f"{args.reps}, {src.name})")
    for name, rs in runs.items():
        t = statistics.median(s for s, _ in rs)
        m = statistics.median(r for _, r in rs)
        rows.append({"tool": name, "seconds": t, "peak_rss_bytes": m,
                     "time_vs_zero_to_fp32": t / base_t, "rss_vs_zero_to_fp32": m / base_m,
                     "runs": rs})
        print(f"{name:<18}{t:>9.2f}{t / base_t:>7.2f}{m / 1e9:>13.2f}{m / base_m:>7.2f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / args.json).write_text(json.dumps({"input": src.name, "reps": args.reps,
                                             "rows": rows}, indent=2))
    print(f"wrote {OUT / args.json}")


if __name__ == "__main__":
    main()
