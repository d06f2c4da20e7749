"""The layers of the house (DESIGN.md, Version 3): each folder imports only from the folders
below it, and the planner is pure.

    display, errors, failpoints, version  <  formats  <  planning  <  cluster  <  publish  <  engine  <  jobs
    <  facade  <  cli, training, api (the top; training reaches the layers below only through
    the facade, and the merge side's top (cli, api) reaches training only where TOP_TO_TRAINING
    says why)

The repo's own tools (dev/: tinytrain, the demo) sit outside the package, above it: the
package never imports them, and the wheel leaves them out.

The arrows are read from the source (an AST walk: lazy imports inside functions, and
`importlib.import_module("...")` or `__import__("...")` of a literal name, included), so an
upward import fails here whether or not it is ever executed.

The same walk keeps the merge side torch-free (issue 33): only the training side
(mpitailor/training; and dev/, outside the package) imports torch, DeepSpeed,
transformers, accelerate or h5py, which the core install (`pip install mpitailor`) lacks;
tests/test_torch_free.py runs the commands to see that none of them is loaded at run time.

And it keeps the training side behind its facade (issue 34): mpitailor/training imports from
mpitailor only `mpitailor.facade` (what training needs of the merge side, named for that),
the public API, `formats/`, the base modules and itself; and torch.distributed is called
only by the training comm (training/distcomm.py); nor is DeepSpeed's wrapper of it,
deepspeed.comm, however either is spelled (`import torch as t; t.distributed`).

Inside formats/ (issue 42) the families stand in FORMATS_ORDER, each importing only those
before it, and the rest of the package reaches a family only through its face: the names its
`__init__` lists in EXPORTS (formats/lazyface.py).
"""
from __future__ import annotations

import ast
import importlib
import textwrap
from pathlib import Path

import mpitailor

PACKAGE = Path(mpitailor.__file__).parent
ORDER = ("base", "formats", "planning", "cluster", "publish", "engine", "jobs", "facade", "top")
BASE = {"display", "errors", "failpoints", "version"}
TOP = {"cli", "training", "api", "__init__", "__main__"}
# What the merge side's top (cli, api, the package) may import of the training side, and why.
TOP_TO_TRAINING = {
    "mpitailor.training.plot": "`mpitailor stats plot` draws the training side's update "
                               "statistics (h5py and matplotlib: the [train] and [plot] extras)",
}
# What only the training side may import (pyproject's [train] and [hf] extras), and where it is.
TRAINING_ONLY = ("torch", "deepspeed", "transformers", "accelerate", "h5py")
TRAINING_SIDE = ("mpitailor.training",)
# What the training side may import of mpitailor: its facade, the public API (`mpitailor`,
# `mpitailor.api`), formats/, the base modules, and itself.
FACADE = "mpitailor.facade"
TRAINING_MAY_IMPORT = (FACADE, "mpitailor.api", "mpitailor.formats", *TRAINING_SIDE,
                       *(f"mpitailor.{m}" for m in sorted(BASE)))
# The modules that may call torch.distributed: the training comm, the only one; and what
# counts as calling it (DeepSpeed's comm wraps it). enable_cpu_training patches
# deepspeed.comm.torch's JIT build away: cpu.py is named for that.
TORCH_DISTRIBUTED_IN = ("mpitailor.training.distcomm", "mpitailor.training.dcp_state")
DISTRIBUTED = ("torch.distributed", "deepspeed.comm")
PATCHES_DEEPSPEED_COMM = ("mpitailor.training.cpu",)


def layer(module: str) -> str | None:
    """The layer of `mpitailor.X...` (None for modules outside the package)."""
    parts = module.split(".")
    if parts[0] != "mpitailor":
        return None
    if len(parts) == 1:
        return "top"
    head = parts[1]
    if head == "facade":
        return "facade"
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


def _dynamic(node: ast.AST) -> str | None:
    """The literal module name of `importlib.import_module("x")`, `import_module("x")` or
    `__import__("x")`; None for anything else (a name built at run time is not seen)."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return None
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return node.args[0].value if called in ("import_module", "__import__") else None


def imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute name) of each module (or module attribute) a module imports."""
    package = module if is_package else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if _dynamic(node) is not None:
            out.append((node.lineno, _dynamic(node)))
        elif isinstance(node, ast.Import):
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
    """`module:line ...` for each import of torch.distributed or deepspeed.comm (however
    spelled) and each such attribute reached from `torch` or `deepspeed` under any name it
    was imported as, outside the training comm."""
    if module in TORCH_DISTRIBUTED_IN:
        return []
    allowed = DISTRIBUTED[:1] if module in PATCHES_DEEPSPEED_COMM else DISTRIBUTED
    found = [(line, f"imports {name}") for line, name in imports(tree, module, is_package)
             if within(name, allowed)]
    names = {top: {top} for top in ("torch", "deepspeed")}  # the names each is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in names and a.asname:
                    names[a.name].add(a.asname)
    found += [(node.lineno, f"uses {top}.{node.attr}") for node in ast.walk(tree)
              for top, attr in (("torch", "distributed"), ("deepspeed", "comm"))
              if f"{top}.{attr}" in allowed and isinstance(node, ast.Attribute)
              and node.attr == attr and isinstance(node.value, ast.Name)
              and node.value.id in names[top]]
    return [f"{module}:{line} {what}" for line, what in sorted(found)]


# formats/ inside: its leaves, then the families, each importing only those before it.
FORMATS_ORDER = ("lazyface", "dtypes", "io", "manifest", "safetensors_header", "torch", "dcp",
                 "zero", "hf")
FAMILIES = ("io", "torch", "dcp", "zero", "hf")  # the subpackages, each with a face


def formats_part(module: str) -> str | None:
    """The part of formats/ a module is in (None outside formats/, "" for its __init__)."""
    parts = module.split(".")
    if parts[:2] != ["mpitailor", "formats"]:
        return None
    return parts[2] if len(parts) > 2 else ""


def face_exports(family: str) -> dict[str, str]:
    """The EXPORTS of formats/<family>/__init__.py, read from its source."""
    tree = ast.parse((PACKAGE / "formats" / family / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == [
                "EXPORTS"]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"formats/{family}/__init__.py has no EXPORTS")


def formats_order(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """`module imports name` for each import, inside formats/, of a part after its own."""
    here = formats_part(module)
    if not here:
        return []
    return [f"{module} ({here}) imports {name} ({formats_part(name)})"
            for name in sorted(imported(tree, module, is_package))
            if formats_part(name) and FORMATS_ORDER.index(formats_part(name))
            > FORMATS_ORDER.index(here)]


def past_a_face(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """`module:line imports name` for each import of a formats/ family from outside it that
    is not a name of its face."""
    here = formats_part(module)
    wrong = []
    for line, name in sorted(imports(tree, module, is_package)):
        family = formats_part(name)
        if family not in FAMILIES or family == here or name == f"mpitailor.formats.{family}":
            continue
        rest = name.split(".")[3:]
        if len(rest) != 1 or rest[0] not in face_exports(family):
            wrong.append(f"{module}:{line} imports {name}: import from mpitailor.formats."
                         f"{family} a name its EXPORTS lists")
    return wrong


def upward(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """`module (layer) imports name (layer)` for each import that points up the layers."""
    here = ORDER.index(layer(module))
    return [f"{module} ({layer(module)}) imports {name} ({layer(name)})"
            for name in sorted(imported(tree, module, is_package))
            if layer(name) is not None and ORDER.index(layer(name)) > here]


def top_to_training(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """`module:line imports name` for each import of the training side by the merge side's
    top (cli, api, the package) that TOP_TO_TRAINING does not name."""
    if layer(module) != "top" or on_training_side(module):
        return []
    return [f"{module}:{line} imports {name}"
            for line, name in sorted(imports(tree, module, is_package))
            if on_training_side(name) and not within(name, TOP_TO_TRAINING)]


RULES = (upward, training_only_imports, facade_breaches, torch_distributed_uses, top_to_training,
         formats_order, past_a_face)


def violations(tree: ast.Module, module: str, is_package: bool = False) -> list[str]:
    """What every rule of this file finds in one module."""
    return [v for rule in RULES for v in rule(tree, module, is_package)]


def test_every_module_is_in_a_layer():
    for module, _ in modules():
        layer(module)


def test_imports_point_only_down():
    wrong = []
    for module, path in modules():
        wrong += upward(ast.parse(path.read_text()), module, path.name == "__init__.py")
    assert not wrong, "imports that point up the layers:\n" + "\n".join(wrong)


def test_the_command_line_and_api_reach_the_training_side_only_where_named():
    wrong = []
    for module, path in modules():
        wrong += top_to_training(ast.parse(path.read_text()), module, path.name == "__init__.py")
    assert not wrong, ("the merge side's top imports the training side (torch) where "
                       "TOP_TO_TRAINING does not say why:\n" + "\n".join(wrong))


PLANTED = {  # one violation each, as #42's reviewer planted them; every one must be caught
    "an upward import": ("mpitailor.formats.zero.read", "from mpitailor.jobs.merge import merge"),
    "torch on the merge side": ("mpitailor.engine.execute", "import torch"),
    "training past the facade": ("mpitailor.training.hf",
                                 "from mpitailor.jobs.recovery import recover_chain"),
    "torch.distributed outside the training comm": ("mpitailor.training.stats",
                                                    "import torch.distributed as dist"),
    "torch.distributed through an alias": ("mpitailor.training.stats",
                                           "import torch as t\nt.distributed.barrier()"),
    "deepspeed.comm outside the training comm": ("mpitailor.training.hf",
                                                 "import deepspeed.comm as dist"),
    "import_module past the facade": ("mpitailor.training.hf", "import importlib\n"
                                      "importlib.import_module('mpitailor.jobs.merge')"),
    "the facade importing the command line": ("mpitailor.facade",
                                              "from mpitailor.cli.main import main"),
    "the command line importing training": ("mpitailor.cli.tools",
                                            "from mpitailor.training.hf import LayerwiseTrainer"),
    "past a family's face": ("mpitailor.jobs.merge",
                             "from mpitailor.formats.zero.read import read_meta"),
    "a name a face does not export": ("mpitailor.jobs.merge",
                                      "from mpitailor.formats.zero import RankShard"),
    "a family importing one after it": ("mpitailor.formats.torch.safeload",
                                        "from mpitailor.formats.zero import read_meta"),
}


def test_every_planted_violation_is_caught_and_the_clean_lines_pass():
    for what, (module, source) in PLANTED.items():
        found = violations(ast.parse(f"def f():\n    {source.replace(chr(10), chr(10) + '    ')}"
                                     f"\n"), module)
        assert found, f"{what} ({module}: {source!r}) passed every rule"
    clean = ("from mpitailor.facade import Comm", "from mpitailor.errors import UserError",
             "import importlib\nimportlib.import_module('mpitailor.training.plot')")
    assert violations(ast.parse("\n".join(clean[:2])), "mpitailor.training.hf") == []
    assert violations(ast.parse(clean[2]), "mpitailor.cli.tools") == []


def test_formats_families_import_only_those_before_them_and_others_only_their_faces():
    wrong = []
    for module, path in modules():
        tree = ast.parse(path.read_text())
        wrong += formats_order(tree, module, path.name == "__init__.py")
        wrong += past_a_face(tree, module, path.name == "__init__.py")
    assert not wrong, "\n".join(wrong)


def test_every_name_of_every_face_is_there():
    for family in FAMILIES:
        face = importlib.import_module(f"mpitailor.formats.{family}")
        for name in face_exports(family):
            assert getattr(face, name) is not None, (family, name)
        assert sorted(dir(face)) == sorted(face_exports(family))


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
            from mpitailor.formats.zero.read import read_meta
            import torchvision  # not torch: another distribution
    """))
    assert training_only_imports(tree, "mpitailor.formats.zero.read", False) == [
        "mpitailor.formats.zero.read:3 imports torch",
        "mpitailor.formats.zero.read:4 imports deepspeed.runtime.zero",
        "mpitailor.formats.zero.read:8 imports torch.distributed",
        "mpitailor.formats.zero.read:9 imports transformers.AutoConfig",
        "mpitailor.formats.zero.read:10 imports accelerate.utils.DistributedType",
        "mpitailor.formats.zero.read:11 imports h5py",
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


def test_the_facade_rule_sees_top_level_and_lazy_imports_and_names_what_to_use():
    tree = ast.parse(textwrap.dedent("""
        from mpitailor import failpoints
        from mpitailor.errors import UserError
        from mpitailor.formats.zero.files import LATEST
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
