"""`make demo`: train a tiny model with real DeepSpeed, merge two saves by parity with MPI,
resume DeepSpeed from the composite, export the run to HF safetensors, and say what happened.

    python -m dev.demo [--out demo-out] [--ranks 2]
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mpitailor.cli.shipped import shipped_dir
from mpitailor.planning.plan_report import human
from dev.tinytrain import TrainSpec, launch

RECIPE = shipped_dir("recipes") / "parity.yml"


def _shown(path: Path) -> str:
    """The path relative to the current dir where it lies below it (the repo), else whole."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise SystemExit("demo: no mpiexec found; `pip install mpich` provides one")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo-out", type=Path)
    ap.add_argument("--ranks", default=2, type=int, help="MPI ranks for the merge")
    args = ap.parse_args()
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    run, merged = out / "run", out / "merged"

    spec = TrainSpec(save_dir=str(run), world_size=2, layers=4, grouping="per_layer",
                     steps=10, save_at=(5, 10))
    print(f"1. training a tiny Llama ({spec.layers} layers) with DeepSpeed ZeRO-3 on "
          f"{spec.world_size} CPU processes, saving at steps {spec.save_at} ...", flush=True)
    t = time.perf_counter()
    trained = launch(spec)
    # The model's config.json beside its saves, as `model.config.save_pretrained(run)` puts
    # it: what an HF export of the run reads (step 4).
    from dev.tinytrain.model import tiny_config
    tiny_config(spec).to_json_file(str(run / "config.json"))
    print(f"   done in {time.perf_counter() - t:.1f}s; last loss {trained['losses'][-1]:.4f}; "
          f"checkpoints: " + ", ".join(f"{p.name} ({human(du(p))})"
                                       for p in sorted(run.glob("global_step*"))))

    print(f"2. merging by parity (even layers from step 10, odd from step 5) with "
          f"`mpiexec -n {args.ranks} python -m mpitailor {_shown(RECIPE)}`",
          flush=True)
    env = {**os.environ, "NEW": str(run / "global_step10"), "OLD": str(run / "global_step5"),
           "OUT": str(merged)}
    t = time.perf_counter()
    r = subprocess.run([mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "mpitailor",
                        str(RECIPE), "--no-progress"], env=env, timeout=300)
    if r.returncode != 0:
        return r.returncode
    print(f"   merged in {time.perf_counter() - t:.1f}s wall (with interpreter start-up); "
          f"{merged} holds {human(du(merged))}; manifest: {merged / 'mpitailor_manifest.json'}")

    print("3. resuming DeepSpeed from the composite checkpoint for 3 more steps ...", flush=True)
    resumed = launch(TrainSpec(**{**spec.__dict__, "save_dir": str(out / "resumed"),
                                  "steps": 13, "save_at": (), "load_dir": str(merged),
                                  "load_tag": "global_step10"}))
    losses = resumed["losses"]
    ok = len(losses) == 3 and all(math.isfinite(x) for x in losses)
    print(f"   resumed at step {resumed['first_step']}, trained to step "
          f"{resumed['global_steps']}; losses {[round(x, 4) for x in losses]}")

    hf = out / "hf"
    print(f"4. exporting the run's newest layers to HF safetensors with `mpiexec -n "
          f"{args.ranks} python -m mpitailor export {_shown(run)} -o {_shown(hf)}`", flush=True)
    r = subprocess.run([mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "mpitailor",
                        "export", str(run), "-o", str(hf), "-q"], timeout=300)
    if r.returncode != 0:
        return r.returncode
    print(f"   {hf} holds " + ", ".join(sorted(p.name for p in hf.iterdir())) +
          ": `AutoModelForCausalLM.from_pretrained` loads it")
    print("demo: OK" if ok else "demo: FAILED (non-finite loss)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
