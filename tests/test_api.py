"""`from mpitailor import merge, recover`: the command line's code path as Python functions,
returning a result and raising mpitailor's errors; importing the package stays torch-free."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from ckpt_fixtures import build
from merge_check import check_merge, parity
from merging import RECIPES, merge_in_process, recipe_env

import mpitailor
from mpitailor.errors import NothingToRecover, UserError
from mpitailor.formats.zero.read import read_meta


def test_merge_returns_what_it_wrote(ckpt, tmp_path, monkeypatch):
    new, old = ckpt("w2_bf16_per_layer", 10), ckpt("w2_bf16_per_layer", 5)
    for k, v in recipe_env(new, old, tmp_path / "ignored").items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "merged"
    result = mpitailor.merge(RECIPES / "parity.yml", out, export=["universal"])
    assert result.output == out
    # One process, no MPI: that one rank wrote both output partitions (W=2) ...
    assert [st["partitions"] for st in result.rank_stats] == [[0, 1]]
    manifest = json.loads((out / "mpitailor_manifest.json").read_text())
    assert manifest["mpi_ranks"] == 1
    # ... and the bytes it reports are those of the files on disk.
    assert result.bytes_written == sum((out / f).stat().st_size for f in manifest["files"]) > 0
    assert dict(result.layer_source)["layers.1"] == "old"
    check_merge(out, parity(new, old), base=new)
    assert (out / "latest_universal").read_text() == "global_step10"
    assert not (tmp_path / "ignored").exists()


@pytest.mark.parametrize("name", ["w2_bf16_per_layer", "s2_w3_fp32_decay_tied_frozen"])
def test_the_oracle_fails_on_a_wrong_merge(ckpt, tmp_path, monkeypatch, name):
    """check_merge (tests/merge_check.py) can fail: a layer paired with the source it did not
    come from, the wrong base, and one bit of one Adam moment changed in the output."""
    new, old = ckpt(name, 10), ckpt(name, 5)
    out = tmp_path / "merged"
    merge_in_process("parity.yml", recipe_env(new, old, out), monkeypatch)
    check_merge(out, parity(new, old), base=new)
    with pytest.raises(AssertionError, match=r"layers\.1\."):  # layer 1 came from old
        check_merge(out, {**parity(new, old), "layers.1": new}, base=new)
    with pytest.raises(AssertionError):  # counters and tag come from new
        check_merge(out, parity(new, old), base=old)
    # One ulp of rank 0's first exp_avg_sq element (the first parameter's first element:
    # never padding).
    path = next((out / "global_step10").glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    optim = torch.load(path, weights_only=False)
    osd = optim["optimizer_state_dict"]
    t = (osd.get("base_optimizer_state") or osd["optimizer_state_dict"])["state"][0]["exp_avg_sq"]
    t[0] = torch.nextafter(t[0], torch.tensor(float("inf")))
    torch.save(optim, path)
    with pytest.raises(AssertionError, match="exp_avg_sq"):
        check_merge(out, parity(new, old), base=new)


def test_recover_returns_the_composite(tmp_path):
    out = tmp_path / "recovered"
    result = mpitailor.recover(build("w2_parity"), out, world_size=3)
    assert result.output == out
    meta = read_meta(out)
    assert meta.global_steps == 8 and meta.world_size == 3
    sources = {src for _, src in result.layer_source}
    assert len(sources) > 1  # layers from several saves: a real composite


def test_errors_are_raised_not_exits(ckpt, tmp_path, monkeypatch):
    new, old = ckpt("w2_fp32_one", 10), ckpt("w2_fp32_one", 5)
    for k, v in recipe_env(new, old, tmp_path / "o").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UserError, match="choose among hf, universal"):
        mpitailor.merge(RECIPES / "parity.yml", export=["onnx"])
    with pytest.raises(UserError, match="max_shard_size"):
        mpitailor.merge(RECIPES / "parity.yml", export="safetensors", max_shard_size="lots")
    assert not (tmp_path / "o").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NothingToRecover):
        mpitailor.recover(empty, tmp_path / "r")


def test_importing_the_package_does_not_import_torch():
    code = ("import sys, mpitailor, mpitailor.planning.plan; "
            "assert 'torch' not in sys.modules; "
            "from mpitailor import merge, recover, MergeResult; "
            "assert callable(merge) and callable(recover)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
