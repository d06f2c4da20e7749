"""Torch files on the tests' side: torch itself for what mpitailor's merge side no longer does
with torch (its reader returns tensorref.Tensor references, never torch tensors).

- `torch_load(path)`: a checkpoint file as torch tensors in memory (weights_only, DeepSpeed's
  own classes allowed), for tests that change a file and write it back with torch.save.
- `as_refs(obj)`: a torch object in the form mpitailor's torch-free writer takes (tensors as
  tensorref.Tensor), so that `zip_write.write_torch_file(path, as_refs(obj))` can be held byte
  for byte against `torch.save(obj)`.
- `ref_bytes(t)`: the bytes of a tensorref.Tensor's elements, for bitwise comparisons.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
from merge_check import _allowed

from mpitailor.formats.dtypes import name_of
from mpitailor.formats.torch import opaque
from mpitailor.formats.torch.rebuild import Size
from mpitailor.formats.torch.tensorref import Storage, Tensor


def _numpy_globals() -> list:
    import numpy as np
    return [np._core.multiarray._reconstruct, np._core.multiarray.scalar, np.ndarray,
            np.dtype, np.dtypes.UInt32DType, np.dtypes.Float64DType, np.dtypes.Int64DType]


def torch_load(path: Path | str, *, numpy: bool = False):
    """The file as torch.load(weights_only=True) gives it, read into memory (not mmap: the
    caller may overwrite the file with torch.save). numpy: also allow numpy arrays (HF and
    accelerate RNG states)."""
    allowed = _allowed() + (_numpy_globals() if numpy else [])
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def ref_bytes(t: Tensor) -> bytes:
    """The bytes of a (contiguous) tensorref.Tensor's elements."""
    assert t.is_contiguous(), t
    return bytes(t.raw_bytes())


def _storage_view(u: torch.UntypedStorage) -> memoryview:
    # Zero-copy: a never-touched torch.empty stays untouched until someone reads it.
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(u).numpy())


def as_refs(obj):
    """obj with every torch tensor as a tensorref.Tensor that pickles as torch pickles it:
    one Storage per torch storage (views and shared storages stay shared), tensors with
    attributes of their own (or of a subclass) wrapped as torch's _rebuild_from_type_v2
    writes them, torch.Size as mpitailor's; the same object met twice maps to the same
    object (the pickle's memo then shares what torch's shares)."""
    storages: dict[int, Storage] = {}
    memo: dict[int, object] = {}

    def conv(x):
        if id(x) in memo:
            return memo[id(x)]
        if isinstance(x, torch.Tensor):
            out = tensor(x)
        elif isinstance(x, torch.Size):
            out = Size(tuple(x))
        elif isinstance(x, torch.dtype):
            out = opaque.stand_in(str(x))  # torch pickles a dtype as its GLOBAL
        elif isinstance(x, dict):
            if type(x) not in (dict, OrderedDict):
                raise TypeError(f"as_refs: a {type(x).__name__}")
            out = memo[id(x)] = type(x)()
            for k, v in x.items():
                out[conv(k)] = conv(v)
            return out
        elif isinstance(x, list):
            out = memo[id(x)] = []
            out.extend(conv(v) for v in x)
            return out
        elif type(x) is tuple:
            out = tuple(conv(v) for v in x)
        else:
            return x
        memo[id(x)] = out
        return out

    def tensor(t: torch.Tensor) -> Tensor:
        if t.device.type != "cpu":
            raise TypeError(f"as_refs: a {t.device} tensor")
        if isinstance(t, torch.nn.Parameter):
            raise TypeError("as_refs: nn.Parameter is not handled")
        u = t.untyped_storage()
        dtype = name_of(t.dtype)
        s = storages.get(u._cdata)
        if s is None:
            s = storages[u._cdata] = Storage(dtype, u.nbytes() // t.element_size(),
                                             data=_storage_view(u))
        elif s.dtype != dtype:
            raise TypeError("as_refs: one storage viewed as two dtypes (torch refuses too)")
        meta = torch._utils.get_tensor_metadata(t)
        state = torch._utils._get_obj_state(t)
        wrapper = None
        if type(t) is not torch.Tensor or state:
            kind = type(t)
            wrapper = (opaque.stand_in(f"{kind.__module__}.{kind.__qualname__}"), conv(state))
        return Tensor(s, t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                      t.requires_grad, meta or None, wrapper)

    return conv(obj)
