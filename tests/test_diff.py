"""`diff A B`: exit 0 when identical, 1 when not, 2 on bad input; a parity merge differs from
each source in exactly the layers it took from the other; world sizes do not matter."""
from __future__ import annotations

import json

import pytest
from ckpt_fixtures import build
from merging import RECIPES, recipe_env, run_cli

KINDS = {"fp32", "exp_avg", "exp_avg_sq"}


def diff(a, b, ranks=1):
    r = run_cli(["diff", str(a), str(b), "--json"], {}, ranks=ranks)
    return r, (json.loads(r.stdout) if r.returncode in (0, 1) else None)


def differing(rep) -> set[str]:
    return {key for key, kinds in rep["layers"].items()
            if any(not kinds[k]["identical"] for k in KINDS & kinds.keys())}


@pytest.mark.parametrize("name", ["w2_fp32_one", "s2_w2_bf16_per_layer"])
def test_a_parity_merge_differs_from_each_source_where_it_took_the_other(ckpt, tmp_path, name):
    new, old = ckpt(name, 10), ckpt(name, 5)
    out = tmp_path / "merged"
    assert run_cli([str(RECIPES / "parity.yml")], recipe_env(new, old, out)).returncode == 0
    r, rep = diff(out, new, ranks=2)
    assert r.returncode == 1, r.stderr
    assert differing(rep) == {"layers.1", "layers.3"}
    for key in ("layers.0", "embed", "norm"):
        assert all(d["identical"] for d in rep["layers"][key].values()), key
    d = rep["layers"]["layers.1"]["fp32"]
    assert d["max_abs_diff"] > 0 and 0 < d["rel_norm_diff"] < 1 and d["differing"] > 0
    assert rep["counters"]["global_steps"]["identical"]
    r, rep = diff(out, old)
    assert r.returncode == 1
    assert differing(rep) == {"layers.0", "layers.2", "embed", "norm", "lm_head"}
    assert not rep["counters"]["global_steps"]["identical"]
    r, rep = diff(new, new, ranks=3)
    assert r.returncode == 0 and rep["identical"] and not differing(rep)
    assert "identical" in run_cli(["diff", str(new), str(new)], {}).stdout


@pytest.mark.parametrize("name,world", [("w2_bf16_small_subgroups_tied_frozen", 3),
                                        ("s2_w3_fp32_decay_tied_frozen", 2)])
def test_the_same_state_at_another_world_size_is_identical(ckpt, tmp_path, name, world):
    new = ckpt(name, 10)
    out = tmp_path / "resharded"
    recipe = tmp_path / "identity.yml"
    recipe.write_text(f"layers: {{rest: '{new}'}}\noutput: '{out}'\n")
    assert run_cli([str(recipe), "--world-size", str(world)], {}, ranks=2).returncode == 0
    r, rep = diff(new, out, ranks=2)
    assert r.returncode == 0, (r.stderr, rep)
    assert "frozen" in rep["layers"]["layers.1"] and "adam_step" in rep["layers"]["layers.0"]
    if name.startswith("s2_"):  # stage 1/2 model states hold the 16-bit weights: compared
        assert rep["layers"]["layers.0"]["16bit"]["identical"]


def test_a_partial_save_is_compared_on_the_layers_it_holds():
    root = build("w2_parity")
    r, rep = diff(root / "global_step8", root / "global_step8", ranks=2)
    assert r.returncode == 0, r.stderr
    assert rep["not_compared"] and set(rep["layers"]).isdisjoint(rep["not_compared"])


def test_different_models_are_bad_input(ckpt):
    r, _ = diff(ckpt("w2_fp32_one", 10), ckpt("w3_qwen2_fp32_decay", 10))
    assert r.returncode == 2 and "different models" in r.stderr, r.stderr
