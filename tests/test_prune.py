"""Retention (`prune`): what the newest composite no longer needs goes, and nothing else.

One real run (tiny DeepSpeed ZeRO-3, W=2, parity with a full save every 4th save) is trained
once for the module: saves at 2 (full), 4, 6, 8 (an older chain), 10 (full), 12 (layers 1, 3
and the aux keys), 14 (0, 2, aux), 16 (1, 3, aux). Every test works on a copy. The planner's
rules are also tested alone, on made-up records.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from ckpt_fixtures import spec_for
from conftest import tree_digest
from merging import run_cli
from retention_timelines import Files, Meta

from dev.tinytrain import launch
from mpitailor.formats.zero.files import Lineage
from mpitailor.planning.chain import Pruned, Save, choose, follow
from mpitailor.planning.retention import Composite, plan_retention

AUX = frozenset({"embed", "norm", "lm_head"})
ODD, EVEN = frozenset({"layers.1", "layers.3"}) | AUX, frozenset({"layers.0", "layers.2"}) | AUX


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prune") / "run"
    spec = replace(spec_for("w2_parity", root), steps=16, save_at=tuple(range(2, 17, 2)),
                   stats=None, policy={"name": "parity", "full_every": 4})
    launch(spec)
    return root


@pytest.fixture
def run(trained, tmp_path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(trained, root)
    return root


def prune_cli(root: Path, *more: str):
    return run_cli(["prune", str(root), *more], {})


def saves_in(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir() if p.name.startswith("global_step")),
                  key=lambda n: int(n.removeprefix("global_step")))


def recovered(root: Path, out: Path) -> Path:
    r = run_cli(["recover", str(root), "-o", str(out), "--no-progress"], {})
    assert r.returncode == 0, r.stderr
    return out


# -- the command on a real run ----------------------------------------------------------


def test_prune_keeps_what_recovery_needs_and_recovers_the_same_bytes(run, tmp_path):
    before = recovered(run, tmp_path / "before")
    kept = {n: tree_digest(run / n) for n in ("global_step10", "global_step14",
                                              "global_step16")}
    r = prune_cli(run, "--keep-last", "1")
    assert r.returncode == 0, r.stderr
    # the older chain goes; 12 goes (14 and 16 hold every layer again); the chain's full
    # save, the newest copy of every layer (14: layers 0 and 2; 16: the rest) stay
    assert saves_in(run) == ["global_step10", "global_step14", "global_step16"]
    assert {n: tree_digest(run / n) for n in kept} == kept
    assert not [p for p in run.iterdir() if p.name.endswith(".mpitailor-pruning")]
    assert "removed" in r.stdout and "global_step12: every layer it holds is saved again" \
        in r.stdout and "kept" in r.stdout
    assert all(line.startswith("mpitailor: ") and (" removed " in line or " kept " in line
                                                   or "removed 5 save(s)" in line)
               for line in r.stdout.splitlines()), r.stdout
    tomb = json.loads((run / ".mpitailor-pruned").joinpath(
        *os.listdir(run / ".mpitailor-pruned")).read_text())
    assert tomb["name"] == "global_step12" and tomb["step"] == 12
    after = recovered(run, tmp_path / "after")
    check_same_composite(before, after)


def check_same_composite(before: Path, after: Path) -> None:
    """Every file byte for byte; in the manifest, only the creation time, the output path
    and the recipe's comment lines (the header counts the partial saves, and names the pruned
    one) may differ: every layer, source path and CRC-32 are the same."""
    files = sorted(str(p.relative_to(before)) for p in before.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(after)) for p in after.rglob("*") if p.is_file())
    for name in files:
        if name != "mpitailor_manifest.json":
            assert (before / name).read_bytes() == (after / name).read_bytes(), name
    a, b = (json.loads((d / "mpitailor_manifest.json").read_text()) for d in (before, after))
    assert "# stepped across, deleted by mpitailor prune: global_step12" in b["recipe"]

    def body(m: dict, out: Path) -> dict:
        lines = [line for line in m.pop("recipe").splitlines() if not line.startswith("#")]
        m.pop("created")
        return {**m, "recipe": "\n".join(lines).replace(str(out), "OUT")}
    assert body(a, before) == body(b, after)


def test_dry_run_deletes_nothing(run):
    before = tree_digest(run)
    names = sorted(os.listdir(run))
    r = prune_cli(run, "--keep-last", "0", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert tree_digest(run) == before and sorted(os.listdir(run)) == names
    assert "would remove" in r.stdout and f"would remove {run}/global_step12" in r.stdout
    assert "would remove 5 save(s)" in r.stdout


def test_a_save_in_progress_and_a_held_lock_survive(run):
    (run / "global_step18").mkdir()  # a newer save being written (DeepSpeed writes in place)
    shutil.copy(run / "global_step10" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                run / "global_step18")
    shutil.copytree(run / "global_step16", run / ".global_step20.mpitailor-staging")
    (run / "global_step11").mkdir()  # an older save killed before any file was written
    fd = os.open(run / ".global_step6.mpitailor-lock", os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live process writes global_step6
    try:
        r = prune_cli(run, "--keep-last", "0")
    finally:
        os.close(fd)
    assert r.returncode == 0, r.stderr
    assert saves_in(run) == ["global_step6", "global_step10", "global_step14", "global_step16",
                             "global_step18"]
    assert (run / ".global_step20.mpitailor-staging" / "mpitailor_partial.json").exists()
    assert "global_step11: incomplete by its own record" in r.stdout
    assert f"kept {run}/global_step18: newer than the newest usable save" in r.stdout
    assert f"kept {run}/global_step6: a live process holds" in r.stdout


def test_keep_last_keeps_the_newest_saves_whatever_they_hold(run):
    r = prune_cli(run, "--keep-last", "6")  # 6, 8, 10, 12, 14, 16
    assert r.returncode == 0, r.stderr
    assert saves_in(run) == [f"global_step{s}" for s in (6, 8, 10, 12, 14, 16)]
    assert not (run / ".mpitailor-pruned").exists()  # nobody builds on 2 and 4
    r = prune_cli(run, "--keep-last", "100")
    assert r.returncode == 0 and "removed 0 save(s)" in r.stdout, r.stdout + r.stderr


def test_older_composites_go_the_newest_stays(run, tmp_path):
    parked = tmp_path / "parked"
    (run / "global_step16").rename(parked)  # recover as it was at step 14
    old = recovered(run, tmp_path / "out" / "recovered-step14")
    (parked).rename(run / "global_step16")
    new = recovered(run, tmp_path / "out" / "recovered-step16")
    resume = run / ".mpitailor-resume"
    resume.mkdir()
    shutil.copytree(old, resume / "recovered-global_step14-abc")
    shutil.copytree(new, resume / "recovered-global_step16-def")
    (tmp_path / "out" / "recovered-step9").mkdir()  # no manifest: not ours to judge
    r = prune_cli(run, "--keep-last", "8", "--composites", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(resume)) == ["recovered-global_step16-def"]
    assert sorted(os.listdir(tmp_path / "out")) == ["recovered-step16", "recovered-step9"]
    assert "older than the newest composite: assembled from global_step14" in r.stdout
    assert "recovered-step9: not a readable composite" in r.stdout
    assert len(saves_in(run)) == 8  # keep-last 8 keeps every save


def test_bad_input_is_one_line_and_exit_2(run, tmp_path):
    cases = [([str(tmp_path / "nope"), "--keep-last", "1"], "does not exist"),
             ([str(run / "latest"), "--keep-last", "1"], "not a directory"),
             ([str(run), "--keep-last", "-1"], "--keep-last -1: give a count >= 0"),
             ([str(run / "global_step10"), "--keep-last", "1"], f"give the dir that holds the "
                                                                 f"saves: {run}"),
             ([str(run), "--keep-last", "1", "--composites", str(run / "latest")],
              "--composites DIR")]
    before = tree_digest(run)
    for args, what in cases:
        r = run_cli(["prune", *args], {})
        assert r.returncode == 2 and what in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert tree_digest(run) == before


def test_recover_refuses_a_tag_dir_and_a_dir_of_runs(run, tmp_path):
    r = run_cli(["recover", str(run / "global_step12"), "--emit-recipe"], {})
    assert r.returncode == 2 and f"a checkpoint's tag dir, not a save dir; give the dir " \
        f"that holds the saves: {run}" in r.stderr, r.stderr
    runs = tmp_path / "runs"
    runs.mkdir()
    for name in ("run_a", "run_b"):
        (runs / name).mkdir()
        for tag in ("global_step10", "global_step12"):
            shutil.copytree(run / tag, runs / name / tag)
        shutil.copy(run / "latest", runs / name / "latest")
    r = run_cli(["recover", str(runs), "--emit-recipe"], {})
    assert r.returncode == 2 and "holds the save dirs run_a, run_b" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_half_written_save_is_called_incomplete(run):
    (run / "global_step18").mkdir()
    (run / "checkpoint-20").mkdir()
    r = run_cli(["recover", str(run), "--emit-recipe"], {})
    assert r.returncode == 0, r.stderr
    for name in ("global_step18", "checkpoint-20"):
        assert f"skipping {name}: {run / name}: an incomplete save" in r.stderr, r.stderr
    assert "name the tag dir" not in r.stderr


def test_clean_reclaims_a_killed_prune(run):
    dead = run / ".global_step4.mpitailor-pruning"
    (run / "global_step4").rename(dead)  # killed between the rename and the rmtree
    r = run_cli(["clean", str(run)], {})
    assert r.returncode == 0, r.stderr
    assert not dead.exists() and f"removed {dead}" in r.stdout
    assert saves_in(run) == [f"global_step{s}" for s in (2, 6, 8, 10, 12, 14, 16)]


def test_the_api_prunes_and_reports(run):
    from mpitailor.cluster.comm import Comm
    from mpitailor.errors import UserError
    from mpitailor.jobs.prune import prune
    rep = prune(Comm(), run, keep_last=2, dry_run=True)
    assert rep.removed == () and [v.path.name for v in rep.plan.removals] == [
        "global_step2", "global_step4", "global_step6", "global_step8", "global_step12"]
    rep = prune(Comm(), run, keep_last=2)
    assert sorted(p.name for p in rep.removed) == sorted(
        ["global_step2", "global_step4", "global_step6", "global_step8", "global_step12"])
    assert rep.plan.newest == "global_step16" and len(rep.lines) == 8
    again = prune(Comm(), run, keep_last=2)  # the tombstone stays: 14 builds on 12
    assert again.removed == () and (run / ".mpitailor-pruned").is_dir()
    with pytest.raises(UserError, match="give a count >= 0"):
        prune(Comm(), run, keep_last=-3)


# -- the planner alone, on made-up records (Files, Meta: retention_timelines') ------------


ROOT = Path("/saves")


def save(step: int, held=None, parent: str | None = None, chain: str | None = None,
         problem: str | None = None) -> Save:
    sid = f"{step:08x}"
    lineage = Lineage(sid, chain or sid, parent)
    meta = None if problem else Meta(step, Files(held is not None), held)
    return Save(f"global_step{step}", ROOT / f"global_step{step}", meta, lineage, problem)


def parity_run() -> list[Save]:
    """Full 2, partials 4 (odd), 6 (even), 8 (odd), 10 (even)."""
    c = f"{2:08x}"
    return [save(2), save(4, ODD, f"{2:08x}", c), save(6, EVEN, f"{4:08x}", c),
            save(8, ODD, f"{6:08x}", c), save(10, EVEN, f"{8:08x}", c)]


def verdicts(plan) -> dict[str, bool]:
    return {v.path.name: v.remove for v in plan.verdicts}


def test_planner_removes_superseded_partials_with_tombstones():
    saves = parity_run()
    chain = choose(ROOT, saves, "global_step2")
    plan = plan_retention(ROOT, saves, chain, keep_last=0)
    assert verdicts(plan) == {"global_step2": False, "global_step4": True,
                              "global_step6": True, "global_step8": False,
                              "global_step10": False}
    marks = {v.path.name: v.tombstone for v in plan.verdicts if v.remove}
    assert marks["global_step4"].lineage.save_id == f"{4:08x}"  # 8 builds on 6 on 4
    assert marks["global_step6"].step == 6
    assert verdicts(plan_retention(ROOT, saves, chain, keep_last=4))["global_step4"] is False
    assert not any(verdicts(plan_retention(ROOT, saves, chain, keep_last=9)).values())


def test_follow_steps_across_tombstones_not_across_unmarked_gaps():
    saves = parity_run()
    without = [s for s in saves if s.name not in ("global_step4", "global_step6")]
    tombs = tuple(Pruned(s.name, s.step, s.lineage) for s in saves[1:3])
    assert [s.name for s in follow(saves[0], without, tombs)] == [
        "global_step4", "global_step6", "global_step8", "global_step10"]
    chain = choose(ROOT, without, "global_step2", tombs)
    assert [s.name for s in chain.partials] == ["global_step8", "global_step10"]
    assert chain.pruned == ("global_step4", "global_step6") and not chain.skipped
    gap = choose(ROOT, without, "global_step2", tombs[:1])  # 6 gone without a tombstone
    assert gap.partials == () and "another timeline" in dict(gap.skipped)["global_step8"]
    # a fork: an abandoned branch off 2 (step 3) loses to the pruned, newer branch
    fork = [*without, save(3, EVEN, f"{2:08x}", f"{2:08x}")]
    assert [s.name for s in choose(ROOT, fork, "global_step2", tombs).partials] == [
        "global_step8", "global_step10"]


def test_planner_never_removes_what_may_be_in_progress():
    saves = [*parity_run(), save(5, problem="truncated"), save(12, problem="no manifest"),
             save(11, EVEN, "ffffffff", "ffffffff")]
    old = [save(0)]  # an older chain's full save
    saves = sorted(old + saves, key=lambda s: s.step)
    chain = choose(ROOT, saves, "global_step2")
    busy = {str(ROOT / "global_step6"): "a live process holds .global_step6.mpitailor-lock"}
    plan = plan_retention(ROOT, saves, chain, keep_last=0, busy=busy)
    v = verdicts(plan)
    assert v["global_step0"] and v["global_step5"] and v["global_step4"]
    assert not v["global_step11"] and not v["global_step12"]  # newer than 10
    assert not v["global_step6"] and not v["global_step2"]
    why = {p.path.name: p.why for p in plan.verdicts}
    assert "a live process" in why["global_step6"] and "truncated" in why["global_step5"]


def test_planner_drops_tombstones_nobody_needs_and_judges_composites():
    saves = parity_run()
    stale = Pruned("global_step1", 1, Lineage("0badc0de", "0badc0de", None))
    chain = choose(ROOT, saves, "global_step2", (stale,))
    newest = saves[-1]
    comps = (Composite(Path("/out/recovered-step10"), str(newest.path), newest.lineage.save_id,
                       10),
             Composite(Path("/out/recovered-step8"), str(ROOT / "global_step8"), "x", 8),
             Composite(Path("/out/recovered-step12"), str(ROOT / "global_step12"), "y", 12),
             Composite(Path("/out/recovered-other"), "/elsewhere/global_step2", "z", 2),
             Composite(Path("/out/recovered-bad"), problem="no manifest"),
             Composite(Path("/out/recovered-tag"), str(newest.path / "global_step10"),
                       newest.lineage.save_id, 10))  # as HF's checkpoint-N are named
    plan = plan_retention(ROOT, saves, chain, keep_last=9, pruned=(stale,), composites=comps)
    v = verdicts(plan)
    assert v["0badc0de"] is True  # the stale tombstone
    assert v["recovered-step8"] is True
    assert not any(v[n] for n in ("recovered-step10", "recovered-step12", "recovered-other",
                                  "recovered-bad", "recovered-tag"))


def test_the_checkpointer_prunes_as_it_trains_with_keep_last(trained, tmp_path):
    """LayerwiseCheckpointer(keep_last=1): after each published save the run prunes its own
    save dir. Left at the end: the timeline's full save (10) and the newest copy of every
    layer (14: even layers; 16: odd layers and the aux keys); the older chain and step 12
    (its layers saved again at 16) are gone. Recovered, it gives the bytes of the same run
    trained without retention."""
    root = tmp_path / "run"
    spec = replace(spec_for("w2_parity", root), steps=16, save_at=tuple(range(2, 17, 2)),
                   stats=None, policy={"name": "parity", "full_every": 4, "keep_last": 1})
    launch(spec)
    assert saves_in(root) == ["global_step10", "global_step14", "global_step16"]
    mine, twin = recovered(root, tmp_path / "mine"), recovered(trained, tmp_path / "twin")
    files = lambda out: {str(p.relative_to(out)): p.read_bytes()  # noqa: E731
                         for p in sorted(out.rglob("*")) if p.is_file()
                         and p.name != "mpitailor_manifest.json"}
    a, b = files(mine), files(twin)
    assert sorted(a) == sorted(b) and [n for n in a if a[n] != b[n]] == []


def test_layerwise_trainer_applies_save_total_limit_by_these_rules(tmp_path):
    """HF Trainer with save_total_limit=1: LayerwiseTrainer prunes by mpitailor's rules (HF's
    rotation is off). Saves at 2 (full), 4, 6 (full), 8: the older chain goes, the timeline
    of 6 stays whole, and it recovers."""
    from ckpt_fixtures import HF_MODULE
    root = tmp_path / "run"
    spec = replace(spec_for("hf_w2_parity", root), steps=8, save_at=(2, 4, 6, 8), stats=None,
                   policy={"name": "parity", "full_every": 2, "keep_last": 1})
    launch(spec, module=HF_MODULE)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("checkpoint-")) == \
        ["checkpoint-6", "checkpoint-8"]
    out = recovered(root, tmp_path / "out")
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 8
