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
    no composite written first, the same bytes as recover + --export hf."""
    from ckpt_fixtures import spec_for

    from dev.tinytrain.model import tiny_config
    save = build("w2_parity")
    tiny_config(spec_for("w2_parity", tmp_path)).save_pretrained(tmp_path / "model")
    r = run_cli(["export", str(save), "-o", str(tmp_path / "direct"), "--dtype", "bf16",
                 "--max-shard-size", "100KB", "--config", str(tmp_path / "model")], {},
                ranks=2)
    assert r.returncode == 0, r.stderr
    r = run_cli(["recover", str(save), "-o", str(tmp_path / "recovered"), "--export",
                 "hf", "--dtype", "bf16", "--max-shard-size", "100KB"], {},
                ranks=1)
    assert r.returncode == 0, r.stderr
    direct, via = tmp_path / "direct", tmp_path / "recovered" / "hf"
    names = sorted(p.name for p in via.iterdir())
    assert len([n for n in names if n.endswith(".safetensors")]) > 1  # sharded, with an index
    # a plain DeepSpeed save: no config of its own, so the export carries --config's alone
    assert sorted(p.name for p in direct.iterdir() if p.name != "mpitailor_manifest.json") \
        == sorted([*names, "config.json"])
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


def test_hf_export_of_a_plain_deepspeed_save_needs_config_and_loads_with_it(tmp_path):
    """A DeepSpeed save dir carries no config.json (what accelerate's save_state writes with
    the DeepSpeed plugin): --format hf is refused on every rank, nothing written, until
    --config gives one; then from_pretrained loads the export, weights as saved."""
    import transformers
    from ckpt_fixtures import spec_for
    from test_merge_errors import expect_clean_failure

    from dev.tinytrain.model import tiny_config
    save = build("w2_bf16_per_layer")
    assert not (save / "config.json").exists()
    out = tmp_path / "hf"
    r = run_cli(["export", str(save), "-o", str(out)], {}, ranks=2)
    expect_clean_failure(r, out, sources=[], before=[],
                         message=f"{save}: no config.json beside the checkpoint")
    assert "pass --config" in r.stderr
    model_dir = tmp_path / "models--tiny" / "snapshots" / "rev"  # a Hub cache snapshot:
    tiny_config(spec_for("w2_bf16_per_layer", tmp_path)).save_pretrained(model_dir)
    (model_dir.parents[1] / "blobs").mkdir()  # side files are links to ../../blobs/
    (model_dir.parents[1] / "blobs" / "b1").write_text("{}")
    (model_dir / "special_tokens_map.json").symlink_to("../../blobs/b1")
    (model_dir / "notes.txt").write_text("not an HF side file")
    r = run_cli(["export", str(save), "-o", str(out), "--config", str(model_dir)], {},
                ranks=2)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "mpitailor_manifest.json",
        "special_tokens_map.json"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    oracle = get_fp32_state_dict_from_zero_checkpoint(str(save))
    got = model.state_dict()
    assert sorted(got) == sorted(oracle)
    for key, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, oracle[key].bfloat16()), key


def test_config_flag_wins_over_the_source_config(tmp_path):
    save = build("hf_w2_bf16") / "checkpoint-10"
    own = json.loads((save / "config.json").read_text())
    given = tmp_path / "given.json"
    given.write_text(json.dumps({**own, "mpitailor_test": "from --config"}))
    out = tmp_path / "hf"
    r = run_cli(["export", str(save), "-o", str(out), "--config", str(given)], {})
    assert r.returncode == 0, r.stderr
    written = json.loads((out / "config.json").read_text())
    assert written["mpitailor_test"] == "from --config"
    assert {p.name for p in out.iterdir()} >= {p.name for p in save.iterdir()
                                               if p.name.startswith("tokenizer")}


@pytest.mark.parametrize("case,message", [
    ("missing", "no such file or directory"),
    ("not_json", "not a JSON object"),
    ("dir_without", "a directory without config.json")])
def test_a_bad_config_flag_is_one_line_naming_it(tmp_path, case, message):
    from mpitailor.errors import UserError
    from mpitailor.jobs.export import check_config
    bad = {"missing": tmp_path / "nowhere.json", "not_json": tmp_path / "c.json",
           "dir_without": tmp_path / "model"}[case]
    (tmp_path / "c.json").write_text("{not json")
    (tmp_path / "model").mkdir()
    with pytest.raises(UserError) as err:
        check_config(bad)
    assert str(bad) in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_config_flag_exits_2_before_anything_is_read_or_written(tmp_path):
    from mpitailor.cluster.comm import Comm
    from mpitailor.errors import UserError
    from mpitailor.jobs.export import run_export
    (tmp_path / "c.json").write_text("[1, 2]")
    out, nowhere = tmp_path / "out", tmp_path / "no-source"
    with pytest.raises(UserError, match="--config goes with --format hf"):
        run_export(Comm(None), nowhere, out, "fp32", None, None, config=tmp_path / "c.json")
    r = run_cli(["export", str(nowhere), "-o", str(out), "--config", str(tmp_path / "c.json")],
                {})
    errors = [line for line in r.stderr.splitlines() if "mpitailor: error:" in line]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert "c.json: not a JSON object" in errors[0]  # the flag, before the missing source
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_verify_refuses_a_flipped_bit_in_a_record_the_export_reads(ckpt_copy, tmp_path):
    """--verify as merge's, for every format: every source record read is checked whole
    against its zip CRC-32 (a byte-range export alone copies the flipped value silently)."""
    from conftest import tree_digest
    from test_merge_errors import expect_clean_failure

    from mpitailor.formats.zero.read import read_meta
    from mpitailor.formats.zero.shard import open_shard
    root = ckpt_copy("hf_w2_bf16")
    tag = root / "checkpoint-10"
    with open_shard(read_meta(tag), 1) as shard:
        victim, at = shard.data_path, shard.offsets["fp32", 0] + 1000
    data = bytearray(victim.read_bytes())
    data[at] ^= 0x40
    victim.write_bytes(bytes(data))
    before = tree_digest(root)
    for fmt in ("hf", "fp32", "universal"):
        out = tmp_path / fmt
        r = run_cli(["export", str(tag), "-o", str(out), "--format", fmt, "--verify"], {},
                    ranks=2)
        expect_clean_failure(r, out, sources=[root], before=[before],
                             message=f"{victim}: the record at byte")
        assert "fails its CRC-32 check" in r.stderr, fmt
