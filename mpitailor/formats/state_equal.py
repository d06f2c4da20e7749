"""Equality of checkpoint state values that may hold tensors (hyper-parameters some optimizers
keep as tensors, scheduler states), where `==` on a tensor would not give one answer."""
from __future__ import annotations

import torch


def same_values(a, b) -> bool:
    """a equals b, tensors compared by shape and value, inside dicts, lists and tuples."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    return a == b
