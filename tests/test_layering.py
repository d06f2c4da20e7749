"""The layers of the house (DESIGN.md, Version 3): each folder imports only from the folders
below it, and the planner is pure.

    display, errors, failpoints, version  <  formats  <  planning  <  cluster  <  publish  <  engine  <  jobs
    <  cli, training, api, facade (the top: they may import each other; training reaches
    the layers below only through the facade)

The repo's own tools (dev/: tinytrain, the demo) sit outside the package, above it: the
package never imports them, and the wheel leaves them out.

The arrows are read from the source (an AST walk, lazy imports inside functions included), so
an upward import fails here whether or not it is ever executed.

The same walk keeps the merge side torch-free (issue 33): only the training side
(mpitailor/training; and dev/, outside the package) imports torch, DeepSpeed,
transformers, accelerate or h5py, which the core install (`pip install mpitailor`) lacks;
tests/test_torch_free.py runs the commands to see that none of them is loaded at run time.

And it keeps the training side behind its facade (issue 34): mpitailor/training imports from
mpitailor only `mpitailor.facade` (what training needs of the merge side, named for that),
the public API, `formats/`, the base modules and itself; and torch.distributed is called
only by the training comm (training/distcomm.py).
"""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import mpitailor

PACKAGE = Path(mpitailor.__file__).parent
ORDER = ("base", "formats", "planning", "cluster", "publish", "engine", "jobs", "top")
BASE = {"display", "errors", "failpoints", "version"}
TOP = {"cli", "training", "api", "facade", "__init__", "__main__"}
HEAVY = ("torch", "mpi4py")
# What only the training side may import (pyproject's [train] and [hf] extras), and where it is.
TRAINING_ONLY = ("torch", "deepspeed", "transformers", "accelerate", "h5py")
TRAINING_SIDE = ("mpitailor.training",)
# What the training side may import of mpitailor: its facade, the public API (`mpitailor`,
# `mpitailor.api`), formats/, the base modules, and itself.
FACADE = "mpitailor.facade"
TRAINING_MAY_IMPORT = (FACADE, "mpitailor.api", "mpitailor.formats", *TRAINING_SIDE,
                       *(f"mpitailor.{m}" for m in sorted(BASE)))
# The modules that may call torch.distributed: the training comm, the only one.
TORCH_DISTRIBUTED_IN = ("mpitailor.training.distcomm",)


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


def within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def instead(name: str) -> str:
    """What a training module should import in place of `name`: the facade's name for the
    same object, where it has one, else what to add there."""
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        facade = importlib.import_module(FACADE)
        same = [n for n in facade.__all__ if getattr(facade, n) is obj]
        if same:
            return f"from {FACADE} import {same[0]}"
        break
    return (f"{FACADE} does not export it: use the facade's name for that job (its "
            f"docstring lists each name and why), or add one there, named for what training "
            f"needs")


def facade_breaches(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """`module:line imports name: use ...` for each import of a training module (top level or
    lazy) that reaches into mpitailor past the facade."""
    if not on_training_side(module):
        return []
    return [f"{module}:{line} imports {name}: {instead(name)}"
            for line, name in sorted(imports(tree, module, is_package))
            if name.split(".")[0] == "mpitailor" and name != "mpitailor"
            and not within(name, TRAINING_MAY_IMPORT)]


def torch_distributed_uses(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """`module:line ...` for each import of torch.distributed (however spelled) and each
    `torch.distributed` attribute reached from `torch`, outside the training comm."""
    if module in TORCH_DISTRIBUTED_IN:
        return []
    found = [(line, f"imports {name}") for line, name in imports(tree, module, is_package)
             if within(name, ("torch.distributed",))]
    found += [(node.lineno, "uses torch.distributed") for node in ast.walk(tree)
              if isinstance(node, ast.Attribute) and node.attr == "distributed"
              and isinstance(node.value, ast.Name) and node.value.id == "torch"]
    return [f"{module}:{line} {what}" for line, what in sorted(found)]


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


def test_the_training_side_reaches_the_merge_side_only_through_its_facade():
    wrong = []
    for module, path in modules():
        wrong += facade_breaches(ast.parse(path.read_text()), module, path.name == "__init__.py")
    assert not wrong, (f"the training side imports the merge side past its facade ({FACADE}; "
                       f"it may import {', '.join(TRAINING_MAY_IMPORT)}):\n" + "\n".join(wrong))


def test_the_facade_stands_below_the_training_side():
    path = PACKAGE / "facade.py"
    names = imported(ast.parse(path.read_text()), FACADE, False)
    assert not [n for n in names if on_training_side(n)], sorted(names)


def test_the_facade_rule_sees_top_level_and_lazy_imports_and_names_what_to_use():
    tree = ast.parse(textwrap.dedent("""
        from mpitailor import failpoints
        from mpitailor.errors import UserError
        from mpitailor.formats.files import LATEST
        from mpitailor.facade import layer_index
        from mpitailor.planning.layers import sort_keys
        import mpitailor
        import mpitailor.api

        def f():
            from mpitailor.jobs.merge import run_merge
            from mpitailor.training.distcomm import training_comm
            from .snapshot import write
            from ..cluster.comm import Comm
    """))
    assert facade_breaches(tree, "mpitailor.training.x", False) == [
        "mpitailor.training.x:6 imports mpitailor.planning.layers.sort_keys: "
        "from mpitailor.facade import sort_keys",
        "mpitailor.training.x:11 imports mpitailor.jobs.merge.run_merge: mpitailor.facade "
        "does not export it: use the facade's name for that job (its docstring lists each "
        "name and why), or add one there, named for what training needs",
        "mpitailor.training.x:14 imports mpitailor.cluster.comm.Comm: "
        "from mpitailor.facade import Comm",
    ]
    assert facade_breaches(tree, "mpitailor.cli.main", False) == []  # the rule is training's


def test_only_the_training_comm_calls_torch_distributed():
    wrong = []
    for module, path in modules():
        wrong += torch_distributed_uses(ast.parse(path.read_text()), module,
                                        path.name == "__init__.py")
    comm = ", ".join(TORCH_DISTRIBUTED_IN)
    assert not wrong, (f"torch.distributed outside the training comm ({comm}: add what you "
                       f"need there, and call that):\n" + "\n".join(wrong))


def test_the_torch_distributed_rule_sees_every_spelling():
    tree = ast.parse(textwrap.dedent("""
        import torch
        import torch.distributed as dist
        from torch import distributed
        from torch.distributed import all_reduce

        def f(t):
            import torch.distributed
            torch.distributed.barrier()
            torch.cuda.synchronize()
    """))
    assert torch_distributed_uses(tree, "mpitailor.training.stats", False) == [
        "mpitailor.training.stats:3 imports torch.distributed",
        "mpitailor.training.stats:4 imports torch.distributed",
        "mpitailor.training.stats:5 imports torch.distributed.all_reduce",
        "mpitailor.training.stats:8 imports torch.distributed",
        "mpitailor.training.stats:9 uses torch.distributed",
    ]
    assert torch_distributed_uses(tree, "mpitailor.training.distcomm", False) == []


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
