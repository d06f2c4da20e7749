"""torch's pickle, read and written without torch.

A torch file (torch.save, zip) holds `data.pkl`, a pickle in which every tensor is a call of
`torch._utils._rebuild_tensor_v2(storage, offset, shape, stride, requires_grad, hooks)` and
every storage a persistent id `("storage", torch.<T>Storage, key, location, numel)` naming the
record `data/<key>`.

Reading (`unpickle`): Python's unpickler with `find_class` as the only gate. Every global
the pickle names resolves to a stand-in (opaque.py) or is refused; tensors become
`tensorref.Tensor`s whose storages point at their records' bytes in the file, which are not
read. Nothing from a file is ever imported or run: the stand-ins record the arguments and
state the pickle gives them and do nothing else. Names the user allows with `--safe-globals`
(safeload.trust) are accepted where they would be refused, and are stand-ins too.

Writing (`dumps`): the pure-Python pickler, protocol 2, with torch's `persistent_id`: a
`Tensor` reduces as torch's tensor does, a stand-in writes back its original GLOBAL, REDUCE,
NEWOBJ and BUILD, so the pickle's bytes are those `torch.save` writes for the same object
(tests/test_ptzip.py holds them against torch.save).
"""
from __future__ import annotations

import codecs
import collections
import io
import pickle
from collections.abc import Callable

from mpitailor.formats import opaque
from mpitailor.formats.tensorref import Storage, Tensor

# torch's storage classes (the persistent id's second field) -> dtype names of dtypes.py.
STORAGE_TYPES = {
    "FloatStorage": "fp32", "HalfStorage": "fp16", "BFloat16Storage": "bf16",
    "DoubleStorage": "f64", "LongStorage": "i64", "IntStorage": "i32", "ShortStorage": "i16",
    "CharStorage": "i8", "ByteStorage": "u8", "BoolStorage": "bool",
}
_STORAGE_OF = {dtype: opaque.stand_in(f"torch.{name}") for name, dtype in STORAGE_TYPES.items()}
_DTYPE_OF = {cls: dtype for dtype, cls in _STORAGE_OF.items()}
TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16",
                "int8", "uint8", "bool")


class _RebuildTensor(opaque.Opaque):
    """`torch._utils._rebuild_tensor_v2`: called by the pickle, it gives a Tensor."""

    global_name = "torch._utils._rebuild_tensor_v2"

    def __new__(cls, storage, storage_offset, shape, stride, requires_grad=False,
                hooks=None, metadata=None):
        if not isinstance(storage, Storage) or not _ints(shape, stride) or \
                not isinstance(storage_offset, int) or len(shape) != len(stride):
            raise pickle.UnpicklingError("a tensor with malformed storage, shape or stride")
        if storage_offset < 0 or any(d < 0 for d in (*shape, *stride)) or (
                any(shape) and all(shape) and storage_offset + sum(
                    (d - 1) * s for d, s in zip(shape, stride)) >= storage.numel):
            raise pickle.UnpicklingError("a tensor that lies outside its storage")
        return Tensor(storage, storage_offset, shape, stride, bool(requires_grad), metadata)


REBUILD_TENSOR = opaque.register(_RebuildTensor)


class _RebuildFromType(opaque.Opaque):
    """`torch._tensor._rebuild_from_type_v2(func, type, args, state)`: a tensor with attributes
    of its own (DeepSpeed's `ds_id` on its flat groups) or of a subclass. A tensor's comes back
    as that Tensor carrying (type, state); anything else stays a stand-in."""

    global_name = "torch._tensor._rebuild_from_type_v2"

    def __new__(cls, func=None, new_type=None, args=(), state=None):
        if func is REBUILD_TENSOR and isinstance(args, tuple):
            t = func(*args)
            t.wrapper = (new_type, state)
            return t
        return super().__new__(cls, func, new_type, args, state)


REBUILD_FROM_TYPE = opaque.register(_RebuildFromType)
TENSOR_TYPE = opaque.stand_in("torch.Tensor")  # how torch names its type(self)


@opaque.register
class Size(tuple, metaclass=opaque._OpaqueMeta):
    """`torch.Size`: a tuple of ints, written back as torch writes one."""

    global_name = "torch.Size"

    def __new__(cls, dims=()):
        dims = tuple(dims)
        if not _ints(dims):
            raise pickle.UnpicklingError("torch.Size of non-integers")
        return super().__new__(cls, dims)

    def __reduce__(self):
        return Size, (tuple([*self]),)


def _ints(*seqs) -> bool:
    return all(isinstance(s, tuple) and all(type(d) is int for d in s) for s in seqs)


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
    "builtins.set": set, "__builtin__.set": set,
    "builtins.frozenset": frozenset, "__builtin__.frozenset": frozenset,
    "torch._tensor._rebuild_from_type_v2": REBUILD_FROM_TYPE,
    **{f"torch.{name}": _STORAGE_OF[dtype] for name, dtype in STORAGE_TYPES.items()},
}
_TORCH_STAND_INS = ("torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
                    "torch.Tensor", "torch._tensor.Tensor", "torch.nn.parameter.Parameter",
                    "torch.device", *(f"torch.{d}" for d in TORCH_DTYPES))
# The extra names of each allow-list safeload.load takes.
ALLOWED = {
    "deepspeed": ("deepspeed.runtime.zero.config.ZeroStageEnum",
                  "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                  "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                  "deepspeed.utils.tensor_fragment.fragment_address"),
    "numpy": tuple(f"{m}.{n}" for m in ("numpy.core.multiarray", "numpy._core.multiarray")
                   for n in ("_reconstruct", "scalar"))
    + ("numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType", "numpy.dtypes.Float64DType",
       "numpy.dtypes.Int64DType"),
}


class Refused(pickle.UnpicklingError):
    """A global outside the allow-list; `name` is its full name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"Unsupported global: GLOBAL {name}")
        self.name = name


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: frozenset[str], opaque_ok: bool,
                 storage: Callable[[str, str, int], Storage]) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed, self.opaque_ok = allowed, opaque_ok
        self.storage = storage
        self.storages: dict[str, Storage] = {}

    def find_class(self, module: str, name: str):
        full = f"{module}.{name}"
        if full in _BASE:
            return _BASE[full]
        if full in self.allowed or full in _TORCH_STAND_INS:
            return opaque.stand_in(full)
        if self.opaque_ok and opaque.may_stand_in(full):
            return opaque.stand_in(full)
        raise Refused(full)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and pid[1] in _DTYPE_OF and isinstance(pid[2], str)
                and type(pid[4]) is int and pid[4] >= 0):
            raise pickle.UnpicklingError(f"a persistent id torch does not write: {pid!r:.80}")
        key, dtype, numel = pid[2], _DTYPE_OF[pid[1]], pid[4]
        if key not in self.storages:
            self.storages[key] = self.storage(key, dtype, numel)
        got = self.storages[key]
        if (got.dtype, got.numel) != (dtype, numel):
            raise pickle.UnpicklingError(f"storage {key} read as two different types")
        return got


def unpickle(data: bytes, *, allowed: frozenset[str] = frozenset(),
             opaque_ok: bool = False,
             storage: Callable[[str, str, int], Storage]):
    """The object `data` (a torch data.pkl) describes. storage(key, dtype, numel) gives the
    storage of record data/<key>. Raises Refused for a global outside the allow-list (with
    opaque_ok: only for modules that exist to run code), UnpicklingError and others for a
    malformed pickle."""
    return _Unpickler(data, allowed, opaque_ok, storage).load()


class StorageRef:
    """A tensor's storage as its reduce names it (torch wraps it in a new TypedStorage each
    time): the pickler's persistent_id turns it into torch's storage tuple."""

    __slots__ = ("storage",)

    def __init__(self, storage: Storage) -> None:
        self.storage = storage


class _Pickler(opaque.Pickler):
    def __init__(self, buf) -> None:
        super().__init__(buf, protocol=2)
        self.keys: dict[int, str] = {}
        self.storages: list[Storage] = []  # in key order; also keeps their ids unique

    def reducer_override(self, obj):
        if type(obj) is Tensor:
            return obj.torch_reduce()
        if type(obj).__module__.partition(".")[0] == "torch":
            # torch's own objects pickle their storages by value in a form weights-only
            # loaders refuse: the merge side never has one, the training side calls torch.save
            raise TypeError(f"internal error: a torch {type(obj).__name__} to the torch-free "
                            f"writer")
        return super().reducer_override(obj)

    def persistent_id(self, obj):
        if type(obj) is not StorageRef:
            return None
        s = obj.storage
        key = self.keys.get(id(s))
        if key is None:
            key = self.keys[id(s)] = str(len(self.keys))
            self.storages.append(s)
        # torch's tuple, with the same objects: its literals "storage" and "cpu" and one key
        # string per storage, which the memo then shares just as in torch's pickle.
        return ("storage", _STORAGE_OF[s.dtype], key, "cpu", s.numel)


def dumps(obj) -> tuple[bytes, list[Storage]]:
    """The data.pkl torch.save(obj) writes, and the storages it names, in key order."""
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    return buf.getvalue(), p.storages
