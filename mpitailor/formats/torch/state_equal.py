"""Equality of checkpoint state values that may hold tensors (hyper-parameters some optimizers
keep as tensors, scheduler states), where `==` on a tensor would not give one answer."""
from __future__ import annotations

from mpitailor.formats.torch.tensorref import Tensor


def same_values(a, b) -> bool:
    """a equals b, tensors compared by dtype, shape and bits, inside dicts, lists and tuples."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and \
            (a.dtype, a.shape) == (b.dtype, b.shape) and a.is_contiguous() and \
            b.is_contiguous() and bytes(a.raw_bytes()) == bytes(b.raw_bytes())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    return a == b

