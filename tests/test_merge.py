"""Layer-wise merges of real DeepSpeed checkpoints: every slice from the right source."""
from __future__ import annotations

import pytest
import torch
from ckpt_fixtures import STAGE12_VARIANTS, ZERO3_VARIANTS, build
from conftest import tree_digest
from merge_check import assert_same, check_merge, filter_first_last, parity
from merging import merge_in_process, recipe_env

from mpitailor.formats.torch.safeload import load

RECIPES = {"parity.yml": parity, "filter.yml": filter_first_last, "layer-patterns.yml": parity}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("name", ZERO3_VARIANTS + STAGE12_VARIANTS)
def test_merge_takes_every_slice_from_its_source(ckpt, tmp_path, monkeypatch, name, recipe):
    new, old = ckpt(name, 10), ckpt(name, 5)
    before = tree_digest(build(name))
    out = tmp_path / "merged"
    result = merge_in_process(recipe, recipe_env(new, old, out), monkeypatch)
    assert result.output == out and (out / "latest").read_text() == "global_step10"
    check_merge(out, RECIPES[recipe](new, old), base=new)
    assert tree_digest(build(name)) == before  # sources untouched
    assert not list(tmp_path.glob(".*"))       # no staging or lock left behind


def test_mergekit_slices_recipe(ckpt, tmp_path, monkeypatch):
    new, old = ckpt("w3_bf16_decay_tied_frozen", 10), ckpt("w3_bf16_decay_tied_frozen", 5)
    out = tmp_path / "merged"
    merge_in_process("mergekit-slices.yml", recipe_env(new, old, out), monkeypatch)
    expected = {"layers.0": old, "layers.1": old, "layers.2": new, "layers.3": new,
                "embed": old, "norm": new, "lm_head": new}
    check_merge(out, expected, base=new)


def test_identity_reproduces_the_checkpoint(ckpt, tmp_path, monkeypatch):
    new, old = ckpt("w2_bf16_small_subgroups_tied_frozen", 10), \
        ckpt("w2_bf16_small_subgroups_tied_frozen", 5)
    recipe = tmp_path / "identity.yml"
    recipe.write_text("sources: {new: '${NEW}', old: '${OLD}'}\nlayers: {rest: old}\n"
                      "embed: old\nnorm: old\nlm_head: old\nbase: old\noutput: ${OUT}\n")
    out = tmp_path / "merged"
    merge_in_process(recipe, recipe_env(new, old, out), monkeypatch)
    check_merge(out, {k: old for k in ("embed", "norm", "lm_head", "layers.0", "layers.1",
                                       "layers.2", "layers.3")}, base=old)
    # Every object of every file, not only the parameter slices, padding included.
    for f in old.iterdir():
        assert_same(load(f), load(out / "global_step5" / f.name), f.name)


def test_hf_checkpoint_extras_are_carried(ckpt, tmp_path, monkeypatch):
    new, old = ckpt("hf_w2_bf16", 10), ckpt("hf_w2_bf16", 5)
    out = tmp_path / "merged"
    merge_in_process("parity.yml", recipe_env(new, old, out), monkeypatch)
    names = {p.name for p in out.iterdir()}
    assert {"trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "config.json",
            "training_args.bin", "latest", "global_step10",
            "mpitailor_manifest.json"} <= names
    assert (out / "trainer_state.json").read_bytes() == (new / "trainer_state.json").read_bytes()



def test_16bit_hf_weights_are_rebuilt_from_the_merged_master(ckpt, tmp_path, monkeypatch):
    """DeepSpeed's own gathered 16-bit weights of each source are the oracle: every tensor of
    the merged model.safetensors equals the one saved by the source its layer came from."""
    from safetensors.torch import load_file

    from mpitailor.planning.layers import classify
    name = "hf_w3_bf16_weights_tied"
    new, old = ckpt(name, 10), ckpt(name, 5)
    out = tmp_path / "merged"
    merge_in_process("parity.yml", recipe_env(new, old, out), monkeypatch)
    got = load_file(out / "model.safetensors")
    want = {p: load_file(p / "model.safetensors") for p in (new, old)}
    assert set(got) == set(want[new])
    expected = parity(new, old)
    for key, t in got.items():
        ref = want[expected[classify(key)]][key]
        assert t.dtype == ref.dtype == torch.bfloat16 and torch.equal(t, ref), key
    assert not torch.equal(got["model.layers.1.mlp.up_proj.weight"],
                           want[new]["model.layers.1.mlp.up_proj.weight"])
