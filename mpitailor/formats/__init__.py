"""Facts about files: DeepSpeed ZeRO checkpoints of stages 1-3 (layout, rank files, safe
loading, shards), the torch zip container and its pickle (read and written without torch:
tensorref.py, torchpickle.py, ptzip.py), safetensors, HF side files, dtypes and their casts,
the manifest.

The package re-exports only its small records (files, layout, meta), so the planner imports
no reader: `read_meta` is in `formats.read`, `open_shard` (a `Shard`:
formats/shard_protocol.py) in `formats.shard`; import them there.
"""
from __future__ import annotations

from mpitailor.formats.files import CheckpointFiles, resolve
from mpitailor.formats.layout import (
    ELEMENT,
    KINDS,
    MOMENTS,
    OPTIM_BYTES_PER_ELEMENT,
    Layout,
    Slot,
    compute_layout,
)
from mpitailor.formats.meta import CheckpointMeta

__all__ = ["ELEMENT", "KINDS", "MOMENTS", "OPTIM_BYTES_PER_ELEMENT", "CheckpointFiles",
           "CheckpointMeta", "Layout", "Slot", "compute_layout", "resolve"]
