"""`--export universal`: DeepSpeed's Universal Checkpoint layout, written by the MPI ranks.

Oracles: DeepSpeed's own offline converter (`ds_to_universal`) run on the same merged
checkpoint, and DeepSpeed's `load_universal` at another world size training on exactly as
a native resume of the same merge resharded by mpitailor does.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ckpt_fixtures import spec_for
from merging import RECIPES, recipe_env, run_cli

from dev.tinytrain import launch
from mpitailor.engine.universal import min_single_subgroup_world
from mpitailor.formats.zero.read import read_meta
from mpitailor.planning.reshard import target_layout

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def ds_to_universal(tag_dir: Path, out_tag_dir: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                        "--input_folder", str(tag_dir), "--output_folder", str(out_tag_dir),
                        "--num_extract_workers", "1", "--num_merge_workers", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def assert_same_universal(ours: Path, theirs: Path) -> None:
    """Every parameter's fp32 / exp_avg / exp_avg_sq file equal, bitwise; the counters and
    hyper-parameters `load_universal` reads from optimizer_state.pt equal."""
    params = sorted(p.name for p in theirs.iterdir() if p.is_dir())
    assert params and sorted(p.name for p in ours.iterdir() if p.is_dir()) == params
    for name in params:
        for kind in KINDS:
            a = torch.load(ours / name / f"{kind}.pt", weights_only=True)
            b = torch.load(theirs / name / f"{kind}.pt", weights_only=True)
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, (name, kind)
            assert torch.equal(a, b), (name, kind)
    a = torch.load(ours / "optimizer_state.pt", weights_only=False)
    b = torch.load(theirs / "optimizer_state.pt", weights_only=False)
    for key in ("zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "param_groups"):
        assert a[key] == b[key] if key != "loss_scaler" else vars(a[key]) == vars(b[key]), key
    steps_a = {g: s["step"] for g, s in a["optimizer_state_dict"]["state"].items()}
    steps_b = {g: s["step"] for g, s in b["optimizer_state_dict"]["state"].items()}
    assert steps_a == steps_b


@pytest.mark.parametrize("name,ranks,extra", [
    ("w2_fp32_one", 2, []),
    # many sub-groups, tied and frozen weights; exported from a merge resharded to W=3
    ("w2_bf16_small_subgroups_tied_frozen", 3, ["--world-size", "3"])])
def test_universal_export_equals_ds_to_universal(ckpt, tmp_path, name, ranks, extra):
    new, old = ckpt(name, 10), ckpt(name, 5)
    out = tmp_path / "merged"
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "universal", *extra],
                recipe_env(new, old, out), ranks=ranks)
    assert r.returncode == 0, r.stderr
    assert (out / "latest_universal").read_text() == "global_step10"
    theirs = tmp_path / "ds" / "global_step10"
    ds_to_universal(out / "global_step10", theirs)
    assert_same_universal(out / "global_step10" / "zero", theirs / "zero")
    manifest = json.loads((out / "mpitailor_manifest.json").read_text())["files"]
    assert "latest_universal" in manifest and \
        "global_step10/zero/model.norm.weight/exp_avg_sq.pt" in manifest
    limited = "load_universal restores this checkpoint inexactly" in r.stderr
    assert limited == (name != "w2_fp32_one"), r.stderr  # many sub-groups, frozen params


def test_load_universal_at_another_world_size_trains_as_a_native_reshard(ckpt, tmp_path):
    """Merge at W=2 with the Universal export; DeepSpeed loads it at W=3 with
    load_universal. The same merge resharded natively to W=3 gives the same losses, bitwise:
    two independent paths (our resharder; our export + DeepSpeed's loader) agree."""
    name = "w2_fp32_one"  # one param group, one sub-group: where load_universal is exact
    new, old = ckpt(name, 10), ckpt(name, 5)
    universal, native = tmp_path / "universal", tmp_path / "native3"
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "universal"],
                recipe_env(new, old, universal), ranks=2)
    assert r.returncode == 0, r.stderr
    r = run_cli([str(RECIPES / "parity.yml"), "--world-size", "3"],
                recipe_env(new, old, native), ranks=2)
    assert r.returncode == 0, r.stderr
    spec = replace(spec_for(name, tmp_path / "resumed"), world_size=3, steps=13, save_at=())
    via_universal = launch(replace(spec, load_dir=str(universal), load_universal=True))
    via_native = launch(replace(spec, load_dir=str(native), load_tag="global_step10"))
    assert via_universal["world_size"] == 3 and via_universal["global_steps"] == 13
    assert len(via_universal["losses"]) == 3
    assert all(math.isfinite(x) for x in via_universal["losses"])
    assert via_universal["losses"] == via_native["losses"]


def test_world_size_where_the_model_is_one_subgroup(ckpt):
    """Where load_universal's shared step tensor is harmless: checked against the layout the
    resharder computes (itself checked against DeepSpeed's own at W=2, 3)."""
    meta = read_meta(ckpt("w2_bf16_small_subgroups_tied_frozen", 10))  # sub_group_size 6000
    w = min_single_subgroup_world(meta)
    assert w is not None and w > meta.world_size

    def subgroups(world: int) -> int:
        return len(target_layout(meta, world, lambda g, names: 0.0).layout.subgroup_sizes)
    assert subgroups(w) == 1 and subgroups(w - 1) > 1
    assert min_single_subgroup_world(read_meta(ckpt("w2_fp32_one", 10))) == 1


def test_dry_run_says_whether_load_universal_is_exact(ckpt, tmp_path):
    for name, expect in (("w2_fp32_one", "load_universal restores it exactly"),
                         ("w2_bf16_small_subgroups_tied_frozen",
                          "exact only at world sizes >= ")):
        r = run_cli([str(RECIPES / "parity.yml"), "--export", "universal", "--dry-run"],
                    recipe_env(ckpt(name, 10), ckpt(name, 5), tmp_path / name))
        assert r.returncode == 0 and expect in r.stdout, r.stdout + r.stderr
        assert not (tmp_path / name).exists()


def test_base_latest_universal_is_not_carried_over(ckpt, ckpt_copy, tmp_path):
    """A save dir that ds_to_universal (or an earlier export) left a `latest_universal` in:
    the output's names its own tag, or is absent without the export."""
    save = ckpt_copy("w2_fp32_one")  # its `latest` names global_step10
    (save / "latest_universal").write_text("global_step10_universal")
    old = ckpt("w2_fp32_one", 5)
    for args, expect in (([], None), (["--export", "universal"], "global_step10")):
        out = tmp_path / f"out{len(args)}"
        r = run_cli([str(RECIPES / "parity.yml"), *args], recipe_env(save, old, out))
        assert r.returncode == 0, r.stderr
        latest = out / "latest_universal"
        assert (latest.read_text() if latest.exists() else None) == expect


@pytest.mark.parametrize("dtype_flag", ["--dtype", "--export-dtype"])  # the name, the old one
def test_dtype_needs_the_hf_export(ckpt, tmp_path, dtype_flag):
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "universal", dtype_flag, "bf16"],
                recipe_env(ckpt("w2_fp32_one", 10), ckpt("w2_fp32_one", 5), tmp_path / "o"))
    assert r.returncode == 2 and "--dtype applies to --export hf" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()
