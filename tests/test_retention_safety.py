"""Retention fails safe (issue 40): after any prune, recovery is what it was before, or prune
refused (exit != 0) and removed nothing.

The property runs on random timelines in memory (tests/retention_timelines.py: thousands in
a second or two), and on the real `w2_parity` fixture (full save 2; partial saves 4: odd
layers, 6: even layers, 8: odd layers) copied and damaged at random, through the real
survey, planner and deletion. Then one regression test per finding of the review (R1-R7),
through the real command line.

A save that "cannot be read now": as a user without CAP_DAC_OVERRIDE, chmod 000 does it; as
root the command runs under `setpriv` with that capability (and DAC_READ_SEARCH) dropped
from its bounding set, so that the kernel refuses it as it would refuse a user. Where
neither is possible the test says so (skip). The random on-disk cases use a FIFO where a
layer file should be, which is as real and needs no privilege.
"""
from __future__ import annotations

import collections
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tree_digest
from merging import run_cli
from retention_timelines import DAMAGE, run_case
from test_merge_errors import error_lines

from mpitailor.cluster.comm import Comm
from mpitailor.errors import MpitailorError
from mpitailor.jobs.prune import prune
from mpitailor.jobs.readlocks import release
from mpitailor.jobs.recovery import recover_chain, recover_recipe
from mpitailor.jobs.tombstones import RECORD

PRUNED = ".mpitailor-pruned"
CASES = 3000  # in memory: ~2 s; bench/retention_fuzz.py runs more


# -- the property, in memory -----------------------------------------------------------


def test_no_timeline_loses_a_layer_to_prune():
    cases = [run_case(seed) for seed in range(CASES)]
    lost = [c for c in cases if c.lost]
    assert lost == [], lost[:3]
    # the generator reaches what it is meant to: every kind of damage, prunes that go
    # ahead and prunes that refuse, for each reason
    kinds = collections.Counter(k for c in cases for k in c.damage)
    assert set(kinds) == set(DAMAGE), kinds
    outcomes = collections.Counter(c.outcome for c in cases)
    assert {"pruned", "refused: blocked", "refused: CannotReadNow",
            "refused: CheckpointError"} <= set(outcomes), outcomes
    changed = sum(c.outcome == "pruned" and c.before[0] == "ok" for c in cases)
    assert changed > CASES // 2, outcomes


# -- the property, on disk, through the real survey, planner and deletion --------------


def recipe_body(run: Path) -> str | None:
    """What `recover` takes from where (the recipe less its comment lines); None: it
    refuses."""
    try:
        text = recover_recipe(Comm(), run, None).text
    except MpitailorError:
        return None
    finally:
        release()
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def sid_of(run: Path, name: str) -> str:
    tag = run / name
    record = tag / "mpitailor_partial.json"
    if record.exists():
        return json.loads(record.read_text())["lineage"]["save_id"]
    return json.loads((tag / "mpitailor_save.json").read_text())["save_id"]


def tombstone(run: Path, sid: str, step: int, chain: str, parent: str | None) -> None:
    (run / PRUNED).mkdir(exist_ok=True)
    (run / PRUNED / sid).write_text(json.dumps({
        "format": "mpitailor-pruned", "name": f"global_step{step}", "step": step,
        "save_id": sid, "chain": chain, "parent": parent}))


def damage_on_disk(run: Path, rng: random.Random) -> list[tuple[Path, Path]]:
    """Damage run at random as the review did; returns the files swapped for FIFOs (cannot
    be read now: put back after the prune)."""
    names = sorted(p.name for p in run.iterdir() if p.name.startswith("global_step"))
    full = sid_of(run, "global_step2")
    swapped = []
    if rng.random() < 0.5 and names:  # a layer file that cannot be read now
        tag = run / rng.choice(names)
        victim = rng.choice(sorted(p for p in tag.iterdir() if p.is_file()))
        aside = run.parent / "aside"  # outside the save dir: no stray name in a save
        victim.rename(aside)
        os.mkfifo(victim)
        swapped.append((victim, aside))
    if rng.random() < 0.3:  # forged: newer than anything, on the full save
        tombstone(run, "f0" * 8, 99, full, full)
    if rng.random() < 0.3:  # a loop nobody builds on
        tombstone(run, "c1" * 8, 98, "c1" * 8, "c2" * 8)
        tombstone(run, "c2" * 8, 97, "c2" * 8, "c1" * 8)
    if rng.random() < 0.3:  # garbage
        (run / PRUNED).mkdir(exist_ok=True)
        (run / PRUNED / ("b0" * 8)).write_bytes(b"\x00not json")
    if rng.random() < 0.2 and (run / PRUNED).is_dir():  # the tombstone dir lost
        shutil.rmtree(run / PRUNED)
    if rng.random() < 0.2 and "global_step6" in names:  # killed mid-save: no manifest
        (run / "global_step6" / "mpitailor_partial.json").unlink()
    return swapped


@pytest.mark.parametrize("seed", range(8))
def test_prune_on_disk_keeps_what_recovery_takes(ckpt_copy, seed):
    rng = random.Random(seed)
    run = ckpt_copy("w2_parity")
    if rng.random() < 0.6:  # an earlier prune leaves a tombstone (of global_step4)
        prune(Comm(), run, keep_last=rng.randint(0, 1))
    swapped = damage_on_disk(run, rng)
    for fifo, aside in swapped:  # recovery as it is once everything reads again
        fifo.unlink()
        aside.rename(fifo)
    before = recipe_body(run)
    for fifo, aside in swapped:
        fifo.rename(aside)
        os.mkfifo(fifo)
    digest = tree_digest(run) if not swapped else None
    listing = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    try:
        prune(Comm(), run, keep_last=rng.randint(0, 3))
        refused = False
    except MpitailorError:
        refused = True
    for fifo, aside in swapped:
        fifo.unlink()
        aside.rename(fifo)
    if refused:
        assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == listing
        assert digest is None or tree_digest(run) == digest
    else:
        assert recipe_body(run) == before


# -- R1: a layer file that cannot be read now is not an incomplete save ------------------


def as_user(args: list[str]) -> subprocess.CompletedProcess:
    """The CLI as a user the kernel checks permissions for (see the module's docstring)."""
    cmd = [sys.executable, "-m", "mpitailor", *args]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to drop CAP_DAC_OVERRIDE with")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    if "setpriv:" in r.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {r.stderr.strip()}")
    return r


@pytest.fixture
def locked_layer(ckpt_copy):
    """w2_parity with global_step6's rank-0 layers file chmod 000 (its newest layers.0, 2)."""
    run = ckpt_copy("w2_parity")
    victim = run / "global_step6" / "rank_0_layers.safetensors"
    victim.chmod(0)
    yield run
    victim.chmod(0o644)


def test_r1_a_save_that_cannot_be_read_now_is_kept_and_prune_exits_1(locked_layer):
    run = locked_layer
    names = sorted(os.listdir(run))
    r = as_user(["prune", str(run), "--keep-last", "0"])
    assert r.returncode == 1, r.stderr
    [line] = error_lines(r.stderr)
    assert f"prune removed nothing: {run}/global_step6 cannot be read now" in line
    assert "Permission denied" in line and "run prune again" in line
    assert sorted(os.listdir(run)) == names  # global_step4 stays too
    r = as_user(["recover", str(run), "--emit-recipe"])
    assert r.returncode == 1 and "global_step6: cannot be read now" in r.stderr, r.stderr
    (run / "global_step6" / "rank_0_layers.safetensors").chmod(0o644)
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0 and "holds the newest copy of layers.0, layers.2" in r.stdout


def test_r1_a_fifo_where_a_layer_file_should_be_is_kept(ckpt_copy):
    run = ckpt_copy("w2_parity")
    victim = run / "global_step6" / "rank_1_layers.safetensors"
    victim.unlink()
    os.mkfifo(victim)
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 1 and "global_step6 cannot be read now" in r.stderr, r.stderr
    assert "a FIFO" in r.stderr or "not a regular file" in r.stderr, r.stderr
    assert (run / "global_step4").is_dir() and (run / "global_step6").is_dir()


def test_an_incomplete_save_still_goes(ckpt_copy):
    """A save killed after its rank files and before its manifest (the commit marker),
    older than the newest usable save: incomplete by its own record, removed."""
    run = ckpt_copy("w2_parity")
    shutil.copytree(run / "global_step6", run / "global_step7")
    (run / "global_step7" / "mpitailor_partial.json").unlink()
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0, r.stderr
    assert "global_step7: incomplete by its own record" in r.stdout
    assert not (run / "global_step7").exists() and (run / "global_step6").is_dir()


# -- R2: the tombstone dir lost, or a file -----------------------------------------------


@pytest.fixture
def pruned_run(ckpt_copy):
    """w2_parity pruned once: global_step4 (its layers all in 8) gone, its tombstone left."""
    run = ckpt_copy("w2_parity")
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0 and not (run / "global_step4").exists(), r.stdout + r.stderr
    record = json.loads((run / RECORD).read_text())
    assert record["tombstones"] == [sid_of_pruned(run)]
    return run


def sid_of_pruned(run: Path) -> str:
    [sid] = os.listdir(run / PRUNED)
    return sid


@pytest.mark.parametrize("how", ["cp -r DIR/*", "a file"])
def test_r2_a_lost_tombstone_dir_is_an_error_not_a_rollback(pruned_run, tmp_path, how):
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in pruned_run.iterdir():  # what `cp -r DIR/* COPY` copies: no dotted names
        if not p.name.startswith("."):
            (shutil.copytree if p.is_dir() else shutil.copy)(p, copy / p.name)
    if how == "a file":
        (copy / PRUNED).write_text("")
    for cmd in (["recover", str(copy), "--emit-recipe"], ["prune", str(copy), "--keep-last",
                                                           "0"]):
        r = run_cli(cmd, {})
        assert r.returncode == 2, r.stdout + r.stderr
        [line] = error_lines(r.stderr)
        assert f"{copy / PRUNED}: {'missing' if how != 'a file' else 'not a directory'}" \
            in line and "cp -a SRC/. DEST" in line
    assert sorted(p.name for p in copy.iterdir() if p.name.startswith("global")) == \
        ["global_step2", "global_step6", "global_step8"]


def test_r2_one_lost_tombstone_a_save_builds_on_is_an_error(pruned_run):
    (pruned_run / PRUNED / sid_of_pruned(pruned_run)).unlink()
    r = run_cli(["recover", str(pruned_run), "--emit-recipe"], {})
    assert r.returncode == 2 and "missing, but prune's record lists it" in r.stderr, r.stderr


# -- R3, R4, R5: forged, looping and bad tombstones ------------------------------------------


def test_r3_a_forged_tombstone_is_not_a_branch(ckpt_copy):
    run = ckpt_copy("w2_parity")
    before = recipe_body(run)
    full = sid_of(run, "global_step2")
    tombstone(run, "f0" * 8, 99, full, full)
    assert recipe_body(run) == before  # the timeline of 8, not the full save alone
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0 and "no remaining save builds on it" in r.stdout, r.stdout
    assert recipe_body(run) == before


def test_r3_a_tombstone_out_of_step_or_chain_on_the_timeline_is_refused(pruned_run):
    sid = sid_of_pruned(pruned_run)
    path = pruned_run / PRUNED / sid
    good = json.loads(path.read_text())
    for forged, what in (({"step": 99}, "newer than its child global_step6"),
                         ({"chain": "ee" * 8}, "not this timeline's")):
        path.write_text(json.dumps({**good, **forged}))
        r = run_cli(["recover", str(pruned_run), "--emit-recipe"], {})
        assert r.returncode == 2 and what in r.stderr, r.stderr
        assert len(error_lines(r.stderr)) == 1


def test_r4_a_loop_of_tombstones_ends_at_once(pruned_run):
    """Unrelated: skipped. On the timeline (the pruned save's parent made a tombstone whose
    parent is the pruned save): an error naming it, not a walk round and round."""
    sid = sid_of_pruned(pruned_run)
    tombstone(pruned_run, "c1" * 8, 98, "c1" * 8, "c2" * 8)
    tombstone(pruned_run, "c2" * 8, 97, "c2" * 8, "c1" * 8)
    before = run_cli(["recover", str(pruned_run), "--emit-recipe"], {})
    assert before.returncode == 0, before.stderr
    good = json.loads((pruned_run / PRUNED / sid).read_text())
    chain = good["chain"]
    tombstone(pruned_run, sid, 4, chain, "d1" * 8)
    tombstone(pruned_run, "d1" * 8, 3, chain, sid)
    for cmd in (["recover", str(pruned_run), "--emit-recipe"],
                ["prune", str(pruned_run), "--keep-last", "0"]):
        r = run_cli(cmd, {}, timeout=60)
        assert r.returncode == 2 and "form a loop" in r.stderr, r.stderr


@pytest.mark.parametrize("kind", ["garbage", "fifo", "dir", "deep", "huge"])
def test_r5_a_bad_tombstone_no_save_needs_fails_nothing(pruned_run, kind):
    bad = pruned_run / PRUNED / ("b0" * 8)
    if kind == "garbage":
        bad.write_bytes(os.urandom(64))
    elif kind == "fifo":
        os.mkfifo(bad)
    elif kind == "dir":
        bad.mkdir()
    elif kind == "deep":
        bad.write_text("[" * 100_000)
    else:
        with open(bad, "wb") as f:
            f.truncate(200 << 20)  # sparse: 200 MB that costs no disk
    before = recipe_body(pruned_run)
    assert before is not None
    r = run_cli(["recover", str(pruned_run), "--emit-recipe"], {})
    assert r.returncode == 0 and f"ignoring {bad}: not a tombstone" in r.stderr, r.stderr
    r = run_cli(["prune", str(pruned_run), "--keep-last", "0"], {})
    assert r.returncode == 0 and f"kept {bad}: not a tombstone" in r.stdout, r.stdout
    assert os.path.lexists(bad) and recipe_body(pruned_run) == before


def test_r5_a_bad_tombstone_a_save_builds_on_is_one_line(pruned_run):
    (pruned_run / PRUNED / sid_of_pruned(pruned_run)).write_text("[" * 100_000)
    r = run_cli(["recover", str(pruned_run), "--emit-recipe"], {})
    assert r.returncode == 2 and "the tombstone global_step6 builds on is damaged" in r.stderr
    assert len(error_lines(r.stderr)) == 1 and "Traceback" not in r.stderr


# -- R6: a save that is a symbolic link --------------------------------------------------


def test_r6_a_symlinked_save_is_refused_by_name(ckpt_copy, tmp_path):
    run = ckpt_copy("w2_parity")
    (run / "global_step4").rename(tmp_path / "elsewhere")
    (run / "global_step4").symlink_to(tmp_path / "elsewhere")
    digest = tree_digest(tmp_path / "elsewhere")
    for cmd in (["recover", str(run), "--emit-recipe"], ["prune", str(run), "--keep-last",
                                                          "0"]):
        r = run_cli(cmd, {})
        assert r.returncode == 2, r.stdout + r.stderr
        [line] = error_lines(r.stderr)
        assert f"{run / 'global_step4'}: a symbolic link (to {tmp_path / 'elsewhere'})" in line
    assert (run / "global_step4").is_symlink() and tree_digest(tmp_path / "elsewhere") == digest


# -- R7: prune and a recover that planned with a save ------------------------------------


def test_r7_prune_keeps_the_saves_a_planned_recover_reads(ckpt_copy, tmp_path):
    """recover plans while global_step8 is not there yet (sources 4: odd layers, 6: even);
    8 arrives, which holds every layer 4 holds: prune would remove 4. The recover holds its
    sources (a shared flock on each save dir, no file beside it): prune keeps 4, and the
    merge planned before reads it whole. Nothing of the lock stays in the save dir."""
    run = ckpt_copy("w2_parity")
    (run / "global_step8").rename(tmp_path / "step8")
    from mpitailor.jobs.merge import plan_recipe, run_merge
    from mpitailor.api import _options
    recipe, _, place = recover_chain(Comm(), run, tmp_path / "out")
    try:
        assert "global_step4" in dict(recipe.sources)
        (tmp_path / "step8").rename(run / "global_step8")
        r = run_cli(["prune", str(run), "--keep-last", "0"], {})
        assert r.returncode == 0, r.stderr
        assert f"kept {run}/global_step4: a live process reads it" in r.stdout, r.stdout
        planned = plan_recipe(Comm(), recipe, place)
        run_merge(Comm(), planned, _options((), None, None, False, False))
    finally:
        release()
    assert not [p for p in run.iterdir() if p.name.endswith(".mpitailor-lock")]
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0 and not (run / "global_step4").exists(), r.stdout


def test_r7_a_save_removed_before_recover_holds_it_is_one_line(ckpt_copy):
    from mpitailor.jobs.readlocks import hold_sources
    run = ckpt_copy("w2_parity")
    shutil.rmtree(run / "global_step6")
    with pytest.raises(MpitailorError, match="global_step6: removed while recover read it"):
        hold_sources([run / "global_step8", run / "global_step6"])
    assert not [p for p in run.iterdir() if p.name.endswith(".mpitailor-lock")]
