"""Retention fails safe (issue 40): after any prune, recovery is what it was before, or prune
refused (exit != 0) and removed nothing.

The property runs on random timelines in memory (tests/retention_timelines.py: thousands in
a second or two), and on real saves copied and damaged at random, through the real survey,
planner and deletion (tests/retention_disk.py). Then one regression test per finding of
the first review (R1-R7) and of the second (F1-F9), through the real command line.

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
from pathlib import Path

import pytest
import yaml
from conftest import tree_digest
from merging import run_cli
from retention_disk import (
    LATEST_NOW,
    PRUNED,
    STRAY,
    as_user,
    damage_on_disk,
    listing,
    plant,
    prune_keeps_what_recovery_takes,
    recipe_body,
    sid_of,
    tombstone,
    unplant,
)
from retention_timelines import DAMAGE, run_case
from test_merge_errors import error_lines

from mpitailor.cluster.comm import Comm
from mpitailor.errors import MpitailorError
from mpitailor.jobs.prune import prune
from mpitailor.jobs.readlocks import release
from mpitailor.jobs.recovery import recover_chain
from mpitailor.jobs.tombstones import RECORD

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
            "refused: CheckpointError", "refused: Unproven"} <= set(outcomes), outcomes
    changed = sum(c.outcome == "pruned" and c.before[0] == "ok" for c in cases)
    assert changed > CASES // 2, outcomes


# -- the property, on disk, through the real survey, planner and deletion --------------


@pytest.mark.parametrize("seed", range(48))  # ~0.3 s each
def test_prune_on_disk_keeps_what_recovery_takes(ckpt_copy, seed):
    rng = random.Random(seed)
    run = ckpt_copy(rng.choice(["w2_parity", "w2_parity_twin_full"]))
    if run.name == "w2_parity_twin_full":  # a rollback to any full save, chosen by hand
        (run / "latest").write_text(rng.choice(["global_step2", "global_step4",
                                                "global_step6", "global_step8"]))
    if rng.random() < 0.6:  # an earlier prune leaves a tombstone (of global_step4)
        prune(Comm(), run, keep_last=rng.randint(0, 1))
    swaps = damage_on_disk(run, rng)
    keep_last = rng.randint(0, 3)
    prune_keeps_what_recovery_takes(run, swaps, recipe_body,
                                    lambda: prune(Comm(), run, keep_last=keep_last),
                                    tree_digest)


# -- R1: a layer file that cannot be read now is not an incomplete save ------------------


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


# -- F1: two saves with one save id ---------------------------------------------------------


def twin_of_4(run: Path, name: str) -> None:
    """A copy of global_step4 under name, its save id kept, its parent an id nobody has
    (it reads as an abandoned save, or, numbered, as a newer one)."""
    shutil.copytree(run / "global_step4", run / name)
    path = run / name / "mpitailor_partial.json"
    manifest = json.loads(path.read_text())
    manifest["lineage"]["parent"] = "ab" * 16
    if name[len("global_step"):].isdigit():
        manifest["global_steps"], manifest["tag"] = int(name[len("global_step"):]), name
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["global_step4x", "global_step5", "global_step100"])
def test_f1_two_saves_with_one_save_id_are_an_error(ckpt_copy, name):
    """Prune took the tombstone of global_step4 from its twin (or, the twin kept, took the id
    for "a save of that id is there") and removed 4 with none: recover then skipped 6 and 8
    as another timeline and gave step 2. Now neither recover nor prune picks one."""
    run = ckpt_copy("w2_parity")
    twin_of_4(run, name)
    names = listing(run)
    for cmd in (["prune", str(run), "--keep-last", "0"], ["recover", str(run), "--emit-recipe"]):
        r = run_cli(cmd, {})
        assert r.returncode == 2, r.stdout + r.stderr
        [line] = error_lines(r.stderr)
        assert f"{run / 'global_step4'} and {run / name}: two saves with one save id" in line
        assert "move the copy out of the save dir" in line
    assert listing(run) == names
    shutil.rmtree(run / name)
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0 and not (run / "global_step4").exists(), r.stderr
    assert "base: global_step8" in run_cli(["recover", str(run), "--emit-recipe"], {}).stdout


# -- F2: a `latest` that cannot be read at prune time ------------------------------------


@pytest.fixture
def rolled_back(ckpt_copy):
    """w2_parity_twin_full (full saves 2, 4, 6, 8) resumed by hand from global_step4."""
    run = ckpt_copy("w2_parity_twin_full")
    (run / "latest").write_text("global_step4")
    return run


@pytest.mark.parametrize("kind", LATEST_NOW)
def test_f2_prune_removes_nothing_while_latest_cannot_be_read(rolled_back, tmp_path, kind):
    """Prune took the newest full save for the timeline (as recover does, with a warning)
    and removed 2, 4 and 6: with `latest` back, recovery gave step 8, not 4."""
    run, aside = rolled_back, tmp_path / "latest.real"
    before, names = recipe_body(run), listing(run)
    assert before is not None and "base: global_step4" in before
    (run / "latest").rename(aside)
    plant(run / "latest", kind, aside)
    r = run_cli(["prune", str(run), "--keep-last", "0"], {}, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    [line] = error_lines(r.stderr)
    assert f"prune removes nothing: {run / 'latest'}" in line and "run prune again" in line
    unplant(run / "latest")
    aside.rename(run / "latest")
    assert listing(run) == names and recipe_body(run) == before


def test_f2_a_latest_that_names_no_tag_is_exit_2_and_one_it_names_must_read(rolled_back):
    run = rolled_back
    (run / "latest").write_text("global_step4\nglobal_step8")
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 2 and "fix it (the tag of the save to resume from" in r.stderr
    # the save it names cannot be read now: not "no usable save there", which would start
    # recovery (and prune) from global_step8
    (run / "latest").write_text("global_step4")
    victim = run / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.unlink()
    os.mkfifo(victim)
    for cmd in (["recover", str(run), "--emit-recipe"], ["prune", str(run), "--keep-last", "0"]):
        r = run_cli(cmd, {}, timeout=60)
        assert r.returncode == 1, r.stdout + r.stderr
        [line] = error_lines(r.stderr)
        assert f"{run / 'global_step4'}: cannot be read now" in line
        assert f"{run / 'latest'} names it as the save to resume from" in line
    assert len(listing(run)) > 0 and (run / "global_step2").is_dir()


# -- F3: a merge manifest's name inside a save -------------------------------------------


@pytest.mark.parametrize("kind", STRAY)
def test_f3_a_manifest_inside_a_save_keeps_the_tombstones(pruned_run, kind):
    """global_step6 read as a composite: a second prune found no save building on the
    tombstone of 4, removed it and its line in the record; with the stray entry gone,
    recovery gave step 2."""
    run, stray = pruned_run, pruned_run / "global_step6" / "mpitailor_manifest.json"
    before = recipe_body(run)
    plant(stray, kind)
    names, record = listing(run), (run / RECORD).read_text()
    for cmd in (["prune", str(run), "--keep-last", "0"], ["recover", str(run), "--emit-recipe"]):
        r = run_cli(cmd, {}, timeout=60)
        assert r.returncode == 2, r.stdout + r.stderr
        [line] = error_lines(r.stderr)
        assert f"{run / 'global_step6'}: holds both a save's record (mpitailor_partial.json)" \
            in line and "a merge's manifest" in line
    assert listing(run) == names and (run / RECORD).read_text() == record
    unplant(stray)
    assert recipe_body(run) == before


def test_f3_a_dir_that_cannot_be_told_from_a_save_blocks_prune(pruned_run):
    """No save record in it, and a manifest that does not read: it may be a save (prune
    keeps it, and removes nothing while it is there); a composite (a manifest that reads)
    is left alone as before."""
    run = pruned_run
    (run / "recovered-x").mkdir()
    os.mkfifo(run / "recovered-x" / "mpitailor_manifest.json")
    names = listing(run)
    r = run_cli(["prune", str(run), "--keep-last", "0"], {}, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    [line] = error_lines(r.stderr)
    assert f"prune removed nothing: {run / 'recovered-x'} cannot be read now" in line
    assert "cannot be told from a save" in line and listing(run) == names


# -- F4: recover and a save it cannot read --------------------------------------------------


@pytest.mark.parametrize("rel,kind", [("global_step8/rank_0_layers.safetensors", "fifo"),
                                      ("global_step8/rank_0_layers.safetensors", "dir"),
                                      ("global_step6/mpitailor_partial.json", "fifo"),
                                      ("global_step6/mpitailor_partial.json", "dir")])
def test_f4_recover_refuses_a_save_it_cannot_read(ckpt_copy, rel, kind):
    """Not a save killed mid-write (its own record would say so): one that cannot be read
    now. recover took the older copies of its layers (exit 0, base 6 or 4); now exit 1."""
    run = ckpt_copy("w2_parity")
    (run / rel).unlink()
    plant(run / rel, kind)
    r = run_cli(["recover", str(run), "--emit-recipe"], {}, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    [line] = error_lines(r.stderr)
    save = rel.split("/")[0]  # (6 unread: 8 builds on an id that may be 6's, said so)
    assert f"{save}: cannot be read now" in line or f"and {save} (" in line, line
    assert str(run / rel) in line and "cannot be read now" in line


def test_f4_an_hf_trainer_state_that_is_a_dangling_link(ckpt_copy, tmp_path):
    run = ckpt_copy("hf_w2_parity")
    before, names = recipe_body(run), listing(run)
    state = run / "checkpoint-6" / "trainer_state.json"
    state.rename(tmp_path / "trainer_state.json")
    state.symlink_to("/nonexistent/trainer_state.json")
    for cmd in (["recover", str(run), "--emit-recipe"], ["prune", str(run), "--keep-last", "0"]):
        r = run_cli(cmd, {}, timeout=60)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"{state}: a symbolic link" in error_lines(r.stderr)[0]
    state.unlink()
    (tmp_path / "trainer_state.json").rename(state)
    assert listing(run) == names and recipe_body(run) == before


# -- F5: prune and a save dir whose lineage records disagree --------------------------------


@pytest.mark.parametrize("forged", [(4, 6, 8), (6,)])
def test_f5_prune_writes_no_tombstone_its_own_check_rejects(ckpt_copy, forged):
    """Partial saves of another chain than the full save's (or than each other's): recover
    follows them (lineage is by parent), but a tombstone of 4 would not fit beside 6, and
    recover after prune failed (exit 2, "tampered"). Prune now replays recovery of what it
    would leave first, and removes nothing."""
    run = ckpt_copy("w2_parity")
    for step in forged:
        path = run / f"global_step{step}" / "mpitailor_partial.json"
        manifest = json.loads(path.read_text())
        manifest["lineage"]["chain"] = "77" * 16
        path.write_text(json.dumps(manifest))
    before, names = recipe_body(run), listing(run)
    assert before is not None
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 2, r.stdout + r.stderr
    [line] = error_lines(r.stderr)
    assert f"{run}: prune removes nothing: it cannot show that recovery after it" in line
    assert "lineage records disagree" in line
    assert listing(run) == names and recipe_body(run) == before


# -- F6: a FIFO by a lock's name -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_f6_a_lock_that_is_not_a_file_is_refused_not_waited_on(ckpt_copy, kind):
    run = ckpt_copy("w2_parity")
    plant(run / ".global_step4.mpitailor-lock", kind)
    names = listing(run)
    r = run_cli(["prune", str(run), "--keep-last", "0"], {}, timeout=60)  # (it hung forever)
    assert r.returncode == 1, r.stdout + r.stderr
    [line] = error_lines(r.stderr)
    assert f"{run / '.global_step4.mpitailor-lock'}: cannot tell whether a live process " \
           f"holds it" in line and "a lock is a regular file" in line
    assert listing(run) == names


# -- F7: mpitailor's own dirs as links -------------------------------------------------------


@pytest.mark.parametrize("name", [PRUNED, ".mpitailor-resume"])
def test_f7_a_link_in_place_of_mpitailors_own_dirs_is_refused(pruned_run, tmp_path, name):
    """Followed, prune wrote tombstones into (and removed the tombstones of) another run's
    save dir, or removed composites outside the save dir."""
    run, away = pruned_run, tmp_path / "another_run"
    if name == PRUNED:
        (run / name).rename(away)
    else:
        away.mkdir()
        (away / "recovered-old").mkdir()
    (run / name).symlink_to(away)
    digest = tree_digest(away)
    cmds = [["prune", str(run), "--keep-last", "0"]]
    cmds += [["recover", str(run), "--emit-recipe"]] if name == PRUNED else []
    for cmd in cmds:
        r = run_cli(cmd, {})
        assert r.returncode == 2, r.stdout + r.stderr
        [line] = error_lines(r.stderr)
        assert f"{run / name}: a symbolic link (to {away})" in line
    assert tree_digest(away) == digest and sorted(os.listdir(away)) != []


# -- F8: what prune cannot read is exit 1 and one line ------------------------------------------


@pytest.mark.parametrize("target", ["global_step4/rng_state_0.pth", "global_step6",
                                    "mpitailor-retention", PRUNED])
def test_f8_what_prune_cannot_read_is_exit_1_naming_it(ckpt_copy, target):
    """A save prune would remove (4: every layer saved again) kept because it cannot be
    read was "removed 0", exit 0; an unlistable save or record dir was a raw
    PermissionError."""
    run = ckpt_copy("w2_parity")
    if not target.startswith("global_step4"):  # the tombstone of 4 and prune's record
        assert run_cli(["prune", str(run), "--keep-last", "0"], {}).returncode == 0
    names = listing(run)
    (run / target).chmod(0)
    try:
        r = as_user(["prune", str(run), "--keep-last", "0"])
    finally:
        (run / target).chmod(0o755 if (run / target).is_dir() else 0o644)
    assert r.returncode == 1, r.stdout + r.stderr
    [line] = error_lines(r.stderr)
    assert str(run / target.split("/")[0]) in line and "Permission denied" in line, line
    assert "Traceback" not in r.stderr and "PermissionError" not in line
    assert listing(run) == names


# -- F9: a newline in a pruned save's name ---------------------------------------------------


def test_f9_a_name_in_the_recipes_comments_stays_a_comment(ckpt_copy):
    """"# stepped across, deleted by mpitailor prune: NAME": a newline in NAME made what
    followed it a live line of the recipe (`base: global_step2`)."""
    run = ckpt_copy("w2_parity")
    (run / "global_step4").rename(run / "global_step4\nbase: global_step2")
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0 and all(line.startswith("mpitailor: ")
                                     for line in r.stdout.splitlines()), r.stdout
    r = run_cli(["recover", str(run), "--emit-recipe"], {})
    assert r.returncode == 0, r.stderr
    assert "deleted by mpitailor prune: global_step4\\nbase: global_step2" in r.stdout
    assert r.stdout.count("\nbase:") == 1 and yaml.safe_load(r.stdout)["base"] == "global_step8"
