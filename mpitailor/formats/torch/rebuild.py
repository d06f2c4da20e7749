"""torch's own globals as the torch-free reader makes them and the writer names them: the
tensor rebuild functions (which give `tensorref.Tensor`s), the storage types of a persistent
id, `torch.Size`, and the stand-ins of torch's dtypes and tensor type.

Shared by pickle_read.py (a pickle's GLOBALs resolve to these) and pickle_write.py (a
`Tensor` pickles as a call of REBUILD_TENSOR)."""
from __future__ import annotations

import pickle
import re

from mpitailor.display import bounded
from mpitailor.formats.torch import opaque
from mpitailor.formats.torch.tensorref import Storage, Tensor

# torch's storage classes (the persistent id's second field) -> dtype names of dtypes.py.
STORAGE_TYPES = {
    "FloatStorage": "fp32", "HalfStorage": "fp16", "BFloat16Storage": "bf16",
    "DoubleStorage": "f64", "LongStorage": "i64", "IntStorage": "i32", "ShortStorage": "i16",
    "CharStorage": "i8", "ByteStorage": "u8", "BoolStorage": "bool",
}
STORAGE_OF = {dtype: opaque.stand_in(f"torch.{name}") for name, dtype in STORAGE_TYPES.items()}
DTYPE_OF = {cls: dtype for dtype, cls in STORAGE_OF.items()}
TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16",
                "int8", "uint8", "bool")


class _RebuildTensor(opaque.Opaque):
    """`torch._utils._rebuild_tensor_v2`: called by the pickle, it gives a Tensor."""

    global_name = "torch._utils._rebuild_tensor_v2"

    def __new__(cls, storage, storage_offset, shape, stride, requires_grad, hooks,
                metadata=None, *, wrapper=None):  # (torch's needs the first six too)
        if not isinstance(storage, Storage) or not _ints(shape, stride):
            raise pickle.UnpicklingError("a tensor with malformed storage, shape or stride")
        if metadata is not None and not (type(metadata) is dict
                                         and all(type(k) is str for k in metadata)):
            raise pickle.UnpicklingError("tensor metadata that is not a dict of names")
        if metadata and any(metadata.get(bit, False) is not False for bit in _VIEW_BITS):
            # torch's neg/conj bits: torch.load gives the negated (conjugated) values, while
            # a copy of the bytes would carry the values before it
            raise pickle.UnpicklingError(f"a tensor saved as a negated or conjugated view "
                                         f"({bounded(metadata)}); save tensor.resolve_neg() "
                                         f"or .resolve_conj() instead")
        if not _int64_sized(shape, stride, storage_offset):
            raise pickle.UnpicklingError("a tensor whose shape, stride, offset or element "
                                         "count lies past 2**63 (torch's 64-bit integers)")
        if type(requires_grad) is not bool or (requires_grad and storage.dtype not in _FLOATS):
            raise pickle.UnpicklingError("requires_grad that is not a bool, or of a tensor "
                                         "that is not floating point")
        try:
            return Tensor(storage, storage_offset, shape, stride, bool(requires_grad),
                          metadata, wrapper)
        except ValueError as e:
            raise pickle.UnpicklingError(str(e)) from None


REBUILD_TENSOR = opaque.register(_RebuildTensor)


class _RebuildFromType(opaque.Opaque):
    """`torch._tensor._rebuild_from_type_v2(func, type, args, state)`: a tensor with attributes
    of its own (DeepSpeed's `ds_id` on its flat groups) or of a subclass. A tensor's comes back
    as that Tensor carrying (type, state); anything else stays a stand-in."""

    global_name = "torch._tensor._rebuild_from_type_v2"

    def __new__(cls, func=None, new_type=None, args=(), state=None):
        # torch calls func(*args) first: only its tensor rebuild may be named here (anything
        # else, written back, would be a call DeepSpeed's loader makes), of a tensor type.
        if func is not REBUILD_TENSOR or not isinstance(args, tuple) \
                or not isinstance(new_type, type) or new_type not in _TENSOR_TYPES \
                or (state is not None and type(state) is not dict):  # (a class hashes by id)
            raise pickle.UnpicklingError("_rebuild_from_type_v2 of something other than a "
                                         "tensor")
        # torch sets each key as an attribute of the tensor: `data` would swap its bytes
        # for another's. DeepSpeed's own (ds_id, ...) are the ones real files carry.
        odd = next((k for k in state or () if type(k) is not str or not _DS_ATTR.fullmatch(k)),
                   None)
        if odd is not None:
            raise pickle.UnpicklingError(f"a tensor attribute {bounded(odd)} other than "
                                         f"DeepSpeed's ds_*")
        return func(*args, wrapper=(new_type, state))


REBUILD_FROM_TYPE = opaque.register(_RebuildFromType)



# Stand-ins that are functions in torch: called (REDUCE), never made with NEWOBJ.
CALLS_ONLY = frozenset({REBUILD_TENSOR, REBUILD_FROM_TYPE})
_FLOATS = ("fp32", "fp16", "bf16", "f64")
_DS_ATTR = re.compile(r"ds_\w+")
TENSOR_TYPE = opaque.stand_in("torch.Tensor")  # how torch names its type(self)
_TENSOR_TYPES = frozenset({TENSOR_TYPE})  # what DeepSpeed's tensors with ds_* carry


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


_VIEW_BITS = ("neg", "conj")  # what torch._utils.get_tensor_metadata records of a view
_INT64 = 1 << 63


def _int64_sized(shape, stride, offset) -> bool:
    """Whether torch could hold this view: every dim and stride, the offset and the element
    count within int64, as torch multiplies them (the product stops past it: thousands of
    huge dims would cost quadratic time)."""
    if type(offset) is int and not -_INT64 <= offset < _INT64 or not all(
            -_INT64 <= d < _INT64 for d in (*shape, *stride)):
        return False
    n = 1
    for d in shape:
        n *= d
        if abs(n) >= _INT64:
            return False
    return True


def _ints(*seqs) -> bool:
    return all(isinstance(s, tuple) and all(type(d) is int for d in s) for s in seqs)

