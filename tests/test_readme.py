"""The HF Trainer script of docs/training.md runs as written: on 2 CPU processes it trains
with layer-wise saves, is killed (kill -9) in a save, and run again it recovers and resumes by
itself — on 2 processes, and on 1 or 3 (a job requeued on another number of GPUs)."""
from __future__ import annotations

import json

import pytest
from doc_scripts import assert_same_checkpoint, copy_run, doc_script, run_ranks

from mpitailor import recover
from mpitailor.formats.zero.read import read_meta


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The job that failed: rank 0 killed (kill -9) while publishing its step-8 partial save."""
    root = tmp_path_factory.mktemp("hf-killed")
    code = doc_script("hf-trainer-example")
    assert "max_steps=8" in code and "resume_from_checkpoint=" in code
    (root / "train.py").write_text(code)
    codes = run_ranks(root / "train.py", root,
                      {"MPITAILOR_FAILPOINT": "partial-publish/global_step8:0"})
    assert codes[0] == -9, (root / "rank0.log").read_text()[-3000:]
    assert not (root / "run" / "checkpoint-8" / "latest").exists()  # not a save
    assert (root / "run" / "checkpoint-6" / "global_step6" / "mpitailor_partial.json").exists()
    return root


@pytest.mark.parametrize("world", [2, 1, 3])
def test_the_readme_hf_trainer_example_resumes_at_any_size(killed, tmp_path, world):
    run = copy_run(killed, tmp_path) / "run"
    offline = tmp_path / "offline"  # what `recover --world-size N` makes of the same saves
    recover(run, offline, world_size=world)
    codes = run_ranks(tmp_path / "train.py", tmp_path, ranks=world)  # the requeued job
    log = (tmp_path / "rank0.log").read_text()
    assert codes == [0] * world, log[-3000:]
    composite, = (run / ".mpitailor-resume").glob(f"recovered-checkpoint-6-*-w{world}")
    resharded = "" if world == 2 else ", resharded from world size 2"
    # One line, with no logging set up by the script: where it resumed from, at what size.
    assert (f"mpitailor: resuming from {composite} (step 6, world size {world}{resharded})"
            f", recovered from the full save checkpoint-2 and the partial saves checkpoint-4, "
            f"checkpoint-6 (newest copy of every layer)") in log, log[-3000:]
    assert read_meta(composite).world_size == world
    # HF says at INFO only that a rank has no RNG state; mpitailor warns (one line)
    missing = {2: None, 1: "rng_state.pth", 3: "rng_state_2.pth"}[world]
    rng = [line for line in log.splitlines() if "holds no rng_state" in line]
    assert rng == ([] if missing is None else [
        f"mpitailor: warning: {composite} holds no {missing} (saved by another number of "
        f"ranks): those random streams start afresh, the rest resume exactly"]), log[-3000:]
    assert_same_checkpoint(composite, offline)
    # The base is a partial save: it carries what a full checkpoint-N would.
    for name in ("zero_to_fp32.py", "generation_config.json", "config.json"):
        assert (composite / name).is_file(), name
    start = json.loads((composite / "trainer_state.json").read_text())
    state = json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())
    assert start["global_step"] == 6 and state["global_step"] == 8  # resumed, not restarted
    # The resumed job's first save starts a new timeline: a full save, at the new size.
    assert read_meta(run / "checkpoint-8").world_size == world
    assert not (run / "checkpoint-8" / "global_step8" / "mpitailor_partial.json").exists()


def test_the_readme_hf_trainer_example_killed_in_its_first_save_starts_afresh(tmp_path):
    """Killed in its first save (a full one: DeepSpeed's files written, `latest` too, but
    not HF's trainer state), the script run again starts from scratch with one warning, and
    removes what the killed save left, instead of failing on every restart."""
    (tmp_path / "train.py").write_text(doc_script("hf-trainer-example"))
    codes = run_ranks(tmp_path / "train.py", tmp_path,
                      {"MPITAILOR_FAILPOINT": "full-save/checkpoint-2:0"})
    assert codes[0] == -9, (tmp_path / "rank0.log").read_text()[-3000:]
    run = tmp_path / "run"
    assert not (run / "checkpoint-2" / "trainer_state.json").exists()
    codes = run_ranks(tmp_path / "train.py", tmp_path)
    log = (tmp_path / "rank0.log").read_text()
    assert codes == [0, 0], log[-3000:]
    warnings = [line for line in log.splitlines() if line.startswith("mpitailor: warning: ")]
    assert len(warnings) == 1 and "training starts from scratch" in warnings[0] and \
        "removed what an interrupted save left: checkpoint-2" in warnings[0], log[-3000:]
    state = json.loads((run / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and (run / "checkpoint-2" / "latest").exists()
    assert not (run / ".mpitailor-resume").exists()  # nothing was recovered
