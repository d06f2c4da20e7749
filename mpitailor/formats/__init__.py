"""Reading and writing DeepSpeed ZeRO-3 checkpoints: layout, files, safe loading.

The package re-exports only its torch-free records (files, layout, meta), so the planner
can import them without torch. Reading needs torch: `read_meta` is in `formats.read`,
`open_shard`/`RankShard` in `formats.shard`; import them from there.
"""
from __future__ import annotations

from mpitailor.formats.files import CheckpointFiles, resolve
from mpitailor.formats.layout import (
    BYTES_PER_ELEMENT,
    KINDS,
    MOMENTS,
    Layout,
    Slot,
    compute_layout,
)
from mpitailor.formats.meta import CheckpointMeta

__all__ = ["BYTES_PER_ELEMENT", "KINDS", "MOMENTS", "CheckpointFiles", "CheckpointMeta",
           "Layout", "Slot", "compute_layout", "resolve"]
