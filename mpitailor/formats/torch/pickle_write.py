"""torch's pickle written without torch: `dumps(obj)` gives the `data.pkl` torch.save(obj)
writes.

The pure-Python pickler, protocol 2, with torch's `persistent_id`: a `tensorref.Tensor`
reduces as torch's tensor does, a stand-in (opaque.py) writes back its original GLOBAL,
REDUCE, NEWOBJ and BUILD, so the pickle's bytes are those `torch.save` writes for the same
object (tests/test_ptzip.py holds them against torch.save).
"""
from __future__ import annotations

import io
from collections import OrderedDict

from mpitailor.formats.torch import opaque
from mpitailor.formats.torch.rebuild import (
    REBUILD_FROM_TYPE,
    REBUILD_TENSOR,
    STORAGE_OF,
    TENSOR_TYPE,
)
from mpitailor.formats.torch.tensorref import Storage, Tensor


def _tensor_reduce(t: Tensor):
    """What torch's pickler writes for a tensor with these fields (any other pickler, e.g.
    mpi4py's, carries the Tensor as it is)."""
    # Fresh tuples and hooks dict, as torch's Tensor.__reduce_ex__ makes them: the pickle's
    # memo then shares exactly what torch's would.
    args = (StorageRef(t.storage), t.storage_offset, tuple([*t.shape]), tuple([*t.stride]),
            t.requires_grad, OrderedDict())
    args += (t.metadata,) if t.metadata else ()
    if t.wrapper is None or (t.wrapper[0] is TENSOR_TYPE and not t.wrapper[1]):
        return REBUILD_TENSOR, args
    return REBUILD_FROM_TYPE, (REBUILD_TENSOR, t.wrapper[0], args, t.wrapper[1])


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
            return _tensor_reduce(obj)
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
        return ("storage", STORAGE_OF[s.dtype], key, "cpu", s.numel)


def dumps(obj) -> tuple[bytes, list[Storage]]:
    """The data.pkl torch.save(obj) writes, and the storages it names, in key order."""
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    return buf.getvalue(), p.storages
