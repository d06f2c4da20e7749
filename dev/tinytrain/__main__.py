"""Command line for a tiny training run, for job scripts (slurm/train.sbatch).

    python -m dev.tinytrain --save-dir D --world-size 2 --steps 12 --save-at 3,6,9,12 \
        --policy parity [--resume-from DIR [--resume-tag TAG]] [--grouping per_layer]

Starts the world_size training processes itself (one Slurm task runs this launcher) and
prints rank 0's result as one JSON line: losses, first_step, global_steps, world_size.
With --slurm-ranks every task of an srun step is one training rank instead, on any number of
nodes (`srun -N 2 -n 4 python -m dev.tinytrain --slurm-ranks --world-size 4 ...`);
rank 0 prints the result.
Exit codes: 0 ok, 1 the training failed, 2 bad arguments.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from dev.tinytrain.launch import TrainFailed, launch
from dev.tinytrain.spec import GROUPINGS, TrainSpec


def steps_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected steps like 3,6,9, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dev.tinytrain",
                                description="Train a tiny model with real DeepSpeed ZeRO-3 "
                                            "on CPU, saving and resuming checkpoints.")
    p.add_argument("--save-dir", required=True, help="where checkpoints are saved")
    p.add_argument("--world-size", type=int, default=2, help="training processes (ZeRO ranks)")
    p.add_argument("--steps", type=int, default=10, help="train until this global step")
    p.add_argument("--save-at", type=steps_list, default=(5, 10), metavar="N,N,...",
                   help="global steps to save at")
    p.add_argument("--policy", help="layer-wise save policy (parity, ...): the first save is "
                                    "full, later ones partial; default: every save is full")
    p.add_argument("--grouping", choices=GROUPINGS, default="one",
                   help="optimizer param groups (per_layer: exact recovery)")
    p.add_argument("--resume-from", metavar="DIR", help="checkpoint dir to resume from")
    p.add_argument("--resume-tag", metavar="TAG", help="tag in DIR (default: DIR/latest)")
    p.add_argument("--step-sleep", type=float, default=0.0, metavar="SECONDS",
                   help="sleep after each step (a run slow enough to interrupt)")
    p.add_argument("--client-state", action="store_true",
                   help="save ordinary objects in client_state (a Namespace, a numpy scalar, a "
                        "dataclass), as training scripts do; a resume prints them back")
    p.add_argument("--node-local-storage", action="store_true",
                   help="DeepSpeed's use_node_local_storage: each node saves its own ranks' "
                        "files (save dir on a disk of its own)")
    p.add_argument("--slurm-ranks", action="store_true",
                   help="this process is one training rank of an srun step (rank, world and "
                        "rendezvous from Slurm; --world-size must be the step's task count)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="give up on the run after this long")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = TrainSpec(save_dir=args.save_dir, world_size=args.world_size, steps=args.steps,
                         save_at=args.save_at, grouping=args.grouping,
                         policy={"name": args.policy} if args.policy else None,
                         load_dir=args.resume_from, load_tag=args.resume_tag,
                         step_sleep=args.step_sleep, client_state=args.client_state,
                         node_local_storage=args.node_local_storage)
    except ValueError as e:
        print(f"tinytrain: error: {e}", file=sys.stderr)
        return 2
    if args.slurm_ranks:
        return run_slurm_rank(spec)
    # scancel / requeue send SIGTERM: exit through launch's cleanup, which kills the ranks,
    # rather than leave them orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = launch(spec, timeout=args.timeout)
    except TrainFailed as e:
        print(f"tinytrain: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


def run_slurm_rank(spec: TrainSpec) -> int:
    """One rank of the run, in this process (the srun step is the world)."""
    import os

    from dev.tinytrain import slurm_worker
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS")
    if "SLURM_PROCID" not in os.environ or tasks != str(spec.world_size):
        print(f"tinytrain: error: --slurm-ranks runs as the tasks of an srun step of "
              f"--world-size {spec.world_size} tasks (this step: {tasks or 'none'})",
              file=sys.stderr)
        return 2
    os.environ.update(slurm_worker.rank_env(dict(os.environ)))
    from dev.tinytrain import worker  # after OMP_NUM_THREADS: it imports torch
    worker.run(spec, "-")  # exits the process
    return 0


if __name__ == "__main__":
    sys.exit(main())
