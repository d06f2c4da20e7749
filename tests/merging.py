"""Running merges from tests: in-process (the library API) or as the real CLI under mpiexec."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from child_env import child_env

from mpitailor.cluster.comm import Comm
from mpitailor.jobs.merge import MergeOptions, plan_merge, run_merge

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def recipe_env(new: Path, old: Path, out: Path) -> dict[str, str]:
    return {"NEW": str(new), "OLD": str(old), "OUT": str(out)}


def merge_in_process(recipe: str | Path, env: dict[str, str], monkeypatch, comm=None,
                     world_size: int | None = None):
    """Serial merge through the library API (a world of one unless comm is given);
    world_size: reshard to it."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    comm = comm or Comm(None)
    path = recipe if Path(recipe).is_absolute() else RECIPES / recipe
    return run_merge(comm, plan_merge(comm, str(path), world_size=world_size), MergeOptions())


def run_cli(args: list[str], env: dict[str, str], ranks: int = 1, timeout: float = 180):
    """`mpiexec -n ranks python -m mpitailor ARGS` (plain python for 1 rank)."""
    full = child_env()
    full.update(env)
    cmd = [sys.executable, "-m", "mpitailor", *args]
    if ranks > 1:
        cmd = [str(MPIEXEC), "-n", str(ranks), *cmd]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)
