"""Frozen parameters' fragments, checked in each rank's model states before any export joins
them: the exports put the ranks' fragments end to end, so one of the wrong length would
shift every later element (the second attack of 2026-11-28: another tensor's values came out
of an export, exit 0)."""
from __future__ import annotations

import math
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.torch import Tensor
from mpitailor.formats.zero.meta import CheckpointMeta


def check_frozen_fragments(meta: CheckpointMeta, model: dict, path: Path,
                           only_present: bool = False) -> None:
    """Each frozen parameter's fragment in this rank's model states as DeepSpeed saves it: a
    tensor of ceil(n / W) elements under stage 3 (the rank's partition, padded), all n under
    stages 1 and 2, whatever its strides (DeepSpeed saves `param.detach().cpu()`, a slice of
    a wider buffer keeps its strides). only_present: a partial save holds the frozen
    parameters of the layers it saved, and only those are checked."""
    fragments = model.get("frozen_param_fragments") or {}
    if not isinstance(fragments, dict):
        fragments = {}
    for name, shape in meta.frozen_shapes:
        if only_present and name not in fragments:
            continue
        n = math.prod(shape)
        want = -(-n // meta.world_size) if meta.zero_stage == 3 else n
        t = fragments.get(name)
        if not (isinstance(t, Tensor) and t.numel() == want):
            raise CheckpointError(f"{path}: frozen parameter {name}'s fragment is not the "
                                  f"{want} elements DeepSpeed saves for it; a damaged or "
                                  f"crafted file")
