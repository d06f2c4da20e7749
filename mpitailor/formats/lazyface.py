"""The face of a subpackage of formats/: the names the rest of the package may import from
it, each loaded from its module on first use.

A face that imported its modules eagerly would make every import of one name load the
whole family: the planner, which needs CheckpointMeta and the layout arithmetic, would load
the readers and numpy with them (0.3 s of a rank's start-up). So a face names where each
name lives and Python (PEP 562) asks it only for what is used."""
from __future__ import annotations

import importlib
from collections.abc import Callable


def face(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object],
                                                          Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`'s __init__: exports maps each name to the
    module of the package that defines it (a module exported whole maps to itself)."""
    def getattr_(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(f"{package}.{module}")
        return loaded if module == name else getattr(loaded, name)

    def dir_() -> list[str]:
        return sorted(exports)

    return getattr_, dir_
