"""The README's HF Trainer script runs as written: on 2 CPU processes it trains with layer-wise
saves, is killed (kill -9) in a save, and run again it recovers and resumes by itself."""
from __future__ import annotations

import json

from readme_scripts import readme_script, run_ranks


def test_the_readme_hf_trainer_example(tmp_path):
    code = readme_script("hf-trainer-example")
    assert "max_steps=8" in code and "resume_from_checkpoint=" in code
    script = tmp_path / "train.py"
    script.write_text(code)
    # The job that failed: rank 0 killed (kill -9) while publishing its step-8 partial save.
    codes = run_ranks(script, tmp_path, {"MPITAILOR_FAILPOINT": "partial-publish/global_step8:0"})
    assert codes[0] == -9, (tmp_path / "rank0.log").read_text()[-3000:]
    assert not (tmp_path / "run" / "checkpoint-8" / "latest").exists()  # not a save
    assert (tmp_path / "run" / "checkpoint-6" / "global_step6" / "mpitailor_partial.json").exists()
    codes = run_ranks(script, tmp_path)  # the requeued job: the README's script, as written
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    composite = list((tmp_path / "run" / ".mpitailor-resume").glob("recovered-checkpoint-6-*"))
    assert len(composite) == 1
    start = json.loads((composite[0] / "trainer_state.json").read_text())
    state = json.loads((tmp_path / "run" / "checkpoint-8" / "trainer_state.json").read_text())
    assert start["global_step"] == 6 and state["global_step"] == 8  # resumed, not restarted
    # The resumed job's first save starts a new timeline: a full save.
    assert list((tmp_path / "run" / "checkpoint-8" / "global_step8").glob("*optim_states.pt"))
