"""The built wheel, installed into a fresh venv outside the checkout, has everything the
README names: the `mpitailor` command, the recipes and the Slurm prologue; and nothing of the
repo's own tools (dev/: the tiny trainer, the demo).

Offline: the wheel is built here, and the fresh venv finds the dependencies (torch,
DeepSpeed, ...) through a .pth file pointing at this venv's site-packages, which does not
make the checkout's own (editable) mpitailor importable there."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from ckpt_fixtures import build

REPO = Path(__file__).resolve().parents[1]


def sh(cmd, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300,
                          **kwargs)


def build_and_install(root: Path) -> None:
    """The wheel built into root/wheels, installed into a fresh venv, root/venv. Built from
    a copy of the checkout's files (tracked, and new ones git does not ignore): setuptools
    packs what an earlier build left in the checkout's build/ too, which would hide a module
    that pyproject no longer ships."""
    src, wheels = root / "src", root / "wheels"
    files = sh(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO)
    assert files.returncode == 0, files.stderr
    for name in filter(None, files.stdout.split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    r = sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
            "-w", wheels, src])
    assert r.returncode == 0, r.stderr
    venv = root / "venv"
    assert sh([sys.executable, "-m", "venv", venv]).returncode == 0
    lib = next((venv / "lib").glob("python3*/site-packages"))
    (lib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    r = sh([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-index", "--no-deps",
            *wheels.glob("mpitailor-*.whl")])
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def installed(built_once, tmp_path_factory):
    root = built_once("pkg", build_and_install)  # one wheel for both xdist workers
    venv = root / "venv"
    lib = next((venv / "lib").glob("python3*/site-packages"))
    away = tmp_path_factory.mktemp("elsewhere")  # outside the checkout: none of it on the path
    # MPICH (`mpitailor[mpi]`) as this venv has it: mpiexec on PATH, libmpi where the loader
    # looks (mpi4py would find it in the new venv's lib/ had pip put it there).
    dev = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{dev}:{os.environ['PATH']}",
           "LD_LIBRARY_PATH": str(dev.parent / "lib")}
    env.pop("PYTHONPATH", None)
    return venv, away, env, lib, next((root / "wheels").glob("mpitailor-*.whl"))


def test_the_command_names_itself_and_finds_its_files(installed):
    venv, away, env, lib, _ = installed
    r = sh([venv / "bin" / "mpitailor", "--help"], cwd=away, env=env)
    assert r.returncode == 0 and r.stdout.startswith("usage: mpitailor "), r.stdout
    r = sh([venv / "bin" / "mpitailor", "paths"], cwd=away, env=env)
    assert r.returncode == 0, r.stderr
    dirs = dict(line.split(None, 1) for line in r.stdout.splitlines())
    for kind, name in (("recipes", "parity.yml"), ("slurm", "resume-prologue.sh")):
        assert Path(dirs[kind]).is_relative_to(lib) and (Path(dirs[kind]) / name).is_file()
    r = sh([venv / "bin" / "python", "-c", "import mpitailor; print(mpitailor.__file__)"],
           cwd=away, env=env)
    assert Path(r.stdout.strip()).is_relative_to(lib), r.stdout  # the wheel's, not the repo's


def test_the_wheel_leaves_the_repos_dev_tools_out(installed):
    venv, away, env, _, wheel = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "mpitailor/training/checkpointer.py" in names  # the training side ships
    assert not [n for n in names if n.startswith(("dev/", "mpitailor/tinytrain/"))
                or n == "mpitailor/demo.py"
                or n.endswith(("start-cluster.sh", "stop-cluster.sh"))], names
    assert "mpitailor/slurm/train-script.sbatch" in names  # the docs' sbatch for scripts
    r = sh([venv / "bin" / "python", "-c", "import dev.tinytrain"], cwd=away, env=env)
    assert r.returncode != 0 and "No module named 'dev'" in r.stderr, r.stderr


def test_the_wheel_holds_every_module_of_the_package(installed):
    """pyproject lists the packages by name: a new subpackage left off would ship without its
    modules and fail only when imported."""
    names = set(zipfile.ZipFile(installed[4]).namelist())
    modules = {str(p.relative_to(REPO)) for p in (REPO / "mpitailor").rglob("*.py")}
    assert sorted(modules - names) == []


def test_the_prologue_runs_from_the_installed_package(installed):
    venv, away, env, _, _ = installed
    save = build("w2_parity")
    env = {**env, "MPITAILOR_LAUNCH": f"{Path(sys.executable).parent / 'mpiexec'} -n 2"}
    r = sh([venv / "bin" / "mpitailor", "slurm-prologue", save, away / "resume"], cwd=away,
           env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"MPITAILOR_RESUME_FROM={away / 'resume' / 'recovered-step8'}\n"
    assert "written by 2 rank(s)" in r.stderr
