"""Per-layer update statistics of a live ZeRO engine (stage 1, 2 or 3), and their HDF5 log.

The relative update of a layer is ||w - w_saved|| / ||w_saved||, where w_saved is the layer's
fp32 master weights when it was last saved. Each rank keeps a copy of its own slices of the
weights as last saved (4 bytes per parameter / world size: a quarter of its optimizer
state), computes local sums of squares, and one all-reduce gives every rank the norms.
Padding is excluded. Collective over the data-parallel group: call on every rank.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from mpitailor.formats.layout import compute_layout
from mpitailor.planning.layers import classify as default_classify
from mpitailor.planning.layers import sort_keys


def model_layer_keys(engine, classify: Callable[[str], str] = default_classify) -> list[str]:
    """The layer keys of the engine's optimized parameters, in model order."""
    return sort_keys({classify(n) for g in engine._get_zero_param_shapes() for n in g})


class UpdateTracker:
    def __init__(self, engine, classify: Callable[[str], str] = default_classify) -> None:
        self.engine = engine
        self.flat = engine.zero_optimization_stage() in (1, 2)
        layout = compute_layout(engine._get_zero_param_shapes(), engine.dp_world_size,
                                flat=self.flat)
        rank = engine.global_rank
        self.pieces: dict[str, list[tuple[int, int, int]]] = {}
        for s in layout.slots:
            at, _, n = layout.held(s, rank)
            if n > 0:
                self.pieces.setdefault(classify(s.name), []).append((s.subgroup, at, n))
        self.keys = model_layer_keys(engine, classify)
        self.snapshot: dict[str, torch.Tensor] = {}

    def _current(self, key: str) -> torch.Tensor:
        opt = self.engine.optimizer
        flats = opt.single_partition_of_fp32_groups if self.flat else \
            opt.fp32_partitioned_groups_flat
        parts = [flats[g].detach()[o: o + n] for g, o, n in self.pieces.get(key, [])]
        return torch.cat(parts) if parts else torch.empty(0)

    def measure(self) -> dict[str, dict[str, float]]:
        """key -> {update_norm, weight_norm, relative_update} (inf before the first save)."""
        sums = torch.zeros(len(self.keys), 3, dtype=torch.float64)
        for i, k in enumerate(self.keys):
            w = self._current(k).double()
            sums[i, 2] = w.square().sum()
            if k in self.snapshot:
                s = self.snapshot[k].double()
                sums[i, 0] = (w - s).square().sum()
                sums[i, 1] = s.square().sum()
        if dist.is_initialized():
            dist.all_reduce(sums)
        out = {}
        for i, k in enumerate(self.keys):
            upd, prev, now = (math.sqrt(x) for x in sums[i].tolist())
            seen = k in self.snapshot
            out[k] = {"update_norm": upd if seen else math.nan, "weight_norm": now,
                      "relative_update": upd / prev if seen and prev > 0 else math.inf}
        return out

    def mark_saved(self, keys) -> None:
        for k in keys:
            self.snapshot[k] = self._current(k).clone()


class StatsLog:
    """Append-only HDF5 log (rank 0): one row per save, one column per layer key."""

    def __init__(self, path: str | Path, keys: list[str]) -> None:
        self.path, self.keys = Path(path), list(keys)

    TIMINGS = ("blocked_s", "waited_s", "background_s")  # per save; NaN where unknown

    def append(self, step: int, full: bool, saved: set[str], stats: dict | None,
               blocked: float = math.nan, waited: float = math.nan) -> None:
        """One save's row. blocked: seconds training stood still for it (waited: of those,
        for the save before); its background seconds come later (`set`)."""
        import h5py

        row = {"update_norm": [], "weight_norm": [], "relative_update": []}
        for k in self.keys:
            for field in row:
                row[field].append(stats[k][field] if stats else math.nan)
        with h5py.File(self.path, "a") as f:
            if "step" not in f:
                f.create_dataset("layers", data=np.array(self.keys, dtype="S"))
                f.create_dataset("step", shape=(0,), maxshape=(None,), dtype="i8")
                f.create_dataset("full", shape=(0,), maxshape=(None,), dtype="bool")
                L = len(self.keys)
                f.create_dataset("saved", shape=(0, L), maxshape=(None, L), dtype="bool")
                for field in row:
                    f.create_dataset(field, shape=(0, L), maxshape=(None, L), dtype="f8")
            n = f["step"].shape[0]
            for name in self.TIMINGS:  # also into a log written before they were recorded
                if name not in f:
                    f.create_dataset(name, data=np.full(n, math.nan), maxshape=(None,))
            for name in ("step", "full", "saved", *row, *self.TIMINGS):
                f[name].resize(n + 1, axis=0)
            f["step"][n] = step
            f["full"][n] = full
            f["saved"][n] = [k in saved for k in self.keys]
            for field, values in row.items():
                f[field][n] = values
            f["blocked_s"][n], f["waited_s"][n], f["background_s"][n] = blocked, waited, math.nan

    def set(self, row: int, name: str, value: float) -> None:
        """A timing of an earlier row, known once its background write ended."""
        import h5py

        with h5py.File(self.path, "a") as f:
            f[name][row] = value
