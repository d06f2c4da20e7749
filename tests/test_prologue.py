"""The shipped resume prologue on every save layout mpitailor reads (issue 41, D1): plain
DeepSpeed `global_stepN/`, HF Trainer `checkpoint-N/global_stepN/` and Accelerate
`checkpoint-N/pytorch_model/`, at the saves' world size and at another, run twice (a
requeue: the second run reuses the first recovery, it does not make another).

Outside Slurm, with MPITAILOR_LAUNCH naming this venv's mpiexec (what the docs say for a
Slurm Prolog); tests/test_slurm.py runs it inside real jobs.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env
from ckpt_fixtures import build
from merging import MPIEXEC

from mpitailor.formats.zero.read import read_meta


def prologue(save_dir: Path, out_parent: Path, world: int | None) -> subprocess.CompletedProcess:
    env = {**child_env(), "MPITAILOR_LAUNCH": f"{MPIEXEC} -n 2",
           "MPITAILOR_PYTHON": sys.executable}
    if world:
        env["MPITAILOR_WORLD_SIZE"] = str(world)
    return subprocess.run([sys.executable, "-m", "mpitailor", "slurm-prologue", str(save_dir),
                           str(out_parent)], env=env, capture_output=True, text=True,
                          timeout=300)


def check_prologue(save_dir: Path, out_parent: Path, world: int | None, step: int) -> Path:
    first = prologue(save_dir, out_parent, world)
    assert first.returncode == 0, first.stderr
    resumed = Path(first.stdout.strip().removeprefix("MPITAILOR_RESUME_FROM="))
    assert resumed.name == f"recovered-step{step}" + (f"-w{world}" if world else "")
    meta = read_meta(resumed)
    assert meta.global_steps == step and meta.world_size == (world or 2)
    again = prologue(save_dir, out_parent, world)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout and f"reusing {resumed}" in again.stderr, again.stderr
    assert sorted(p.name for p in out_parent.iterdir()) == [resumed.name, "resume-from"]
    return resumed


@pytest.mark.parametrize("world", [None, 3])
@pytest.mark.parametrize("name", ["hf_s2_w2_parity", "w2_parity"])
def test_prologue_recovers_and_reuses_for_each_layout(tmp_path, name, world):
    """An HF Trainer run (ZeRO-2, partial saves in checkpoint-N/global_stepN) and a plain
    DeepSpeed run (ZeRO-3)."""
    save = tmp_path / "run"
    shutil.copytree(build(name), save)
    check_prologue(save, tmp_path / "out", world, 8)


def test_prologue_outside_a_job_without_srun_names_mpitailor_launch(tmp_path):
    """D6 of issue 41: outside a job (no SLURM_JOB_ID) and without srun, the prologue says
    to set MPITAILOR_LAUNCH, not to raise --ntasks; exit 2, nothing recovered."""
    save = tmp_path / "run"
    shutil.copytree(build("w2_parity"), save)
    env = {k: v for k, v in child_env().items() if not k.startswith("SLURM_")}
    env["MPITAILOR_PYTHON"] = sys.executable
    bare = tmp_path / "bin"  # a PATH without srun, whatever this machine has
    bare.mkdir()
    for tool in ("bash", "env", "sed", "date", "realpath", "dirname", "mkdir", "rm", "mv",
                 "mktemp", "cat", "printf"):
        found = shutil.which(tool)
        if found:
            (bare / tool).symlink_to(found)
    env["PATH"] = f"{Path(sys.executable).parent}:{bare}"
    r = subprocess.run([sys.executable, "-m", "mpitailor", "slurm-prologue", str(save),
                        str(tmp_path / "out")], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    assert "launcher srun not found" in r.stderr and "MPITAILOR_LAUNCH" in r.stderr, r.stderr
    assert not list((tmp_path / "out").glob("recovered-*"))
