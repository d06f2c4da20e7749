"""Reading and writing DeepSpeed ZeRO-3 checkpoints: layout, files, safe loading."""
from __future__ import annotations

from mpitailor.zero3.files import CheckpointFiles, resolve
from mpitailor.zero3.layout import Layout, Slot, compute_layout
from mpitailor.zero3.meta import CheckpointMeta, read_meta
from mpitailor.zero3.shard import KINDS, RankShard, open_shard

__all__ = ["KINDS", "CheckpointFiles", "CheckpointMeta", "Layout", "RankShard", "Slot",
           "compute_layout", "open_shard", "read_meta", "resolve"]
