"""One optimizer param group per layer, so that every ZeRO sub-group belongs to one layer.

With the default grouping a ZeRO-3 sub-group mixes layers, and a merged checkpoint must
pick one Adam `step` for a sub-group whose layers come from different saves. With one group
per layer every sub-group has one owner and recovery is exact.
"""
from __future__ import annotations

from collections.abc import Callable

from mpitailor.training import dependencies

with dependencies(__name__):
    import torch

from mpitailor.facade import classify as default_classify

NO_DECAY_MARKERS = ("bias", "norm", "ln_")


def per_layer_param_groups(model: torch.nn.Module, weight_decay: float = 0.0,
                           classify: Callable[[str], str] = default_classify) -> list[dict]:
    """Param groups named by layer key, in model order; biases and norms get no decay."""
    groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = weight_decay > 0 and not any(m in name for m in NO_DECAY_MARKERS)
        groups.setdefault((classify(name), decay), []).append(p)
    return [{"params": ps, "name": key if not decay else f"{key}.decay",
             "weight_decay": weight_decay if decay else 0.0}
            for (key, decay), ps in groups.items()]


def decay_param_groups(model: torch.nn.Module, weight_decay: float = 0.01) -> list[dict]:
    """HF Trainer's default layout: one decayed group, one not decayed."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if any(m in name for m in NO_DECAY_MARKERS) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]
