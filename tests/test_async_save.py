"""Asynchronous layer-wise saves (real DeepSpeed, ZeRO stages 1-3, HF Trainer): the same
saves as synchronous ones, nothing visible until complete, and failures never silent."""
from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from ckpt_fixtures import ASYNC_TWINS, FROZEN, VARIANTS, build, spec_for
from conftest import tree_digest
from merging import run_cli
from safetensors import safe_open
from stats_check import check_norms, read_log

from dev.compare import same
from dev.tinytrain import TrainSpec, launch
from dev.tinytrain.launch import TrainFailed
from mpitailor.formats.manifest import PARTIAL_MANIFEST, read_manifest
from mpitailor.formats.torch.safeload import load

LAYERWISE_STEPS = (4, 6, 8)  # partial saves of the fixtures (2 is the full one)


def tag_dirs(root: Path, step: int) -> Path:
    hf = root / f"checkpoint-{step}"
    return hf / f"global_step{step}" if hf.is_dir() else root / f"global_step{step}"


@pytest.mark.parametrize("twin", sorted(ASYNC_TWINS))
def test_asynchronous_saves_hold_what_synchronous_saves_hold(twin):
    sync_root, async_root = build(ASYNC_TWINS[twin]), build(twin)
    for step in LAYERWISE_STEPS:
        a, b = tag_dirs(sync_root, step), tag_dirs(async_root, step)
        ma, mb = read_manifest(a / PARTIAL_MANIFEST), read_manifest(b / PARTIAL_MANIFEST)
        assert ma.kind == mb.kind == "partial"
        assert sorted(ma.files) == sorted(mb.files), step
        for key in ("layers", "global_steps", "world_size", "dtype", "zero_stage",
                    "layout_sha256"):
            assert ma[key] == mb[key], (step, key)
        for name in ma.files:
            if name.endswith(".safetensors"):  # the layers' slices: the same bytes
                assert (a / name).read_bytes() == (b / name).read_bytes(), (step, name)
                with safe_open(b / name, "pt") as f:
                    assert len(f.keys()) > 0
            elif name.startswith("rank_"):    # model states, optimizer state, rng: same values
                sa = load(a / name, opaque_ok=True, allow=("numpy", "deepspeed"))
                sb = load(b / name, opaque_ok=True, allow=("numpy", "deepspeed"))
                assert same(sa, sb), (step, name)
    if (async_root / "checkpoint-8").is_dir():  # HF: `latest` after the writer published
        assert (async_root / "checkpoint-8" / "latest").read_text() == "global_step8"


def test_asynchronous_save_timings_and_stats_log(tmp_path):
    spec = replace(spec_for("w2_parity_async", tmp_path / "run"), stats=str(tmp_path / "s.h5"))
    result = launch(spec)
    timings = result["save_timings"]
    assert [t["step"] for t in timings] == [2, 4, 6, 8]
    assert [t["full"] for t in timings] == [True, False, False, False]
    partial = timings[1:]
    assert all(t["blocked"] > 0 and t["background"] > 0 for t in partial)
    # Rank 0's copies start a second late (COPY_LATE), long after the next step's forward and
    # backward of this tiny model: the optimizer steps after the saves of steps 4 and 6 were
    # held for them; after the last save no step came.
    assert [t["step_held"] > 0 for t in partial] == [True, True, False], partial
    # Host buffers: none after construction (and the full save); from the first partial save
    # on, the largest partial save parity makes (rank 0's slices, as its files hold them).
    root = tmp_path / "run"
    need = []
    for step in LAYERWISE_STEPS[:2]:  # a parity cycle
        with safe_open(root / f"global_step{step}" / "rank_0_layers.safetensors", "pt") as f:
            need.append(sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys()))
    assert [t["host_bytes"] for t in timings] == [0] + [max(need)] * 3
    log = read_log(tmp_path / "s.h5")
    assert log["blocked_s"].shape == (4,) and all(x > 0 for x in log["blocked_s"])
    assert all(x > 0 for x in log["background_s"][1:])
    held = log["step_held_s"]  # as the timings: the steps after saves 4 and 6 held
    assert math.isnan(held[0]) and all(held[1:3] > 0) and held[3] == 0, held
    assert np.array_equal(log["saved"], log["chosen"])  # every save was published
    # The saved copy behind the update norms is taken from the host buffers, in the writer.
    assert check_norms(root, log, (2, 4, 6, 8)) == 3 * 5  # held by 4, 6, 8


@pytest.mark.parametrize("twin", ["s1_w2_parity_async", "hf_s2_w2_parity_async"])
def test_the_next_optimizer_step_waits_for_the_overlapped_copy(twin, tmp_path):
    """ZeRO stage 1 and the HF Trainer (stage 2) go through the same hook as the plain loop
    at stage 3 (above): with rank 0's copy a second late, the optimizer step after each
    partial save but the last was held; the saves hold what synchronous saves hold
    (test_asynchronous_saves_hold_what_synchronous_saves_hold)."""
    result = launch(spec_for(twin, tmp_path / "run"), module=VARIANTS[twin][1]
                    or "dev.tinytrain.worker")
    partial = result["save_timings"][1:]
    assert [t["step"] for t in partial] == [4, 6, 8]
    assert [t["step_held"] > 0 for t in partial] == [True, True, False], partial


def test_kill_9_during_the_background_write_leaves_the_previous_saves(tmp_path):
    """Rank 0 dies while the writer of the step-6 save runs (its rank files written, the
    manifest not): nothing of step 6 is visible, and recover takes the saves before it."""
    root = tmp_path / "run"
    spec = replace(spec_for("w2_parity_async", root), stats=str(tmp_path / "s.h5"),
                   extra={"env": {"MPITAILOR_FAILPOINT": "partial-publish/global_step6:0"}})
    with pytest.raises(TrainFailed, match="rank 0 exited -9"):
        launch(spec)
    assert not (root / "global_step6").exists()
    assert not (root / "global_step8").exists()
    log = read_log(tmp_path / "s.h5")  # step 6 was attempted, and is not recorded as saved
    assert list(log["step"]) == [2, 4, 6]
    assert log["saved"][1].any() and log["chosen"][2].any() and not log["saved"][2].any()
    # Recovering the crashed run equals recovering a copy of the saves made before step 6.
    before = tmp_path / "before"
    before.mkdir()
    for name in ("global_step2", "global_step4"):
        shutil.copytree(root / name, before / name)
    shutil.copy2(root / "latest", before / "latest")
    digest = tree_digest(root)
    for d, out in ((root, tmp_path / "a"), (before, tmp_path / "b")):
        r = run_cli(["recover", str(d), "-o", str(out)], {}, ranks=2)
        assert r.returncode == 0, r.stderr
    assert tree_digest(root) == digest  # the staging dir left by the kill is not touched
    for name in sorted(p.name for p in (tmp_path / "a" / "global_step4").iterdir()):
        assert (tmp_path / "a" / "global_step4" / name).read_bytes() == \
            (tmp_path / "b" / "global_step4" / name).read_bytes(), name


def test_a_full_disk_in_the_writer_raises_on_every_rank_and_publishes_nothing(tmp_path):
    root = tmp_path / "run"
    spec = replace(spec_for("w2_parity_async", root), stats=str(tmp_path / "s.h5"),
                   extra={"env": {"MPITAILOR_FAILPOINT": "partial-write/global_step4:1:enospc"}})
    with pytest.raises(TrainFailed) as failed:
        launch(spec)
    text = str(failed.value)
    # The one rank's failure raised on both (the exit code after an uncaught exception can be
    # 1, or an abort in the interpreter's teardown with DeepSpeed's threads alive).
    for rank in (0, 1):
        assert f"training rank {rank} exited" in text
    assert text.count("PartialSaveFailed: partial checkpoint not saved") >= 2
    assert "No space left on device" in text and "(on rank 1)" in text
    assert not (root / "global_step4").exists()
    assert not list(root.glob(".global_step4*"))  # staging removed, lock released
    assert (root / "global_step2").is_dir()  # the full save before it stands
    # The stats log: step 4 says what the policy chose and that nothing was saved; the save
    # that raised (step 6) wrote no row.
    log = read_log(tmp_path / "s.h5")
    assert list(log["step"]) == [2, 4]
    assert log["saved"][0].all() and log["chosen"][0].all()
    assert {k for k, c in zip(log["layers"], log["chosen"][1]) if c} == \
        {"layers.1", "layers.3", "embed", "norm", "lm_head"}
    assert not log["saved"][1].any()
    assert math.isfinite(log["blocked_s"][1]) and math.isnan(log["background_s"][1])


def test_host_buffers_over_the_limit_are_refused_on_every_rank(tmp_path):
    # A model wide enough that a partial save's slices pass 1 MiB, the least limit accepted
    spec = replace(spec_for("w2_parity_async", tmp_path / "run"), stats=None, hidden=256,
                   intermediate=512, max_host_bytes="1MiB")
    with pytest.raises(TrainFailed) as failed:
        launch(spec)
    text = str(failed.value)
    assert text.count("over max_host_bytes=1.00 MiB (1048576 bytes)") >= 2  # on both ranks
    for rank in (0, 1):
        assert f"training rank {rank} exited" in text
    assert not (tmp_path / "run" / "global_step4").exists()


def test_resume_from_asynchronous_saves(tmp_path):
    root = build("w2_parity_async")
    out = tmp_path / "recovered"
    r = run_cli(["recover", str(root), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    spec = replace(spec_for("w2_parity_async", tmp_path / "resumed"), steps=10, save_at=(),
                   stats=None, policy=None, async_save=False, load_dir=str(out),
                   load_tag="global_step8")
    result = launch(spec)
    assert result["global_steps"] == 10
    assert all(math.isfinite(x) for x in result["losses"])
    assert VARIANTS["w2_parity_async"][0]["async_save"] is True


def test_saves_that_outpace_the_writer_are_said_with_the_figures(tmp_path):
    # Rank 0's writer of step 4 sleeps 3 s: the save of step 6 waits for it while training
    # stands still, and rank 0 warns once (at most one a minute), naming both saves.
    spec = replace(spec_for("w2_parity_async", tmp_path / "run"), stats=None,
                   extra={"env": {"MPITAILOR_FAILPOINT": "partial-write/global_step4:0:sleep=3"}})
    result = launch(spec, log_dir=tmp_path)
    waited = {t["step"]: t["waited"] for t in result["save_timings"]}
    assert waited[6] > 1 and waited[8] < 1, waited
    warnings = [line for line in (tmp_path / "rank0.log").read_text().splitlines()
                if "asynchronous saves come faster than they are written" in line]
    assert len(warnings) == 1, warnings
    assert "the save of step 4 took" in warnings[0] and "the save of step 6 waited" in warnings[0]
    assert "come faster" not in (tmp_path / "rank1.log").read_text()


def test_end_cpu_training_waits_for_the_save_in_flight(tmp_path):
    """The last line of the docs' training scripts, right after an asynchronous save (the
    writer of step 8 still sleeping): the save is published before the process ends, exit 0."""
    root = tmp_path / "run"
    spec = replace(spec_for("w2_parity_async", root), stats=None,
                   extra={"end": "end_cpu_training",
                          "env": {"MPITAILOR_FAILPOINT": "partial-write/global_step8:0:sleep=3"}})
    launch(spec)
    assert (root / "global_step8" / PARTIAL_MANIFEST).is_file()
    assert not list(root.glob(".global_step8*"))


def test_end_cpu_training_fails_loudly_when_the_save_in_flight_fails(tmp_path):
    root = tmp_path / "run"
    spec = replace(spec_for("w2_parity_async", root), stats=None,
                   extra={"end": "end_cpu_training",
                          "env": {"MPITAILOR_FAILPOINT": "partial-write/global_step8:1:enospc"}})
    with pytest.raises(TrainFailed) as failed:
        launch(spec)
    text = str(failed.value)
    for rank in (0, 1):
        assert f"training rank {rank} exited 1" in text, text
    assert "mpitailor: end_cpu_training: waiting for the asynchronous save of " \
           f"{root / 'global_step8'} to be published" in text, text
    assert text.count("mpitailor: error: end_cpu_training: partial checkpoint not saved") >= 1, \
        text
    assert "; exiting with 1" in text
    assert not (root / "global_step8").exists()


@pytest.mark.parametrize("variant", [{}, dict(tie=True), dict(dtype="bf16", tie=True,
                                                              frozen=FROZEN)],
                         ids=["untied", "tied", "bf16-tied-frozen"])
def test_zero3_module_placeholders_are_the_bytes_deepspeed_writes(tmp_path, variant):
    # A partial save makes the module's placeholders without DeepSpeed's partitioning round
    # trip (a collective per save); the bytes must be what DeepSpeed's own prologue gives,
    # the persistent parameters included (a tiny model: most of them are), tied and frozen
    # ones too.
    spec = TrainSpec(save_dir=str(tmp_path), world_size=2, layers=2, steps=2, save_at=(),
                     **variant)
    ranks = launch(spec, module="tests.states_worker")
    for r in ranks:
        assert r["gathered"] > 0 and r["gathered_after"] == r["gathered"], r
        assert r["equal"], r
