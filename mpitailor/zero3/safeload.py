"""Load DeepSpeed checkpoint files without ever unpickling arbitrary objects.

`torch.load(weights_only=True)` refuses every global outside an allow-list. DeepSpeed's
optimizer files pickle two small classes of its own; they are allowed by name and nothing
else is. Files are memory-mapped, so only the pages of the tensors a caller touches are read.
"""
from __future__ import annotations

import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from mpitailor.errors import CheckpointError


def _deepspeed_globals() -> list:
    # Imported lazily. DeepSpeed's package init warns once that it picked the CPU
    # accelerator; that says nothing about mpitailor's work, so keep it off the console.
    ds_log = logging.getLogger("DeepSpeed")
    mute = logging.Filter("nothing")  # passes no record named "DeepSpeed"
    ds_log.addFilter(mute)
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
    finally:
        ds_log.removeFilter(mute)
    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


def _numpy_globals() -> list:
    """What HF Trainer's `rng_state_*.pth` (numpy RNG state) needs."""
    import numpy as np
    from numpy.core.multiarray import _reconstruct  # type: ignore[attr-defined]
    dtypes = [type(np.dtype(t)) for t in ("uint32", "float64", "int64")]
    return [_reconstruct, np.ndarray, np.dtype, *dtypes]


ALLOWED = {"deepspeed": _deepspeed_globals, "numpy": _numpy_globals}


def load(path: Path | str, *, allow: tuple[str, ...] = ("deepspeed",), mmap: bool = True,
         index_only: bool = False) -> Any:
    """Load a torch-serialised file safely; one-line CheckpointError on any failure.

    index_only: parse the structure only; tensors come back on the meta device, tagged with
    their byte offsets (see rawio.py), and no tensor data is read.
    """
    path = Path(path)
    allowed = [g for name in allow for g in ALLOWED[name]()]
    where = "meta" if index_only else "cpu"
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=where, weights_only=True,
                              mmap=mmap and not index_only)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused to load: it pickles an object outside mpitailor's allow-list "
            f"({_culprit(str(e))}); mpitailor never runs code from checkpoint files") from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        first = str(e).strip().split("\n")[0]
        raise CheckpointError(
            f"{path}: unreadable or truncated checkpoint file ({first}); "
            f"re-copy it from the original save") from None


def _culprit(message: str) -> str:
    """The line of torch's long refusal that names the global it blocked."""
    for line in message.splitlines():
        if "GLOBAL" in line or "Unsupported" in line:
            return line.strip().rstrip(".")
    return "unsupported global"
