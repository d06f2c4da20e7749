"""DCP's `.metadata` pickle read without torch, through an allow-list of DCP's own classes.

torch's FileSystemReader unpickles `.metadata` with plain `pickle.load`: a crafted file runs
code. Here Python's pure unpickler is held to what DCP writes (protocol 2-5 data opcodes;
a global only from the list below; a new object only of DCP's metadata classes, each given
its state once by BUILD; a call only of the few functions DCP's pickles call, each checking
its arguments) and builds records, never DCP's classes: `Rec` instances that hold the state
the pickle gave them. metadata.py turns them into checked, frozen values.

Not Python's C unpickler, though it reads a 2,646-item file in a fifth of the time: it asks
find_class for globals and nothing else. Dict keys it hashes itself (a file's ints and
tuples can be made to share one hash, N**2/2 comparisons; a tuple nested 10**5 deep as a
key overflows C's stack in hashing), whatever an opcode makes it makes, uncounted. Here
every opcode runs a handler of Python's or this module's; load() is the loop, trimmed.
"""
from __future__ import annotations

import io
import pickle
import re

from mpitailor.formats.torch import Unpickler

_DCP = "torch.distributed.checkpoint"
# The classes DCP pickles as NEWOBJ + BUILD (dataclasses, TensorProperties' tuple state).
RECORD_CLASSES = frozenset({
    f"{_DCP}.metadata.Metadata", f"{_DCP}.metadata.TensorStorageMetadata",
    f"{_DCP}.metadata.ChunkStorageMetadata", f"{_DCP}.metadata.BytesStorageMetadata",
    f"{_DCP}.metadata.TensorProperties", f"{_DCP}.metadata.StorageMeta",
    f"{_DCP}.metadata.MetadataIndex", f"{_DCP}.filesystem._StorageInfo",
    # Megatron-Core's torch_dist adds `all_local_plans` to its Metadata, every rank's SavePlan
    # (kept to reuse the metadata on its next save): records here, never looked into.
    f"{_DCP}.planner.SavePlan", f"{_DCP}.planner.WriteItem", f"{_DCP}.planner.TensorWriteData"})
# torch's dtypes as DCP names them (globals `torch.float32`, ...): values, never called.
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
          "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128",
          "uint16", "uint32", "uint64")
LAYOUTS = ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc",
           "torch.sparse_bsr", "torch.sparse_bsc", "torch._mkldnn", "torch.jagged")
MAX_MADE = 1 << 24  # objects one .metadata may make (a 405B model's has ~10**6)
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_NAME = re.compile(r"[A-Za-z_]\w*")


class Refused(pickle.UnpicklingError):
    """A global outside the allow-list (its full name)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"global {name}, which is not one of DCP's metadata classes")
        self.name = name


class DType(str):
    """A torch dtype the pickle names (`torch.float32` -> DType("float32"))."""


class Rec:
    """An instance of one of DCP's metadata classes, as the pickle made it: its class's full
    name and the state BUILD gave it (None until then). Hashes by identity: a MetadataIndex
    is a dict key, never looked up by value here."""

    __slots__ = ("kind", "state")

    def __init__(self, kind: str) -> None:
        self.kind, self.state = kind, None


class _RecClass:
    """What find_class gives for a record class: NEWOBJ makes a Rec of it."""

    __slots__ = ("kind",)

    def __init__(self, kind: str) -> None:
        self.kind = kind


def _size(dims=()):
    """`torch.Size(dims)`: a tuple of non-negative ints."""
    dims = tuple(dims) if isinstance(dims, (tuple, list)) else None
    if dims is None or not all(type(d) is int and 0 <= d < 1 << 62 for d in dims):
        raise pickle.UnpicklingError("torch.Size of something other than sizes")
    return dims


def _layout(name):
    """`torch.serialization._get_layout(name)`: the layout's name, one torch has."""
    if name not in LAYOUTS:
        raise pickle.UnpicklingError(f"layout {str(name)[:40]!r} is not one torch has")
    return name


def _memory_format(code):
    """`_MEM_FORMAT_ENCODING(code)`: contiguous 0, channels last 1, preserve 2."""
    if type(code) is not int or code not in (0, 1, 2):
        raise pickle.UnpicklingError("a memory format encoding other than 0, 1 or 2")
    return code


def _write_item_type(value):
    """`WriteItemType(value)` (an Enum: TENSOR 1, SHARD 2, BYTE_IO 3): the int."""
    if type(value) is not int or value not in (1, 2, 3):
        raise pickle.UnpicklingError("a WriteItemType other than 1, 2 or 3")
    return value


MAX_PATH = 4096  # characters in a path a pickle may build (a file system's PATH_MAX)


def _path(*parts):
    """`pathlib.PosixPath(*parts)` (a StorageMeta's checkpoint_id): the path as a string,
    of at most MAX_PATH characters in all (a part the pickle repeats through its memo costs
    it two bytes, and would cost this a joined copy)."""
    if not parts or len(parts) > MAX_PATH or not all(type(p) is str for p in parts) or \
            sum(len(p) + 1 for p in parts) > MAX_PATH:
        raise pickle.UnpicklingError("a path of something other than strings, or longer than "
                                     "any path")
    return "/".join(parts)


_CALLS = {"torch.Size": _size, "torch.serialization._get_layout": _layout,
          f"{_DCP}.metadata._MEM_FORMAT_ENCODING": _memory_format,
          f"{_DCP}.planner.WriteItemType": _write_item_type,
          **{f"{m}.{c}": _path for m in ("pathlib", "pathlib._local")  # 3.13: _local
             for c in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}}
_DTYPE_VALUES = {f"torch.{d}": DType(d) for d in DTYPES}


# Protocol 2-5 opcodes that push data (DCP pickles with protocol 4 and frames), and POP. Lists and
# dicts are filled by the torch reader's own handlers (the container's type checked);
# globals, calls, new objects, BUILD and dict keys by this module's.
_OPCODES = (
    pickle.MARK, pickle.STOP, pickle.PROTO, pickle.FRAME, pickle.TUPLE, pickle.TUPLE1,
    pickle.TUPLE2, pickle.TUPLE3, pickle.EMPTY_TUPLE, pickle.EMPTY_LIST, pickle.EMPTY_DICT,
    pickle.NONE, pickle.NEWTRUE, pickle.NEWFALSE, pickle.BININT, pickle.BININT1,
    pickle.BININT2, pickle.LONG1, pickle.BINFLOAT, pickle.BINUNICODE, pickle.SHORT_BINUNICODE,
    pickle.BINUNICODE8, pickle.SHORT_BINSTRING, pickle.BINBYTES, pickle.SHORT_BINBYTES,
    pickle.BINGET, pickle.LONG_BINGET, pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE,
    pickle.APPEND, pickle.APPENDS, pickle.SETITEM, pickle.SETITEMS,
    pickle.POP)  # (mpitailor's writer names each global first and pops it: metadata_write)
# The opcodes that push a new object: counted (max_made).
_MAKING = frozenset(op[0] for op in (
    pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.EMPTY_LIST,
    pickle.EMPTY_DICT, pickle.BININT, pickle.BININT1, pickle.BININT2, pickle.LONG1,
    pickle.BINFLOAT, pickle.BINUNICODE, pickle.SHORT_BINUNICODE, pickle.BINUNICODE8,
    pickle.SHORT_BINSTRING, pickle.BINBYTES, pickle.SHORT_BINBYTES, pickle.GLOBAL,
    pickle.STACK_GLOBAL, pickle.REDUCE, pickle.NEWOBJ))


_PURE = pickle._Unpickler.dispatch  # type: ignore[attr-defined]  # Python's own handlers


def _refused_opcode(self):
    op = self.data[self.file.tell() - 1:self.file.tell()]  # the byte just read
    raise pickle.UnpicklingError(f"opcode {op!r} is not one DCP's pickles use")


def _load_frame(self):
    """FRAME as the C unpickler takes it: a length the rest of the file holds; the opcodes
    in it are then read as any others (each reads what it needs; a file cut short ends in
    EOFError before STOP)."""
    size = int.from_bytes(self.read(8), "little")
    if size > len(self.data) - self.file.tell():
        raise pickle.UnpicklingError("a frame longer than the rest of the file")


class _Unpickler(Unpickler):
    """The torch reader's unpickler, with DCP's globals, calls, objects and keys, and its
    own loop (load): Python's reads every opcode through a framing layer, two calls deep,
    and the torch reader counts made objects in a wrapper around each handler; here the
    file is read straight and the count kept in the loop, the same handlers run."""

    max_made = MAX_MADE

    def __init__(self, data: bytes) -> None:
        super().__init__(data, frozenset(), False, storage=None)
        self.data = data

    def find_class(self, module: str, name: str):
        if not (isinstance(module, str) and isinstance(name, str)
                and _MODULE.fullmatch(module) and _NAME.fullmatch(name)):
            raise pickle.UnpicklingError("a global that is not module.Name")
        full = f"{module}.{name}"
        if full in RECORD_CLASSES:
            return _RecClass(full)
        if full in _CALLS:
            return _CALLS[full]
        if full in _DTYPE_VALUES:
            return _DTYPE_VALUES[full]
        raise Refused(full)

    def load_stack_global(self):
        name = self.stack.pop()
        module = self.stack.pop()
        self.append(self.find_class(module, name))

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if not any(func is f for f in _CALLS.values()) or type(args) is not tuple:
            raise pickle.UnpicklingError("a call of something other than the functions DCP's "
                                         "pickles call")
        self.stack[-1] = func(*args)

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if type(cls) is not _RecClass or args != ():
            raise pickle.UnpicklingError("a new object of something other than DCP's "
                                         "metadata classes")
        self.append(Rec(cls.kind))

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) is not Rec or inst.state is not None or state is None:
            raise pickle.UnpicklingError("BUILD other than once on a DCP metadata object")
        inst.state = state

    def _key_of(self, target: dict, key):
        """A dict key DCP writes: a string (hashed with Python's keyed hash) or a
        MetadataIndex record (hashed by identity): nothing a file holds makes keys collide."""
        if type(key) is str or type(key) is Rec and key.kind.endswith(".MetadataIndex"):
            return key
        raise pickle.UnpicklingError(f"a dict key of type {type(key).__name__}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a persistent id (DCP's metadata has none)")

    def load(self):
        """The object the pickle describes: each opcode's handler run in turn, the objects
        made counted against max_made (_MAKES), an opcode off the list refused."""
        self.file = io.BytesIO(self.data)
        self.read, self.readline = self.file.read, self.file.readline
        self.metastack, self.stack, self.memo, self.proto = [], [], {}, 0
        self.append = self.stack.append
        read, handlers, makes, limit = self.read, _HANDLERS, _MAKES, self.max_made
        memo, made = self.memo, 0
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                op = key[0]
                # the memo's opcodes, half of DCP's, as Python's handlers do them, inline
                if op == _MEMOIZE:
                    memo[len(memo)] = self.stack[-1]
                elif op == _LONG_BINGET or op == _BINGET:
                    i = int.from_bytes(read(4 if op == _LONG_BINGET else 1), "little")
                    if i not in memo:
                        raise pickle.UnpicklingError(f"memo value not found at index {i}")
                    self.append(memo[i])
                else:
                    made += makes[op]
                    if made > limit:
                        raise pickle.UnpicklingError(f"a pickle that makes over {limit} "
                                                     f"objects")
                    handlers[op](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value


# The handler of each opcode byte: this module's (globals, calls, new objects, BUILD), the
# torch reader's (items added to lists and dicts, the container's type checked), else
# Python's own; _refused_opcode for those off the list.
_OWN = {pickle.GLOBAL[0]: Unpickler.load_global, pickle.STACK_GLOBAL[0]:
        _Unpickler.load_stack_global, pickle.REDUCE[0]: _Unpickler.load_reduce,
        pickle.NEWOBJ[0]: _Unpickler.load_newobj, pickle.BUILD[0]: _Unpickler.load_build,
        pickle.FRAME[0]: _load_frame,
        **{op[0]: getattr(Unpickler, name) for op, name in (
            (pickle.APPEND, "load_append"), (pickle.APPENDS, "load_appends"),
            (pickle.SETITEM, "load_setitem"), (pickle.SETITEMS, "load_setitems"))}}
_ALLOWED = {op[0] for op in _OPCODES} | {pickle.GLOBAL[0], pickle.STACK_GLOBAL[0],
                                         pickle.REDUCE[0], pickle.NEWOBJ[0], pickle.BUILD[0]}
_HANDLERS = tuple(_OWN.get(b, _PURE.get(b)) if b in _ALLOWED else _refused_opcode
                  for b in range(256))
_MAKES = bytes(b in _MAKING for b in range(256))  # 1 for an opcode that makes an object
_MEMOIZE, _BINGET, _LONG_BINGET = pickle.MEMOIZE[0], pickle.BINGET[0], pickle.LONG_BINGET[0]


def unpickle(data: bytes):
    """The object a DCP `.metadata` pickle describes, made of Python data, DType, and Rec
    records; Refused for a global off the list, UnpicklingError (and the errors Python's
    unpickler raises on a malformed pickle) otherwise."""
    return _Unpickler(data).load()
