"""Recovery you can trust (issue 13): ordinary client state, damaged and foreign saves,
model-parallel layouts and `.bin` weights, each on real DeepSpeed checkpoints."""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import replace

import pytest
import torch
from ckpt_fixtures import build, spec_for
from conftest import tree_digest
from merge_check import check_merge
from merging import RECIPES, run_cli
from torch_files import torch_load

from dev.tinytrain import launch
from dev.tinytrain.worker import client_state, shown_client_state
from mpitailor.formats.torch.safeload import load
from mpitailor.formats.zero.read import read_meta

AUX = ("embed", "norm", "lm_head")
CLIENT_GLOBALS = {"argparse.Namespace", "numpy._core.multiarray.scalar", "numpy.dtype",
                  "__main__.RunNotes"}


class Tripwire:
    """A client-state class whose construction leaves a mark: building it runs its code."""

    def __init__(self, marker):
        self.marker = marker

    def __setstate__(self, state):
        open(state["marker"], "w").close()
        self.__dict__.update(state)


# The training script's own class (it runs as __main__): what mpitailor carries unbuilt.
Tripwire.__module__ = "__main__"
setattr(sys.modules["__main__"], "Tripwire", Tripwire)


def unsafe_globals(path) -> set[str]:
    return set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))


def test_client_state_is_carried_through_and_resumed(tmp_path):
    """A run that saves a Namespace, a numpy scalar and a dataclass (full save at 2, partial
    saves at 4, 6, 8) recovers, and DeepSpeed's resume returns those objects as saved."""
    root = build("w2_client_state")
    before = tree_digest(root)
    out = tmp_path / "recovered"
    r = run_cli(["recover", str(root), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        merged, source = out / "global_step8" / name, root / "global_step8" / \
            f"rank_{rank}_model_states.pt"
        assert unsafe_globals(merged) == CLIENT_GLOBALS  # the same classes, by name
        got, want = load(merged, opaque_ok=True), load(source, opaque_ok=True)
        for key in ("args", "best_loss", "notes"):
            assert got[key] == want[key]  # same globals, arguments and state
    spec = replace(spec_for("w2_client_state", tmp_path / "resumed"), steps=10, save_at=(),
                   policy=None, load_dir=str(out))
    result = launch(spec)
    assert result["first_step"] == 8 and result["global_steps"] == 10
    assert result["client_state"] == shown_client_state(client_state(spec, 8))
    assert tree_digest(root) == before


def test_untrusted_objects_are_never_built(ckpt_copy, tmp_path):
    """mpitailor merges a checkpoint whose client state would run code when built, without
    building it; the output still refers to it, so a (trusting) loader gets it back."""
    root = ckpt_copy("w2_fp32_one")
    marker = tmp_path / "built"
    for step in (5, 10):
        for rank in (0, 1):
            path = root / f"global_step{step}" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            states = torch_load(path)
            states["tripwire"] = Tripwire(str(marker))
            torch.save(states, path)
    out = tmp_path / "merged"
    env = {"NEW": str(root / "global_step10"), "OLD": str(root / "global_step5"),
           "OUT": str(out)}
    r = run_cli([str(RECIPES / "parity.yml")], env, ranks=2)
    assert r.returncode == 0, r.stderr
    assert not marker.exists()  # no code from the checkpoint ran
    merged = out / "global_step10" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    assert unsafe_globals(merged) == {"__main__.Tripwire"}
    torch.load(merged, weights_only=False)  # what DeepSpeed's own loader does
    assert marker.exists()


def test_safe_globals_builds_named_classes_and_refuses_unknown_ones(ckpt, tmp_path):
    root = build("w2_client_state")
    out = tmp_path / "merged"
    r = run_cli(["recover", str(root), "-o", str(out), "--safe-globals",
                 "argparse.Namespace"], {}, ranks=2)  # built for real; the rest stand-ins
    assert r.returncode == 0, r.stderr
    merged = out / "global_step8" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    assert unsafe_globals(merged) == CLIENT_GLOBALS
    r = run_cli(["recover", str(root), "-o", str(tmp_path / "x"), "--safe-globals",
                 "argparse.NoSuchClass"], {}, ranks=2)
    assert r.returncode == 2 and r.stderr.count("cannot import it") == 1, r.stderr  # once


def truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("latest", ["previous save", "truncated save"])
def test_interrupted_full_save_is_skipped(tmp_path, latest):
    """Rank 1's optimizer file of the newest full save is cut short (its node died while
    saving): recover uses the previous full save, whatever `latest` names, and says why."""
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity_twin_full"), root)  # full saves at 2, 4, 6, 8
    truncate(root / "global_step8" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (root / "latest").write_text("global_step6" if latest == "previous save" else "global_step8")
    out = tmp_path / "out"
    r = run_cli(["recover", str(root), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    assert "skipping global_step8" in r.stderr and "truncated" in r.stderr
    assert (out / "latest").read_text() == "global_step6"


def test_no_usable_full_save_is_an_error_not_a_fresh_start(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity"), root)  # full save at 2, partial saves at 4, 6, 8
    truncate(root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    r = run_cli(["recover", str(root), "--emit-recipe"], {}, ranks=2)
    assert r.returncode == 2, r.stderr
    assert "no usable full checkpoint" in r.stderr and "global_step2" in r.stderr


def test_nothing_finished_is_nothing_to_recover(tmp_path):
    """A first full save killed half-way (no `latest`): exit 3, nothing to recover."""
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity") / "global_step2", root / "global_step2")
    truncate(root / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (root / "global_step2" / "mpitailor_save.json").unlink()
    r = run_cli(["recover", str(root), "--emit-recipe"], {}, ranks=1)
    assert r.returncode == 3, r.stderr
    assert "nothing to recover" in r.stderr and r.stdout == ""


def flip_byte(path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_corrupted_partial_save_is_skipped_by_recover(tmp_path):
    """One flipped byte in a partial save's layer file: its CRC-32 no longer matches the
    manifest. recover skips that save (and says so); the layers come from older saves."""
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity"), root)
    flip_byte(root / "global_step8" / "rank_1_layers.safetensors")
    out = tmp_path / "out"
    r = run_cli(["recover", str(root), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    assert "skipping global_step8" in r.stderr and "CRC-32" in r.stderr
    s4, s6 = root / "global_step4", root / "global_step6"
    check_merge(out, {"layers.0": s6, "layers.2": s6, "layers.1": s4, "layers.3": s4,
                      **{k: s6 for k in AUX}}, base=s6)


def test_corrupted_partial_save_is_refused_by_a_merge(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity"), root)
    flip_byte(root / "global_step8" / "rank_1_layers.safetensors")
    before = tree_digest(root)
    out = tmp_path / "out"
    env = {"NEW": str(root / "global_step8"), "OLD": str(root / "global_step2"),
           "OUT": str(out)}
    recipe = tmp_path / "r.yml"
    recipe.write_text("layers: {odd: '${NEW}', rest: '${OLD}'}\nbase: '${NEW}'\n"
                      "output: ${OUT}\n")
    r = run_cli([str(recipe)], env, ranks=2)
    assert r.returncode == 2 and "fails the CRC-32" in r.stderr, r.stderr
    assert r.stderr.count("mpitailor: error:") == 1 and not out.exists()
    assert tree_digest(root) == before


@pytest.mark.parametrize("how", ["mp_rank_01 files", "mp_world_size 2"])
def test_model_parallel_layouts_are_refused(ckpt_copy, tmp_path, how):
    root = ckpt_copy("w2_fp32_one")
    tag = root / "global_step10"
    model0 = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if how == "mp_rank_01 files":
        shutil.copy(model0, tag / "zero_pp_rank_0_mp_rank_01_model_states.pt")
    else:
        states = torch_load(model0)
        states["mp_world_size"] = 2
        torch.save(states, model0)
    out = tmp_path / "out"
    r = run_cli(["inspect", str(tag)], {})
    assert r.returncode == 2 and "tensor/pipeline-parallel" in r.stderr, r.stderr
    r = run_cli([str(RECIPES / "parity.yml")], {"NEW": str(tag), "OLD": str(
        root / "global_step5"), "OUT": str(out)}, ranks=2)
    assert r.returncode == 2 and r.stderr.count("tensor/pipeline-parallel") == 1, r.stderr


def test_bin_weights_and_foreign_files_of_the_base_are_left_out(ckpt_copy, tmp_path):
    """An HF base whose 16-bit weights are pytorch_model.bin, with a log and a core dump
    beside them: the merge succeeds, says what it left out, and the manifest lists it."""
    run = ckpt_copy("hf_w3_bf16_weights_tied")
    new = run / "checkpoint-10"
    from safetensors.torch import load_file
    torch.save(load_file(str(new / "model.safetensors")), new / "pytorch_model.bin")
    (new / "model.safetensors").unlink()
    (new / "train.log").write_text("step 10\n")
    (new / "core.4242").write_bytes(b"\0" * 64)
    os.mkfifo(new / "a.fifo")
    out = tmp_path / "merged"
    env = {"NEW": str(new), "OLD": str(run / "checkpoint-5"), "OUT": str(out)}
    r = run_cli([str(RECIPES / "parity.yml")], env, ranks=2)
    assert r.returncode == 0, r.stderr
    assert "pytorch_model.bin" in r.stderr and "not carried over" in r.stderr
    manifest = json.loads((out / "mpitailor_manifest.json").read_text())
    assert sorted(manifest["left_out"]) == ["a.fifo", "core.4242", "pytorch_model.bin",
                                            "train.log"]
    assert {"trainer_state.json", "config.json", "scheduler.pt"} <= set(manifest["files"])
    assert not (out / "pytorch_model.bin").exists() and not (out / "train.log").exists()
    assert read_meta(out).global_steps == 10


def test_a_merge_into_the_save_dir_does_not_list_its_own_lock_as_left_out(ckpt_copy):
    run = ckpt_copy("w2_fp32_one")
    out = run / "merged"
    env = {"NEW": str(run / "global_step10"), "OLD": str(run / "global_step5"), "OUT": str(out)}
    r = run_cli([str(RECIPES / "parity.yml")], env, ranks=2)
    assert r.returncode == 0, r.stderr
    assert "mpitailor-lock" not in r.stderr and "mpitailor-staging" not in r.stderr
    manifest = json.loads((out / "mpitailor_manifest.json").read_text())
    assert not [n for n in manifest["left_out"] if "mpitailor-" in n], manifest["left_out"]
