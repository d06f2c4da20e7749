"""The layers of the house (DESIGN.md, Version 2): arrows only point down.

The middle layer (recipe, plan, reshard, layers) is pure decisions: importing it loads
neither torch nor mpi4py. The bottom layer (`zero3/`) imports nothing above it.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import mpitailor

PACKAGE = Path(mpitailor.__file__).parent
HEAVY = ("torch", "mpi4py")
MIDDLE = ("mpitailor.plan", "mpitailor.program", "mpitailor.recipe", "mpitailor.reshard",
          "mpitailor.layers")

# Modules above zero3/ that zero3/ may import: leaves of the house, standard library only.
BOTTOM = {"mpitailor.errors", "mpitailor.crc", "mpitailor.filerecord", "mpitailor.failpoints"}

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


def test_middle_layer_loads_neither_torch_nor_mpi4py():
    code = CHILD.format(heavy=HEAVY, modules=MIDDLE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert not out.stdout, f"importing {', '.join(MIDDLE)}:\n{out.stdout}"


def _imported(tree: ast.Module, package: str) -> set[str]:
    """Absolute names of the modules (or module attributes) a module in `package` imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_zero3_imports_nothing_above_it():
    wrong = []
    for path in sorted((PACKAGE / "zero3").rglob("*.py")):
        package = ".".join(path.parent.relative_to(PACKAGE.parent).parts)
        allowed = BOTTOM
        for name in sorted(_imported(ast.parse(path.read_text()), package)):
            if not name.startswith("mpitailor.") or name.startswith("mpitailor.zero3."):
                continue
            if not any(name == a or name.startswith(a + ".") for a in allowed):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}: imports {name}")
    assert not wrong, ("zero3/ (formats) must import nothing above it but "
                       f"{sorted(BOTTOM)}:\n" + "\n".join(wrong))
