"""The proof of a merge: real DeepSpeed (and HF Trainer) load it and train on."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from ckpt_fixtures import HF_MODULE, VARIANTS, spec_for
from merging import merge_in_process, recipe_env

from dev.tinytrain import launch


def resume(name: str, load_dir, tmp_path, steps: int = 13) -> dict:
    """Train fixture variant `name` on from load_dir until `steps`, saving nothing."""
    hf = VARIANTS[name][1] == HF_MODULE
    spec = replace(spec_for(name, tmp_path / "resumed"), steps=steps, save_at=(),
                   load_dir=str(load_dir), load_tag=None if hf else "global_step10")
    if hf:  # HF Trainer saves on its own schedule: give it one past the end
        spec = replace(spec, save_at=(1000,))
    return launch(spec, module=VARIANTS[name][1] or "dev.tinytrain.worker")


# One fixture per layout family a resume can trip on: one group (parity mixes sources inside
# it), bf16 + decay groups + tied + frozen, fp32 per-layer groups at W=4, small sub-groups,
# Qwen2's names, HF Trainer with 16-bit weights, ZeRO-2 with decay groups, tied and frozen,
# ZeRO-2 under HF Trainer. Left out, as they add no layout: bf16 per-layer groups (ZeRO-2's
# resumes in test_reshard), HF Trainer fp32 and bf16 at W=2 (resumed after a recover in
# test_training). Every merge is checked slice by slice in test_merge.
RESUMED = ["w2_fp32_one", "w3_bf16_decay_tied_frozen", "w4_fp32_per_layer",
           "w2_bf16_small_subgroups_tied_frozen", "w3_qwen2_fp32_decay", "hf_w3_bf16_weights_tied",
           "s2_w3_fp32_decay_tied_frozen", "hf_s2_w2_bf16"]


@pytest.mark.parametrize("name", RESUMED)
def test_deepspeed_resumes_a_parity_merge(ckpt, tmp_path, monkeypatch, name):
    out = tmp_path / "merged"
    merge_in_process("parity.yml", recipe_env(ckpt(name, 10), ckpt(name, 5), out), monkeypatch)
    result = resume(name, out, tmp_path)
    assert result["global_steps"] == 13
    tail = result["losses"][-3:]
    assert len(tail) == 3 and all(math.isfinite(x) for x in tail), result


# (stage 1: test_reshard's there-and-back resumes loss for loss like the original)
@pytest.mark.parametrize("name", ["w3_bf16_decay_tied_frozen", "s2_w3_fp32_decay_tied_frozen"])
def test_identity_merge_resumes_bit_identically(ckpt, tmp_path, monkeypatch, name):
    new, old = ckpt(name, 10), ckpt(name, 5)
    recipe = tmp_path / "identity.yml"
    recipe.write_text("layers: {rest: '${NEW}'}\noutput: ${OUT}\n")
    out = tmp_path / "merged"
    merge_in_process(recipe, recipe_env(new, old, out), monkeypatch)
    from_merged = resume(name, out, tmp_path / "a")
    from_original = resume(name, new.parent, tmp_path / "b")
    assert from_merged["losses"] == from_original["losses"]
    assert len(from_merged["losses"]) == 3
