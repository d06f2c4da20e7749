"""What the reader fuzzer checks of an object mpitailor's reader accepted (reader_oracle.py):

- `same(ours, theirs)`: it describes what torch.load(weights_only=True) built: the same
  containers (types, order, sharing of storages), scalars (bit for bit), tensors (dtype,
  shape, stride, storage offset, storage size and bytes, element values through raw_bytes),
  torch.Size as mpitailor's Size, stand-ins as what the real classes reduce to;
- `outside(ours, path)`: no tensor reaches past its storage, no storage names another file
  or holds the planted marker's bytes;
- `walkers(ours, path)`: what the object describes unshared is within the reader's bound,
  and the package's walkers of loaded objects (rawio.copied, rawio.materialize,
  pickle_write.dumps) do work in proportion to it.
Each returns None when all is well, else one line. Walks are iterative and visit each object
once (the inputs nest deep and share a lot).
"""
from __future__ import annotations

import copyreg
import math
import os
import struct
import sys

import reader_fuzzing as fz

from mpitailor.formats.dtypes import name_of
from mpitailor.formats.torch import opaque, pickle_write, rawio, rebuild, safeload
from mpitailor.formats.torch.rebuild import Size
from mpitailor.formats.torch.tensorref import Storage, Tensor

MAX_NODES = 200_000  # objects a check visits before it gives up (no input has as many)
WALK_PATHS = 4  # paths per object above which the walkers are run under a call budget
WALK_MAX = 100_000  # ... unless there are more paths than this (the bound is checked instead)


def _children(x):
    if isinstance(x, dict):
        return [*x.keys(), *x.values()]
    if isinstance(x, (list, tuple, set, frozenset)):
        return list(x)
    if isinstance(x, opaque.Opaque):
        return [x.__dict__.get("_args"), x.__dict__.get("_state")]
    if isinstance(x, Tensor):
        return [x.storage]
    return []


def _objects(root):
    """Every object reachable from root, once each (up to MAX_NODES)."""
    seen, stack, out = set(), [root], []
    while stack and len(out) < MAX_NODES:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        out.append(x)
        stack.extend(_children(x))
    return out


# ---- bytes only from the file's own records ----------------------------------------------

def _span(t: Tensor) -> tuple[int, int] | None:
    """Lowest and highest element index the view touches (None when it has no elements)."""
    if any(d == 0 for d in t.shape):
        return None
    lo = t.storage_offset + sum(min(0, (d - 1) * s) for d, s in zip(t.shape, t.stride))
    hi = t.storage_offset + sum(max(0, (d - 1) * s) for d, s in zip(t.shape, t.stride))
    return lo, hi


def outside(root, path) -> str | None:
    size, real = os.path.getsize(path), os.path.realpath(path)
    for x in _objects(root):
        if isinstance(x, Tensor):
            if not isinstance(x.storage, Storage):
                return "a tensor whose storage is not a storage"
            span = _span(x)
            if span and (span[0] < 0 or span[1] >= x.storage.numel):
                return "a tensor view reaches outside its storage"
            if span and x.is_contiguous() and len(x.raw_bytes()) != x.nbytes:
                return "raw_bytes() of a tensor is not its size"
        elif isinstance(x, Storage):
            where = getattr(x, "path", None)
            if where is not None and os.path.realpath(where) != real:
                return "a storage names another file than the one loaded"
            if not isinstance(x.numel, int) or x.numel < 0 or x.nbytes > size:
                return "a storage claims more bytes than its file holds"
            if fz.MARKER in bytes(x.read()):
                return "the planted marker file's bytes came back from a load"
    return None


# ---- the same as torch's ----------------------------------------------------------------------

def name(obj) -> str:
    """module.qualname of a class or function, as a pickle's GLOBAL names it."""
    name = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    return name.replace("numpy.core.", "numpy._core.")


def _elements(storage: bytes, itemsize: int, offset: int, shape, stride) -> bytes:
    """The bytes of a view's elements in order, gathered from its storage's bytes (bit for
    bit: a copy in torch would turn a bool's byte 2 into 1)."""
    import numpy as np
    if 0 in shape:
        return b""
    items = np.frombuffer(storage, dtype=np.dtype(f"V{itemsize}"))
    # the stride of a dimension of size 1 is never stepped (torch allows any, numpy's C long
    # does not)
    view = np.lib.stride_tricks.as_strided(
        items[offset:], shape=tuple(shape),
        strides=tuple(0 if d == 1 else s * itemsize for d, s in zip(shape, stride)))
    return np.ascontiguousarray(view).tobytes()


def _storage_bytes(u) -> bytes:
    import torch
    return torch.empty(0, dtype=torch.uint8).set_(u).numpy().tobytes()


def _scalar_same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    return a == b


class _Compare:
    def __init__(self) -> None:
        self.stack: list = []
        self.seen: set = set()
        self.storage_of: dict = {}  # torch storage (pointer, bytes) -> id of ours
        self.torch_of: dict = {}    # id of our storage -> torch storage
        self.storage_bytes: dict = {}

    def bytes_of(self, u) -> bytes:
        key = (u.data_ptr(), u.nbytes())
        if key not in self.storage_bytes:
            self.storage_bytes[key] = _storage_bytes(u)
        return self.storage_bytes[key]

    def push(self, ours, theirs, where: str) -> None:
        self.stack.append((ours, theirs, where))

    def run(self, ours, theirs) -> str | None:
        self.push(ours, theirs, "obj")
        while self.stack:
            m, t, where = self.stack.pop()
            if (id(m), id(t)) in self.seen:
                continue
            self.seen.add((id(m), id(t)))
            if len(self.seen) > MAX_NODES:
                return None
            problem = self.one(m, t, where)
            if problem:
                return f"{where}: {problem}"
        return None

    def one(self, m, t, where: str) -> str | None:
        import torch
        if isinstance(t, torch.nn.Parameter):
            if not (isinstance(m, opaque.Opaque)
                    and type(m).global_name.startswith("torch._utils._rebuild_parameter")):
                return f"a Parameter read as {type(m).__name__}"
            self.push(m._args[0], t.data, where + ".data")
            return None if m._args[1] == t.requires_grad else "requires_grad"
        if isinstance(t, torch.Tensor):
            return self.tensor(m, t, where)
        if isinstance(t, torch.storage.TypedStorage):
            if not isinstance(m, Storage):
                return f"a storage read as {type(m).__name__}"
            size = t._size()  # size() says TypedStorage is deprecated, every time
            if (name_of(t.dtype), size) != (m.dtype, m.numel):
                return f"storage {name_of(t.dtype)} x {size} read as {m.dtype} x {m.numel}"
            return None if bytes(m.read()) == _storage_bytes(t._untyped_storage) \
                else "storage bytes differ"
        if isinstance(t, torch.serialization.StorageType):
            dtype = rebuild.STORAGE_TYPES.get(getattr(m, "global_name", "")[6:])
            return None if dtype == name_of(t.dtype) else f"storage class {m!r:.60}"
        if isinstance(t, torch.Size):
            return None if type(m) is Size and tuple(m) == tuple(t) else f"torch.Size {m!r:.60}"
        if isinstance(t, torch.dtype):
            return None if getattr(m, "global_name", None) == str(t) else f"dtype {m!r:.60}"
        if isinstance(t, torch.device):
            ok = isinstance(m, opaque.Opaque) and type(m).global_name == "torch.device" \
                and str(torch.device(*m._args)) == str(t)
            return None if ok else f"device {m!r:.60}"
        if isinstance(m, (opaque.Opaque, opaque._OpaqueMeta)):
            return self.stand_in(m, t, where)
        if isinstance(t, type) or callable(t):
            return None if isinstance(m, type) and name(m) == name(t) else f"global {name(t)}"
        if isinstance(t, (dict, list, tuple, set, frozenset)):
            return self.container(m, t, where)
        if t is None or isinstance(t, (int, float, str, bytes, bytearray, complex)):
            return None if _scalar_same(m, t) else f"{t!r:.40} read as {m!r:.40}"
        return f"torch's {type(t).__name__} read as {type(m).__name__}"

    def container(self, m, t, where: str) -> str | None:
        if type(m) is not type(t):
            return f"{type(t).__name__} read as {type(m).__name__}"
        if len(m) != len(t):
            return f"{type(t).__name__} of {len(t)} read with {len(m)}"
        if isinstance(t, dict):
            for i, ((mk, mv), (tk, tv)) in enumerate(zip(m.items(), t.items())):
                self.push(mk, tk, f"{where}.key{i}")
                self.push(mv, tv, f"{where}[{tk!r:.20}]")
        elif isinstance(t, (set, frozenset)):
            if all(isinstance(x, (int, str, bytes, float)) for x in t) and m != t:
                return "set elements"
        else:
            for i, (a, b) in enumerate(zip(m, t)):
                self.push(a, b, f"{where}[{i}]")
        return None

    def tensor(self, m, t, where: str) -> str | None:
        if not isinstance(m, Tensor):
            return f"a tensor read as {type(m).__name__}"
        import torch
        # Through the class: a file may have set attributes named like the methods (BUILD).
        u = torch.Tensor.untyped_storage(t)
        fields = (name_of(t.dtype), tuple(t.shape), tuple(torch.Tensor.stride(t)),
                  torch.Tensor.storage_offset(t), t.requires_grad, u.nbytes())
        got = (m.dtype, m.shape, m.stride, m.storage_offset, m.requires_grad, m.storage.nbytes)
        names = ("dtype", "shape", "stride", "storage_offset", "requires_grad", "storage bytes")
        for n, a, b in zip(names, fields, got):
            if a != b:
                return f"tensor {n} {a} read as {b}"
        if torch.Tensor.is_neg(t) or torch.Tensor.is_conj(t):
            # torch's values are the bytes negated (conjugated); mpitailor moves bytes
            return "a negated or conjugated view read as its plain bytes"
        attrs = dict(t.__dict__)
        if attrs:
            if m.wrapper is None:
                return "a tensor's attributes were dropped"
            self.push(m.wrapper[1], attrs, where + ".__dict__")
        key = (u.data_ptr(), u.nbytes())
        if u.nbytes():
            if self.storage_of.setdefault(key, id(m.storage)) != id(m.storage) or \
                    self.torch_of.setdefault(id(m.storage), key) != key:
                return "tensors that share a storage in torch do not in mpitailor, or back"
            if (id(m.storage), "bytes") not in self.seen:
                self.seen.add((id(m.storage), "bytes"))
                if bytes(m.storage.read()) != self.bytes_of(u):
                    return "storage bytes differ"
        if m.numel() and m.is_contiguous():
            theirs = _elements(self.bytes_of(u), torch.Tensor.element_size(t), fields[3],
                               fields[1], fields[2])
            if bytes(m.raw_bytes()) != theirs:
                return "element values (raw_bytes) differ"
        return None

    def stand_in(self, m, t, where: str) -> str | None:
        """A stand-in against the real object: the instructions the real one reduces to."""
        if isinstance(m, opaque._OpaqueMeta):  # a class or function the pickle names
            same_name = m.global_name.replace("numpy.core.", "numpy._core.") == name(t)
            return None if same_name else f"global {m.global_name} vs {name(t)}"
        if _reloads_as(m, t):
            return None
        red = t.__reduce_ex__(2)
        func, args = red[0], red[1]
        state = red[2] if len(red) > 2 else None
        newobj = func is copyreg.__newobj__
        if newobj:
            func, args = args[0], args[1:]
        if type(m).global_name != name(func):
            return f"stand-in {type(m).global_name} vs {name(func)}"
        if args or not newobj:  # object.__new__ drops NEWOBJ's arguments; the stand-in keeps them
            self.push(m._args, tuple(args), where + ".args")
        built_by_call = m._how == "reduce" and m._state is opaque._NOSTATE
        if not built_by_call and (state is not None or m._state is not opaque._NOSTATE):
            # (a real class called with arguments has the state its __init__ gave it; the
            # stand-in keeps the arguments, which make the same object when loaded for real)
            self.push(m._state, state, where + ".state")
        return None


def _reloads_as(m, t) -> bool:
    """Whether torch's weights-only loader, given mpitailor's own pickle of the stand-in m
    (what an output carrying it holds), builds an object that pickles as t does. Real
    classes normalize the state they are given (numpy: a dtype's byte order '<' becomes '|'
    for one-byte kinds, numpy 1's module names are numpy 2's; pickle's BUILD of a
    (dict, slots) tuple on DeepSpeed's loss scaler): the stand-in carries the state as the
    file wrote it, and the output loads as the input did."""
    import io
    import pickle

    import torch
    from reader_oracle import _torch_globals
    from torch._weights_only_unpickler import Unpickler
    try:
        data, storages = pickle_write.dumps(m)
        if storages:
            return False
        with torch.serialization.safe_globals(_torch_globals(("numpy", "deepspeed"))):
            real = Unpickler(io.BytesIO(data), encoding="bytes").load()
        return pickle.dumps(real, 2) == pickle.dumps(t, 2)
    except Exception:  # noqa: BLE001 - not the same, whatever stopped it
        return False


def same(ours, theirs) -> str | None:
    return _Compare().run(ours, theirs)


# ---- the walkers of loaded objects ----------------------------------------------------------------

def _paths(root, cap: int) -> tuple[int, int, bool]:
    """(paths through the object graph from root, capped; distinct objects; a cycle?)."""
    memo: dict[int, int] = {}
    cycle = False
    stack = [(root, False)]
    on_path: set[int] = set()
    while stack:
        x, done = stack.pop()
        if done:
            on_path.discard(id(x))
            memo[id(x)] = min(cap, 1 + sum(memo.get(id(c), 1) for c in _children(x)))
            continue
        if id(x) in memo:
            continue
        if id(x) in on_path:
            cycle = True
            continue
        on_path.add(id(x))
        stack.append((x, True))
        stack.extend((c, False) for c in _children(x) if id(c) not in memo)
    return memo.get(id(root), 1), len(memo), cycle


class _Budget(Exception):
    pass


def _budgeted(fn, calls: int):
    count = [0]

    def prof(frame, event, arg):
        if event == "call":
            count[0] += 1
            if count[0] > calls:
                raise _Budget()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)


def walkers(root, path) -> str | None:
    """The package's walkers copy shared containers unshared (rawio.copied, by design), so the
    reader bounds what a file may describe unshared (safeload.MAX_OBJECTS): a file accepted
    beyond twice that bound (or with a cycle, which no walker ends) is a finding; below it,
    where the object shares a lot, each walker is given 50 calls per unshared object."""
    bound = getattr(safeload, "MAX_OBJECTS", 1 << 20)
    paths, distinct, cycle = _paths(root, 4 * bound)
    if paths > 2 * bound:
        return f"the reader accepts a file that describes over {2 * bound} objects unshared"
    if not cycle and (paths <= WALK_PATHS * distinct or paths > WALK_MAX):
        return None
    budget = 50 * (distinct if cycle else paths) + 10_000
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, fn in (("rawio.copied", lambda: rawio.copied(root, fd)),
                         ("rawio.materialize", lambda: rawio.materialize(root)),
                         ("pickle_write.dumps", lambda: pickle_write.dumps(root))):
            try:
                _budgeted(fn, budget)
            except _Budget:
                return f"{name} does over 50 calls per object{' (a cycle)' if cycle else ''}"
            except RecursionError:
                return f"{name} recurses without end ({'a cycle' if cycle else 'deep nesting'})"
            except Exception:  # noqa: BLE001 - other failures of a walker are not this check's
                pass
    finally:
        os.close(fd)
    return None
