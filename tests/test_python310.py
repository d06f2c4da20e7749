"""Python 3.10, the oldest that pyproject.toml's requires-python promises, runs the merge side.

A Python 3.10 venv with the core install's dependencies only (pyproject's [project]
dependencies: no torch, no DeepSpeed) is built once into .cache/py310-venv and rebuilt when
that list, the build requirements or the interpreter change. Each test session installs the
checkout into a temporary dir with that venv's pip (non-editable, as `pip install mpitailor`
does), then:

  - every module compiles under 3.10 (syntax: `except*`, PEP 695 generics, ...);
  - every merge-side module imports under 3.10 (training/ needs torch:
    for them compiling, and the check below, is all that 3.10 can do here);
  - no module names a stdlib module, a stdlib attribute or a builtin that 3.10 lacks
    (typing.Self, tomllib, datetime.UTC, enum.StrEnum, ExceptionGroup, ...), read from the
    source by 3.10 itself, so that a branch the commands below never take is covered too;
  - real commands (merge, recover, export, inspect, diff) on real fixtures write the same
    bytes under 3.10 and under this venv's 3.11, both running the same installed copy.

Without a Python 3.10 the tests skip, saying so, except where CI is set: there they fail, so
that a CI machine that lost its 3.10 does not pass by skipping. `python tests/test_python310.py`
builds the venv (the Makefile can do this ahead of the parallel run).
"""
from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from child_env import child_env
from merging import MPIEXEC

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".cache" / "py310-venv"
STAMP = VENV / ".installed"  # written last: holds the key of a complete venv
LOCK = REPO / ".cache" / "py310-venv.lock"
DEV_BIN = Path(sys.executable).parent
# They import torch (the training side); the rest of the package must import without it.
TORCH_SIDE = ("mpitailor/training/",)
MANIFEST_CREATED = re.compile(rb'^(  "created": )"[^"\n]*"(,?)$', re.M)


def find_python310() -> str | None:
    """The real path of a Python 3.10, or None. A pyenv shim on PATH answers only when pyenv
    has 3.10 selected, so each candidate is asked for its version and its executable."""
    candidates = [shutil.which("python3.10"),
                  *sorted(map(str, (Path.home() / ".pyenv" / "versions").glob(
                      "3.10*/bin/python3.10")), reverse=True)]
    for cand in filter(None, candidates):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            r = subprocess.run([cand, "-c", "import sys; print(sys.version_info[:2] == (3, 10),"
                                            " sys.executable)"],
                               capture_output=True, text=True, timeout=30)
            ok, _, exe = r.stdout.strip().partition(" ")
            if r.returncode == 0 and ok == "True":
                return exe
    return None


def core_requirements() -> list[str]:
    """What the core install needs: the package's dependencies, and setuptools to build it
    (installed into the venv so that the per-session install needs no network)."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [*meta["project"]["dependencies"], *meta["build-system"]["requires"]]


def build_venv(python310: str) -> Path:
    """The cached 3.10 venv's python, built now if its key changed. pytest-xdist workers and
    separate pytest runs take turns on a file lock: one builds, the others wait and reuse."""
    version = subprocess.run([python310, "-c", "import sys; print(sys.version)"],
                             capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(json.dumps([python310, version, core_requirements()]).encode()
                         ).hexdigest()[:16]
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if STAMP.is_file() and STAMP.read_text() == key:
            return VENV / "bin" / "python"
        shutil.rmtree(VENV, ignore_errors=True)  # a stale key, or a build that was killed
        subprocess.run([python310, "-m", "venv", str(VENV)], check=True, timeout=300)
        r = subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                            "--disable-pip-version-check", *core_requirements()],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"pip install into the Python 3.10 venv {VENV} failed:\n"
                               f"{r.stdout}{r.stderr}")
        STAMP.write_text(key)
    return VENV / "bin" / "python"


@pytest.fixture(scope="module")
def py310() -> Path:
    python310 = find_python310()
    if python310 is None:
        why = ("no Python 3.10 (neither python3.10 on PATH nor ~/.pyenv/versions/3.10*), "
               "which pyproject.toml's requires-python = \">=3.10\" promises to support")
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must test it, not skip", pytrace=False)
        pytest.skip(why)
    return build_venv(python310)


@pytest.fixture(scope="module")
def installed(py310, built_once) -> Path:
    """The checkout installed by 3.10's pip into a dir of its own (put on PYTHONPATH): the
    package the core install gets, recipes and Slurm scripts inside it. Once for both xdist
    workers."""
    return built_once("py310-install", lambda root: install_checkout(py310, root)) / "site"


def install_checkout(py310: Path, root: Path) -> None:
    """The checkout installed into root/site by 3.10's pip. Built from a copy, because pip
    builds in the source tree (build/), where other tests build too."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    src = root / "src"
    src.mkdir()
    shutil.copy2(REPO / "pyproject.toml", src)
    shutil.copy2(REPO / meta["project"]["readme"], src)
    for top in {"mpitailor", *meta["tool"]["setuptools"]["package-dir"].values()}:
        shutil.copytree(REPO / top, src / top, ignore=shutil.ignore_patterns("__pycache__"))
    site = root / "site"
    r = subprocess.run([str(py310), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-deps", "--no-index", "--no-build-isolation", "--target",
                        str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip install of the checkout under Python 3.10:\n{r.stderr}"


def env_for(site: Path) -> dict[str, str]:
    """Both interpreters run the copy in `site`. mpi4py finds MPICH's libmpi (this venv's
    `mpitailor[mpi]`) where the loader looks; the 3.10 venv has no MPI library of its own."""
    env = child_env()
    libs = [str(DEV_BIN.parent / "lib"), os.environ.get("LD_LIBRARY_PATH")]
    env.update(PYTHONPATH=str(site), LD_LIBRARY_PATH=os.pathsep.join(filter(None, libs)))
    return env


def test_every_module_compiles(py310, tmp_path):
    # the bytecode goes to tmp_path: the checkout keeps 3.11's __pycache__ only
    r = subprocess.run([str(py310), "-m", "compileall", "-q", str(REPO / "mpitailor")],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path)})
    assert r.returncode == 0, f"Python 3.10 cannot compile:\n{r.stdout}{r.stderr}"


def merge_side_modules() -> list[str]:
    names = []
    for p in sorted((REPO / "mpitailor").rglob("*.py")):
        rel = p.relative_to(REPO).as_posix()
        if rel.startswith(TORCH_SIDE) or p.name == "__main__.py":  # __main__ runs the CLI
            continue
        names.append(rel.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
    return names


def test_every_merge_side_module_imports(py310, installed, tmp_path):
    """Imports run what the module's top level runs: class bodies, decorators, default
    values, pydantic's reading of annotations."""
    modules = merge_side_modules()
    script = textwrap.dedent("""
        import importlib, json, sys, traceback
        failed = {}
        for name in json.loads(sys.argv[1]):
            try:
                importlib.import_module(name)
            except BaseException:
                failed[name] = traceback.format_exc()
        import mpitailor
        print(json.dumps({"failed": failed, "from": mpitailor.__file__}))
    """)
    r = subprocess.run([str(py310), "-c", script, json.dumps(modules)], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path, env=env_for(installed))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert Path(got["from"]).is_relative_to(installed), got["from"]  # the install, not the repo
    assert not got["failed"], "under Python 3.10:\n" + "\n".join(
        f"import {name}:\n{tb}" for name, tb in got["failed"].items())
    assert len(modules) > 50, modules  # the walk found the package


def test_training_modules_name_their_extra_without_torch(py310, installed, tmp_path):
    """The core install has no torch: each training module imported directly (not through a
    name of mpitailor.training) is one ImportError that names the extra to install, never a
    bare ModuleNotFoundError (C1 of issue 40). Modules that need no framework import."""
    names = sorted(p.stem for p in (REPO / "mpitailor" / "training").glob("*.py")
                   if p.stem != "__init__")
    script = textwrap.dedent("""
        import importlib, json, sys
        out = {}
        for name in json.loads(sys.argv[1]):
            try:
                importlib.import_module("mpitailor.training." + name)
                out[name] = "imported"
            except BaseException as e:
                out[name] = type(e).__name__ + ": " + str(e)
        print(json.dumps(out))
    """)
    r = subprocess.run([str(py310), "-c", script, json.dumps(names)], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path, env=env_for(installed))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    refused = {n: why for n, why in got.items() if why != "imported"}
    assert {"hf", "accel", "stats", "partial_save", "checkpointer"} <= set(refused), got
    for name, why in refused.items():
        assert why.startswith("ImportError: ") and "pip install 'mpitailor[train" in why \
            and "\n" not in why, (name, why)
    assert got["policies"] == "imported", got  # torch-free: stats plot and the docs use it


# Run by 3.10 over the package's source: every stdlib module it imports, every stdlib
# attribute it reads (`from M import N`, `M.N`, `M.sub.N`) and every builtin it names must
# exist in 3.10. The calling (newer) Python passes its own stdlib module names (3.10's list
# lacks tomllib) and builtins (those 3.10 lacks are reported wherever named). A branch
# guarded by sys.version_info, or a try whose except catches ImportError or AttributeError,
# is the code's own fallback and is not read.
NEWER_NAMES = textwrap.dedent("""
    import ast, builtins, importlib, json, sys

    NEWER = json.loads(sys.argv[1])
    NEW_BUILTINS = set(NEWER["builtins"]) - set(dir(builtins))
    STDLIB = set(NEWER["stdlib"]) | sys.stdlib_module_names
    NEW_METHODS = {"add_note"}  # BaseException.add_note (3.11)
    GUARDS = {"ImportError", "ModuleNotFoundError", "AttributeError"}
    MISSING = object()


    def lookup(dotted):
        \"\"\"The stdlib object `dotted` names under this Python, or MISSING.\"\"\"
        parts = dotted.split(".")
        try:
            obj = importlib.import_module(parts[0])
        except ImportError:
            return MISSING
        for i, attr in enumerate(parts[1:], 1):
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
                continue
            try:  # a submodule not imported by its package
                obj = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                return MISSING
        return obj


    def dotted(node):
        names = []
        while isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        return (node.id, names[::-1]) if isinstance(node, ast.Name) else (None, [])


    class Reader(ast.NodeVisitor):
        def __init__(self, path):
            self.path, self.alias, self.found = path, {}, []

        def report(self, node, what):
            self.found.append(f"{self.path}:{node.lineno}: {what}")

        def stdlib(self, name):
            return name.partition(".")[0] in STDLIB

        def visit_Import(self, node):
            for a in node.names:
                if self.stdlib(a.name):
                    if lookup(a.name) is MISSING:
                        self.report(node, f"import {a.name}")
                    top = a.name if a.asname else a.name.partition(".")[0]
                    self.alias[a.asname or top] = top

        def visit_ImportFrom(self, node):
            if node.level or not node.module or not self.stdlib(node.module):
                return
            for a in node.names:
                if a.name != "*" and lookup(f"{node.module}.{a.name}") is MISSING:
                    self.report(node, f"from {node.module} import {a.name}")
                self.alias[a.asname or a.name] = f"{node.module}.{a.name}"

        def visit_Attribute(self, node):
            root, attrs = dotted(node)
            if root in self.alias:
                # the whole chain once, at its outermost node
                if lookup(".".join([self.alias[root], *attrs])) is MISSING:
                    self.report(node, ".".join([root, *attrs]))
                return
            if node.attr in NEW_METHODS:
                self.report(node, f".{node.attr}")
            self.generic_visit(node)

        def visit_Name(self, node):
            if node.id in NEW_BUILTINS:
                self.report(node, node.id)

        def visit_If(self, node):
            if "version_info" not in ast.dump(node.test):
                self.generic_visit(node)

        def visit_Try(self, node):
            caught = {n.id for h in node.handlers for n in ast.walk(h.type or ast.Tuple([]))
                      if isinstance(n, ast.Name)}
            for part in ([] if caught & GUARDS else node.body), node.handlers, node.orelse, \\
                    node.finalbody:
                for child in part:
                    self.visit(child)

        visit_TryStar = visit_Try


    found = []
    for path in sys.argv[2:]:
        reader = Reader(path)
        with open(path, encoding="utf-8") as f:
            reader.visit(ast.parse(f.read(), path))
        found += reader.found
    print(json.dumps(found))
""")
NEWER_THAN_310 = json.dumps({"builtins": dir(builtins),
                             "stdlib": sorted(sys.stdlib_module_names)})


def test_no_stdlib_name_newer_than_310(py310):
    """Training side included: nothing of it imports under 3.10 here (no torch), so this is
    where a 3.11 name in it shows."""
    files = [str(p.relative_to(REPO)) for p in sorted((REPO / "mpitailor").rglob("*.py"))]
    r = subprocess.run([str(py310), "-I", "-c", NEWER_NAMES, NEWER_THAN_310, *files],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert not found, "names Python 3.10 does not have:\n" + "\n".join(found)


def test_the_check_sees_newer_names(py310, tmp_path):
    """The reader above on a module full of 3.11 names, and of their 3.10 fallbacks."""
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        import datetime, enum, sys, tomllib
        import asyncio as aio
        from typing import Self, TYPE_CHECKING
        if sys.version_info >= (3, 11):
            from typing import Never
        try:
            from typing import assert_never
        except ImportError:
            assert_never = None
        when = datetime.UTC
        class Colour(enum.StrEnum): pass
        group = aio.TaskGroup
        try:
            pass
        except ExceptionGroup as e:
            e.add_note("seen")
    """))
    r = subprocess.run([str(py310), "-I", "-c", NEWER_NAMES, NEWER_THAN_310,
                        str(probe)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    found = [line.split(": ", 1)[1] for line in json.loads(r.stdout)]
    assert found == ["import tomllib", "from typing import Self", "datetime.UTC", "enum.StrEnum",
                     "aio.TaskGroup", "ExceptionGroup", ".add_note"], found


def normalise(stdout: str) -> str:
    """A summary line's timings differ from run to run; nothing else may."""
    stdout = re.sub(r"\bin \d+\.\d+ s\b", "in <S> s", stdout)
    return re.sub(r"\(\d+\.\d+ GB/s\)", "(<R> GB/s)", stdout)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root, a manifest's `created` time (to the second) blanked."""
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "mpitailor_manifest.json":
                data = MANIFEST_CREATED.sub(rb'\1"<CREATED>"\2', data, count=1)
            files[p.relative_to(root).as_posix()] = data
    return files


def cases():
    """name -> (args, MPI ranks, expected exit code, recipe environment). A function, so that
    collecting this file does not build the fixtures."""
    from ckpt_fixtures import build, tag_dir
    w2, hf = build("w2_parity"), build("hf_w2_parity")
    quiet = "--no-progress"
    return {
        # a full save (even layers) with a partial one (odd layers), checked after writing
        "merge": (["merge", str(REPO / "recipes" / "parity.yml"), "--verify", quiet], 2, 0,
                  {"NEW": str(w2 / "global_step2"), "OLD": str(w2 / "global_step4")}),
        "recover": (["recover", str(w2), "-o", "{OUT}", quiet], 2, 0, {}),
        "recover-world-size-3": (["recover", str(w2), "-o", "{OUT}", "--world-size", "3",
                                  quiet], 2, 0, {}),
        "export-hf": (["export", str(hf), "-o", "{OUT}", "--format", "hf", quiet], 2, 0, {}),
        # a cast (numpy's, a different release under each Python)
        "export-hf-bf16": (["export", str(hf), "-o", "{OUT}", "--format", "hf", "--dtype",
                            "bf16", quiet], 2, 0, {}),
        "export-fp32": (["export", str(w2), "-o", "{OUT}", "--format", "fp32", quiet], 2, 0,
                        {}),
        "inspect": (["inspect", str(tag_dir("w2_parity", 4))], 1, 0, {}),
        "inspect-json": (["inspect", str(tag_dir("hf_w2_parity", 8)), "--json"], 1, 0, {}),
        "diff": (["diff", "--json", str(tag_dir("w2_parity", 2)), str(tag_dir("w2_parity", 8))],
                 2, 1, {}),
    }


CASES = ["merge", "recover", "recover-world-size-3", "export-hf", "export-hf-bf16",
         "export-fp32", "inspect", "inspect-json", "diff"]


@pytest.mark.parametrize("case", CASES)
def test_same_bytes_as_311(py310, installed, tmp_path, case):
    """One command under 3.10, then under 3.11, each writing to the same path (a manifest
    records its output path); every file and the standard output must be the same."""
    args, ranks, rc, recipe_env = cases()[case]
    work, out = tmp_path / "work", tmp_path / "work" / "out"
    args = [a.replace("{OUT}", str(out)) for a in args]
    got = {}
    for python in (py310, Path(sys.executable)):
        work.mkdir()
        cmd = [str(python), "-m", "mpitailor", *args]
        if ranks > 1:
            cmd = [str(MPIEXEC), "-n", str(ranks), *cmd]
        # cwd outside the checkout: `python -m` puts the cwd first on sys.path
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=work,
                           env={**env_for(installed), **recipe_env, "OUT": str(out)})
        assert r.returncode == rc, f"{python}: exit {r.returncode}\n{r.stdout}{r.stderr}"
        got[python] = normalise(r.stdout), tree(work)
        work.rename(tmp_path / f"done-{len(got)}")
    (out310, files310), (out311, files311) = got.values()
    assert out310 == out311, f"stdout under 3.10:\n{out310}\nunder 3.11:\n{out311}"
    assert files310.keys() == files311.keys(), (sorted(files310), sorted(files311))
    differ = [name for name in files310 if files310[name] != files311[name]]
    assert not differ, f"different bytes under 3.10 and 3.11: {differ}"
    assert files310 or out310.strip(), "the command left nothing to compare"


if __name__ == "__main__":
    found = find_python310()
    if found is None:
        print("no Python 3.10: its tests will skip (or fail, where CI is set)")
        sys.exit(1 if os.environ.get("CI") else 0)
    print(build_venv(found))
