"""Value equality of what a checkpoint file holds, as mpitailor's reader or torch gives it:
the one comparison the async-save tests and the GPU check make of two saves' small states."""
from __future__ import annotations

import numpy as np
import torch

from mpitailor.formats.torch.opaque import Opaque
from mpitailor.formats.torch.tensorref import Tensor


def same(a, b) -> bool:
    """Equal values: tensors (mpitailor's references or torch's) by dtype, shape and bytes;
    numpy arrays elementwise; inside dicts, lists and tuples; stand-ins of untrusted classes
    by how they were written (class, arguments, state); objects without an equality of their
    own (DeepSpeed's loss scaler) by their attributes."""
    if isinstance(a, Opaque) or isinstance(b, Opaque):
        return isinstance(a, Opaque) and isinstance(b, Opaque) and \
            type(a).global_name == type(b).global_name and \
            all(same(a.__dict__[k], b.__dict__[k]) for k in ("_how", "_args", "_state"))
    if isinstance(a, type) or isinstance(b, type):  # a stand-in class, or a real one
        return getattr(a, "global_name", a) == getattr(b, "global_name", b)
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and \
            (a.dtype, a.shape) == (b.dtype, b.shape) and \
            bytes(a.raw_bytes()) == bytes(b.raw_bytes())
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is type(b) and type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return same(vars(a), vars(b))
    return a == b
