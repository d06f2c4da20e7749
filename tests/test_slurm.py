"""On a real one-node Slurm: requeue and resume through the prologue, the singleton guard.

`make test-slurm` (part of `make test`) installs and starts the cluster with
slurm/start-cluster.sh (root; ~8 s the first time) and sets MPITAILOR_SLURM_TESTS=1; the plain
`pytest tests` run skips this module. The module is skipped only when Slurm cannot be set up
here (start-cluster.sh exits 3: not root, or apt fails).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ckpt_fixtures
import pytest
from cluster_util import wait_for
from doc_scripts import doc_script

from dev.tinytrain import TrainSpec
from dev.tinytrain.worker import client_state, shown_client_state
from mpitailor.formats.zero.read import read_meta

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "slurm"
CANNOT_SET_UP = 3  # start-cluster.sh: not root, or apt fails

pytestmark = pytest.mark.skipif(
    os.environ.get("MPITAILOR_SLURM_TESTS") != "1",
    reason="runs in `make test-slurm` (part of `make test`), which starts a one-node Slurm "
           "as root; MPITAILOR_SLURM_TESTS=1 runs it here")


@pytest.fixture(scope="module")
def env():
    """Environment for Slurm commands; the cluster is stopped at the end if started here."""
    start = subprocess.run(["bash", str(SLURM / "start-cluster.sh")], capture_output=True,
                           text=True, timeout=300)
    if start.returncode == CANNOT_SET_UP:
        pytest.skip(f"Slurm cannot be set up here: {start.stderr.strip().splitlines()[-1]}")
    assert start.returncode == 0, f"start-cluster.sh failed:\n{start.stderr}"
    conf = re.search(r"^export SLURM_CONF=(.+)$", start.stdout, re.M).group(1)
    yield {**os.environ, "SLURM_CONF": conf, "MPITAILOR_PYTHON": sys.executable}
    if "started slurmctld" in start.stderr:  # else `make test-slurm` (or you) stops it
        subprocess.run(["bash", str(SLURM / "stop-cluster.sh")], timeout=120)


def run(cmd, env, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def job_state(job: str, env) -> str:
    show = run(["scontrol", "show", "job", job], env, timeout=30).stdout
    return m.group(1) if (m := re.search(r"JobState=(\S+)", show)) else "UNKNOWN"


def diagnose(job: str, out: Path, env) -> str:
    text = out.read_text() if out.exists() else "(no output file)"
    show = run(["scontrol", "show", "job", job], env, timeout=30)
    return f"--- {out}:\n{text}\n--- scontrol show job {job}:\n{show.stdout}{show.stderr}"


def submit(job_env, out: Path, *options: str) -> str:
    """sbatch slurm/train.sbatch from the repo root; the job id."""
    sub = run(["sbatch", "--parsable", *options, f"--output={out}", SLURM / "train.sbatch"],
              job_env, timeout=30, cwd=REPO)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def test_requeued_training_resumes_from_the_recovered_checkpoint(env, tmp_path):
    save, out = tmp_path / "save", tmp_path / "train.out"
    # Steps slow enough (1.5 s) to requeue between the first partial save and the next.
    # Every save carries ordinary objects in client_state (a Namespace, a numpy scalar, a
    # dataclass), as real training scripts do: they must not turn the resume into a restart.
    job_env = {**env, "MPITAILOR_SAVE_DIR": str(save),
               "MPITAILOR_TRAIN_ARGS": "--step-sleep 1.5 --client-state"}
    job = submit(job_env, out)
    try:
        wait_for("partial checkpoint", lambda: list(save.glob("*/mpitailor_partial.json")), 150)
        requeue = run(["scontrol", "requeue", job], env, timeout=30)
        assert requeue.returncode == 0, requeue.stderr
        # Slurm restarts a requeued job once the old credential expires (~18 s here).
        state = wait_for("end of the job", lambda: (s := job_state(job, env)) in
                         ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") and s,
                         240, interval=1)
        assert state == "COMPLETED"
        check_resumed_run(out.read_text(), tmp_path)
    except (AssertionError, TimeoutError) as e:
        pytest.fail(f"{e}\n{diagnose(job, out, env)}")
    finally:
        run(["scancel", job], env, timeout=30)


def check_resumed_run(text: str, root: Path) -> None:
    assert "restart 1" in text and "CANCELLED" in text and "DUE TO JOB REQUEUE" in text
    recovered = Path((root / "resume-from").read_text().strip())
    assert recovered.parent == root and recovered.name.startswith("recovered-step")
    assert f"recovered {recovered} (tag" in text
    assert "written by 2 rank(s)" in text  # the prologue's srun gave one MPI world of 2
    tag = (recovered / "latest").read_text().strip()
    step = int(re.fullmatch(r"global_step(\d+)", tag).group(1))
    manifest = json.loads((recovered / "mpitailor_manifest.json").read_text())
    steps = {layer["global_steps"] for layer in manifest["layers"].values()}
    assert max(steps) == step and len(steps) >= 2, manifest["layers"]  # a composite
    results = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert len(results) == 1  # the first run was killed before it printed one
    result = results[0]
    assert result["first_step"] == step and result["global_steps"] == 12
    assert len(result["losses"]) == 12 - step
    spec = TrainSpec(save_dir=str(root), client_state=True)  # the job's lr and seed
    assert result["client_state"] == shown_client_state(client_state(spec, step)), result
    assert all(math.isfinite(x) for x in result["losses"]), result


def test_srun_without_pmi_is_refused_not_run_as_singletons(env, tmp_path):
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(f"layers: {{rest: {ckpt_fixtures.build('w2_parity')}/global_step2}}\n")
    cmd = ["srun", "-n", "2", sys.executable, "-m", "mpitailor", recipe, "--no-progress"]
    bad = run([*cmd[:1], "--mpi=none", *cmd[1:], "-o", tmp_path / "bad"], env)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.count("SLURM_STEP_NUM_TASKS=2 says 2 processes") == 2  # both ranks
    assert "srun --mpi=pmi2" in bad.stderr
    assert not (tmp_path / "bad").exists()
    good = run([*cmd, "-o", tmp_path / "good"], env)  # MpiDefault=pmi2
    assert good.returncode == 0, good.stderr
    assert "written by 2 rank(s)" in good.stdout


def prologue(save: Path, out_parent: Path, env) -> subprocess.CompletedProcess:
    return run(["bash", SLURM / "resume-prologue.sh", save, out_parent], env)


def test_prologue_twice_reuses_the_first_recovery(env, tmp_path):
    save = ckpt_fixtures.build("w2_parity")  # full save at 2, partial saves at 4, 6, 8
    first = prologue(save, tmp_path, env)
    assert first.returncode == 0, first.stderr
    recovered = tmp_path / "recovered-step8"
    assert first.stdout == f"MPITAILOR_RESUME_FROM={recovered}\n"
    assert "written by 2 rank(s)" in first.stderr
    manifest = recovered / "mpitailor_manifest.json"
    written = manifest.stat().st_mtime_ns
    second = prologue(save, tmp_path, env)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert f"reusing {recovered}" in second.stderr and "written by" not in second.stderr
    assert manifest.stat().st_mtime_ns == written
    assert (tmp_path / "resume-from").read_text() == f"{recovered}\n"


def test_prologue_leaves_a_foreign_dir_in_place_of_its_output_alone(env, tmp_path):
    """recovered-step8 exists but is no recovery of this save (a recovery of an abandoned
    timeline's step 8, say): it stays as it is, and the recovery takes the next name."""
    (tmp_path / "recovered-step8").mkdir()
    (tmp_path / "recovered-step8" / "mine").write_text("keep")
    r = prologue(ckpt_fixtures.build("w2_parity"), tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"MPITAILOR_RESUME_FROM={tmp_path / 'recovered-step8.1'}\n"
    assert (tmp_path / "recovered-step8" / "mine").read_text() == "keep"


def test_prologue_fails_when_saves_exist_but_none_recovers(env, tmp_path):
    """Saves exist, and the only full one is damaged: an error, never a fresh start."""
    save = tmp_path / "save"
    shutil.copytree(ckpt_fixtures.build("w2_parity"), save)
    victim = save / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    (tmp_path / "resume-from").write_text("/an/earlier/answer\n")
    r = prologue(save, tmp_path, env)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert "no usable full checkpoint" in r.stderr and "cannot plan the recovery" in r.stderr
    assert not (tmp_path / "resume-from").exists()


def test_prologue_after_a_first_save_killed_half_way_starts_from_scratch(env, tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    shutil.copytree(ckpt_fixtures.build("w2_parity") / "global_step2", save / "global_step2")
    (save / "global_step2" / "mpitailor_save.json").unlink()  # written after DeepSpeed's
    (save / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    r = prologue(save, tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "MPITAILOR_RESUME_FROM=\n" and "nothing to resume from" in r.stderr


def test_prologue_without_checkpoints_has_nothing_to_resume(env, tmp_path):
    (tmp_path / "save").mkdir()
    r = prologue(tmp_path / "save", tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "MPITAILOR_RESUME_FROM=\n"
    assert "nothing to resume from" in r.stderr
    assert (tmp_path / "resume-from").read_text() == "\n"


def test_a_job_back_on_another_number_of_tasks_resumes_at_that_size(env, tmp_path):
    """A 2-task job killed after its first partial save; the same script submitted again
    with --ntasks=3: the prologue recovers for 3 ranks (no hand-run --world-size) and the
    3-rank training resumes from it, not from scratch."""
    save, first, second = tmp_path / "save", tmp_path / "first.out", tmp_path / "second.out"
    job_env = {**env, "MPITAILOR_SAVE_DIR": str(save), "MPITAILOR_TRAIN_ARGS": "--step-sleep 1.5"}
    job = submit(job_env, first)
    try:
        wait_for("partial checkpoint", lambda: list(save.glob("*/mpitailor_partial.json")), 150)
    finally:
        run(["scancel", job], env, timeout=30)
    wait_for("end of the first job", lambda: job_state(job, env) not in ("RUNNING", "PENDING",
                                                                         "COMPLETING"), 60)
    job_env["MPITAILOR_TRAIN_ARGS"] = ""
    job = submit(job_env, second, "--ntasks=3")
    try:
        state = wait_for("end of the job", lambda: (s := job_state(job, env)) in
                         ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") and s,
                         240, interval=1)
        assert state == "COMPLETED"
        text = second.read_text()
        recovered = Path((tmp_path / "resume-from").read_text().strip())
        assert re.fullmatch(r"recovered-step\d+-w3", recovered.name), recovered
        assert "recovering for world size 3" in text and "world size 3) in" in text
        manifest = json.loads((recovered / "mpitailor_manifest.json").read_text())
        assert (manifest["source_world_size"], manifest["world_size"]) == (2, 3)
        step = int((recovered / "latest").read_text().strip().removeprefix("global_step"))
        result, = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert result["first_step"] == step and result["global_steps"] == 12
        assert len(list((recovered / f"global_step{step}").glob("*optim_states.pt"))) == 3
    except (AssertionError, TimeoutError) as e:
        pytest.fail(f"{e}\n{diagnose(job, second, env)}")
    finally:
        run(["scancel", job], env, timeout=30)


def test_prologue_given_a_tag_dir_refuses_and_names_the_save_dir(env, tmp_path):
    """Never an empty MPITAILOR_RESUME_FROM= and exit 0 (a job that would then train from
    scratch next to its saves): the one line names the save dir to give instead."""
    save = ckpt_fixtures.build("w2_parity")
    r = prologue(save / "global_step8", tmp_path, env)
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert f"a checkpoint's tag dir, not a save dir; give the dir that holds the saves: " \
           f"{save}" in r.stderr
    assert not (tmp_path / "resume-from").exists()


def test_prologue_with_keep_last_prunes_after_recovering(env, tmp_path):
    """MPITAILOR_KEEP_LAST=0: once the composite is there, what it no longer needs goes: the
    composite of an older step, and step 4 (its layers saved again at 8); the full save at 2
    and the newest copies (6, 8) stay. The answer is the new composite all the same."""
    save = tmp_path / "save"
    shutil.copytree(ckpt_fixtures.build("w2_parity"), save)
    out_parent = tmp_path / "out"
    (save / "global_step8").rename(tmp_path / "aside")
    older = prologue(save, out_parent, env)  # a composite of step 6, then step 8 is saved
    assert older.returncode == 0, older.stderr
    (tmp_path / "aside").rename(save / "global_step8")
    r = run(["bash", SLURM / "resume-prologue.sh", save, out_parent],
            {**env, "MPITAILOR_KEEP_LAST": "0"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"MPITAILOR_RESUME_FROM={out_parent / 'recovered-step8'}\n"
    assert not (out_parent / "recovered-step6").exists(), r.stderr
    assert (out_parent / "recovered-step8" / "latest").exists()
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("global_step")) == \
        ["global_step2", "global_step6", "global_step8"], r.stderr


# ---- The docs' HF Trainer and Accelerate scripts, as a user submits them -----------------

def submit_script(env, cwd: Path, out: Path, *options: str) -> str:
    """sbatch slurm/train-script.sbatch train.py from cwd (the script's dir); the job id."""
    sub = run(["sbatch", "--parsable", *options, f"--output={out}",
               SLURM / "train-script.sbatch", "train.py"],
              {**env, "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo",
               "OMP_NUM_THREADS": "1"}, timeout=30, cwd=cwd)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def finished(job: str, env) -> str:
    return wait_for("end of the job", lambda: (s := job_state(job, env)) in
                    ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") and s, 300,
                    interval=1)


def test_the_docs_hf_trainer_script_requeued_mid_save_resumes(env, tmp_path):
    """docs/training.md's HF Trainer script, run by slurm/train-script.sbatch on 2 tasks, is
    requeued (scontrol requeue) while rank 0 publishes its step-6 save: the requeued run,
    the same script unchanged, skips the half-written checkpoint-6, resumes from the
    composite of checkpoints 2 and 4, and completes step 8."""
    (tmp_path / "train.py").write_text(doc_script("hf-trainer-example"))
    gate, out = tmp_path / "gate", tmp_path / "job.out"
    gate.mkdir()
    hold = f"partial-publish/checkpoint-6/global_step6:0:pause={gate}"
    job = submit_script({**env, "MPITAILOR_FAILPOINT": hold}, tmp_path, out)
    try:
        wait_for("the step-6 save", lambda: (gate / "reached").exists(), 240)
        requeue = run(["scontrol", "requeue", job], env, timeout=30)
        assert requeue.returncode == 0, requeue.stderr
        # Only once the requeued run has started (so the first run's rank 0, held before
        # publishing, is gone): a go-ahead sooner raced the requeue's SIGTERM, and in one CI
        # run under load rank 0 published checkpoint-6 before the signal came.
        wait_for("the requeued run", lambda: out.exists() and "restart 1" in out.read_text(),
                 240, interval=0.5)
        (gate / "go").touch()  # the requeued run passes the point
        assert finished(job, env) == "COMPLETED"
        text = out.read_text()
        assert "restart 1" in text and "DUE TO JOB REQUEUE" in text
        assert "skipping checkpoint-6" in text and "an incomplete save" in text, text[-3000:]
        assert re.search(r"resuming from \S+/recovered-checkpoint-4-\S+ \(step 4, world size 2\)",
                         text), text[-3000:]
        state = json.loads((tmp_path / "run" / "checkpoint-8" / "trainer_state.json")
                           .read_text())
        assert state["global_step"] == 8
    except (AssertionError, TimeoutError) as e:
        pytest.fail(f"{e}\n{diagnose(job, out, env)}")
    finally:
        run(["scancel", job], env, timeout=30)


def test_the_docs_accelerate_script_back_on_three_tasks_resumes_at_that_size(env, tmp_path):
    """docs/training.md's Accelerate script on 2 tasks, cancelled while rank 0 publishes its
    step-6 save; the same script submitted again with --ntasks=3 recovers the newest copy
    of every layer for 3 ranks itself (recover_for_resume) and trains on to step 8."""
    (tmp_path / "train.py").write_text(doc_script("accelerate-example"))
    gate, first, second = tmp_path / "gate", tmp_path / "first.out", tmp_path / "second.out"
    gate.mkdir()
    hold = f"partial-publish/checkpoint-6/pytorch_model:0:pause={gate}"
    job = submit_script({**env, "MPITAILOR_FAILPOINT": hold}, tmp_path, first)
    try:
        wait_for("the step-6 save", lambda: (gate / "reached").exists(), 240)
    finally:
        run(["scancel", job], env, timeout=30)
    finished(job, env)
    job = submit_script(env, tmp_path, second, "--ntasks=3")
    try:
        assert finished(job, env) == "COMPLETED"
        text = second.read_text()
        assert "3 task(s)" in text
        assert "resuming from" in text and "(step 4, world size 3, resharded from world " \
            "size 2)" in text, text[-3000:]
        new = read_meta(tmp_path / "run" / "checkpoint-8" / "pytorch_model")
        assert (new.world_size, new.global_steps) == (3, 8)
    except (AssertionError, TimeoutError) as e:
        pytest.fail(f"{e}\n{diagnose(job, second, env)}")
    finally:
        run(["scancel", job], env, timeout=30)
