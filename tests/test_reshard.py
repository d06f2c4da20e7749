"""Resharding while merging: real DeepSpeed resumes at the new world size, and the
consolidated weights and moments equal those of the same merge without resharding."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from ckpt_fixtures import spec_for
from merging import RECIPES, merge_in_process, recipe_env, run_cli

from dev.tinytrain import launch
from mpitailor.formats.zero.consolidate import consolidate
from mpitailor.formats.zero.read import read_meta


@pytest.mark.parametrize("name,world", [("w2_bf16_small_subgroups_tied_frozen", 3),
                                        ("w4_fp32_per_layer", 2),
                                        ("s2_w3_fp32_decay_tied_frozen", 2),
                                        ("s2_w2_bf16_per_layer", 3)])
def test_resharded_merge_resumes_and_matches(ckpt, tmp_path, monkeypatch, name, world):
    new, old = ckpt(name, 10), ckpt(name, 5)
    plain = tmp_path / "plain"
    merge_in_process("parity.yml", recipe_env(new, old, plain), monkeypatch)
    resharded = tmp_path / "resharded"
    r = run_cli([str(RECIPES / "parity.yml"), "--world-size", str(world)],
                recipe_env(new, old, resharded), ranks=2)
    assert r.returncode == 0, r.stderr
    meta = read_meta(resharded)
    assert meta.world_size == world and meta.global_steps == 10
    a, b = consolidate(read_meta(plain)), consolidate(meta)
    for kind in a:
        assert set(a[kind]) == set(b[kind])
        for n in a[kind]:
            assert np.array_equal(a[kind][n], b[kind][n]), (kind, n)
    spec = replace(spec_for(name, tmp_path / "resumed"), world_size=world, steps=13,
                   save_at=(), load_dir=str(resharded), load_tag="global_step10")
    result = launch(spec)
    assert result["world_size"] == world and result["global_steps"] == 13
    assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])


def test_stage1_reshard_there_and_back_is_the_identity(ckpt, tmp_path, monkeypatch):
    """ZeRO stage 1, 2 -> 3 -> 2 ranks: the same bytes as the checkpoint merged with itself,
    and DeepSpeed resumes it loss for loss like the original."""
    name = "s1_w2_fp32_one"
    src = ckpt(name, 10)
    identity = tmp_path / "identity"
    merge_in_process("parity.yml", recipe_env(src, src, identity), monkeypatch)
    there, back = tmp_path / "w3", tmp_path / "w2"
    merge_in_process("parity.yml", recipe_env(src, src, there), monkeypatch,
                     world_size=3)
    assert read_meta(there).world_size == 3
    merge_in_process("parity.yml", recipe_env(there / "global_step10", there / "global_step10",
                                              back), monkeypatch, world_size=2)
    for f in sorted((identity / "global_step10").iterdir()):
        assert f.read_bytes() == (back / "global_step10" / f.name).read_bytes(), f.name
    spec = replace(spec_for(name, tmp_path / "r"), steps=13, save_at=())
    a = launch(replace(spec, load_dir=str(back), load_tag="global_step10"))
    b = launch(replace(spec, load_dir=str(src.parent), load_tag="global_step10",
                       save_dir=str(tmp_path / "r2")))
    assert a["losses"] == b["losses"] and len(a["losses"]) == 3


def test_reshard_to_the_same_world_size_is_a_plain_merge(ckpt, tmp_path):
    r = run_cli([str(RECIPES / "parity.yml"), "--world-size", "2", "--dry-run"],
                recipe_env(ckpt("w2_fp32_one", 10), ckpt("w2_fp32_one", 5), tmp_path / "o"))
    assert r.returncode == 0 and "resharding" not in r.stdout
    r = run_cli([str(RECIPES / "parity.yml"), "--world-size", "3", "--dry-run"],
                recipe_env(ckpt("w2_fp32_one", 10), ckpt("w2_fp32_one", 5), tmp_path / "o"))
    assert r.returncode == 0 and "resharding   2 -> 3 ranks" in r.stdout, r.stdout


def test_recover_from_partial_saves_onto_another_world_size(tmp_path):
    """The job came back with 3 ranks instead of 2: recover reshards while it merges."""
    from ckpt_fixtures import build
    out = tmp_path / "recovered"
    r = run_cli(["recover", str(build("w2_parity")), "-o", str(out), "--world-size", "3",
                 "--export", "universal"], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    assert (out / "latest_universal").read_text() == "global_step8"
    assert (out / "global_step8" / "zero" / "model.norm.weight" / "fp32.pt").is_file()
    spec = replace(spec_for("w2_parity", tmp_path / "resumed"), world_size=3, steps=11,
                   save_at=(), policy=None, stats=None, load_dir=str(out),
                   load_tag="global_step8")
    result = launch(spec)
    assert result["global_steps"] == 11 and all(math.isfinite(x) for x in result["losses"])
