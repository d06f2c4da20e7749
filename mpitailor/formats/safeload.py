"""Load DeepSpeed checkpoint files without ever unpickling arbitrary objects, or torch.

The files are torch zips; their pickle is read by torchpickle.py, whose only way to a global
is an allow-list: torch's tensor and storage records, a few small DeepSpeed classes (by
name, as stand-ins, never imported), numpy's for HF's RNG states where asked. Model-states
files may also hold the training script's own objects (client state): loaded with
`opaque_ok=True`, those become stand-ins that are carried through unbuilt (see opaque.py).
Classes the user names with `trust()` (`--safe-globals`) are allowed everywhere (each name is
imported once, to check it), and carried as stand-ins like client state: mpitailor reads
nothing of them, and a stand-in writes back exactly what the file holds.
Tensors come back as references to their records' bytes (tensorref.py): nothing of a tensor
is read until a caller asks for its values.
"""
from __future__ import annotations

import importlib
import itertools
import pickle
import stat
import zipfile
from pathlib import Path
from typing import Any

from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats import opaque, ptzip, torchpickle
from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.tensorref import Storage

_trusted: set[str] = set()  # names the user allowed with --safe-globals


def trust(names: tuple[str, ...] | list[str]) -> None:
    """Allow these `module.Name` globals in every file (the user's explicit choice; each is
    imported here, which runs its module's code, to check the name). UserError if one
    cannot be imported."""
    for full in names:
        module, _, attr = full.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr) if module else None
        except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
            raise UserError(f"--safe-globals {full}: cannot import it ({type(e).__name__}: "
                            f"{e}); name a class as module.Name, importable here") from None
        if obj is None:
            raise UserError(f"--safe-globals {full!r}: name a class as module.Name")
        _trusted.add(full)  # as named, and as a pickle names it
        _trusted.add(f"{getattr(obj, '__module__', module)}.{getattr(obj, '__qualname__', attr)}")


def load(path: Path | str, *, allow: tuple[str, ...] = ("deepspeed",),
         opaque_ok: bool = False) -> Any:
    """Load a torch-serialised file safely; one-line CheckpointError on any failure.

    Tensors come back as tensorref.Tensor, their bytes left in the file.
    opaque_ok: globals outside the allow-list become stand-ins (opaque.py) instead of a
    refusal, unless they belong to a module that exists to run code.
    """
    path = Path(path)
    allowed = frozenset(n for name in allow for n in torchpickle.ALLOWED[name]) | _trusted
    require_regular(path)
    try:
        with open(path, "rb") as f:
            records = ptzip.read_records(f)
            data = ptzip.read_pickle(f, records)
        archive = ptzip.archive_of(records)

        def storage(key: str, dtype: str, numel: int) -> Storage:
            name = f"{archive}/data/{key}"
            if name not in records:
                raise pickle.UnpicklingError(f"no record {name}")
            offset, size, _ = records[name]
            if size != numel * DTYPES[dtype].itemsize:
                raise pickle.UnpicklingError(f"record {name} holds {size} bytes, not "
                                             f"{numel} elements of {dtype}")
            return Storage(dtype, numel, path=path, offset=offset)

        obj = torchpickle.unpickle(data, allowed=allowed, opaque_ok=opaque_ok,
                                   storage=storage)
        _check_depth(obj, path)
        return obj
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except torchpickle.Refused as e:
        hint = f" (if you trust this file, --safe-globals {e.name} allows it)" \
            if opaque.may_stand_in(e.name) else ""
        raise CheckpointError(
            f"{path}: refused to load: it pickles {e.name} outside mpitailor's "
            f"allow-list; mpitailor never runs code from checkpoint files{hint}") from None
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, OSError, ValueError,
            TypeError, KeyError, IndexError, AttributeError, RecursionError,
            MemoryError) as e:
        first = str(e).strip().split("\n")[0] or type(e).__name__
        raise CheckpointError(
            f"{path}: unreadable or truncated checkpoint file ({first}); "
            f"re-copy it from the original save") from None


MAX_DEPTH = 200  # DeepSpeed's and HF's states nest < 10 deep; client state a little more


_CONTAINERS = (dict, list, tuple, set, frozenset, opaque.Opaque)


def _check_depth(obj, path: Path) -> None:
    """Refuse containers nested deeper than MAX_DEPTH: everything after the load (copies,
    the pickler) walks them recursively. Iterative, each container once (a pickle may share
    one); leaves are never pushed: this runs on every file a rank loads."""
    seen, stack = set(), [(obj, 1)] if isinstance(obj, _CONTAINERS) else []
    while stack:
        x, depth = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{path}: containers nested over {MAX_DEPTH} levels deep; not "
                                  f"a checkpoint mpitailor reads (a damaged or crafted file)")
        if isinstance(x, dict):
            children = itertools.chain(x.keys(), x.values())
        elif isinstance(x, opaque.Opaque):
            children = (x._args, x._state)
        else:
            children = x
        stack.extend((c, depth + 1) for c in children if isinstance(c, _CONTAINERS))


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
