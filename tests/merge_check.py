"""What a correct merge is, stated independently of mpitailor's plan.

`check_merge` compares every parameter slice of every output rank (fp32 master, exp_avg,
exp_avg_sq; padding excluded) with the same slice of the source the test says that layer
must come from, plus frozen fragments, counters and per-sub-group Adam steps; for ZeRO
stages 1/2 also every 16-bit weight and buffer of the one model-states file.
"""
from __future__ import annotations

from pathlib import Path

import torch

from mpitailor.formats import KINDS
from mpitailor.formats.consolidate import consolidate
from mpitailor.formats.read import read_meta
from mpitailor.formats.safeload import load
from mpitailor.formats.shard import open_shard
from mpitailor.planning.layers import classify


def check_merge(out: Path, expected: dict[str, Path], base: Path) -> None:
    """expected: layer key -> source checkpoint; base: source of counters and config."""
    merged = read_meta(out)
    metas = {p: read_meta(p) for p in set(expected.values()) | {base}}
    base_meta = metas[base]
    assert merged.world_size == base_meta.world_size
    assert merged.global_steps == base_meta.global_steps
    assert merged.layout == base_meta.layout
    assert merged.files.tag == base_meta.files.tag
    if merged.layout.flat:
        _check_weights16(merged, expected, metas)
    for r in range(merged.world_size):
        with open_shard(merged, r) as m:
            shards = {p: open_shard(meta, r) for p, meta in metas.items()}
            try:
                _check_rank(m, shards, expected, base)
            finally:
                for s in shards.values():
                    s.close()


def _check_weights16(merged, expected, metas) -> None:
    """Stage 1/2: the one model-states file holds the whole model. Its 16-bit weights must be
    the merged fp32 master weights cast down (checked against the sources above), frozen
    parameters and buffers those of their layer's source."""
    module = load(merged.files.model_path(0), opaque_ok=True)["module"]
    fp32 = consolidate(merged, kinds=("fp32",))["fp32"]
    aliases = dict(merged.shared_params)
    trainable = {s.name for s in merged.layout.slots}
    for name, t in module.items():
        target = aliases.get(name, name)
        if target in trainable:
            assert torch.equal(t, fp32[target].to(t.dtype)), name
            continue
        src = load(metas[expected[classify(target)]].files.model_path(0), opaque_ok=True)
        want = src["module"][name]
        if want.numel() != t.numel():  # a partial save's placeholder: frozen, kept whole
            want = src["frozen_param_fragments"][target].to(t.dtype).view(t.shape)
        assert torch.equal(t, want), name


def _check_rank(m, shards, expected, base) -> None:
    layout = m.meta.layout
    for slot in layout.slots:
        src = shards[expected[classify(slot.name)]]
        at, _, n = layout.held(slot, m.rank)
        for kind in KINDS:
            got = m.read(kind, slot.subgroup, at, n)
            want = src.read(kind, slot.subgroup, at, n)
            assert torch.equal(got, want), (slot.name, kind, m.rank)

    for name, frag in (m.model.get("frozen_param_fragments") or {}).items():
        want = shards[expected[classify(name)]].model["frozen_param_fragments"][name]
        assert torch.equal(frag, want), name
    b = shards[base].model
    for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler",
                "dp_world_size", "param_shapes", "shared_params", "ds_config"):
        assert m.model[key] == b[key], key
    # Each sub-group's Adam step: exact when one source owns it, else the newest's.
    for g in range(len(m.meta.layout.subgroup_sizes)):
        owners = {expected[classify(s.name)] for s in m.meta.layout.subgroup_slots(g)}
        steps = {shards[p].meta.subgroup_steps[g] for p in owners}
        assert float(m.inner["state"][g]["step"]) == max(steps)


def parity(new: Path, old: Path, n_layers: int = 4) -> dict[str, Path]:
    layers = {f"layers.{i}": new if i % 2 == 0 else old for i in range(n_layers)}
    return {**layers, "embed": new, "norm": new, "lm_head": new, "other": new}


def filter_first_last(new: Path, old: Path, n_layers: int = 4) -> dict[str, Path]:
    layers = {f"layers.{i}": new if i in (0, n_layers - 1) else old for i in range(n_layers)}
    return {**layers, "embed": new, "norm": old, "lm_head": new, "other": new}


def assert_same(a, b, where: str) -> None:
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        # Bitwise (padding is garbage and may be NaN): compare the raw bytes.
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b or repr(a) == repr(b), where
