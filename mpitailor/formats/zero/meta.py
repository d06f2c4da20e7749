"""What one ZeRO checkpoint is: layout, counters, groups, dtype. The record only.

The record is small, frozen and picklable, so rank 0 can read it once and broadcast it;
each rank then checks its own rank files against it when it opens them (`shard.py`).
It is read from rank 0's files by `read.py`, which needs torch; this module does not, so
the planner can take a `CheckpointMeta` without loading torch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mpitailor.formats.zero import files as zfiles
from mpitailor.formats.zero.files import CheckpointFiles
from mpitailor.formats.zero.layout import Layout

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default `sub_group_size`


@dataclass(frozen=True, slots=True)
class CheckpointMeta:
    files: CheckpointFiles
    layout: Layout
    dtype: str                                   # model (16-bit or fp32) dtype
    global_steps: int
    global_samples: int
    param_groups: tuple[tuple[int, ...], ...]    # sub-group ids of each optimizer param group
    subgroup_steps: tuple[float, ...]            # Adam `step` of each sub-group
    frozen_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    shared_params: tuple[tuple[str, str], ...]   # alias -> tied parameter
    ds_version: str
    held_layers: frozenset[str] | None = None    # partial checkpoints: the layer keys saved
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE  # ZeRO-3 config: where sub-groups close
    lineage: zfiles.Lineage | None = None        # place in a timeline (mpitailor saves)
    layer_patterns: tuple[tuple[str, str], ...] = ()  # the patterns the run saved with
    # the record of every file ((name, record) pairs: a partial save's manifest's; a full
    # save's SAVE_RECORD's, where it records them), read once with the rest, so that nodes
    # without the record can check their ranks' files
    file_records: tuple[tuple[str, object], ...] = ()
    zero_stage: int = 3  # 1 and 2 have flat layouts (layout.flat) and one model-states file

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def partial(self) -> bool:
        return self.files.partial

    def layer_keys(self, classify: Callable[[str], str]) -> set[str]:
        """The layer keys of the parameters the checkpoint holds (trained and frozen)."""
        return {classify(s.name) for s in self.layout.slots} | \
            {classify(n) for n, _ in self.frozen_shapes}

    @property
    def path(self) -> Path:
        return self.files.tag_dir
