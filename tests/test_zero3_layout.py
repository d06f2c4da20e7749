"""mpitailor's slot table rebuilds exactly what DeepSpeed itself consolidates."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from ckpt_fixtures import STAGE12_VARIANTS, ZERO3_VARIANTS
from deepspeed.utils import zero_to_fp32 as z2f

from mpitailor.formats.zero.consolidate import consolidate
from mpitailor.formats.zero.layout import compute_layout
from mpitailor.formats.zero.read import read_meta
from mpitailor.formats.zero.shard import open_shard


def same(ours: np.ndarray, theirs: torch.Tensor) -> bool:
    """Our consolidated float32 array equals DeepSpeed's tensor (values and shape; a frozen
    parameter DeepSpeed keeps in its own dtype, as torch.equal compared it)."""
    return ours.dtype == np.float32 and np.array_equal(ours, theirs.detach().float().numpy())


def deepspeed_moments(tag_dir, meta, kind: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's own ZeRO-3 reconstruction, fed the Adam moment buffers instead of fp32."""
    model_files = z2f.get_model_state_files(str(tag_dir))
    states = z2f.parse_model_states(model_files)
    shards = [open_shard(meta, r) for r in range(meta.world_size)]
    groups = [[torch.from_numpy(s.read(kind, g)) for g in range(len(meta.layout.subgroup_sizes))]
              for s in shards]
    out: dict = {}
    if meta.layout.flat:  # stage 1/2: DeepSpeed's reader takes the partitions unpadded
        groups = [[t[:meta.layout.lean_size(g, r)] for g, t in enumerate(ts)]
                  for r, ts in enumerate(groups)]
        z2f._zero2_merge_trainable_params(out, meta.world_size, groups, states)
    else:
        z2f._zero3_merge_trainable_params(out, meta.world_size, groups, states)
    return {k: v.contiguous() for k, v in out.items()}


@pytest.mark.parametrize("name", ZERO3_VARIANTS + STAGE12_VARIANTS)
@pytest.mark.parametrize("step", [5, 10])
def test_weights_match_deepspeed_consolidation(ckpt, name, step):
    path = ckpt(name, step)
    meta = read_meta(path)
    ours = consolidate(meta, kinds=("fp32",))["fp32"]
    theirs = z2f.get_fp32_state_dict_from_zero_checkpoint(str(meta.files.tag_dir.parent),
                                                          tag=meta.files.tag)
    aliases = dict(meta.shared_params)
    assert set(theirs) == set(ours) | set(aliases)
    for name_, t in theirs.items():
        assert same(ours[aliases.get(name_, name_)], t), name_


@pytest.mark.parametrize("name", ZERO3_VARIANTS + STAGE12_VARIANTS)
def test_moments_match_deepspeed_reconstruction(ckpt, name):
    meta = read_meta(ckpt(name, 10))
    ours = consolidate(meta, kinds=("exp_avg", "exp_avg_sq"))
    for kind in ("exp_avg", "exp_avg_sq"):
        theirs = deepspeed_moments(meta.files.tag_dir, meta, kind)
        assert set(theirs) == set(ours[kind])
        for n, t in theirs.items():
            assert same(ours[kind][n], t), (kind, n)
        assert any(t.abs().sum() > 0 for t in theirs.values())  # trained, not zeros


@pytest.mark.parametrize("name", ZERO3_VARIANTS)
def test_slot_table_accounts_for_every_element(ckpt, name):
    meta = read_meta(ckpt(name, 5))
    layout = meta.layout
    for g, size in enumerate(layout.subgroup_sizes):
        slots = layout.subgroup_slots(g)
        assert sum(s.length for s in slots) == size
        assert [s.offset for s in slots] == [sum(x.length for x in slots[:i])
                                             for i in range(len(slots))]
    for s in layout.slots:
        assert sum(s.valid(r) for r in range(layout.world_size)) == s.numel


@pytest.mark.parametrize("name", STAGE12_VARIANTS)
def test_flat_layout_tiles_each_group(ckpt, name):
    """Stage 1/2: the ranks' partitions tile each group's parameters, in order, once."""
    layout = read_meta(ckpt(name, 5)).layout
    assert layout.flat
    for g, size in enumerate(layout.subgroup_sizes):
        slots = layout.subgroup_slots(g)
        used = sum(s.numel for s in slots)
        assert size * layout.world_size >= used and size % 2 == 0
        for s in slots:
            held = [layout.held(s, r) for r in range(layout.world_size)]
            starts = [first for _, first, n in held if n]
            assert sum(n for *_, n in held) == s.numel and starts == sorted(starts)
            for r, (at, first, n) in enumerate(held):
                if n:  # the element at `at` of rank r is element `first` of the parameter
                    assert layout.locate(s, first)[:2] == (r, at)
                    assert at + n <= layout.lean_size(g, r)


def test_flat_layout_arithmetic():
    """Groups are padded to a multiple of 2W, cut into W partitions; a parameter can
    straddle ranks, and the fp32 partitions are stored without their padding."""
    layout = compute_layout([{"a": (5,), "b": (2, 3)}, {"c": (1,)}], world_size=4, flat=True)
    a, b, c = layout.slots
    assert layout.subgroup_sizes == (4, 2)     # 11 -> 16 elements; 1 -> 8
    assert [layout.held(a, r) for r in range(4)] == [(0, 0, 4), (0, 4, 1), (0, 0, 0),
                                                    (0, 0, 0)]
    assert [layout.held(b, r) for r in range(4)] == [(0, 0, 0), (1, 0, 3), (0, 3, 3),
                                                    (0, 0, 0)]
    assert [layout.lean_size(0, r) for r in range(4)] == [4, 4, 3, 0]
    assert [layout.held(c, r)[2] for r in range(4)] == [1, 0, 0, 0]
    assert layout.buffer_size("exp_avg", 0, 3) == 4 and layout.buffer_size("fp32", 0, 3) == 0


def test_layout_padding_arithmetic():
    layout = compute_layout([{"a": (5,), "b": (2, 3)}, {"c": (1,)}], world_size=4)
    a, b, c = layout.slots
    assert (a.length, a.offset, [a.valid(r) for r in range(4)]) == (2, 0, [2, 2, 1, 0])
    assert (b.length, b.offset, [b.valid(r) for r in range(4)]) == (2, 2, [2, 2, 2, 0])
    assert (c.length, c.subgroup, [c.valid(r) for r in range(4)]) == (1, 1, [1, 0, 0, 0])
    assert layout.subgroup_sizes == (4, 1)


def test_meta_reports_counters_and_groups(ckpt):
    meta = read_meta(ckpt("w3_bf16_decay_tied_frozen", 5))
    assert (meta.world_size, meta.dtype, meta.global_steps) == (3, "bf16", 5)
    assert meta.param_groups == ((0,), (1,))
    assert meta.subgroup_steps == (5.0, 5.0)
    assert dict(meta.shared_params) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert dict(meta.frozen_shapes) == {"model.layers.1.mlp.up_proj.weight": (128, 64)}
