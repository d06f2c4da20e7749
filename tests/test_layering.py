"""The layers of the house (DESIGN.md, Version 3): each folder imports only from the folders
below it, and the planner is pure.

    display, errors, failpoints, version  <  formats  <  planning  <  cluster  <  publish  <  engine  <  jobs
    <  cli, training, api (the top: they may import each other)

The repo's own tools (dev/: tinytrain, the demo) sit outside the package, above it: the
package never imports them, and the wheel leaves them out.

The arrows are read from the source (an AST walk, lazy imports inside functions included), so
an upward import fails here whether or not it is ever executed.

The same walk keeps the merge side torch-free (issue 33): only the training side
(mpitailor/training; and dev/, outside the package) imports torch, DeepSpeed,
transformers, accelerate or h5py, which the core install (`pip install mpitailor`) lacks;
tests/test_torch_free.py runs the commands to see that none of them is loaded at run time.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import mpitailor

PACKAGE = Path(mpitailor.__file__).parent
ORDER = ("base", "formats", "planning", "cluster", "publish", "engine", "jobs", "top")
BASE = {"display", "errors", "failpoints", "version"}
TOP = {"cli", "training", "api", "__init__", "__main__"}
HEAVY = ("torch", "mpi4py")
# What only the training side may import (pyproject's [train] and [hf] extras), and where it is.
TRAINING_ONLY = ("torch", "deepspeed", "transformers", "accelerate", "h5py")
TRAINING_SIDE = ("mpitailor.training",)


def layer(module: str) -> str | None:
    """The layer of `mpitailor.X...` (None for modules outside the package)."""
    parts = module.split(".")
    if parts[0] != "mpitailor":
        return None
    if len(parts) == 1:
        return "top"
    head = parts[1]
    if head in BASE:
        return "base"
    if head in TOP:
        return "top"
    if head in ORDER:
        return head
    raise AssertionError(f"{module}: in no layer of the house; put it in one of {ORDER[1:-1]}"
                         f" or name it in test_layering.BASE/TOP")


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        out.append((".".join(rel.parts), path))
    return out


def imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute name) of each module (or module attribute) a module imports."""
    package = module if is_package else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            out.extend((node.lineno, f"{base}.{a.name}") for a in node.names)
    return out


def imported(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Absolute names of the modules (or module attributes) a module imports."""
    return {name for _, name in imports(tree, module, is_package)}


def on_training_side(module: str) -> bool:
    return any(module == side or module.startswith(side + ".") for side in TRAINING_SIDE)


def training_only_imports(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """`module:line imports name` for each torch/DeepSpeed/... import of a module outside the
    training side (top level or lazy, inside a function)."""
    if on_training_side(module):
        return []
    return [f"{module}:{line} imports {name}"
            for line, name in sorted(imports(tree, module, is_package))
            if name.split(".")[0] in TRAINING_ONLY]


def test_every_module_is_in_a_layer():
    for module, _ in modules():
        layer(module)


def test_imports_point_only_down():
    wrong = []
    for module, path in modules():
        here = ORDER.index(layer(module))
        for name in sorted(imported(ast.parse(path.read_text()), module,
                                    path.name == "__init__.py")):
            there = layer(name)
            if there is not None and ORDER.index(there) > here:
                wrong.append(f"{module} ({layer(module)}) imports {name} ({there})")
    assert not wrong, "imports that point up the layers:\n" + "\n".join(wrong)


def test_the_package_never_imports_the_repos_dev_tools():
    wrong = [f"{module} imports {name}" for module, path in modules()
             for name in sorted(imported(ast.parse(path.read_text()), module,
                                         path.name == "__init__.py"))
             if name.split(".")[0] == "dev"]
    assert not wrong, "\n".join(wrong)


def test_only_cluster_comm_imports_mpi4py():
    users = [module for module, path in modules()
             if any(n == "mpi4py" or n.startswith("mpi4py.")
                    for n in imported(ast.parse(path.read_text()), module, False))]
    assert users == ["mpitailor.cluster.comm"], users


def test_only_the_training_side_imports_torch_deepspeed_transformers_accelerate_h5py():
    wrong = []
    for module, path in modules():
        wrong += training_only_imports(ast.parse(path.read_text()), module,
                                       path.name == "__init__.py")
    assert not wrong, ("the merge side (the core install: no [train], no [hf]) imports what "
                       "only the training side may:\n" + "\n".join(wrong))


def test_the_torch_rule_sees_top_level_and_lazy_imports_and_spares_the_training_side():
    tree = ast.parse(textwrap.dedent("""
        import os
        import torch
        from deepspeed.runtime import zero
        import numpy as np

        def f():
            import torch.distributed as dist
            from transformers import AutoConfig
            from accelerate.utils import DistributedType
            import h5py
            from mpitailor.formats.read import read_meta
            import torchvision  # not torch: another distribution
    """))
    assert training_only_imports(tree, "mpitailor.formats.read", False) == [
        "mpitailor.formats.read:3 imports torch",
        "mpitailor.formats.read:4 imports deepspeed.runtime.zero",
        "mpitailor.formats.read:8 imports torch.distributed",
        "mpitailor.formats.read:9 imports transformers.AutoConfig",
        "mpitailor.formats.read:10 imports accelerate.utils.DistributedType",
        "mpitailor.formats.read:11 imports h5py",
    ]
    for module in ("mpitailor.training.checkpointer", "mpitailor.training"):
        assert training_only_imports(tree, module, module == "mpitailor.training") == []
    for module in ("mpitailor.cli.main", "mpitailor.api", "mpitailor.trainingx",
                   "mpitailor.demos"):
        assert training_only_imports(tree, module, False), module


def test_the_arrow_check_sees_an_upward_import():
    tree = ast.parse("def f():\n    from mpitailor.jobs.merge import merge\n")
    names = imported(tree, "mpitailor.formats.read", False)
    assert layer(next(iter(names))) == "jobs"
    assert ORDER.index("jobs") > ORDER.index(layer("mpitailor.formats.read"))


# Run in a fresh interpreter: a finder placed first on sys.meta_path notes which mpitailor
# frames asked for a heavy module the first time, then lets the import go on as usual.
CHILD = textwrap.dedent("""
    import sys, traceback

    HEAVY = {heavy!r}
    chains = {{}}

    class Witness:
        def find_spec(self, name, path=None, target=None):
            if name in HEAVY and name not in chains:
                chains[name] = [f"{{f.filename}}:{{f.lineno}}: {{f.line}}"
                                for f in traceback.extract_stack()
                                if "/mpitailor/" in f.filename]
            return None

    sys.meta_path.insert(0, Witness())
    for module in {modules!r}:
        __import__(module)
    for name in HEAVY:
        if name in sys.modules:
            print(f"{{name}} loaded by:")
            print("\\n".join("  " + line for line in chains.get(name, ["?"])))
""")


def test_planning_loads_neither_torch_nor_mpi4py():
    planning = [m for m, _ in modules() if m.startswith("mpitailor.planning.")]
    assert len(planning) >= 5
    code = CHILD.format(heavy=HEAVY, modules=planning)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert not out.stdout, f"importing mpitailor.planning:\n{out.stdout}"
