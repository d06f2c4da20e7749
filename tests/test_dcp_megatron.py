"""Megatron-Core `torch_dist` checkpoints (issue 43, part 3), on tiny real saves made by
megatron-core 0.19.2 itself (tests/data/megatron/README.md): inspect recognises the stacked
layers and the optimizer sharding; a layer-wise merge of `fully_reshardable` saves takes
layer i's chunks of every stacked tensor (weights and Adam state) from layer i's source
(torch's own reader is the oracle: dcp_to_torch_save), writes the same bytes at 1 and 2
ranks, and Megatron loads it (when a megatron-core interpreter is given); `dp_reshardable`
is refused in one line."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from dcp_oracle import merged, torch_state
from merging import run_cli

from mpitailor.formats.dcp.metadata_pickle import unpickle

DATA = Path(__file__).parent / "data" / "megatron"
S0, S1 = DATA / "tiny_s0_fully_reshardable", DATA / "tiny_s1_fully_reshardable"
DP = DATA / "tiny_s0_dp_reshardable"
REPO = Path(__file__).resolve().parents[1]


def _recipe(tmp_path: Path, a: Path = S0, b: Path = S1) -> Path:
    path = tmp_path / "recipe.yml"
    path.write_text(f"sources: {{a: {a}, b: {b}}}\nlayers: {{even: a, odd: b}}\n"
                    f"embed: b\nnorm: b\nbase: a\n")
    return path


def _same(x, y) -> bool:
    import torch
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same, x, y))
    return x == y


def _model_key(key: str) -> str:
    for field in ("param", "exp_avg", "exp_avg_sq"):
        if key.startswith(f"optimizer.state.{field}."):
            return key[len(f"optimizer.state.{field}."):]
    return key


def test_inspect_reads_stacked_layers_and_the_optimizer_sharding():
    for path, sharding in ((S0, "fully_reshardable"), (DP, "dp_reshardable")):
        r = run_cli(["inspect", str(path), "--json"], {})
        assert r.returncode == 0, r.stdout + r.stderr
        rep = json.loads(r.stdout)
        assert rep["producer"] == "Megatron-Core" and rep["stacked_layers"]
        assert rep["optimizer_sharding"] == sharding and rep["world_size"] == 2
        assert list(rep["layers"]) == ["embed", "layers.0", "layers.1", "norm"]
        assert rep["layers"]["layers.1"]["params"] == 12
        assert rep["layers"]["layers.0"]["model_bytes"] == rep["layers"]["layers.1"][
            "model_bytes"] > 0
        state = ["exp_avg", "exp_avg_sq", "param"] if sharding == "fully_reshardable" else []
        assert rep["layers"]["layers.0"]["optimizer_state"] == state


def test_every_entry_comes_from_the_source_the_recipe_names(tmp_path):
    import torch
    out = merged(tmp_path, _recipe(tmp_path))
    got, a, b = (torch_state(p, tmp_path, flat=False) for p in (out, S0, S1))
    assert set(got) == set(a)
    assert (out / "metadata.json").read_bytes() == (S0 / "metadata.json").read_bytes()
    told_apart = stacked = 0
    for key, value in got.items():
        model = _model_key(key)
        if isinstance(value, torch.Tensor) and model.startswith("decoder.layers."):
            stacked += 1
            for i in range(value.shape[0]):  # layer i: the rows at offset i of axis 0
                want, other = (a, b) if i % 2 == 0 else (b, a)
                assert torch.equal(value[i], want[key][i]), (key, i)
                told_apart += not torch.equal(want[key][i], other[key][i])
            continue
        aux = model.startswith(("embedding.", "decoder.final_layernorm."))
        want = b if aux else a  # embed and norm from b; common_state, rng_state: the base
        assert _same(value, want[key]), key
        told_apart += isinstance(value, torch.Tensor) and not torch.equal(a[key], b[key])
    assert stacked == 4 * 12 and told_apart > 90  # the two saves differ where checked


def test_the_same_bytes_whatever_the_number_of_ranks(tmp_path):
    recipe = _recipe(tmp_path)
    one, two = merged(tmp_path, recipe, "one"), merged(tmp_path, recipe, "two", ranks=2)
    names = sorted(p.name for p in one.iterdir() if p.name != "mpitailor_manifest.json")
    assert names == sorted(p.name for p in two.iterdir() if p.name != "mpitailor_manifest.json")
    assert "metadata.json" in names
    for n in names:
        assert (one / n).read_bytes() == (two / n).read_bytes(), n


def test_dp_reshardable_is_refused_in_one_line(tmp_path):
    r = run_cli(["merge", str(_recipe(tmp_path, a=DP)), "-o", str(tmp_path / "out")], {})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "dp_reshardable" in lines[0], r.stderr
    assert "--dist-ckpt-optim-fully-reshardable" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_write_item_type_other_than_torchs_is_refused():
    module, name = b"torch.distributed.checkpoint.planner", b"WriteItemType"
    head = b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + \
        name + b"\x93"
    assert unpickle(head + b"K\x02\x85R.") == 2
    for arg in (b"K\x07\x85R.", b"\x8c\x01x\x85R."):
        with pytest.raises(pickle.UnpicklingError):
            unpickle(head + arg)


def test_damaged_megatron_metadata_gives_one_line_or_a_checked_value(tmp_path):
    """The metadata fuzzer (tests/dcp_fuzzing.py) on a Megatron `.metadata`, SavePlans and
    all."""
    import shutil

    import dcp_fuzzing
    folder = tmp_path / "ckpt"
    shutil.copytree(S0, folder)
    got = dcp_fuzzing.run(folder, (folder / ".metadata").read_bytes(), 200, seed=44)
    assert got["refused"] > 20, got


@pytest.mark.skipif(not os.environ.get("MPITAILOR_MCORE_PYTHON")
                    or not os.environ.get("MPITAILOR_MCORE_TRUTH"),
                    reason="needs a megatron-core interpreter (MPITAILOR_MCORE_PYTHON) and "
                           "the fixtures' truth files (MPITAILOR_MCORE_TRUTH)")
def test_megatron_loads_the_composite_with_every_tensor_from_its_source(tmp_path):
    out = merged(tmp_path, _recipe(tmp_path))
    truth = Path(os.environ["MPITAILOR_MCORE_TRUTH"])
    s0, s1 = (str(truth / f"{p.name}.truth.pt") for p in (S0, S1))
    sources = tmp_path / "sources.json"
    sources.write_text(json.dumps({"layers.0": s0, "layers.1": s1, "embed": s1, "norm": s1,
                                   "lm_head": s0}))
    r = subprocess.run([os.environ["MPITAILOR_MCORE_PYTHON"],
                        str(REPO / "dev" / "megatron" / "load_check.py"), str(out),
                        str(sources), "--hidden", "16", "--layers", "2", "--vocab", "64"],
                       capture_output=True, text=True, timeout=300, env={**os.environ,
                                                                          "PYTHONPATH": ""})
    assert r.returncode == 0 and "OK 224 of 224" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
