"""`diff A B`: which layers of two checkpoints differ, and by how much.

Per layer key (layers.N, embed, norm, lm_head, other) and kind (the fp32 master weights,
exp_avg, exp_avg_sq, frozen parameters, the 16-bit weights (HF weights beside the
checkpoints, or a stage 1/2 model-states file), the
Adam step): identical or not (bit for bit), the largest absolute difference and the norm of
the difference relative to A's; then the counters and the LR scheduler. Values are compared
whole (consolidated), so checkpoints of different world sizes compare; a partial save is
compared on the layers it holds. Parameters are shared among MPI ranks by elements; each rank
reads its parameters' byte ranges a chunk at a time.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpitailor.cluster.comm import Comm
from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.dtypes import DTYPES, from_safetensors
from mpitailor.formats.io import open_regular, shown
from mpitailor.formats.safetensors_header import read_tensor_records
from mpitailor.formats.torch import cast, load, numpy_dtype, rawio, same_values
from mpitailor.formats.zero import (
    KINDS,
    CheckpointMeta,
    frozen_tensor,
    open_all_shards,
    read_meta,
    read_range,
    weight_files,
)
from mpitailor.jobs.torchsum import torch_sum
from mpitailor.planning.layers import LayerClassifier, sort_keys

DIFF_ELEMENTS = 1 << 20  # elements compared at a time
COUNTERS = ("global_steps", "global_samples", "skipped_steps")


@dataclass(frozen=True, slots=True)
class Diff:
    """How two sets of values differ; `+` joins the parts of one (layer, kind)."""

    elements: int = 0
    differing: int = 0     # elements whose bits differ
    max_abs: float = 0.0
    diff_sq: float = 0.0   # sum of squared differences
    ref_sq: float = 0.0    # sum of squares of A's values

    def __add__(self, o: Diff) -> Diff:
        return Diff(self.elements + o.elements, self.differing + o.differing,
                    max(self.max_abs, o.max_abs), self.diff_sq + o.diff_sq,
                    self.ref_sq + o.ref_sq)

    @property
    def identical(self) -> bool:
        return self.differing == 0

    def as_dict(self) -> dict:
        rel = math.sqrt(self.diff_sq / self.ref_sq) if self.ref_sq else \
            (0.0 if self.diff_sq == 0 else math.inf)
        return {"identical": self.identical, "elements": self.elements,
                "differing": self.differing, "max_abs_diff": self.max_abs,
                "rel_norm_diff": rel}


def compare(a: np.ndarray, b: np.ndarray, dtype: str | None = None) -> Diff:
    """Bit-for-bit and numeric difference of two arrays of one shape and numpy dtype. `dtype`
    names what the arrays hold where numpy's dtype does not say it: "bf16" for bf16's bits
    (uint16); the numbers are then the bf16 values."""
    a, b = a.reshape(-1), b.reshape(-1)
    ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[a.itemsize]
    differing = int(np.count_nonzero(a.view(ints) != b.view(ints)))
    a64 = _float64(a, dtype)
    if not differing:
        return Diff(a.size, 0, 0.0, 0.0, torch_sum(np.square(a64)))
    d = a64 - _float64(b, dtype)
    return Diff(a.size, differing, float(np.abs(d).max()), torch_sum(np.square(d)),
                torch_sum(np.square(a64)))


def _float64(x: np.ndarray, dtype: str | None) -> np.ndarray:
    """The values of x (1-D) as float64, exactly (bf16's bits and fp16 through casts.py)."""
    if dtype in ("bf16", "fp16"):
        x = cast(x, dtype, "fp32")
    return x.astype(np.float64)


def diff(comm: Comm, path_a: str | Path, path_b: str | Path) -> dict:
    """Collective: the report of A against B (every rank gets it)."""
    read: dict[int, CheckpointMeta] = {}  # each read by one rank, then shared
    for part in comm.allgather(comm.step(
            lambda: {i: read_meta(p) for i, p in enumerate((path_a, path_b))
                     if i % comm.size == comm.rank})):
        read.update(part)
    ma, mb = read[0], read[1]
    comm.root_step(_check_same_model, ma, mb)
    classify = LayerClassifier(dict(ma.layer_patterns or mb.layer_patterns or ()))
    held = _held_by_both(ma, mb, classify)
    work = [(s.name, kind, s.numel) for s in ma.layout.slots if classify(s.name) in held
            for kind in KINDS]
    work += [(n, "frozen", math.prod(shape)) for n, shape in ma.frozen_shapes
             if classify(n) in held]
    mine = _share(work, comm.rank, comm.size)
    parts = comm.allgather(comm.step(_compare_params, ma, mb, mine, classify))
    layers: dict[str, dict[str, Diff]] = {}
    for part in parts:
        for (key, kind), d in part.items():
            layers.setdefault(key, {})[kind] = layers.get(key, {}).get(kind, Diff()) + d
    extra = comm.root_step(_compare_rest, ma, mb, classify, held)
    for key, kinds in extra.pop("layers").items():
        layers.setdefault(key, {}).update(kinds)
    report = {
        "a": str(ma.path), "b": str(mb.path),
        "layers": {k: {kind: d.as_dict() for kind, d in sorted(layers[k].items())}
                   for k in sort_keys(layers)},
        **extra,
    }
    report["identical"] = all(d["identical"] for kinds in report["layers"].values()
                              for d in kinds.values()) and \
        all(c["identical"] for c in report["counters"].values())
    return report


def _check_same_model(ma: CheckpointMeta, mb: CheckpointMeta) -> None:
    shapes_a = {s.name: s.shape for s in ma.layout.slots} | dict(ma.frozen_shapes)
    shapes_b = {s.name: s.shape for s in mb.layout.slots} | dict(mb.frozen_shapes)
    if shapes_a != shapes_b:
        only = sorted(shapes_a.keys() ^ shapes_b.keys())
        what = f"parameters only in one: {', '.join(only[:3])}" if only else "shapes differ"
        raise UserError(f"{ma.path} and {mb.path} are checkpoints of different models "
                        f"({what}); diff compares saves of one model")


def _held_by_both(ma: CheckpointMeta, mb: CheckpointMeta, classify) -> set[str]:
    keys = {classify(s.name) for s in ma.layout.slots} | {classify(n) for n, _ in
                                                          ma.frozen_shapes}
    for m in (ma, mb):
        if m.held_layers is not None:
            keys &= set(m.held_layers)
    return keys


def _share(work: list[tuple[str, str, int]], rank: int, size: int) -> list[tuple[str, str]]:
    """This rank's contiguous share of the work, balanced by elements."""
    total = sum(n for *_, n in work) or 1
    out, done = [], 0
    for name, kind, n in work:
        if min(size - 1, done * size // total) == rank:
            out.append((name, kind))
        done += n
    return out


def _compare_params(ma: CheckpointMeta, mb: CheckpointMeta, mine: list[tuple[str, str]],
                    classify) -> dict[tuple[str, str], Diff]:
    out: dict[tuple[str, str], Diff] = {}
    if not mine:
        return out
    slots_a, slots_b = ma.layout.by_name(), mb.layout.by_name()
    frozen = dict(ma.frozen_shapes)
    with open_all_shards(ma) as sa, open_all_shards(mb) as sb:
        for name, kind in mine:
            key = (classify(name), kind)
            if kind == "frozen":
                dtype, bits_a = frozen_tensor(sa, name, frozen[name])
                _, bits_b = frozen_tensor(sb, name, frozen[name])
                d = compare(bits_a, bits_b, dtype)
            else:
                d = _compare_slices(sa, slots_a[name], sb, slots_b[name], kind)
            out[key] = out.get(key, Diff()) + d
    return out


def _compare_slices(sa, slot_a, sb, slot_b, kind: str) -> Diff:
    d = Diff()
    a = np.empty(min(DIFF_ELEMENTS, slot_a.numel), dtype=np.float32)
    b = np.empty_like(a)
    for lo in range(0, slot_a.numel, DIFF_ELEMENTS):
        n = min(DIFF_ELEMENTS, slot_a.numel - lo)
        read_range(sa, slot_a, kind, lo, a[:n])
        read_range(sb, slot_b, kind, lo, b[:n])
        d = d + compare(a[:n], b[:n])
    return d


def _compare_rest(ma: CheckpointMeta, mb: CheckpointMeta, classify, held: set[str]) -> dict:
    """Rank 0: Adam steps and 16-bit weights per layer, counters, scheduler."""
    layers: dict[str, dict[str, Diff]] = {}
    steps_b = {s.name: mb.subgroup_steps[s.subgroup] for s in mb.layout.slots}
    for s in ma.layout.slots:
        key = classify(s.name)
        if key in held:
            d = compare(np.array([ma.subgroup_steps[s.subgroup]], dtype=np.float64),
                        np.array([steps_b[s.name]], dtype=np.float64))
            layers.setdefault(key, {})["adam_step"] = \
                layers.get(key, {}).get("adam_step", Diff()) + d
    for name, dtype, ta, tb in _weights16(ma, mb):
        key = classify(name)
        if key in held:
            layers.setdefault(key, {})["16bit"] = \
                layers.get(key, {}).get("16bit", Diff()) + compare(ta(), tb(), dtype)
    model_a = load(ma.files.model_path(0), opaque_ok=True)
    model_b = load(mb.files.model_path(0), opaque_ok=True)
    counters = {c: {"a": model_a.get(c), "b": model_b.get(c),
                    "identical": model_a.get(c) == model_b.get(c)}
                for c in COUNTERS if c in model_a or c in model_b}
    sched_a, sched_b = model_a.get("lr_scheduler"), model_b.get("lr_scheduler")
    counters["lr_scheduler"] = {"identical": same_values(sched_a, sched_b),
                                "a": _lr(sched_a), "b": _lr(sched_b)}
    not_compared = sorted(({classify(s.name) for s in ma.layout.slots} |
                           {classify(n) for n, _ in ma.frozen_shapes}) - held)
    return {"layers": layers, "counters": counters, "not_compared": not_compared}


def _weights16(ma: CheckpointMeta, mb: CheckpointMeta):
    """(name, dtype, A's, B's) of the 16-bit weights both checkpoints carry, one tensor at a
    time, A's and B's as functions that read the values (numpy; bf16 as its bits): the whole
    model of a stage 1/2 model-states file, else HF's safetensors weights."""
    if ma.layout.flat and mb.layout.flat:
        mod_a = load(ma.files.model_path(0), opaque_ok=True)["module"]
        mod_b = load(mb.files.model_path(0), opaque_ok=True)["module"]
        for s in ma.layout.slots:
            ta, tb = mod_a.get(s.name), mod_b.get(s.name)
            if ta is not None and tb is not None and ta.shape == tb.shape \
                    and ta.dtype == tb.dtype:
                yield s.name, ta.dtype, ta.values, tb.values
        return
    files_a = [p for p in weight_files(ma) if p.suffix == ".safetensors"]
    files_b = [p for p in weight_files(mb) if p.suffix == ".safetensors"]
    if not files_a or not files_b:
        return
    # every header read (a crafted one refused, naming the file) before any tensor is
    tensors = {p: _safetensors_tensors(p) for p in (*files_a, *files_b)}
    where_b = {}
    for p in files_b:
        where_b.update({k: p for k in tensors[p]})
    for p in files_a:
        for name, (dtype, shape, at_a) in tensors[p].items():
            if name not in where_b:
                continue
            dtype_b, shape_b, at_b = tensors[where_b[name]][name]
            if shape == shape_b and dtype == dtype_b:
                yield name, dtype, functools.partial(_read_at, p, dtype, at_a), \
                    functools.partial(_read_at, where_b[name], dtype, at_b)


def _safetensors_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]:
    """{name: (dtype, shape, (byte offset in the file, byte count))} of a safetensors file's
    tensors, in name order (safetensors' own), those of a dtype outside dtypes.py left out;
    CheckpointError naming the file where its header is not one."""
    out = {}
    for name, (st_dtype, shape, at, n) in read_tensor_records(path, "a 16-bit weights file"
                                                               ).items():
        dtype = from_safetensors(st_dtype)
        if dtype is None:
            continue
        if n != math.prod(shape) * DTYPES[dtype].itemsize:
            raise CheckpointError(f"{shown(path)}: not a readable safetensors file (tensor "
                                  f"{name!r}: {n} bytes for {dtype} x {list(shape)}); a 16-bit "
                                  f"weights file is damaged")
        out[name] = (dtype, shape, (at, n))
    return out


def _read_at(path: Path, dtype: str, at: tuple[int, int]) -> np.ndarray:
    """The elements at (byte offset, byte count) of file path, flat (bf16: its bits)."""
    out = np.empty(at[1] // DTYPES[dtype].itemsize, dtype=numpy_dtype(dtype))
    fd = open_regular(path, "a 16-bit weights file")
    try:
        rawio.read_into(fd, at[0], out)
    except (OSError, EOFError) as e:
        raise CheckpointError(f"{shown(path)}: cannot read a tensor ({e}); a 16-bit weights "
                              f"file is damaged or truncated") from None
    finally:
        os.close(fd)
    return out


def _lr(sched) -> object:
    """What says where a scheduler is: its last learning rates, else its step counter."""
    if isinstance(sched, dict):
        for key in ("_last_lr", "last_lr", "last_batch_iteration", "last_epoch"):
            if key in sched:
                return {key: sched[key]}
    return None
