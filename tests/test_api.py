"""`from mpitailor import merge, recover`: the command line's code path as Python functions,
returning a result and raising mpitailor's errors; importing the package stays torch-free."""
from __future__ import annotations

import subprocess
import sys

import pytest
from ckpt_fixtures import build
from merge_check import check_merge, parity
from merging import RECIPES, recipe_env

import mpitailor
from mpitailor.errors import NothingToRecover, UserError
from mpitailor.formats.read import read_meta


def test_merge_returns_what_it_wrote(ckpt, tmp_path, monkeypatch):
    new, old = ckpt("w2_bf16_per_layer", 10), ckpt("w2_bf16_per_layer", 5)
    for k, v in recipe_env(new, old, tmp_path / "ignored").items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "merged"
    result = mpitailor.merge(RECIPES / "parity.yml", out, export=["universal"])
    assert result.output == out and result.ranks == 1 and result.bytes_written > 0
    assert dict(result.layer_source)["layers.1"] == "old"
    check_merge(out, parity(new, old), base=new)
    assert (out / "latest_universal").read_text() == "global_step10"
    assert not (tmp_path / "ignored").exists()


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
    with pytest.raises(UserError, match="choose among safetensors, universal"):
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
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
