"""Load DeepSpeed checkpoint files without ever unpickling arbitrary objects, or torch.

The files are torch zips; their pickle is read by pickle_read.py, whose only way to a global
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

import gc
import importlib
import itertools
import os
import pickle
import stat
import struct
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.io import FileIdentity, Window
from mpitailor.formats.torch import opaque, pickle_read, zip_read
from mpitailor.formats.torch.tensorref import Storage, Tensor, view_problem

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
         opaque_ok: bool = False, fd: int | None = None,
         window: tuple[int, int] | None = None) -> Any:
    """Load a torch-serialised file safely; one-line CheckpointError on any failure.

    Tensors come back as tensorref.Tensor, their bytes left in the file; each storage
    records the file's identity, so that a later read by its path refuses another file.
    opaque_ok: plain classes of the user's own modules (client state) become stand-ins
    (opaque.py) instead of a refusal; a call of one is still refused.
    fd: the file, already open (a regular file) by a caller who reads it again through that
    descriptor: what is loaded is what it reads, whatever `path` names by then.
    window: (start, size), with fd: the torch file is those bytes of the file (a DCP item);
    its storages' offsets are the file's.
    """
    return load_with_globals(path, allow=allow, opaque_ok=opaque_ok, fd=fd, window=window)[0]


def load_with_globals(path: Path | str, *, allow: tuple[str, ...] = ("deepspeed",),
                      opaque_ok: bool = False, fd: int | None = None,
                      window: tuple[int, int] | None = None
                      ) -> tuple[Any, frozenset[str]]:
    """load(), and the full name of every global the file's pickle names."""
    path = Path(path)
    lists = (*allow, "client") if opaque_ok else allow
    allowed = frozenset(n for name in lists for n in pickle_read.ALLOWED[name]) | _trusted
    if fd is None:
        require_regular(path)
    try:
        # zipfile seeks: a descriptor of our own (a dup shares the caller's offset, which
        # the caller never uses: its reads are preads)
        base = 0
        if window is not None:
            base, f = window[0], Window(fd, *window)
            identity = FileIdentity.of(fd)
            records = zip_read.read_records(f)
            data = zip_read.read_pickle(f, records)
        else:
            with open(path, "rb") if fd is None else os.fdopen(os.dup(fd), "rb") as f:
                identity = FileIdentity.of(f.fileno())
                records = zip_read.read_records(f)
                data = zip_read.read_pickle(f, records)
        archive = zip_read.archive_of(records)

        def storage(key: str, dtype: str, numel: int) -> Storage:
            name = f"{archive}/data/{key}"
            if name not in records:
                raise pickle.UnpicklingError(f"no record {name}")
            offset, size, _ = records[name]
            if size != numel * DTYPES[dtype].itemsize:
                raise pickle.UnpicklingError(f"record {name} holds {size} bytes, not "
                                             f"{numel} elements of {dtype}")
            return Storage(dtype, numel, path=path, offset=base + offset, identity=identity)

        # The cycle collector would walk every container made so far, again and again, as a
        # file of many is read (a third of the load's time at 10**6 of them); nothing made
        # here is garbage until the load returns.
        collecting = gc.isenabled()
        gc.disable()
        try:
            obj, names = pickle_read.unpickle(data, allowed=allowed, opaque_ok=opaque_ok,
                                              storage=storage)
            _check_loaded(obj, path)
        finally:
            if collecting:
                gc.enable()
        return obj, names
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except pickle_read.Refused as e:
        raise CheckpointError(_refusal(path, e, opaque_ok)) from None
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, OSError, ValueError,
            TypeError, KeyError, IndexError, AttributeError, RecursionError,
            MemoryError, OverflowError, UnicodeDecodeError, struct.error) as e:
        first = str(e).strip().split("\n")[0] or type(e).__name__
        raise CheckpointError(
            f"{path}: unreadable or truncated checkpoint file ({first[:200]}); "
            f"re-copy it from the original save") from None


def carried_globals(path: Path | str) -> list[str]:
    """The globals a model-states file names beyond torch's own tensor machinery
    (DeepSpeed's classes, the training script's client state), sorted."""
    names = load_with_globals(path, opaque_ok=True)[1]
    return sorted(names - pickle_read.TORCH_OWN)


def _refusal(path: Path, e: pickle_read.Refused, opaque_ok: bool) -> str:
    if e.how == "calls":
        what = (f"it calls {e.name} (a class of your script is carried only as plain "
                f"instances, as a dataclass pickles; a call could run code when DeepSpeed "
                f"loads the output)")
    else:
        what = (f"it pickles {e.name} outside mpitailor's allow-list (Namespace, numpy, "
                f"your script's own classes)")
    if re.fullmatch(r"torch\.\w+Storage", e.name):  # no flag makes mpitailor read it
        return (f"{path}: holds a tensor of a dtype mpitailor does not read ({e.name}; it "
                f"reads {', '.join(sorted(pickle_read.STORAGE_TYPES))})")
    # (never suggested for Python's own modules: that is how payloads run code)
    hint = f" (if you trust this file, --safe-globals {e.name} allows it)" \
        if e.name.split(".")[0] not in sys.stdlib_module_names else ""
    return f"{path}: refused to load: {what}; mpitailor never runs code from checkpoint " \
        f"files{hint}"


MAX_DEPTH = 200  # DeepSpeed's and HF's states nest < 10 deep; client state a little more
# Objects a file may describe, each shared container counted every time it is reached: what
# a copy that unshares them (rawio.copied) and the walks after the load cost. A real
# optimizer or model-states file describes thousands.
MAX_OBJECTS = 1 << 20


_CONTAINERS = (dict, list, tuple, set, frozenset, opaque.Opaque, Tensor)
_LEAVES = frozenset({int, float, str, bytes, bytearray, bool, complex, type(None)})


def _children(x):
    kind = type(x)
    if kind is list or kind is tuple:
        return x
    if kind is dict:  # (a plain dict has no attributes)
        return [*x.keys(), *x.values()]
    if isinstance(x, Tensor):  # what torch's rebuild carries beside the view
        return (x.wrapper, x.metadata)
    if isinstance(x, dict):  # an OrderedDict's attributes too (BUILD sets them)
        return itertools.chain(x.keys(), x.values(), getattr(x, "__dict__", {}).values())
    if isinstance(x, opaque.Opaque):
        return (x._args, x._state)
    return x


def _check_loaded(obj, path: Path) -> None:
    """After the whole file is read: refuse containers nested deeper than MAX_DEPTH
    (everything after the load walks them recursively), more than MAX_OBJECTS objects
    once shared containers are unshared, any tensor whose view does not lie inside its
    storage (tensorref checked each when it was made; this holds after anything since),
    views of many more bytes than the storages hold, and a global kept as a value where
    torch files only call it.
    Each container is visited once (memo), in post-order so that its unshared size is the
    sum of its children's."""
    size: dict[int, int] = {}  # id -> unshared size, of every container done
    open_: set[int] = set()  # containers whose children are being visited
    viewed, stored = 0, {}  # bytes of every tensor's view; of every storage, by id
    stack = [(obj, 1, False)]
    while stack:
        x, depth, done = stack.pop()
        if id(x) in pickle_read.CALLS_ONLY_VALUES:
            raise CheckpointError(f"{path}: a pickle that keeps the global "
                                  f"{pickle_read.CALLS_ONLY_VALUES[id(x)]} as a value (torch "
                                  f"files only call it); a damaged or crafted file")
        if isinstance(x, Tensor) and not done and id(x) not in size:
            problem = view_problem(x.storage, x.storage_offset, x.shape, x.stride)
            if problem is not None:
                raise CheckpointError(f"{path}: {problem}; a damaged or crafted file")
            viewed += x.nbytes
            stored.setdefault(id(x.storage), x.storage.nbytes)
        elif not isinstance(x, _CONTAINERS):
            continue
        if done:
            open_.discard(id(x))
            size[id(x)] = 1 + sum(size.get(id(c), 1) for c in _children(x))
            if size[id(x)] > MAX_OBJECTS:
                raise CheckpointError(
                    f"{path}: describes over {MAX_OBJECTS} objects (containers shared over and "
                    f"over); not a checkpoint mpitailor reads (a damaged or crafted file)")
            continue
        if id(x) in open_:
            raise CheckpointError(f"{path}: a container that holds itself; not a checkpoint "
                                  f"mpitailor reads (a damaged or crafted file)")
        if id(x) in size:
            continue
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{path}: containers nested over {MAX_DEPTH} levels deep; not "
                                  f"a checkpoint mpitailor reads (a damaged or crafted file)")
        children = list(_children(x))
        inner = [c for c in children if type(c) not in _LEAVES]
        if not inner and len(children) < MAX_OBJECTS:  # most containers: sized now, once
            size[id(x)] = 1 + len(children)
            continue
        open_.add(id(x))
        stack.append((x, depth, True))
        stack.extend((c, depth + 1, False) for c in inner)
    # Views of one storage, each copied whole later (rawio.copied, materialize): bounded
    # by the storages' own bytes (tied weights view one storage twice, stage 1/2 params
    # view a flat buffer once).
    if viewed > 4 * sum(stored.values()) + (64 << 20):
        raise CheckpointError(f"{path}: its tensors view {viewed} bytes of storages that hold "
                              f"{sum(stored.values())}; a damaged or crafted file")


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
