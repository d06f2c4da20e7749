"""Load DeepSpeed checkpoint files without ever unpickling arbitrary objects.

`torch.load(weights_only=True)` refuses every global outside an allow-list. DeepSpeed's
optimizer files pickle two small classes of its own; they are allowed by name and nothing
else is. Files are memory-mapped, so only the pages of the tensors a caller touches are read.
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from mpitailor.errors import CheckpointError


def _deepspeed_globals() -> list:
    # Imported lazily: the two modules are small and pull no accelerator code.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


def _numpy_globals() -> list:
    """What HF Trainer's `rng_state_*.pth` (numpy RNG state) needs."""
    import numpy as np
    from numpy.core.multiarray import _reconstruct  # type: ignore[attr-defined]
    dtypes = [type(np.dtype(t)) for t in ("uint32", "float64", "int64")]
    return [_reconstruct, np.ndarray, np.dtype, *dtypes]


ALLOWED = {"deepspeed": _deepspeed_globals, "numpy": _numpy_globals}


def load(path: Path | str, *, allow: tuple[str, ...] = ("deepspeed",), mmap: bool = True) -> Any:
    """Load a torch-serialised file safely; one-line CheckpointError on any failure."""
    path = Path(path)
    allowed = [g for name in allow for g in ALLOWED[name]()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except pickle.UnpicklingError as e:
        detail = str(e).split("\n")[0] if "Unsupported global" not in str(e) else \
            next(line.strip() for line in str(e).splitlines() if "Unsupported global" in line)
        raise CheckpointError(
            f"{path}: refused to load: it pickles an object outside mpitailor's allow-list "
            f"({detail}); mpitailor never runs code from checkpoint files") from None
    except (RuntimeError, zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        first = str(e).strip().split("\n")[0]
        raise CheckpointError(
            f"{path}: unreadable or truncated checkpoint file ({first}); "
            f"re-copy it from the original save") from None
