"""Tensors as the merge side sees them: references to bytes, never torch tensors.

A merge moves bytes; it never computes with a tensor. So a checkpoint's tensors are read
(pickle_read.py) as `Tensor`s: a `Storage` (dtype, element count, and where its
bytes are: a record of a file, bytes in memory, or nowhere yet, for a placeholder whose
bytes the copy step writes) plus torch's view fields (storage offset, shape, stride,
requires_grad). Written back, a `Tensor` pickles exactly as torch pickles a tensor with
those fields. Values are read only where a decision needs them (`raw`, `item`), with numpy,
which is imported then and only then.
"""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path

from mpitailor.display import bounded
from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.io import FileIdentity, open_same, read_into

# numpy's name for the bits of each dtype; bf16 has no numpy type: its bits are uint16.
_NUMPY = {"fp32": "<f4", "fp16": "<f2", "bf16": "<u2", "f64": "<f8", "i64": "<i8",
          "i32": "<i4", "i16": "<i2", "i8": "i1", "u8": "u1", "bool": "?"}
_STRUCT = {"fp32": "<f", "fp16": "<e", "f64": "<d", "i64": "<q", "i32": "<i", "i16": "<h",
           "i8": "b", "u8": "B", "bool": "?"}


def numpy_dtype(dtype: str) -> str:
    """numpy's name for the bits of a dtype of dtypes.py (bf16: "<u2")."""
    return _NUMPY[dtype]


class _ReadOnly:
    """Fields set once, when made (object.__setattr__); a pickle's BUILD, or any setattr,
    is refused."""

    __slots__ = ()

    def __setattr__(self, name, value):
        raise AttributeError(f"a {type(self).__name__} is read-only (its {name!r} is set when "
                             f"it is made)")

    __delattr__ = __setattr__

    def __setstate__(self, state):
        raise TypeError(f"a {type(self).__name__} is made by the reader, never rebuilt from a "
                        f"pickle's state")


class Storage(_ReadOnly):
    """A storage: `numel` elements of `dtype`, whose bytes lie in file `path` at `offset`,
    or in memory (`data`), or nowhere yet (a placeholder: the copy step writes them).

    A value, not a target: its fields are set once, here (a pickle's BUILD or any other
    setattr is refused), and every read is checked to lie inside it. The one change it
    takes is `hold`: its own bytes, read from its own record, kept in memory.
    `identity`: the file at `path` as it was when it was loaded and checked; a read that
    opens `path` again refuses another file put there since (None: a storage made some
    other way, whose file nothing checked)."""

    __slots__ = ("dtype", "numel", "path", "offset", "data", "identity")

    def __init__(self, dtype: str, numel: int, *, path: Path | None = None,
                 offset: int | None = None, data: bytes | bytearray | memoryview | None = None,
                 identity: FileIdentity | None = None):
        if dtype not in DTYPES or type(numel) is not int or numel < 0:
            raise ValueError(f"a storage of {bounded(numel)} elements of {bounded(dtype)}")
        if data is not None and len(data) != numel * DTYPES[dtype].itemsize:
            raise ValueError(f"{len(data)} bytes for a storage of {numel} x {dtype}")
        for name, value in zip(self.__slots__, (dtype, numel, path, offset, data, identity)):
            object.__setattr__(self, name, value)

    def __reduce__(self):
        # Other picklers (mpi4py sending states to another rank) carry it by its fields.
        return _storage, (self.dtype, self.numel, self.path, self.offset, self.data,
                          self.identity)

    def hold(self, data: bytes) -> None:
        """Keep this file storage's own bytes in memory (they travel with it then)."""
        if self.path is None or self.data is not None or len(data) != self.nbytes:
            raise ValueError("internal error: hold() of bytes that are not this storage's")
        object.__setattr__(self, "data", data)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def read(self, start: int = 0, nbytes: int | None = None, fd: int | None = None
             ) -> bytes | memoryview:
        """Bytes [start, start + nbytes) of the storage (all of it by default); fd: its file,
        already open. Never a byte outside the storage: ValueError."""
        nbytes = self.nbytes - start if nbytes is None else nbytes
        if start < 0 or nbytes < 0 or start + nbytes > self.nbytes:
            raise ValueError(f"bytes [{start}, {start + nbytes}) of a storage of "
                             f"{self.nbytes} bytes")
        if nbytes == 0:
            return b""
        if self.data is not None:
            return memoryview(self.data)[start: start + nbytes]
        if self.path is None:
            raise RuntimeError("internal error: a placeholder's bytes were read")
        out = bytearray(nbytes)
        own = fd is None
        fd = self.open() if own else fd
        try:
            read_into(fd, self.offset + start, out)
        finally:
            if own:
                os.close(fd)
        return out

    def open(self) -> int:
        """A read-only fd of this storage's file: the one it was loaded from, or a
        CheckpointError naming it if its name now stands for another file."""
        if self.identity is None:
            return os.open(self.path, os.O_RDONLY)
        return open_same(self.path, self.identity)


def _storage(dtype, numel, path, offset, data, identity=None) -> Storage:
    return Storage(dtype, numel, path=path, offset=offset, data=data, identity=identity)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's strides of a new tensor of this shape (sizes of 0 count as 1)."""
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(d, 1)
    return tuple(reversed(out))


def view_problem(storage: Storage, storage_offset, shape, stride) -> str | None:
    """Why (storage_offset, shape, stride) is not a view mpitailor reads of `storage`, or
    None. Every element must lie inside the storage, and a view may not hold more elements
    than its storage (torch's expand() views may; no checkpoint tensor is one, and a copy
    of one would be as large as it claims)."""
    if not (isinstance(shape, tuple) and isinstance(stride, tuple)
            and all(type(d) is int for d in (storage_offset, *shape, *stride))):
        return "a tensor with malformed storage offset, shape or stride"
    if len(shape) != len(stride):
        return f"a tensor of shape {shape} with {len(stride)} strides"
    if storage_offset < 0 or any(d < 0 for d in (*shape, *stride)):
        return "a tensor with a negative storage offset, size or stride"
    if any(d >= 1 << 63 for d in (storage_offset, *shape, *stride)):
        return "a tensor with a size or stride past 2**63"
    numel = math.prod(shape)
    if numel > storage.numel:
        return f"a tensor of {numel} elements over a storage of {storage.numel}"
    last = storage_offset + sum((d - 1) * s for d, s in zip(shape, stride)) if numel else \
        storage_offset - 1
    if last >= storage.numel:
        return (f"a tensor that lies outside its storage (element {last} of "
                f"{storage.numel})")
    return None


class Tensor(_ReadOnly):
    """A view of a storage, as torch's `_rebuild_tensor_v2` describes one. Read-only, like
    Storage; every view lies inside its storage (checked when it is made)."""

    __slots__ = ("storage", "storage_offset", "shape", "stride", "requires_grad", "metadata",
                 "wrapper")

    def __init__(self, storage: Storage, storage_offset: int, shape: tuple[int, ...],
                 stride: tuple[int, ...], requires_grad: bool = False, metadata=None,
                 wrapper: tuple | None = None):
        shape, stride = tuple(shape), tuple(stride)
        if not isinstance(storage, Storage):
            raise ValueError("a tensor without a storage")
        problem = view_problem(storage, storage_offset, shape, stride)
        if problem is not None:
            raise ValueError(problem)
        # wrapper: (type, attribute dict) of a tensor saved with attributes of its own or
        # as a subclass (torch's _rebuild_from_type_v2); None for a plain one.
        for name, value in zip(self.__slots__, (storage, storage_offset, shape, stride,
                                                bool(requires_grad), metadata, wrapper)):
            object.__setattr__(self, name, value)

    def __reduce__(self):
        return Tensor, (self.storage, self.storage_offset, self.shape, self.stride,
                        self.requires_grad, self.metadata, self.wrapper)

    # ---- made here ------------------------------------------------------------------
    @classmethod
    def empty(cls, numel: int, dtype: str = "fp32") -> Tensor:
        """A 1-D placeholder: its bytes are written by someone else (the copy step)."""
        return cls(Storage(dtype, numel), 0, (numel,), (1,))

    @classmethod
    def of_bytes(cls, data: bytes | bytearray | memoryview, dtype: str,
                 shape: tuple[int, ...]) -> Tensor:
        """A new contiguous tensor holding these bytes."""
        numel = math.prod(shape)
        if len(data) != numel * DTYPES[dtype].itemsize:
            raise ValueError(f"{len(data)} bytes for {dtype} x {shape}")
        return cls(Storage(dtype, numel, data=bytes(data)), 0, shape, contiguous_stride(shape))

    @classmethod
    def scalar(cls, value, dtype: str) -> Tensor:
        """A 0-d tensor (what torch.tensor(value, dtype=...) makes)."""
        return cls.of_bytes(struct.pack(_STRUCT[dtype], value), dtype, ())

    # ---- facts ----------------------------------------------------------------------
    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype in ("fp32", "bf16", "fp16", "f64")

    def is_contiguous(self) -> bool:
        return self.stride == contiguous_stride(self.shape) or self.numel() <= 1

    @property
    def file_offset(self) -> int:
        """Byte offset of the first element in its file."""
        if self.storage.offset is None:
            raise RuntimeError("internal error: the file offset of a tensor not in a file")
        self._need_contiguous()
        return self.storage.offset + self.storage_offset * self.itemsize

    # ---- values (read on demand) -----------------------------------------------------
    def raw_bytes(self, start: int = 0, count: int | None = None) -> bytes | memoryview:
        """The bytes of elements [start, start + count) in storage order (contiguous only)."""
        self._need_contiguous()
        count = self.numel() - start if count is None else count
        return self.storage.read((self.storage_offset + start) * self.itemsize,
                                 count * self.itemsize)

    def raw(self, start: int = 0, count: int | None = None):
        """Elements [start, start + count) as a flat numpy array (bf16: its uint16 bits)."""
        import numpy as np
        return np.frombuffer(self.raw_bytes(start, count), dtype=_NUMPY[self.dtype])

    def values(self, fd: int | None = None):
        """All elements in index order, flat, as numpy (bf16: its bits), whatever the
        strides; fd: the storage's file, already open."""
        import numpy as np
        if self.is_contiguous():
            data = self.storage.read(self.storage_offset * self.itemsize, self.nbytes, fd)
            return np.frombuffer(data, dtype=_NUMPY[self.dtype])
        item = self.itemsize
        span = 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride))
        data = np.frombuffer(self.storage.read(self.storage_offset * item, span * item, fd),
                             dtype=_NUMPY[self.dtype])
        return np.lib.stride_tricks.as_strided(data, self.shape, [st * item for st in self.stride],
                                               writeable=False).reshape(-1)

    def item(self):
        """The value of a one-element tensor, as a Python number."""
        if self.numel() != 1:
            raise ValueError(f"item() of a tensor of {self.numel()} elements")
        data = bytes(self.raw_bytes())
        if self.dtype == "bf16":
            return struct.unpack("<f", b"\0\0" + data)[0]
        return struct.unpack(_STRUCT[self.dtype], data)[0]

    def _need_contiguous(self) -> None:
        if not self.is_contiguous():
            raise ValueError(f"a non-contiguous tensor ({self.shape}, stride {self.stride})")

    def __repr__(self) -> str:
        return f"Tensor({self.dtype}, {list(self.shape)})"
