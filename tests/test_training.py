"""Selective layer-wise saving on real DeepSpeed runs, and `recover` under mpiexec."""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace

import h5py
import numpy as np
import pytest
import torch
import yaml
from ckpt_fixtures import HF_MODULE, VARIANTS, build, spec_for
from conftest import tree_digest
from merge_check import check_merge
from merging import run_cli

from dev.tinytrain import launch
from mpitailor.formats.zero.read import read_meta
from mpitailor.formats.zero.shard import open_shard

AUX = ("embed", "norm", "lm_head")


def parity_sources(root, prefix="global_step"):
    """Parity with saves at 2 (full), 4 (odd + aux), 6 (even + aux), 8 (odd + aux): the
    newest copy of layers 0 and 2 is step 6's, of every other key step 8's."""
    s6, s8 = root / f"{prefix}6", root / f"{prefix}8"
    return {"layers.0": s6, "layers.2": s6, "layers.1": s8, "layers.3": s8,
            **{k: s8 for k in AUX}}


@pytest.mark.parametrize("name,prefix", [("w2_parity", "global_step"),
                                         ("hf_w2_parity", "checkpoint-"),
                                         ("s2_w3_bf16_parity", "global_step"),
                                         ("hf_s2_w2_parity", "checkpoint-")])
def test_recover_takes_the_newest_copy_of_every_layer_and_resumes(tmp_path, name, prefix):
    root = build(name)
    before = tree_digest(root)
    out = tmp_path / "recovered"
    r = run_cli(["recover", str(root), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    expected = parity_sources(root, prefix)
    check_merge(out, expected, base=root / f"{prefix}8")  # incl. counters and scheduler
    assert tree_digest(root) == before
    hf = VARIANTS[name][1] == HF_MODULE
    # HF resumes with the LayerwiseTrainer that saved (its one-group-per-layer optimizer).
    spec = replace(spec_for(name, tmp_path / "resumed"), steps=11,
                   save_at=(1000,) if hf else (), stats=None,
                   policy=VARIANTS[name][0]["policy"] if hf else None,
                   load_dir=str(out), load_tag=None if hf else "global_step8")
    result = launch(spec, module=VARIANTS[name][1] or "dev.tinytrain.worker")
    assert result["global_steps"] == 11
    assert len(result["losses"][-3:]) == 3 and all(math.isfinite(x)
                                                   for x in result["losses"][-3:])


@pytest.mark.parametrize("name", ["w2_parity", "s2_w3_bf16_parity"])
def test_partial_slices_equal_a_full_save_of_the_same_step(name):
    """The twin run is the same training with full saves: bit for bit the same state."""
    partial, full = read_meta(build(name) / "global_step8"), \
        read_meta(build(f"{name}_twin_full") / "global_step8")
    assert partial.held_layers == frozenset({"layers.1", "layers.3", *AUX})
    assert partial.layout == full.layout and partial.subgroup_steps == full.subgroup_steps
    layout = full.layout
    for r in range(full.world_size):
        with open_shard(partial, r) as p, open_shard(full, r) as f:
            held = [s for s in layout.slots
                    if any(s.name.startswith(f"model.layers.{i}.") for i in (1, 3))]
            assert held
            for s in held:
                at, _, n = layout.held(s, r) if layout.flat else (s.offset, 0, s.length)
                for kind in ("fp32", "exp_avg", "exp_avg_sq"):
                    assert np.array_equal(p.read(kind, s.subgroup, at, n).view(np.uint32),
                                          f.read(kind, s.subgroup, at, n).view(np.uint32))
            assert p.model["lr_scheduler"] == f.model["lr_scheduler"]


def test_stage2_partial_saves_keep_no_16bit_weights():
    """A stage 1/2 save's model states hold the whole 16-bit model; a partial one keeps
    placeholders (a merge rebuilds the weights from fp32) and writes DeepSpeed's guard once."""
    tag = build("s2_w3_bf16_parity") / "global_step8"
    model = torch.load(tag / "rank_1_model_states.pt", weights_only=False)
    assert all(t.numel() == 0 for t in model["module"].values())
    assert (tag / "mp_rank_00_model_states.pt").is_file()
    assert not list(tag.glob("zero_pp_rank_*_model_states.pt"))


@pytest.mark.parametrize("name", ["w2_parity", "s2_w3_bf16_parity"])
def test_partial_saves_are_smaller(name):
    sizes = {n: sum(p.stat().st_size for p in (build(n) / "global_step8").iterdir())
             for n in (name, f"{name}_twin_full")}
    assert sizes[name] < 0.7 * sizes[f"{name}_twin_full"]


def test_stats_log_records_every_save():
    with h5py.File(build("w2_adaptive") / "stats.h5") as f:
        assert list(f["step"][:]) == [2, 4, 6, 8]
        assert list(f["full"][:]) == [True, False, False, False]
        layers = [x.decode() for x in f["layers"][:]]
        saved, rel = f["saved"][:], f["relative_update"][:]
    assert saved[0].all() and not saved[1:].all()
    assert math.isinf(rel[0][0]) and all(math.isfinite(x) and x > 0 for x in rel[1])
    for row, step in zip(saved[1:], (4, 6, 8)):  # the log agrees with what was written
        manifest = json.loads((build("w2_adaptive") / f"global_step{step}" /
                               "mpitailor_partial.json").read_text())
        assert {k for k, s in zip(layers, row) if s} == set(manifest["layers"])
    # max_staleness=2: no layer goes two saves without being saved
    assert all((saved[i] | saved[i + 1]).all() for i in range(len(saved) - 1))


def test_recover_emits_a_recipe(tmp_path):
    r = run_cli(["recover", str(build("w2_parity")), "--emit-recipe"], {})
    assert r.returncode == 0, r.stderr
    assert "'0': global_step6" in r.stdout and "base: global_step8" in r.stdout
    sources = yaml.safe_load(r.stdout)["sources"]
    # parity: steps 6 and 8 re-saved every layer the full save (2) and step 4 held
    assert sorted(sources) == ["global_step6", "global_step8"], sources


def test_recover_without_a_full_checkpoint(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity"), root)
    shutil.rmtree(root / "global_step2")
    r = run_cli(["recover", str(root), "-o", str(tmp_path / "out")], {}, ranks=2)
    assert r.returncode == 2 and "no usable full checkpoint to start from" in r.stderr
    assert not (tmp_path / "out").exists()


def test_recover_skips_a_partial_of_another_run(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity"), root)
    # A real partial checkpoint of another run (HF decay/no-decay groups, not per-layer),
    # newer than everything else: it belongs to no save of this run's timeline.
    shutil.copytree(build("hf_w2_parity") / "checkpoint-8" / "global_step8",
                    root / "global_step9")
    before = tree_digest(root)
    r = run_cli(["recover", str(root), "-o", str(tmp_path / "out")], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    assert "skipping global_step9: another timeline" in r.stderr
    manifest = json.loads((tmp_path / "out" / "mpitailor_manifest.json").read_text())
    assert manifest["base"] == "global_step8" and "global_step9" not in manifest["sources"]
    assert tree_digest(root) == before


def test_recover_never_mixes_two_timelines(tmp_path):
    """Partial saves at 4, 6, 8; then a rollback to step 2 (other data) trains on in the
    same save dir: a full save at 4, a partial at 6, and a crash at 7. The abandoned run's
    step 8 must not be mixed into the new run's timeline."""
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity"), root)
    old8 = tree_digest(root / "global_step8")
    spec = replace(spec_for("w2_parity", root), steps=7, save_at=(4, 6), data_seed=1,
                   load_dir=str(root), load_tag="global_step2")
    launch(spec)
    assert read_meta(root / "global_step4").held_layers is None  # the new chain's full save
    r = run_cli(["recover", str(root), "-o", str(tmp_path / "out")], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    assert "skipping global_step8: another timeline" in r.stderr
    manifest = json.loads((tmp_path / "out" / "mpitailor_manifest.json").read_text())
    assert manifest["tag"] == "global_step6" and manifest["base"] == "global_step6"
    assert {layer["global_steps"] for layer in manifest["layers"].values()} == {4, 6}
    new6 = read_meta(root / "global_step6").lineage
    assert manifest["sources"]["global_step6"]["save_id"] == new6.save_id
    assert new6.parent == read_meta(root / "global_step4").lineage.save_id
    assert tree_digest(root / "global_step8") == old8  # the abandoned save is left as it was


def test_stats_plot_writes_a_png(tmp_path):
    out = tmp_path / "stats.png"
    r = run_cli(["stats", "plot", str(build("w2_adaptive") / "stats.h5"), "-o", str(out)], {})
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    r = run_cli(["stats", "plot", str(tmp_path / "nope.h5")], {})
    assert r.returncode == 2 and "not an mpitailor stats file" in r.stderr


def test_a_partial_save_replaces_an_existing_tag(tmp_path):
    """Resumed from an older save, training reaches a saved step again: the new partial
    checkpoint replaces the old one, as DeepSpeed's own save_checkpoint does."""
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity"), root)
    spec = replace(spec_for("w2_parity", root), steps=8, save_at=(6, 8),
                   load_dir=str(root), load_tag="global_step2")  # saves 6 (full), 8 (partial)
    launch(spec)
    meta = read_meta(root / "global_step8")
    assert meta.held_layers == frozenset({"layers.1", "layers.3", *AUX})
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    assert read_meta(root / "global_step6").held_layers is None  # the new chain's full save


def test_stage1_adaptive_saves_recover_and_resume_inside_the_job(tmp_path):
    """ZeRO stage 1, adaptive policy (update statistics from the flat partitions): the
    training ranks recover their own saves and resume from the composite."""
    spec = replace(spec_for("w2_adaptive", tmp_path / "run"), zero_stage=1, stats=None,
                   then_resume=2)
    result = launch(spec)
    resumed = result["resumed"]
    assert ".mpitailor-resume/recovered-global_step8-" in resumed["from"]
    assert (resumed["first_step"], resumed["global_steps"]) == (8, 10)
    assert all(math.isfinite(x) for x in resumed["losses"])
    held = [set(json.loads((tmp_path / "run" / f"global_step{s}" / "mpitailor_partial.json")
                           .read_text())["layers"]) for s in (4, 6, 8)]
    assert all(0 < len({k for k in h if k.startswith("layers.")}) < 4 for h in held)


def test_the_in_job_resume_says_what_it_recovered(tmp_path, caplog):
    """recover_for_resume (LayerwiseTrainer.train(resume_from_checkpoint=True)) logs one line
    naming the full save and the partial saves it took layers from."""
    import logging

    from mpitailor.training import recover_for_resume
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity"), root)
    with caplog.at_level(logging.INFO, logger="mpitailor.training.resume"):
        out = recover_for_resume(root)
    lines = [r.getMessage() for r in caplog.records if r.name == "mpitailor.training.resume"]
    # A plain process is a world of one: the W=2 saves come back resharded for it.
    assert lines == [f"resuming from {out} (step 8, world size 1, resharded from world size 2), "
                     f"recovered from the full save global_step2 and the partial saves "
                     f"global_step4, global_step6, global_step8 (newest copy of every layer)"], \
        lines
    assert (read_meta(out).global_steps, read_meta(out).world_size) == (8, 1)
    # The base is a partial save: DeepSpeed's scripts of the run come along, as with a full one.
    assert (out / "zero_to_fp32.py").read_bytes() == (root / "zero_to_fp32.py").read_bytes()


def test_the_in_job_resume_reuses_its_composite_per_world_size(tmp_path):
    """Run twice at the same size, the resume reuses the composite it wrote (HF saves: the
    manifest names the tag dir, the save its checkpoint-N); a full save given at another
    size is resharded once, then reused."""
    from mpitailor.training.resume import recover_for_resume, reshard_for_resume
    root = tmp_path / "run"
    shutil.copytree(build("hf_w2_parity"), root)
    first = recover_for_resume(root)
    written = (first / "mpitailor_manifest.json").stat().st_mtime_ns
    assert recover_for_resume(root) == first
    assert (first / "mpitailor_manifest.json").stat().st_mtime_ns == written
    full = root / "checkpoint-2"
    resharded = reshard_for_resume(full, tmp_path / "resume")
    assert resharded != full and read_meta(resharded).world_size == 1
    assert reshard_for_resume(full, tmp_path / "resume") == resharded


def test_the_in_job_resume_removes_what_a_killed_save_left(tmp_path, caplog):
    """D8 of issue 41: a save killed while writing leaves its staging dir and lock beside
    the saves; the resume that follows removes them (nobody holds the lock) and says so,
    rather than leaving them until the next partial save or `mpitailor clean`."""
    import logging

    from mpitailor.publish.leftovers import LOCK, STAGING, path_of
    from mpitailor.training import recover_for_resume
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity"), root)
    staging, lock = (path_of(root / "global_step10", s) for s in (STAGING, LOCK))
    staging.mkdir()
    (staging / "rank_0_model_states.pt").write_bytes(b"half")
    lock.write_text("")
    with caplog.at_level(logging.INFO, logger="mpitailor.training.resume"):
        out = recover_for_resume(root)
    assert read_meta(out).global_steps == 8
    assert not os.path.lexists(staging) and not os.path.lexists(lock)
    line, = [r.getMessage() for r in caplog.records if r.name == "mpitailor.training.resume"]
    assert "removed what interrupted saves left" in line and staging.name in line, line
