"""The README's HF Trainer script runs as written: on 2 CPU processes it trains with layer-wise
saves, is killed (kill -9) in a save, and run again it recovers and resumes by itself."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from mpitailor.tinytrain.launch import free_port, worker_env

README = Path(__file__).resolve().parents[1] / "README.md"


def snippet() -> str:
    text = README.read_text()
    m = re.search(r"<!-- hf-trainer-example -->\n```python\n(.*?)```\n<!-- /hf-trainer-example -->",
                  text, re.S)
    assert m, "the README lost its HF Trainer example"
    return m.group(1)


def run(script: Path, cwd: Path, ranks: int = 2, env: dict | None = None) -> list[int]:
    port = free_port()
    logs = [cwd / f"rank{r}.log" for r in range(ranks)]
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=cwd, stdout=log.open("w"),
                              stderr=subprocess.STDOUT,
                              env={**worker_env(r, ranks, port), **(env or {})})
             for r, log in enumerate(logs)]
    try:
        return [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_the_readme_hf_trainer_example(tmp_path):
    code = snippet()
    assert "max_steps=8" in code and "resume_from_checkpoint=" in code
    script = tmp_path / "train.py"
    script.write_text(code)
    # The job that failed: rank 0 killed (kill -9) while publishing its step-8 partial save.
    codes = run(script, tmp_path, env={"MPITAILOR_FAILPOINT": "partial-publish/global_step8:0"})
    assert codes[0] == -9, (tmp_path / "rank0.log").read_text()[-3000:]
    assert not (tmp_path / "run" / "checkpoint-8" / "latest").exists()  # not a save
    assert (tmp_path / "run" / "checkpoint-6" / "global_step6" / "mpitailor_partial.json").exists()
    codes = run(script, tmp_path)  # the requeued job: the README's script, as written
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    composite = list((tmp_path / "run" / ".mpitailor-resume").glob("recovered-checkpoint-6-*"))
    assert len(composite) == 1
    start = json.loads((composite[0] / "trainer_state.json").read_text())
    state = json.loads((tmp_path / "run" / "checkpoint-8" / "trainer_state.json").read_text())
    assert start["global_step"] == 6 and state["global_step"] == 8  # resumed, not restarted
    # The resumed job's first save starts a new timeline: a full save.
    assert list((tmp_path / "run" / "checkpoint-8" / "global_step8").glob("*optim_states.pt"))
