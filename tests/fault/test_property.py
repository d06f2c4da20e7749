"""Property: for random ZeRO-3 layouts written in DeepSpeed's exact file format, a merge
takes every parameter (fp32, exp_avg, exp_avg_sq) from the source the recipe names.

World sizes 1-8, parameters smaller than the world size, random param groups and
sub-group sizes (sub-groups close as DeepSpeed closes them), random layer -> source maps.
The oracle is the generator's own whole tensors, rebuilt from the output files with this
file's own partition arithmetic.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import torch
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch_files import torch_load

from mpitailor.cluster.comm import Comm
from mpitailor.jobs.merge import MergeOptions, plan_recipe, run_merge
from mpitailor.planning.recipe import parse_recipe

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


@st.composite
def layouts(draw):
    world = draw(st.integers(1, 8))
    n_layers = draw(st.integers(1, 4))
    names = ["model.embed_tokens.weight"]
    for i in range(n_layers):
        names += [f"model.layers.{i}.p{j}" for j in range(draw(st.integers(1, 3)))]
    names.append("model.norm.weight")
    shapes = {n: tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=2)))
              for n in names}
    n_groups = draw(st.integers(1, 3))
    group_of = {n: draw(st.integers(0, n_groups - 1)) for n in names}
    sub_group_size = draw(st.integers(1, 40))
    n_sources = draw(st.integers(2, 3))
    keys = ["embed", "norm"] + [f"layers.{i}" for i in range(n_layers)]
    choice = {k: draw(st.integers(0, n_sources - 1)) for k in keys}
    return world, shapes, group_of, sub_group_size, n_sources, choice


def subgroups(shapes, group_of, world, sub_group_size):
    """DeepSpeed's rule: per param group, in order, close a sub-group once the per-rank
    partition sizes add up to sub_group_size."""
    out, groups = [], []
    for g in sorted(set(group_of.values())):
        ids, cur, size = [], [], 0
        for n, shape in shapes.items():
            if group_of[n] != g:
                continue
            cur.append(n)
            size += math.ceil(math.prod(shape) / world)
            if size >= sub_group_size:
                ids.append(len(out))
                out.append(cur)
                cur, size = [], 0
        if cur:
            ids.append(len(out))
            out.append(cur)
        groups.append(ids)
    return out, groups


def write_source(root: Path, shapes, subs, groups, world, step, gen) -> dict:
    """One checkpoint in DeepSpeed's ZeRO-3 format; returns its whole tensors."""
    whole = {k: {n: torch.randn(math.prod(s), generator=gen) for n, s in shapes.items()}
             for k in KINDS}
    root.mkdir(parents=True)
    for r in range(world):
        flats = {k: [] for k in KINDS}
        for names in subs:
            for k in KINDS:
                parts = []
                for n in names:
                    pn = math.ceil(math.prod(shapes[n]) / world)
                    padded = torch.cat([whole[k][n], torch.randn(pn * world, generator=gen)])
                    parts.append(padded[r * pn:(r + 1) * pn])  # the padding tail is garbage
                flats[k].append(torch.cat(parts))
        state = {g: {"step": torch.tensor(float(step + g)), "exp_avg": flats["exp_avg"][g],
                     "exp_avg_sq": flats["exp_avg_sq"][g]} for g in range(len(subs))}
        optim = {"optimizer_state_dict": {
            "zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0),
            "dynamic_loss_scale": False, "overflow": False, "partition_count": world,
            "optimizer_state_dict": {"state": state, "param_groups": [
                {"lr": 0.1, "params": ids} for ids in groups]},
            "fp32_flat_groups": flats["fp32"]}, "ds_config": {}, "ds_version": "0.19.8"}
        model = {"module": OrderedDict((n, torch.empty(0)) for n in shapes),
                 "buffer_names": [], "optimizer": None,
                 "param_shapes": [OrderedDict((n, torch.Size(shapes[n])) for n in names)
                                  for names in subs],
                 "frozen_param_shapes": OrderedDict(), "shared_params": {},
                 "frozen_param_fragments": OrderedDict(), "lr_scheduler": {"step": step},
                 "global_steps": step, "global_samples": step * 8, "skipped_steps": 0,
                 "dp_world_size": world, "mp_world_size": 1, "ds_config": {},
                 "ds_version": "0.19.8"}
        torch.save(optim, root / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        torch.save(model, root / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    return {k: {n: t.view(shapes[n]) for n, t in whole[k].items()} for k in KINDS}


def rebuild(tag_dir: Path, shapes, subs, world) -> dict:
    flats = [torch_load(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
             ["optimizer_state_dict"] for r in range(world)]
    out = {k: {} for k in KINDS}
    for g, names in enumerate(subs):
        off = 0
        for n in names:
            numel = math.prod(shapes[n])
            pn = math.ceil(numel / world)
            for k in KINDS:
                parts = [(f["fp32_flat_groups"][g] if k == "fp32" else
                          f["optimizer_state_dict"]["state"][g][k])[off: off + pn]
                         for f in flats]
                out[k][n] = torch.cat(parts)[:numel].view(shapes[n])
            off += pn
    steps = [float(flats[0]["optimizer_state_dict"]["state"][g]["step"])
             for g in range(len(subs))]
    return out, steps


def key_of(name: str) -> str:
    if "embed" in name:
        return "embed"
    if "norm" in name:
        return "norm"
    return "layers." + name.split(".")[2]


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(layouts())
def test_merge_round_trips_random_layouts(tmp_path_factory, layout):
    world, shapes, group_of, sgs, n_sources, choice = layout
    tmp = tmp_path_factory.mktemp("prop")
    subs, groups = subgroups(shapes, group_of, world, sgs)
    gen = torch.Generator().manual_seed(len(subs) * 1009 + world)
    steps = [10 * (i + 1) for i in range(n_sources)]
    wholes = [write_source(tmp / f"s{i}" / f"global_step{steps[i]}", shapes, subs, groups,
                           world, steps[i], gen) for i in range(n_sources)]
    n_layers = len([k for k in choice if k.startswith("layers.")])
    text = "sources:\n" + "".join(f"  s{i}: s{i}/global_step{steps[i]}\n"
                                  for i in range(n_sources))
    text += "layers:\n" + "".join(f"  '{i}': s{choice[f'layers.{i}']}\n"
                                  for i in range(n_layers))
    text += f"embed: s{choice['embed']}\nnorm: s{choice['norm']}\noutput: out\n"
    recipe = parse_recipe(text, origin="property", base_dir=tmp)
    comm = Comm(None)
    run_merge(comm, plan_recipe(comm, recipe), MergeOptions())

    base = n_sources - 1  # newest
    got, got_steps = rebuild(tmp / "out" / f"global_step{steps[base]}", shapes, subs, world)
    for k in KINDS:
        for n in shapes:
            assert torch.equal(got[k][n], wholes[choice[key_of(n)]][k][n]), (k, n)
    for g, names in enumerate(subs):
        owners = {choice[key_of(n)] for n in names}
        assert got_steps[g] == float(steps[max(owners)] + g)   # exact or the newest's
