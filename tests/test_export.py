"""`--export safetensors`: consolidated HF weights that transformers loads, equal to
DeepSpeed's own zero_to_fp32 consolidation of the same merged checkpoint."""
from __future__ import annotations

import pytest
import torch
import transformers
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from merging import RECIPES, recipe_env, run_cli


@pytest.mark.parametrize("dtype,ranks", [("fp32", 1), ("bf16", 2)])
def test_safetensors_export_loads_and_equals_zero_to_fp32(ckpt, tmp_path, dtype, ranks):
    new, old = ckpt("hf_w2_fp32", 10), ckpt("hf_w2_fp32", 5)
    out = tmp_path / "merged"
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "safetensors", "--export-dtype",
                 dtype], recipe_env(new, old, out), ranks=ranks)
    assert r.returncode == 0, r.stderr
    assert "no config.json" not in r.stderr
    hf = out / "hf"
    assert (hf / "config.json").exists()
    # One file below the default 5GB shard size, whatever the number of ranks.
    assert {p.name for p in hf.glob("model*")} == {"model.safetensors"}
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype="auto")
    oracle = get_fp32_state_dict_from_zero_checkpoint(str(out))
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    got = model.state_dict()
    for name, t in oracle.items():
        assert got[name].dtype == want and torch.equal(got[name], t.to(want)), name


def test_safetensors_export_of_a_save_without_a_config_says_so(ckpt, tmp_path):
    """A plain DeepSpeed save has no config.json: the export holds the weights, and the
    merge says in one line that from_pretrained needs a config and how to get one."""
    new, old = ckpt("w2_fp32_one", 10), ckpt("w2_fp32_one", 5)
    out = tmp_path / "merged"
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "safetensors"],
                recipe_env(new, old, out))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "no config.json" in line]
    assert len(lines) == 1 and "--config" in lines[0], r.stderr
    assert (out / "hf" / "model.safetensors").is_file()
    assert not (out / "hf" / "config.json").exists()
