"""The names a DeepSpeed checkpoint gives its parameters, module entries and buffers, checked
before anything uses them: the exports make files and folders of them (the Universal
layout's zero/<name>/), safetensors keys, and the layer rules run regular expressions on
each (whose backtracking grows with the square of a name's length)."""
from __future__ import annotations

from pathlib import Path

from mpitailor.display import bounded
from mpitailor.errors import CheckpointError

MAX_NAME = 512  # characters in a name: real ones have < 200


def check_name(path: Path, key: str, name: str) -> None:
    """A parameter name as torch makes them (dot-joined module and parameter names, none
    empty), which the exports use as file and folder names (the Universal layout's
    zero/<name>/) and safetensors keys: no path separator, NUL or control character, no
    empty part (a `..`), not safetensors' reserved `__metadata__`."""
    if not (0 < len(name) <= MAX_NAME) or "" in name.split(".") or name == "__metadata__" \
            or any(c in "/\\" or ord(c) < 32 for c in name):
        raise CheckpointError(f"{path}: {key} names a parameter {bounded(name)}, which is not a "
                              f"parameter name (a damaged or crafted file)")


def check_model_names(path: Path, model: dict) -> None:
    """Every key of a model-states file's `module` and every name of its `buffer_names`, as
    check_name; called on every rank's file read (a merge classifies each rank's own)."""
    module = model.get("module")
    for name in module if isinstance(module, dict) else ():
        check_name(path, "module", name if type(name) is str else "")
    buffers = model.get("buffer_names")
    for name in buffers if isinstance(buffers, (list, tuple)) else ():
        check_name(path, "buffer_names", name if type(name) is str else "")
