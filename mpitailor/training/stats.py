"""Per-layer update statistics of a live ZeRO engine (stage 1, 2 or 3), and their HDF5 log.

The relative update of a layer is ||w - w_saved|| / ||w_saved||, where w_saved is the layer's
fp32 master weights when it was last saved (published). Each rank keeps a copy of its own
part of the weights as last saved (4 bytes per parameter / world size: a quarter of its
optimizer state), computes local sums of squares, and one all-reduce gives every rank the
norms. Padding is excluded.

Cost: sums of squares are taken on views of the engine's flat fp32 partitions, one contiguous
range per layer and sub-group, through one reused scratch buffer (float32 elementwise, then
torch's cascade sum: relative error ~1e-7 against float64), never per parameter and never
through float64 copies; the saved copy is updated in place. An asynchronous save updates it
from its host buffers in the background writer, once the save is published.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mpitailor.training import dependencies

with dependencies(__name__):
    import torch

from mpitailor.facade import classify as default_classify
from mpitailor.facade import sort_keys
from mpitailor.formats.zero import compute_layout
from mpitailor.training.distcomm import sum_over_ranks

log = logging.getLogger(__name__)


def model_layer_keys(engine, classify: Callable[[str], str] = default_classify) -> list[str]:
    """The layer keys of the engine's optimized parameters, in model order."""
    return sort_keys({classify(n) for g in engine._get_zero_param_shapes() for n in g})


def _coalesce(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(sub-group, start, stop) ranges, adjacent ones merged: a layer's parameters lie one
    after another in a sub-group's buffer, so a layer is mostly one range per sub-group."""
    out: list[tuple[int, int, int]] = []
    for g, a, b in sorted(ranges):
        if out and out[-1][0] == g and out[-1][2] == a:
            out[-1] = (g, out[-1][1], b)
        else:
            out.append((g, a, b))
    return out


class UpdateTracker:
    """Collective over the data-parallel group (`measure`): every rank calls it alike."""

    def __init__(self, engine, classify: Callable[[str], str] = default_classify) -> None:
        self.engine = engine
        self.flat = engine.zero_optimization_stage() in (1, 2)
        layout = compute_layout(engine._get_zero_param_shapes(), engine.dp_world_size,
                                flat=self.flat)
        rank = engine.global_rank
        held: dict[str, list[tuple[int, int, int]]] = {}
        # A partial save's fp32 slice of a parameter (`fp32/{name}`, padding included): where
        # it goes in the saved copy.
        self.spans: dict[str, tuple[str, int, int, int]] = {}
        for s in layout.slots:
            key = classify(s.name)
            at, _, n = layout.held(s, rank)
            if n > 0:
                held.setdefault(key, []).append((s.subgroup, at, at + n))
            start, length = layout.span(s, rank)
            if length > 0:
                self.spans[f"fp32/{s.name}"] = (key, s.subgroup, start, length)
        self.ranges = {k: _coalesce(v) for k, v in held.items()}
        self.keys = model_layer_keys(engine, classify)
        self.saved: list[torch.Tensor] | None = None  # per sub-group, allocated at first save
        self.saved_sq: dict[str, float] = {}  # key -> local sum of squares of its saved copy
        longest = max((b - a for rs in self.ranges.values() for _, a, b in rs), default=0)
        self._longest, self._scratch = longest, None

    def _flats(self) -> list[torch.Tensor]:
        opt = self.engine.optimizer
        return opt.single_partition_of_fp32_groups if self.flat else \
            opt.fp32_partitioned_groups_flat

    def _sq(self, x: torch.Tensor, minus: torch.Tensor | None = None) -> torch.Tensor:
        """sum((x - minus)^2) (or of x^2) through the scratch buffer: no allocation per call
        (a fresh large tensor costs page faults every time)."""
        if self._scratch is None:
            self._scratch = torch.empty(self._longest, dtype=torch.float32, device=x.device)
        buf = self._scratch[: x.numel()]
        if minus is None:
            torch.mul(x, x, out=buf)
        else:
            torch.sub(x, minus, out=buf).square_()
        return buf.sum()

    def measure(self, weights: bool = True) -> dict[str, dict[str, float]]:
        """Collective. key -> {update_norm, weight_norm, relative_update} (relative_update inf
        and update_norm NaN before the layer's first save; weight_norm NaN unless `weights`:
        the policies need only the updates)."""
        flats = self._flats()
        zero = torch.zeros((), dtype=torch.float32, device=flats[0].device)
        upd, now = [], []
        for k in self.keys:
            u = w = zero
            for g, a, b in self.ranges.get(k, ()):
                cur = flats[g].detach()[a:b]
                if weights:
                    w = w + self._sq(cur)
                if k in self.saved_sq:
                    u = u + self._sq(cur, self.saved[g][a:b])
            upd.append(u)
            now.append(w)
        prev = [self.saved_sq.get(k, 0.0) for k in self.keys]
        sums = torch.stack([torch.stack(upd), torch.stack(now)]).double().cpu()
        sums = torch.cat([sums, torch.tensor([prev], dtype=torch.float64)]).T.contiguous()
        sum_over_ranks(sums)
        out = {}
        for i, k in enumerate(self.keys):
            u, w, p = (math.sqrt(x) for x in sums[i].tolist())
            seen = k in self.saved_sq
            out[k] = {"update_norm": u if seen else math.nan,
                      "weight_norm": w if weights else math.nan,
                      "relative_update": u / p if seen and p > 0 else math.inf}
        return out

    def _buffers(self) -> list[torch.Tensor]:
        if self.saved is None:
            self.saved = [torch.empty_like(f) for f in self._flats()]
        return self.saved

    def mark_saved(self, keys) -> None:
        """The engine's weights of `keys` are now the saved ones (a save was published; the
        engine has not stepped since)."""
        saved, flats = self._buffers(), self._flats()
        for k in keys:
            for g, a, b in self.ranges.get(k, ()):
                saved[g][a:b].copy_(flats[g].detach()[a:b])
            self._remember(k)

    def mark_saved_from(self, slices: dict[str, torch.Tensor]) -> None:
        """As mark_saved, from a published asynchronous save's host copies of its fp32
        slices (the background writer calls it: the engine has stepped on since)."""
        saved, keys = self._buffers(), set()
        for name, t in slices.items():
            if name in self.spans:
                key, g, at, n = self.spans[name]
                saved[g][at: at + n].copy_(t.reshape(-1))
                keys.add(key)
        for k in keys:
            self._remember(k)

    def _remember(self, key: str) -> None:
        self.saved_sq[key] = sum(float(self._sq(self.saved[g][a:b]))
                                 for g, a, b in self.ranges.get(key, ()))


ROWS = ("step", "full", "chosen", "saved", "update_norm", "weight_norm", "relative_update",
        "blocked_s", "waited_s", "background_s", "step_held_s")


class StatsLog:
    """HDF5 log (rank 0): one row per global step at which a save was attempted, in step
    order; one column per layer key. `chosen` is what the policy chose; `saved` becomes true
    only once the save is published (an asynchronous one when its writer reports success),
    so a save that failed or was killed is never recorded as saved. The first row a log
    writes drops the rows at and after its step: a run resumed from an earlier save (a new
    checkpointer over the same file) replaces the abandoned timeline's rows from there on.
    A later row of a step already logged replaces it."""

    FIELDS = ("update_norm", "weight_norm", "relative_update")
    # per save; NaN where unknown. step_held_s: an asynchronous save's overlapped copy held
    # the next optimizer step this long (overlap.py)
    TIMINGS = ("blocked_s", "waited_s", "background_s", "step_held_s")

    def __init__(self, path: str | Path, keys: list[str]) -> None:
        self.path, self.keys = Path(path), list(keys)
        self._first = True

    def _open(self):
        import h5py

        # Written before the first save (the attempt), so maybe before the save dir exists.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = h5py.File(self.path, "a")
        L = len(self.keys)
        if "step" not in f:
            f.create_dataset("layers", data=np.array(self.keys, dtype="S"))
            f.create_dataset("step", shape=(0,), maxshape=(None,), dtype="i8")
            f.create_dataset("full", shape=(0,), maxshape=(None,), dtype="bool")
            for name in ("chosen", "saved"):
                f.create_dataset(name, shape=(0, L), maxshape=(None, L), dtype="bool")
            for name in self.FIELDS:
                f.create_dataset(name, shape=(0, L), maxshape=(None, L), dtype="f8")
        n = f["step"].shape[0]
        for name in self.TIMINGS:  # also into a log written before they were recorded
            if name not in f:
                f.create_dataset(name, data=np.full(n, math.nan), maxshape=(None,))
        if "chosen" not in f:  # a log written before: what it recorded as saved was chosen
            f.create_dataset("chosen", data=f["saved"][:], maxshape=(None, L))
        return f

    def attempt(self, step: int, full: bool, chosen, stats: dict | None) -> None:
        """The row of a save about to be written: what the policy chose, and the statistics it
        decided on; nothing saved yet."""
        with self._open() as f:
            steps = f["step"][:]
            keep = steps < step if self._first else steps != step
            if not keep.all():
                if self._first:
                    log.info("%s: rows of steps %s replaced (training resumed from before them)",
                             self.path, ", ".join(str(s) for s in steps[~keep]))
                for name in ROWS:
                    kept = f[name][:][keep]
                    f[name].resize(len(kept), axis=0)
                    if len(kept):
                        f[name][...] = kept
            self._first = False
            n = int(keep.sum())
            for name in ROWS:
                f[name].resize(n + 1, axis=0)
            f["step"][n], f["full"][n] = step, full
            f["chosen"][n] = [k in chosen for k in self.keys]
            f["saved"][n] = np.zeros(len(self.keys), dtype=bool)
            for field in self.FIELDS:
                f[field][n] = [stats[k][field] if stats else math.nan for k in self.keys]
            for name in self.TIMINGS:
                f[name][n] = math.nan

    def update(self, step: int, saved=None, **timings: float) -> None:
        """Step's row: the layers its save published (`saved`), and timings known later
        (`blocked_s`, `waited_s`, `background_s`, `step_held_s`)."""
        with self._open() as f:
            rows = np.flatnonzero(f["step"][:] == step)
            if not len(rows):
                return
            n = int(rows[-1])
            if saved is not None:
                f["saved"][n] = [k in saved for k in self.keys]
            for name, value in timings.items():
                f[name][n] = value
