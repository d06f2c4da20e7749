"""What a correct update-statistics log holds, computed independently from the saves' files
(tests/test_stats.py, tests/test_async_save.py)."""
from __future__ import annotations

import math
from pathlib import Path

import h5py
import pytest
import torch

from mpitailor.formats.zero.read import read_meta
from mpitailor.formats.zero.shard import open_shard
from mpitailor.planning.layers import LayerClassifier


def read_log(path: Path) -> dict:
    with h5py.File(path) as f:
        out = {name: f[name][:] for name in f}
    out["layers"] = [x.decode() for x in out["layers"]]
    return out


def layer_fp32(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Layer key -> its fp32 master weights in a save's files (every rank's part, padding
    excluded, in one fixed order): the layers that save holds."""
    meta = read_meta(tag_dir)
    classify, parts = LayerClassifier(), {}
    for r in range(meta.world_size):
        with open_shard(meta, r) as shard:
            for s in meta.layout.slots:
                key = classify(s.name)
                at, _, n = meta.layout.held(s, r)
                if n and (meta.held_layers is None or key in meta.held_layers):
                    parts.setdefault(key, []).append(
                        torch.from_numpy(shard.read("fp32", s.subgroup, at, n)).double())
    return {k: torch.cat(v) for k, v in parts.items()}


def check_norms(root: Path, log: dict, steps) -> int:
    """Every logged norm that the saves' files determine (a layer the row's save holds, and
    the save it was last saved in) equals the one computed from those files. Returns how
    many were compared."""
    keys, last_saved, compared = log["layers"], {}, 0
    rows = {int(s): i for i, s in enumerate(log["step"])}
    for step in steps:
        i, now = rows[step], layer_fp32(root / f"global_step{step}")
        for k, w in now.items():
            j = keys.index(k)
            assert log["weight_norm"][i, j] == pytest.approx(float(w.norm()), rel=1e-5)
            if k in last_saved:
                prev = last_saved[k]
                assert log["update_norm"][i, j] == pytest.approx(float((w - prev).norm()),
                                                                 rel=1e-4, abs=1e-9)
                assert log["relative_update"][i, j] == pytest.approx(
                    float((w - prev).norm() / prev.norm()), rel=1e-4, abs=1e-12)
                compared += 1
            else:
                assert math.isinf(log["relative_update"][i, j])
        last_saved.update({k: w for k, w in now.items() if log["saved"][i, keys.index(k)]})
    return compared
