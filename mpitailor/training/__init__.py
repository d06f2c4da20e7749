"""Training side: save only some layers, and resume from what was saved.

    from mpitailor.training import LayerwiseCheckpointer, Parity, per_layer_param_groups
    from mpitailor.training import LayerwiseTrainer      # HF Trainer (imports transformers)
    from mpitailor.training import AccelerateCheckpointer  # Accelerate (imports accelerate)
    from mpitailor.training import DcpCheckpointer, load_dcp  # FSDP2 + PyTorch DCP
    from mpitailor.training import AccelerateDcpCheckpointer  # Accelerate + FSDP2 (DCP)
    from mpitailor.training import DcpLayerwiseTrainer  # HF Trainer + FSDP2 (DCP)
    from mpitailor.training import enable_cpu_training, end_cpu_training  # without GPUs

It needs torch and DeepSpeed (`pip install 'mpitailor[train]'`; the core install, the merge
side, has neither). The names are loaded on first use, so that `import mpitailor.training`
and its torch-free parts (`stats plot`) work without them, and a missing one is named in one
line when a name that needs it is asked for.

It stands on the merge side only through `mpitailor.facade` (a small set of names that say
what training needs: layer keys, publication, retention, the in-job resume), `formats/` and
the base modules, and calls torch.distributed only in its training comm (`distcomm.py`);
tests/test_layering.py holds it to both.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["AccelerateCheckpointer", "AccelerateDcpCheckpointer", "Adaptive",
           "DcpCheckpointer", "DcpLayerwiseTrainer", "Filter",
           "LayerwiseCheckpointer", "load_dcp",
           "LayerwiseTrainer", "Parity", "Policy", "enable_cpu_training", "end_cpu_training",
           "make_policy", "per_layer_param_groups", "recover_for_resume", "save_layers"]

# name -> the submodule that defines it. LayerwiseTrainer subclasses transformers.Trainer,
# AccelerateCheckpointer uses accelerate: a plain DeepSpeed loop needs neither.
_WHERE = {
    "LayerwiseCheckpointer": "checkpointer",
    "DcpCheckpointer": "dcp_checkpointer", "load_dcp": "dcp_state",
    "per_layer_param_groups": "groups",
    "save_layers": "partial_save",
    "Adaptive": "policies", "Filter": "policies", "Parity": "policies", "Policy": "policies",
    "make_policy": "policies",
    "recover_for_resume": "resume",
    "LayerwiseTrainer": "hf",
    "AccelerateCheckpointer": "accel",
    "AccelerateDcpCheckpointer": "dcp_accel", "DcpLayerwiseTrainer": "dcp_hf",
    "enable_cpu_training": "cpu", "end_cpu_training": "cpu",
}
assert set(_WHERE) == set(__all__)

# The training side's own dependencies (none of which the core install pulls) -> the extra
# that brings it.
_EXTRA = {"torch": "train", "deepspeed": "train", "h5py": "train", "transformers": "hf",
          "accelerate": "hf"}


def missing_message(missing: str, needed_by: str = "mpitailor.training") -> str:
    """The one line that says which extra brings `missing` (a top-level module name)."""
    extras = "train" if _EXTRA[missing] == "train" else "train,hf"
    what = "torch and DeepSpeed" if extras == "train" else \
        "torch, DeepSpeed, transformers and accelerate"
    return (f"{needed_by} needs {what}, and {missing} is not installed: "
            f"pip install 'mpitailor[{extras}]'")


@contextmanager
def dependencies(needed_by: str) -> Iterator[None]:
    """Around a training module's imports of torch, DeepSpeed, transformers, accelerate or
    h5py: one of them missing is the one line that names the extra to install (also when
    the module is imported directly, not through a name of this package)."""
    try:
        yield
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in _EXTRA:
            raise
        raise ImportError(missing_message(top, needed_by), name=e.name) from None


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'mpitailor.training' has no attribute {name!r}")
    needed_by = "mpitailor.training" if where not in ("hf", "accel", "dcp_accel", "dcp_hf") else \
        f"mpitailor.training.{name}"
    with dependencies(needed_by):
        module = importlib.import_module(f"mpitailor.training.{where}")
    value = getattr(module, name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
