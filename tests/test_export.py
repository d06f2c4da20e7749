"""`--export hf`: consolidated HF weights that transformers loads, equal to
DeepSpeed's own zero_to_fp32 consolidation of the same merged checkpoint."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from merging import RECIPES, recipe_env, run_cli

from mpitailor.cli.parser import build_parser
from mpitailor.formats.safetensors_header import read_header


@pytest.mark.parametrize("dtype,ranks", [("fp32", 1), ("bf16", 2)])
def test_hf_export_loads_and_equals_zero_to_fp32(ckpt, tmp_path, dtype, ranks):
    new, old = ckpt("hf_w2_fp32", 10), ckpt("hf_w2_fp32", 5)
    out = tmp_path / "merged"
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "hf", "--dtype", dtype],
                recipe_env(new, old, out), ranks=ranks)
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


def test_hf_export_of_a_save_without_a_config_says_so(ckpt, tmp_path):
    """A plain DeepSpeed save has no config.json: the export holds the weights, and the
    merge says in one line that from_pretrained needs a config and how to get one."""
    new, old = ckpt("w2_fp32_one", 10), ckpt("w2_fp32_one", 5)
    out = tmp_path / "merged"
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "hf"], recipe_env(new, old, out))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "no config.json" in line]
    assert len(lines) == 1 and "--config" in lines[0], r.stderr
    assert (out / "hf" / "model.safetensors").is_file()
    assert not (out / "hf" / "config.json").exists()


# -- one name for the HF export and its dtype, as `export --format hf --dtype` names them -----

OLD_NAMES = ["--export", "safetensors", "--export-dtype"]  # before; docs/commands.md#old-names
NEW_NAMES = ["--export", "hf", "--dtype"]


def _files(out: Path) -> dict[str, bytes]:
    """Every file under out, the manifest's wall-clock `created` blanked."""
    files = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    files["mpitailor_manifest.json"] = re.sub(rb'"created": "[^"]*"', b'"created": ""',
                                              files["mpitailor_manifest.json"])
    return files


def test_the_old_names_of_the_hf_export_write_the_same_bytes(ckpt, tmp_path):
    """`--export safetensors --export-dtype`, the names before `--export hf --dtype`, still
    work: the same merge, byte for byte, into the same output path (the manifest names it)."""
    new, old = ckpt("hf_w2_fp32", 10), ckpt("hf_w2_fp32", 5)
    out, written = tmp_path / "merged", {}
    for names in (NEW_NAMES, OLD_NAMES):
        r = run_cli([str(RECIPES / "parity.yml"), names[0], names[1], names[2], "bf16",
                     "--max-shard-size", "100KB"], recipe_env(new, old, out))
        assert r.returncode == 0, r.stderr
        shards = sorted(out.glob("hf/model-*.safetensors"))
        assert len(shards) > 1, r.stderr
        assert {t["dtype"] for p in shards for n, t in read_header(p).items()
                if n != "__metadata__"} == {"BF16"}
        written[names[1]] = _files(out)
        shutil.rmtree(out)
    assert written["hf"] == written["safetensors"]


@pytest.mark.parametrize("command", [["merge", "r.yml"], ["recover", "save", "-o", "out"]])
def test_the_old_names_parse_as_the_new(command):
    parse = build_parser().parse_args
    assert parse([*command, *OLD_NAMES, "fp16", "--export", "universal"]) \
        == parse([*command, *NEW_NAMES, "fp16", "--export", "universal"])


@pytest.mark.parametrize("command", ["merge", "recover", "export"])
def test_help_names_the_hf_export_and_its_dtype_alike(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    assert "--dtype {bf16,fp16,fp32}" in text
    assert ("--format {hf,fp32,universal}" if command == "export"
            else "--export {hf,universal}") in text
    assert "--export-dtype" not in text and "{safetensors" not in text \
        and "--export safetensors" not in text


def test_an_export_that_is_not_one_names_the_new_choices(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["merge", "r.yml", "--export", "safetensor"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(r"choose from '?hf'?, '?universal'?", err), err


def test_a_merge_and_its_weights_exports_are_one_program(ckpt, tmp_path):
    """A merge whose base carries 16-bit weights (rebuilt) with `--export hf` in 100 KB
    shards writes its partitions and every weights file in one copy program: the ranks'
    --stats count every byte of every one of those files once (the rank that made it), and
    each file is one unit of the program, laid out by one rank: the partitions, then the
    weights files."""
    import json
    new, old = ckpt("hf_w3_bf16_weights_tied", 10), ckpt("hf_w3_bf16_weights_tied", 5)
    out, stats = tmp_path / "merged", tmp_path / "stats.json"
    r = run_cli([str(RECIPES / "parity.yml"), "--export", "hf", "--dtype", "fp32",
                 "--max-shard-size", "100KB", "--stats", str(stats)],
                recipe_env(new, old, out), ranks=3)
    assert r.returncode == 0, r.stderr
    rebuilt = sorted(out.glob("*.safetensors"))
    exported = sorted(out.glob("hf/model-*.safetensors"))
    assert rebuilt and len(exported) > 1
    tag = next(out.glob("global_step*"))
    program = [*tag.glob("*_states.pt"), *rebuilt, *exported]
    ranks = json.loads(stats.read_text())["ranks"]
    assert sum(s["bytes_written"] for s in ranks) == sum(f.stat().st_size for f in program)
    partitions = 3  # units 0-2; the weights files after them
    assert sorted(u for s in ranks for u in s["homes"]) == \
        list(range(partitions + len(rebuilt) + len(exported)))
