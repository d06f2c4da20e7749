"""Load DeepSpeed checkpoint files without ever unpickling arbitrary objects.

`torch.load(weights_only=True)` refuses every global outside an allow-list. DeepSpeed's
optimizer files pickle a few small classes of its own; they are allowed by name. Model-states
files may also hold the training script's own objects (client state): loaded with
`opaque_ok=True`, those become stand-ins that are carried through unbuilt (see opaque.py).
Classes the user names with `trust()` (`--safe-globals`) are imported and built for real.
Files are memory-mapped, so only the pages of the tensors a caller touches are read.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import re
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch

from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats import opaque


def _deepspeed_globals() -> list:
    # Imported lazily. DeepSpeed's package init warns once that it picked the CPU
    # accelerator; that says nothing about mpitailor's work, so keep it off the console.
    ds_log = logging.getLogger("DeepSpeed")
    mute = logging.Filter("nothing")  # passes no record named "DeepSpeed"
    ds_log.addFilter(mute)
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address  # stage 1/2 files
    finally:
        ds_log.removeFilter(mute)
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _numpy_globals() -> list:
    """What HF Trainer's `rng_state_*.pth` (numpy RNG state) needs."""
    import numpy as np
    from numpy.core.multiarray import _reconstruct  # type: ignore[attr-defined]
    dtypes = [type(np.dtype(t)) for t in ("uint32", "float64", "int64")]
    return [_reconstruct, np.ndarray, np.dtype, *dtypes]


ALLOWED = {"deepspeed": _deepspeed_globals, "numpy": _numpy_globals}
_trusted: list = []  # classes the user named with --safe-globals, imported


def trust(names: tuple[str, ...] | list[str]) -> None:
    """Allow these `module.Name` globals to be built for real (the user's explicit choice:
    importing them runs their modules' code). UserError if one cannot be imported."""
    for full in names:
        module, _, attr = full.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr) if module else None
        except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
            raise UserError(f"--safe-globals {full}: cannot import it ({type(e).__name__}: "
                            f"{e}); name a class as module.Name, importable here") from None
        if obj is None:
            raise UserError(f"--safe-globals {full!r}: name a class as module.Name")
        if obj not in _trusted:
            _trusted.append(obj)


def load(path: Path | str, *, allow: tuple[str, ...] = ("deepspeed",), mmap: bool = True,
         index_only: bool = False, opaque_ok: bool = False) -> Any:
    """Load a torch-serialised file safely; one-line CheckpointError on any failure.

    index_only: parse the structure only; tensors come back on the meta device, tagged with
    their byte offsets (see rawio.py), and no tensor data is read.
    opaque_ok: globals outside the allow-list become stand-ins (opaque.py) instead of a
    refusal, unless they belong to a module that exists to run code.
    """
    path = Path(path)
    allowed = [g for name in allow for g in ALLOWED[name]()] + _trusted
    where = "meta" if index_only else "cpu"
    require_regular(path)
    with torch_openable(path) as named:
        return _load(path, named, allowed, where, mmap and not index_only, opaque_ok)


@contextlib.contextmanager
def torch_openable(path: Path):
    """A name of path that torch's C++ reader can open: itself, or where it is not UTF-8
    (torch encodes names strictly) the /proc/self/fd name of the file held open."""
    if str(path).isascii() or not any("\udc80" <= c <= "\udcff" for c in str(path)):
        yield path
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        yield Path(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _load(path: Path, named: Path, allowed: list, where: str, mmap: bool,
          opaque_ok: bool) -> Any:
    try:
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(named, map_location=where, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError:
            if not opaque_ok:
                raise
        with torch.serialization.safe_globals(allowed):
            unknown = torch.serialization.get_unsafe_globals_in_checkpoint(named)
        denied = [g for g in unknown if not opaque.may_stand_in(g)]
        if denied or not unknown:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL "
                                         f"{(denied or ['(dynamic)'])[0]}")
        stand_ins = [(opaque.stand_in(g), g) for g in unknown]
        with torch.serialization.safe_globals(allowed + stand_ins):
            return torch.load(named, map_location=where, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except pickle.UnpicklingError as e:
        name = _culprit(str(e))
        hint = f" (if you trust this file, --safe-globals {name} allows it)" \
            if name and opaque.may_stand_in(name) else ""
        raise CheckpointError(
            f"{path}: refused to load: it pickles {name or 'an object'} outside mpitailor's "
            f"allow-list; mpitailor never runs code from checkpoint files{hint}") from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        first = str(e).strip().split("\n")[0]
        raise CheckpointError(
            f"{path}: unreadable or truncated checkpoint file ({first}); "
            f"re-copy it from the original save") from None


def _culprit(message: str) -> str | None:
    """The global that torch's long refusal names."""
    m = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"function <?([\w.]+)", message) \
        or re.search(r"but got <class '([\w.]+)'>", message)
    return m.group(1).rstrip(".") if m else None


def require_regular(path: Path) -> None:
    """A FIFO, device or directory where a checkpoint file should be is refused before it is
    opened (opening a FIFO would block forever)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: not a regular file (a FIFO, device or directory); "
                              f"put the checkpoint file itself there")
