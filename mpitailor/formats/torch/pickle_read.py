"""torch's pickle read without torch: `unpickle` gives the object a torch file's `data.pkl`
describes.

Every tensor there is a call of `torch._utils._rebuild_tensor_v2(storage, offset, shape,
stride, requires_grad, hooks)` and every storage a persistent id `("storage",
torch.<T>Storage, key, location, numel)` naming the record `data/<key>`.

Python's unpickler with `find_class` as the only gate. Every global the pickle names
resolves to a stand-in (opaque.py, rebuild.py) or is refused; tensors become
`tensorref.Tensor`s whose storages point at their records' bytes in the file, which are not
read. Nothing from a file is ever imported or run: the stand-ins record the arguments and
state the pickle gives them and do nothing else. Names the user allows with `--safe-globals`
(safeload.trust) are accepted where they would be refused, and are stand-ins too.
"""
from __future__ import annotations

import _compat_pickle
import codecs
import collections
import io
import pickle
import re
from collections.abc import Callable

from mpitailor.display import bounded
from mpitailor.formats.torch import opaque
from mpitailor.formats.torch.rebuild import (
    CALLS_ONLY,
    DTYPE_OF,
    REBUILD_FROM_TYPE,
    REBUILD_TENSOR,
    STORAGE_OF,
    STORAGE_TYPES,
    TORCH_DTYPES,
    Size,
)
from mpitailor.formats.torch.tensorref import Storage

_STATE_AFTER_CALL = frozenset(f"numpy.{m}.{n}" for m in ("core.multiarray", "_core.multiarray")
                              for n in ("_reconstruct",)) | {"numpy.dtype"}
# The numpy dtypes a file may hold (torch's weights-only allow-list): each numpy.dtypes class
# and the dtype strings numpy pickles for it (dtype('u4').__reduce__() is (dtype, ('u4',
# False, True), state)); a long double is 12 or 16 bytes by platform.
_NUMPY_DTYPES = {
    "Bool": "b1", "Int8": "i1", "Int16": "i2", "Int32": "i4", "Int64": "i8", "UInt8": "u1",
    "UInt16": "u2", "UInt32": "u4", "UInt64": "u8", "Float16": "f2", "Float32": "f4",
    "Float64": "f8", "LongDouble": "f12|f16", "Complex64": "c8", "Complex128": "c16",
    "Bytes": r"S\d+", "Str": r"U\d+"}
_BUILT_DTYPES = re.compile("|".join(_NUMPY_DTYPES.values()))


MAX_KEY_OBJECTS = 1000  # in one dict key or set member: real keys are names and numbers


def _small_key(key):
    """key, once it is sure that hashing it (and comparing it with another key of the same
    hash) is cheap: tuples whose items the pickle shared over and over (memo) hash in time
    exponential in their depth, inside C, where no signal is seen, and one nested 10**5 deep
    overflows C's stack. Walked without a memo, stopping at MAX_KEY_OBJECTS; a stand-in's
    state is walked too, as stand-ins compare by it."""
    seen, stack = 0, [key]
    while stack:
        x = stack.pop()
        seen += 1
        if seen > MAX_KEY_OBJECTS:
            raise pickle.UnpicklingError(f"a dict key or set member of over {MAX_KEY_OBJECTS} "
                                         f"objects")
        if isinstance(x, (tuple, frozenset, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, opaque.Opaque):
            if x._how == "newobj":  # a plain object: a dataclass's is unhashable in Python
                raise pickle.UnpicklingError("an object as a dict key or set member")
            stack.extend((x._args, x.__dict__.get("_state")))
    return key


MAX_SAME_HASH = 64  # keys of one dict (members of one set) with one hash: real ones have 1


class _Keys:
    """How many keys of one container share each hash. Ints hash modulo 2**61 - 1 and a
    tuple's hash can be steered by its last int, so a file can give thousands of keys one
    hash; the container then compares each new key with all of them (N**2/2 comparisons:
    15 s for 284 KB). Counted as keys are added, refused past MAX_SAME_HASH."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def add(self, key):
        h = hash(_small_key(key))
        n = self.seen[h] = self.seen.get(h, 0) + 1
        if n > MAX_SAME_HASH:
            raise pickle.UnpicklingError(f"over {MAX_SAME_HASH} keys of one hash in one dict "
                                         f"or set (crafted to collide)")
        return key


def _set(items=()):
    """`builtins.set` as pickles call it, of members cheap to hash, few of any one hash."""
    keys = _Keys()
    return set(keys.add(x) for x in items)


def _bytearray(data=b""):
    """`builtins.bytearray` as pickles use it, of bytes (never of a size: bytearray(10**10)
    would allocate it)."""
    if type(data) is not bytes:
        raise pickle.UnpicklingError("bytearray of something other than bytes")
    return bytearray(data)


def _bytes_from_latin1(text, encoding="latin1"):
    """`_codecs.encode` as protocol 2 uses it for bytes objects, and nothing else."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("_codecs.encode used for something other than bytes")
    return codecs.encode(text, "latin1")


# What every torch pickle may name (torch's weights-only allow-list, the parts DeepSpeed and
# HF files use): real objects where they are harmless data types, stand-ins otherwise.
_BASE: dict[str, object] = {
    "torch._utils._rebuild_tensor_v2": REBUILD_TENSOR,
    "torch.Size": Size,
    "collections.OrderedDict": collections.OrderedDict,
    "_codecs.encode": _bytes_from_latin1,
    "builtins.set": _set, "builtins.bytearray": _bytearray,
    "builtins.complex": complex, "collections.Counter": collections.Counter,
    "torch._tensor._rebuild_from_type_v2": REBUILD_FROM_TYPE,
    **{f"torch.{name}": STORAGE_OF[dtype] for name, dtype in STORAGE_TYPES.items()},
}
_TORCH_STAND_INS = ("torch.Tensor", "torch.nn.parameter.Parameter", "torch.device",
                    *(f"torch.{d}" for d in TORCH_DTYPES))
# Names that are values in a checkpoint, never called or made: torch's storage types (named
# by persistent ids), dtypes, devices and tensor types (the type of _rebuild_from_type_v2).
# Called, each checks its arguments in torch and not here: refused rather than carried.
_VALUES_ONLY = frozenset(f"torch.{n}" for n in (*STORAGE_TYPES, *TORCH_DTYPES)) | {
    "torch.Tensor", "torch.nn.parameter.Parameter", "torch.device"}
# What find_class gives that a pickle may only call: never a value of the object it makes
# (written back, the class or function would be a global of Python's or mpitailor's).
CALLS_ONLY_VALUES = {id(x): name for name, x in _BASE.items() if not isinstance(x, type)
                     or not issubclass(x, opaque.Opaque) or x in CALLS_ONLY}
# torch's own machinery (tensors, storages, sizes, dtypes): what every torch file names.
TORCH_OWN = frozenset(_BASE) | frozenset(_TORCH_STAND_INS)
# The extra names of each allow-list safeload.load takes.
ALLOWED = {
    "deepspeed": ("deepspeed.runtime.zero.config.ZeroStageEnum",
                  "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                  "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                  "deepspeed.utils.tensor_fragment.fragment_address"),
    "numpy": tuple(f"{m}.{n}" for m in ("numpy.core.multiarray", "numpy._core.multiarray")
                   for n in ("_reconstruct", "scalar"))
    + ("numpy.ndarray", "numpy.dtype")
    + tuple(f"numpy.dtypes.{k}DType" for k in _NUMPY_DTYPES),
}
# What training scripts put in DeepSpeed's client_state besides plain data and their own
# dataclasses: allowed in model-states files (safeload.load(opaque_ok=True)).
ALLOWED["client"] = ("argparse.Namespace", *ALLOWED["numpy"])


class Refused(pickle.UnpicklingError):
    """A global outside the allow-list; `name` is its full name, `how` what the file does
    with it where that is the reason ("calls": a class carried only as plain instances)."""

    def __init__(self, name: str, how: str = "") -> None:
        super().__init__(f"Unsupported global: GLOBAL {name}")
        self.name, self.how = name, how


MAX_GLOBALS = 256  # different globals one file may name: real ones name < 40
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_NAME = re.compile(r"[A-Za-z_]\w*")  # no dotted (nested) names: written back, they would
#                                      be split at another dot


class _Opcodes(dict):
    def __missing__(self, key):
        raise pickle.UnpicklingError(f"opcode {bytes([key])!r} is not one torch writes")


# The opcodes torch's own weights-only unpickler reads (torch.save writes protocol 2), and
# no others: none of them imports, calls or builds anything but through the handlers below.
_DATA_OPCODES = (
    pickle.MARK, pickle.STOP, pickle.PROTO, pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2,
    pickle.TUPLE3, pickle.EMPTY_TUPLE, pickle.EMPTY_LIST, pickle.EMPTY_DICT,
    pickle.EMPTY_SET, pickle.NONE, pickle.NEWTRUE, pickle.NEWFALSE, pickle.BININT,
    pickle.BININT1, pickle.BININT2, pickle.LONG1, pickle.BINFLOAT, pickle.BINUNICODE,
    pickle.SHORT_BINSTRING, pickle.BINGET, pickle.LONG_BINGET, pickle.BINPUT,
    pickle.LONG_BINPUT, pickle.BINPERSID)


class Unpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Python's own (pure) unpickler, held to torch's weights-only rules: its opcodes only;
    a global only through find_class; a call (REDUCE) only of a global find_class allowed as
    callable; a new object (NEWOBJ) only of a stand-in class or OrderedDict; BUILD only on a
    stand-in instance (which records the state) or an OrderedDict (attributes of its own);
    items added only to real lists and dicts. The reader's own records (Tensor, Storage,
    Size) and every class are values, never targets. formats/dcp reads DCP's metadata
    pickles with a subclass of it (its own globals, keys and opcodes)."""

    max_made = 1 << 20  # objects one pickle may make (MAX_MADE)

    dispatch = _Opcodes({op[0]: pickle._Unpickler.dispatch[op[0]]  # type: ignore[attr-defined]
                         for op in _DATA_OPCODES})

    def __init__(self, data: bytes, allowed: frozenset[str], opaque_ok: bool,
                 storage: Callable[[str, str, int], Storage]) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.allowed, self.opaque_ok = allowed, opaque_ok
        self.storage = storage
        self.storages: dict[str, Storage] = {}
        self.callable: dict[int, object] = {}  # id -> global find_class allowed as callable
        self.values_only: set[int] = set()  # ids of globals that are values (dtypes, ...)
        self.globals: set[str] = set()  # every global the file names
        self.made = 0  # objects pushed so far (MAX_MADE)
        self.keys: dict[int, _Keys] = {}  # id of a dict items are set in -> its keys' hashes

    def find_class(self, module: str, name: str):
        if not (_MODULE.fullmatch(module) and _NAME.fullmatch(name)):
            raise pickle.UnpicklingError(f"a global named {module!r:.60} {name!r:.60}, not "
                                         f"module.Name")
        if len(self.globals) >= MAX_GLOBALS:
            raise pickle.UnpicklingError(f"over {MAX_GLOBALS} different globals")
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[module, name]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        self.globals.add(full)
        if full in _BASE:
            found = _BASE[full]
        elif full in self.allowed or full in _TORCH_STAND_INS:
            found = opaque.stand_in(full)
        elif self.opaque_ok and opaque.may_stand_in(full):
            return opaque.stand_in(full)  # a plain class of the user's: instances only
        else:
            raise Refused(full)
        if full in _VALUES_ONLY:
            self.values_only.add(id(found))
        else:
            self.callable[id(found)] = found
        return found

    def load_global(self):
        module = self.readline()[:-1].decode("utf-8")
        name = self.readline()[:-1].decode("utf-8")
        self.append(self.find_class(module, name))
    dispatch[pickle.GLOBAL[0]] = load_global

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if self.callable.get(id(func)) is not func:
            name = getattr(func, "global_name", "")
            if name:
                raise Refused(name, "calls")
            raise pickle.UnpicklingError(f"a call of {type(func).__name__}, not of a global")
        if not isinstance(args, tuple):
            raise pickle.UnpicklingError("a call whose arguments are not a tuple")
        if func is collections.OrderedDict and args or func is collections.Counter and not (
                args == () or len(args) == 1 and type(args[0]) is dict):
            # torch's pickles call OrderedDict() and Counter(a dict) and add the items after
            # (SETITEMS: keys checked); a call with keys would hash them unchecked
            raise pickle.UnpicklingError(f"{func.__name__} called with arguments no torch "
                                         f"pickle gives")
        self.stack[-1] = func(*args)
    dispatch[pickle.REDUCE[0]] = load_reduce

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if not isinstance(args, tuple) or id(cls) in self.values_only or not (
                cls is collections.OrderedDict or cls is Size
                or (isinstance(cls, opaque._OpaqueMeta) and cls not in CALLS_ONLY)):
            raise pickle.UnpicklingError(f"a new object of {bounded(cls)}, not of a class the "
                                         f"file may name")
        self.append(cls.__new__(cls, *args))
    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, opaque.Opaque) and type(inst).global_name == "numpy.dtype" and not (
                inst._args and type(inst._args[0]) is str
                and _BUILT_DTYPES.fullmatch(inst._args[0])):
            # torch builds the real dtype and takes a state only for the dtype classes its
            # allow-list names (ALLOWED["numpy"]): not an object, void or datetime dtype
            raise pickle.UnpicklingError(f"BUILD on numpy.dtype{bounded(inst._args)}, a dtype "
                                         f"outside the allow-list")
        if isinstance(inst, opaque.Opaque) and inst.__dict__.get("_state") is opaque.NOSTATE \
                and (inst._how == "newobj" or type(inst).global_name in _STATE_AFTER_CALL):
            # an instance (never a class) that records the state: one made with NEWOBJ, or
            # a call whose real object takes one (a numpy dtype or array); never a call's
            # result such as an enum member, whose state would rewrite the member itself
            # in DeepSpeed's loader
            inst.__setstate__(state)
        elif type(inst) is collections.OrderedDict and type(state) is dict and all(
                type(k) is str and not k.startswith("__")
                and not hasattr(collections.OrderedDict, k) for k in state):
            inst.__dict__.update(state)  # a state dict's `_metadata`
        else:
            raise pickle.UnpicklingError(f"BUILD on {type(inst).__name__}: only an "
                                         f"OrderedDict or a carried object takes a state")
    dispatch[pickle.BUILD[0]] = load_build

    def load_append(self):
        item = self.stack.pop()
        self._target(list, "APPEND").append(item)
    dispatch[pickle.APPEND[0]] = load_append

    def load_appends(self):
        items = self.pop_mark()
        self._target(list, "APPENDS").extend(items)
    dispatch[pickle.APPENDS[0]] = load_appends

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        target = self._target(dict, "SETITEM")
        target[self._key_of(target, key)] = value
    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self):
        items = self.pop_mark()
        target = self._target(dict, "SETITEMS")
        if len(items) % 2:
            raise pickle.UnpicklingError("SETITEMS of an odd number of items")
        for i in range(0, len(items), 2):
            target[self._key_of(target, items[i])] = items[i + 1]
    dispatch[pickle.SETITEMS[0]] = load_setitems

    def _key_of(self, target: dict, key):
        """key, cheap to hash (_small_key) and not one too many of its hash in target."""
        keys = self.keys.get(id(target))
        if keys is None:
            keys = self.keys[id(target)] = _Keys()
        return keys.add(key)

    def _target(self, kind: type, op: str):
        if not self.stack:
            raise pickle.UnpicklingError(f"{op} with nothing to add to")
        target = self.stack[-1]
        if type(target) is not kind and not (kind is dict and type(target) in (
                collections.OrderedDict, collections.Counter)):
            raise pickle.UnpicklingError(f"{op} on {type(target).__name__}")
        return target

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], type) and pid[1] in DTYPE_OF  # a class hashes by id
                and isinstance(pid[2], str)
                and type(pid[3]) is str  # the location ("cpu", "cuda:0"): torch decodes it
                and type(pid[4]) is int and pid[4] >= 0):
            raise pickle.UnpicklingError(f"a persistent id torch does not write: {bounded(pid)}")
        key, dtype, numel = pid[2], DTYPE_OF[pid[1]], pid[4]
        if key not in self.storages:
            self.storages[key] = self.storage(key, dtype, numel)
        got = self.storages[key]
        if (got.dtype, got.numel) != (dtype, numel):
            raise pickle.UnpicklingError(f"storage {bounded(key)} read as two different types")
        return got


# Objects one pickle may make. A file of 2**20 empty dicts costs ~100 MB and a second of
# unpickling alone; counted as they are made, a file of more is refused before it costs
# more (safeload then bounds what the objects describe once shared ones are unshared).
MAX_MADE = Unpickler.max_made
# The opcodes that push a new object (EMPTY_TUPLE pushes the one empty tuple).
_MAKING = (pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.EMPTY_LIST,
           pickle.EMPTY_DICT, pickle.EMPTY_SET, pickle.BININT, pickle.BININT1, pickle.BININT2,
           pickle.LONG1, pickle.BINFLOAT, pickle.BINUNICODE, pickle.SHORT_BINSTRING,
           pickle.BINPERSID, pickle.GLOBAL, pickle.REDUCE, pickle.NEWOBJ)


def counted(handler):
    """handler, counting the object it pushes against the unpickler's max_made."""
    def making(self):
        self.made += 1
        if self.made > self.max_made:
            raise pickle.UnpicklingError(f"a pickle that makes over {self.max_made} objects")
        handler(self)
    return making


for _op in _MAKING:
    Unpickler.dispatch[_op[0]] = counted(Unpickler.dispatch[_op[0]])


def unpickle(data: bytes, *, allowed: frozenset[str] = frozenset(),
             opaque_ok: bool = False,
             storage: Callable[[str, str, int], Storage]):
    """The object `data` (a torch data.pkl) describes, and the globals it names.
    storage(key, dtype, numel) gives the storage of record data/<key>. Raises Refused for a
    global outside the allow-list (with opaque_ok, plain classes of modules other than
    Python's and the frameworks' are carried as instances, never called), UnpicklingError
    and others for a malformed pickle."""
    u = Unpickler(data, allowed, opaque_ok, storage)
    return u.load(), frozenset(u.globals)

