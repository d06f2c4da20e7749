"""`mpitailor export SRC -o OUT --format hf|fp32|universal`: straight from the source's
partition files, equal to DeepSpeed's own zero_to_fp32 and to exporting a recovered copy."""
from __future__ import annotations

import json

import pytest
import torch
from ckpt_fixtures import build
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from merging import run_cli
from safetensors.torch import load_file


@pytest.mark.parametrize("name,ranks", [("w2_bf16_per_layer", 1),
                                        ("w3_bf16_decay_tied_frozen", 2),
                                        ("s2_w3_fp32_decay_tied_frozen", 2),
                                        ("s1_w2_fp32_one", 1)])
def test_fp32_export_equals_zero_to_fp32(tmp_path, name, ranks):
    save = build(name)  # a DeepSpeed save dir: `latest` names the newest full save
    out = tmp_path / "fp32"
    r = run_cli(["export", str(save), "-o", str(out), "--format", "fp32"], {}, ranks=ranks)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors",
                                                     "mpitailor_manifest.json"]
    got = load_file(out / "model.safetensors")
    oracle = get_fp32_state_dict_from_zero_checkpoint(str(save))
    # Tied aliases are left out, as save_pretrained (and --safe_serialization) do.
    assert set(got) <= set(oracle) and len(got) >= len(oracle) - 1
    for key, t in got.items():
        assert t.dtype == torch.float32 and torch.equal(t, oracle[key].float()), key


def test_hf_export_of_a_layerwise_run_equals_exporting_its_recovery(tmp_path):
    """A save dir of a full save and partial saves: each layer's newest copy, exported with
    no composite written first, the same bytes as recover + --export safetensors."""
    save = build("w2_parity")
    r = run_cli(["export", str(save), "-o", str(tmp_path / "direct"), "--dtype", "bf16",
                 "--max-shard-size", "100KB"], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    r = run_cli(["recover", str(save), "-o", str(tmp_path / "recovered"), "--export",
                 "safetensors", "--export-dtype", "bf16", "--max-shard-size", "100KB"], {},
                ranks=1)
    assert r.returncode == 0, r.stderr
    direct, via = tmp_path / "direct", tmp_path / "recovered" / "hf"
    names = sorted(p.name for p in via.iterdir())
    assert len([n for n in names if n.endswith(".safetensors")]) > 1  # sharded, with an index
    assert sorted(p.name for p in direct.iterdir() if p.name != "mpitailor_manifest.json") \
        == names
    for n in names:
        assert (direct / n).read_bytes() == (via / n).read_bytes(), n
    manifest = json.loads((direct / "mpitailor_manifest.json").read_text())
    # the layers come from the partial saves at steps 6 and 8, not from the full save (2)
    assert {s["global_steps"] for s in manifest["sources"].values()} == {6, 8}


def test_export_refuses_bad_input_and_writes_nothing(tmp_path):
    save = build("w2_parity")
    out = tmp_path / "out"
    r = run_cli(["export", str(save / "global_step4"), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 2 and "one partial save holds only some layers" in r.stderr
    r = run_cli(["export", str(save), "-o", str(out), "--format", "fp32", "--dtype", "bf16"],
                {}, ranks=1)
    assert r.returncode == 2 and "--dtype bf16 goes with --format hf" in r.stderr
    r = run_cli(["export", str(tmp_path / "nowhere"), "-o", str(out)], {}, ranks=1)
    assert r.returncode == 2 and "nowhere" in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_universal_export_of_a_stage2_checkpoint_is_refused_before_writing(tmp_path):
    out = tmp_path / "u"
    r = run_cli(["export", str(build("s2_w2_bf16_per_layer")), "-o", str(out), "--format",
                 "universal"], {}, ranks=2)
    assert r.returncode == 2 and "ZeRO stage 2" in r.stderr and "--world-size" in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".*"))


def test_paths_on_the_command_line_are_literal(tmp_path):
    """A `$` in a path given on the command line is a `$`: `ckpt_$USER` is not `ckpt_root`,
    `-o 'out$HOME'` is not `out/root` (only recipe files expand `${VAR}`)."""
    import shutil
    src = build("w2_bf16_per_layer") / "global_step10"
    shutil.copytree(src, tmp_path / "ckpt_$USER")
    shutil.copytree(build("w2_fp32_one") / "global_step10", tmp_path / "ckpt_root")
    env = {"USER": "root", "HOME": "/root"}
    out = tmp_path / "out$HOME"
    r = run_cli(["export", str(tmp_path / "ckpt_$USER"), "-o", str(out), "--format", "fp32"],
                env)
    assert r.returncode == 0, r.stderr
    assert out.is_dir() and not (tmp_path / "out" / "root").exists()
    manifest = json.loads((out / "mpitailor_manifest.json").read_text())
    assert manifest["sources"]["src"]["path"] == str(tmp_path / "ckpt_$USER")
    got = load_file(out / "model.safetensors")
    oracle = get_fp32_state_dict_from_zero_checkpoint(str(build("w2_bf16_per_layer")))
    assert all(torch.equal(t, oracle[k].float()) for k, t in got.items())
    merged = tmp_path / "merged$HOME"
    r = run_cli(["recipes/parity.yml", "-o", str(merged)],
                {**env, "NEW": str(src), "OLD": str(src), "OUT": "unused"})
    assert r.returncode == 0, r.stderr
    assert merged.is_dir() and not (tmp_path / "merged" / "root").exists()


def test_exporting_one_partial_hf_checkpoint_names_the_run_dir(tmp_path):
    run = build("hf_w2_parity")
    r = run_cli(["export", str(run / "checkpoint-4"), "-o", str(tmp_path / "x")], {})
    assert r.returncode == 2
    assert f"export its save dir ({run})" in r.stderr, r.stderr
