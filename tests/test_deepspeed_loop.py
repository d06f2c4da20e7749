"""The plain DeepSpeed loop of docs/training.md runs as written: on 2 CPU processes it saves
layer-wise and is killed (kill -9, rank 0, publishing its step-8 save); requeued on 1, 2 or 3
processes it resumes at step 6 from a composite written for its own world size: byte for byte what
`mpiexec -n 2 python -m mpitailor recover run -o OUT --world-size N` writes offline, and once
loaded the engine holds exactly that composite's weights and Adam moments. A run killed in its
first save (a full DeepSpeed save) starts from scratch when run again, with one warning.

Cost: one killed run shared by the three resumes (module fixture), three resumes, three
offline recovers, and a run killed at step 2 then run in full: about 75 s of CPU, most of it
process start-up; 230 s of wall time on the 2-core machine while other jobs loaded it.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from merge_check import Ckpt, check_merge
from merging import run_cli
from doc_scripts import doc_script, run_ranks

MARKER = "deepspeed-example"
KILL_AT_8 = "partial-publish/global_step8:0"  # rank 0, publishing its step-8 partial save
KEYS = ("embed", "norm", "lm_head", "other", *(f"layers.{i}" for i in range(4)))

# Runs train.py as written, but rank 0 dies (SIGKILL) halfway through writing its optimizer
# states of the step-2 save: the first save, a full DeepSpeed one, where mpitailor has no
# failpoint. What it wrote before dying is what it leaves, as a kill -9 in the write would.
KILLED_IN_FIRST_SAVE = '''\
import io, os, runpy, signal
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

save = TorchCheckpointEngine.save


def save_and_die(self, state_dict, path):
    if os.environ["RANK"] == "0" and str(path).endswith(
            os.path.join("global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")):
        data = io.BytesIO()
        torch.save(state_dict, data)
        with open(path, "wb") as f:
            f.write(data.getvalue()[: len(data.getvalue()) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    save(self, state_dict, path)


TorchCheckpointEngine.save = save_and_die
runpy.run_path("train.py", run_name="__main__")
'''


def tail(cwd: Path, rank: int = 0) -> str:
    return (cwd / f"rank{rank}.log").read_text()[-3000:]


def files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """The docs' script run on 2 processes, rank 0 killed publishing its step-8 save: the
    dir holding its run/ (never written to again: each resume works on its own copy)."""
    cwd = tmp_path_factory.mktemp("killed")
    (cwd / "train.py").write_text(doc_script(MARKER))
    codes = run_ranks(cwd / "train.py", cwd, {"MPITAILOR_FAILPOINT": KILL_AT_8})
    assert codes[0] == -9, tail(cwd)
    run = cwd / "run"
    assert not (run / "global_step8").exists()  # the killed save is not one
    assert (run / "latest").read_text() == "global_step2"  # the full save; 4 and 6 partial
    for n in (4, 6):
        assert (run / f"global_step{n}" / "mpitailor_partial.json").exists()
    return cwd


@pytest.mark.parametrize("world", [1, 2, 3])
def test_requeued_on_n_processes_it_resumes_from_the_composite_recover_writes(
        killed, tmp_path, world):
    # One line more than the docs': the engine as loaded, saved where the test can read it.
    code, n = re.subn(r"^(    engine\.load_checkpoint\(resume\).*\n)",
                      r'\1    engine.save_checkpoint("loaded")\n', doc_script(MARKER),
                      flags=re.M)
    assert n == 1, "the docs' script no longer loads `resume` on a line of its own"
    (tmp_path / "train.py").write_text(code)
    run = tmp_path / "run"
    shutil.copytree(killed / "run", run, symlinks=True)
    before = {n: files(run / f"global_step{n}") for n in (2, 4, 6)}

    codes = run_ranks(tmp_path / "train.py", tmp_path, ranks=world)  # the requeued job
    assert codes == [0] * world, tail(tmp_path)
    composite, = (run / ".mpitailor-resume").glob("recovered-global_step6-*")

    # It resumed, not restarted: from step 6, with the newest copy of every layer, at its
    # world size; the killed run's saves untouched, and its own first save a full one.
    resumed = Ckpt(composite)
    assert (resumed.global_steps, resumed.world_size, resumed.tag) == (6, world, "global_step6")
    manifest = json.loads((composite / "mpitailor_manifest.json").read_text())
    assert {k: v["source"] for k, v in manifest["layers"].items()} == {
        "embed": "global_step6", "norm": "global_step6", "lm_head": "global_step6",
        "layers.0": "global_step6", "layers.1": "global_step4",
        "layers.2": "global_step6", "layers.3": "global_step4"}
    assert {n: files(run / f"global_step{n}") for n in (2, 4, 6)} == before
    assert (run / "latest").read_text() == "global_step8"
    last = Ckpt(run / "global_step8")
    assert not last.partial and (last.global_steps, last.world_size) == (8, world)

    # The composite is what an offline recover of the same killed dir writes for that size.
    out = tmp_path / "offline"
    done = run_cli(["recover", str(killed / "run"), "-o", str(out), "--world-size", str(world)],
                   {}, ranks=2)
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = files(composite), files(out)
    # The manifests name other paths (the output, the saves' copy) and another time.
    manifest_ours = json.loads(ours.pop("mpitailor_manifest.json").decode().replace(
        str(composite), "OUT"))
    manifest_theirs = json.loads(theirs.pop("mpitailor_manifest.json").decode().replace(
        str(out), "OUT").replace(str(killed / "run"), str(run)))
    assert sorted(ours) == sorted(theirs)
    assert [n for n in ours if ours[n] != theirs[n]] == []  # every rank file, byte for byte
    for m in (manifest_ours, manifest_theirs):
        del m["created"], m["mpi_ranks"]  # when, and on how many ranks, it was written
    assert manifest_ours == manifest_theirs

    # Loaded, the engine holds the composite: weights, both Adam moments, steps, counters.
    check_merge(tmp_path / "loaded", {k: composite for k in KEYS}, composite)


def test_killed_in_its_first_save_it_starts_from_scratch_with_one_warning(tmp_path):
    (tmp_path / "train.py").write_text(doc_script(MARKER))
    (tmp_path / "killed_in_first_save.py").write_text(KILLED_IN_FIRST_SAVE)
    codes = run_ranks(tmp_path / "killed_in_first_save.py", tmp_path)
    assert codes[0] == -9, tail(tmp_path)
    run = tmp_path / "run"
    first = run / "global_step2"
    assert (first / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()  # half written
    assert not (run / "latest").exists() and not (first / "mpitailor_save.json").exists()

    codes = run_ranks(tmp_path / "train.py", tmp_path)  # the requeued job, as written
    assert codes == [0, 0], tail(tmp_path)
    logs = "".join((tmp_path / f"rank{r}.log").read_text() for r in (0, 1))
    warnings = [line for line in logs.splitlines() if line.startswith("mpitailor: warning: ")]
    assert len(warnings) == 1 and "training starts from scratch" in warnings[0], warnings
    assert not (run / ".mpitailor-resume").exists()  # nothing recovered, nothing loaded
    # From scratch: a timeline of its own, a full save at step 2 and the partial saves after.
    record = json.loads((first / "mpitailor_save.json").read_text())
    assert record["global_steps"] == 2 and record["parent"] is None
    assert Ckpt(first).global_steps == 2
    assert (run / "latest").read_text() == "global_step2"
    for n in (4, 6, 8):
        partial = json.loads((run / f"global_step{n}" / "mpitailor_partial.json").read_text())
        assert partial["lineage"]["chain"] == record["chain"], n
