"""Training side: save only some layers, and resume from what was saved.

    from mpitailor.training import LayerwiseCheckpointer, Parity, per_layer_param_groups
    from mpitailor.training import LayerwiseTrainer      # HF Trainer (imports transformers)
    from mpitailor.training import AccelerateCheckpointer  # Accelerate (imports accelerate)
"""
from __future__ import annotations

from mpitailor.training.checkpointer import LayerwiseCheckpointer
from mpitailor.training.groups import per_layer_param_groups
from mpitailor.training.partial_save import save_layers
from mpitailor.training.policies import Adaptive, Filter, Parity, Policy, make_policy
from mpitailor.training.resume import recover_for_resume

__all__ = ["AccelerateCheckpointer", "Adaptive", "Filter", "LayerwiseCheckpointer",
           "LayerwiseTrainer", "Parity", "Policy", "make_policy", "per_layer_param_groups",
           "recover_for_resume", "save_layers"]


def __getattr__(name: str):
    # LayerwiseTrainer subclasses transformers.Trainer, AccelerateCheckpointer uses
    # accelerate: import them only when asked (a plain DeepSpeed loop needs neither).
    if name == "LayerwiseTrainer":
        from mpitailor.training.hf import LayerwiseTrainer
        return LayerwiseTrainer
    if name == "AccelerateCheckpointer":
        from mpitailor.training.accel import AccelerateCheckpointer
        return AccelerateCheckpointer
    raise AttributeError(f"module 'mpitailor.training' has no attribute {name!r}")
