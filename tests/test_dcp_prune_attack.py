"""Holes a hostile review found in the retention of DCP save dirs (jobs/prune.py on
DcpCheckpointer's saves, and DCP recovery beside it), each pinned by the test that failed
before its fix.

The fixture is the real 2-rank FSDP2 run `dcp_w2_parity` (a full save at step 2, odd layers
at 4, even layers at 6, odd layers at 8); every test works on its own copy."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import tree_digest
from merging import run_cli

from mpitailor.cluster.comm import Comm
from mpitailor.jobs.dcp_merge import run_dcp_merge
from mpitailor.jobs.dcp_recovery import recover_dcp_chain
from mpitailor.jobs.readlocks import release

FIXTURE = "dcp_w2_parity"


def test_prune_keeps_a_save_a_running_dcp_recover_reads(ckpt_copy, tmp_path):
    """A recover chose its sources (steps 4 and 6) before step-8 was published; a prune
    run then (step-4's layers all saved again by step-8) must keep step-4 while the
    recover reads it: it was deleted under the merge, which failed on a missing file."""
    run = ckpt_copy(FIXTURE)
    (run / "step-8").rename(tmp_path / "step-8")
    try:
        recipe, _, checked = recover_dcp_chain(Comm(), run, tmp_path / "out")
        assert "step-4" in dict(recipe.sources)
        (tmp_path / "step-8").rename(run / "step-8")  # published while recover runs
        r = run_cli(["prune", str(run), "--keep-last", "0"], {})
        assert r.returncode == 0, r.stderr
        assert (run / "step-4").is_dir(), r.stdout
        assert "kept " + str(run / "step-4") + ": a live process reads it" in r.stdout
        run_dcp_merge(Comm(), recipe, checked=checked)  # the recover ends as it began
    finally:
        release()
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})  # once it has ended: gone
    assert r.returncode == 0 and not (run / "step-4").exists(), r.stdout + r.stderr


def test_a_plain_dcp_save_whose_name_tells_no_step_is_not_taken_for_an_old_one(ckpt_copy):
    """A plain `dcp.save` (no record) named `final` has no step prune can know: it was
    removed as 'older than step-2' (its step taken as -1)."""
    run = ckpt_copy(FIXTURE)
    shutil.copytree(run / "step-2", run / "final")
    (run / "final" / "mpitailor_save.json").unlink()
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0, r.stderr
    assert (run / "final" / ".metadata").is_file(), r.stdout
    said = [line for line in r.stdout.splitlines() if "/final:" in line]
    assert said and said[0].startswith("mpitailor: kept"), r.stdout
    assert not (run / "step-4").exists()  # the rest of the prune still done
    assert os.listdir(run / "final")


def another_run(run: Path, tmp_path) -> Path:
    """run copied as another run's save dir: every save id of its records changed
    (reversed: still hex, the lineage kept), so that no id is shared with run."""
    other = tmp_path / "other"
    shutil.copytree(run, other)
    for record in other.glob("step-*/mpitailor_save.json"):
        d = json.loads(record.read_text())
        d.update({k: d[k][::-1] for k in ("save_id", "chain", "parent") if d.get(k)})
        record.write_text(json.dumps(d))
    return other


@pytest.mark.parametrize("linked", [".mpitailor-pruned", "mpitailor-retention"])
def test_prune_follows_no_link_to_another_runs_tombstones(ckpt_copy, tmp_path, linked):
    """A save dir whose tombstone dir (or prune's record dir) is a symbolic link to another
    run's: prune removed the other run's tombstones there ('no remaining save builds on
    it'; none of its own does), and the other run's recovery then refused (exit 2)."""
    other = ckpt_copy(FIXTURE)
    run = another_run(other, tmp_path)
    assert run_cli(["prune", str(other), "--keep-last", "0"], {}).returncode == 0
    (run / linked).symlink_to(other / linked)
    digest, names = tree_digest(other), sorted(os.listdir(other / linked))
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert f"{run / linked}: a symbolic link" in r.stderr and r.stderr.count("\n") == 1
    assert tree_digest(other) == digest and sorted(os.listdir(other / linked)) == names
    assert (run / "step-4").is_dir()  # nothing of its own removed either
    r = run_cli(["recover", str(other), "-o", str(tmp_path / "out")], {})
    assert r.returncode == 0, r.stderr


IN_JOB = """
import sys
from mpitailor.cluster.comm import Comm
from mpitailor.jobs.in_job_resume import recover_in_job
print(recover_in_job(Comm(), sys.argv[1]).path, flush=True)
"""


def test_prune_keeps_the_saves_an_in_job_resume_merges_from(ckpt_copy, tmp_path):
    """The in-job resume (recover_for_resume) holds the saves it merges from while it
    writes the composite, as `recover` does, and lets go once it is written: a prune run
    meanwhile keeps them, the job's own retention after its next save may remove them."""
    import subprocess
    import sys
    import time
    run = ckpt_copy(FIXTURE)
    (run / "step-8").rename(tmp_path / "step-8")
    env = dict(os.environ, MPITAILOR_FAILPOINT="write:0:sleep=4",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    job = subprocess.Popen([sys.executable, "-c", IN_JOB, str(run)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list((run / ".mpitailor-resume").glob(".*")) and time.monotonic() < deadline:
            time.sleep(0.05)  # its staging dir: the sources chosen, the merge under way
        (tmp_path / "step-8").rename(run / "step-8")  # published meanwhile
        r = run_cli(["prune", str(run), "--keep-last", "0"], {})
        assert r.returncode == 0, r.stderr
        assert "kept " + str(run / "step-4") + ": a live process reads it" in r.stdout, \
            r.stdout
    finally:
        out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    assert Path(out.strip()).name.startswith("recovered-step-6-")
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})  # the job let go: it goes
    assert r.returncode == 0 and not (run / "step-4").exists(), r.stdout + r.stderr


def test_a_link_naming_a_save_beside_it_is_an_alias_not_a_save_that_cannot_be_read(
        ckpt_copy, tmp_path):
    """`latest -> step-8` (a user's, or a trainer's, pointer to the newest save) blocked
    every prune as a save that cannot be read now; a link elsewhere still does."""
    run = ckpt_copy(FIXTURE)
    (run / "latest").symlink_to("step-8")
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0 and not (run / "step-4").exists(), r.stdout + r.stderr
    assert (run / "latest").is_symlink() and (run / "step-8").is_dir()
    from ckpt_fixtures import build
    again = tmp_path / "again"
    shutil.copytree(build(FIXTURE), again)
    (again / "step-5").symlink_to(run / "step-8")  # a save elsewhere, for all prune knows
    r = run_cli(["prune", str(again), "--keep-last", "0"], {})
    assert r.returncode == 1 and "step-5" in r.stderr, r.stdout + r.stderr
    assert (again / "step-4").is_dir()
