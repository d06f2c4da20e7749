"""Retention of DCP saves (issue 43, part 2): `prune` of a save dir of DcpCheckpointer's saves
removes what the newest composite no longer needs, leaves tombstones recovery steps across,
and never takes a byte a composite made with `--link` still uses (the file system counts the
hard links: a pruned save's linked files stay until their last name goes, and prune says so).

The fixture is a real 2-rank FSDP2 run (`dcp_w2_parity`: a full save at step 2, odd layers at
4, even layers at 6, odd layers at 8). The property of tests/test_retention_safety.py holds
here too, on real DCP saves damaged at random: after any prune, recovery is what it was, or
prune refused and changed nothing."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from conftest import tree_digest
from dcp_oracle import torch_state
from merging import run_cli
from retention_disk import damage_dcp_on_disk, prune_keeps_what_recovery_takes

from mpitailor.cluster.comm import Comm
from mpitailor.errors import MpitailorError
from mpitailor.jobs.dcp_recovery import recover_dcp_chain
from mpitailor.jobs.prune import prune
from mpitailor.jobs.readlocks import release

FIXTURE = "dcp_w2_parity"


def recipe_body(run: Path) -> str | None:
    """What `recover` takes from where (the recipe less its comments); None: it refuses."""
    try:
        text = recover_dcp_chain(Comm(), run, None)[0].text
    except MpitailorError:
        return None
    finally:
        release()  # (recover holds its sources: a prune after it here would keep them)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def composite_digest(out: Path) -> dict[str, str]:
    digest = tree_digest(out)
    digest.pop("mpitailor_manifest.json")  # (names the saves taken and their paths)
    return digest


def test_prune_removes_a_superseded_partial_save_and_recovery_writes_the_same_bytes(
        ckpt_copy, tmp_path):
    run = ckpt_copy(FIXTURE)
    assert run_cli(["recover", str(run), "-o", str(tmp_path / "before")], {}).returncode == 0
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0, r.stderr
    assert "removed " + str(run / "step-4") in r.stdout, r.stdout
    assert sorted(p.name for p in run.glob("step-*")) == ["step-2", "step-6", "step-8"]
    assert len(list((run / ".mpitailor-pruned").iterdir())) == 1  # step-4's tombstone
    r = run_cli(["recover", str(run), "-o", str(tmp_path / "after")], {})
    assert r.returncode == 0, r.stderr
    assert composite_digest(tmp_path / "after") == composite_digest(tmp_path / "before")
    # a second prune has nothing left to do
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0 and "removed 0 save(s)" in r.stdout, r.stdout


def test_keep_last_keeps_the_newest_saves_of_the_timeline(ckpt_copy):
    run = ckpt_copy(FIXTURE)
    r = run_cli(["prune", str(run), "--keep-last", "3"], {})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in run.glob("step-*")) == ["step-2", "step-4", "step-6",
                                                          "step-8"]
    assert "within --keep-last 3" in r.stdout


def test_a_linked_composite_keeps_its_bytes_when_its_sources_are_pruned(ckpt_copy, tmp_path):
    run = ckpt_copy(FIXTURE)
    newest = run / "step-8"
    newest.rename(tmp_path / "step-8")  # the composite of steps 2, 4 and 6
    outside = tmp_path / "linked"
    inside = run / ".mpitailor-resume" / "recovered-step-6-x"
    for out in (outside, inside):
        r = run_cli(["recover", str(run), "-o", str(out), "--link"], {})
        assert r.returncode == 0, r.stderr
    (tmp_path / "step-8").rename(newest)
    before = torch_state(outside, tmp_path)
    linked = {p.stat().st_ino for p in outside.glob("s*.distcp")}
    assert linked & {p.stat().st_ino for p in (run / "step-4").glob("*.distcp")}
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 0, r.stderr
    assert not (run / "step-4").exists() and not inside.exists()  # the older composite too
    said = [line for line in r.stdout.splitlines() if "step-4:" in line]
    assert "stay on disk, hard-linked elsewhere" in said[0], said
    after = torch_state(outside, tmp_path)  # torch's own reader, files still there
    assert before.keys() == after.keys()
    import torch
    for key, value in before.items():
        same = torch.equal(value, after[key]) if isinstance(value, torch.Tensor) else \
            value == after[key]
        assert same, key


def test_a_save_that_cannot_be_read_now_blocks_prune(ckpt_copy):
    run = ckpt_copy(FIXTURE)
    victim = run / "step-6" / "__1_0.distcp"
    victim.rename(run.parent / "aside")
    os.mkfifo(victim)
    names = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "prune removed nothing" in r.stderr and "step-6" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == names


@pytest.mark.parametrize("seed", range(32))  # ~0.4 s each
def test_prune_of_damaged_dcp_saves_keeps_what_recovery_takes(ckpt_copy, seed):
    rng = random.Random(seed)
    run = ckpt_copy(FIXTURE)
    if rng.random() < 0.5:  # an earlier prune left step-4's tombstone
        prune(Comm(), run, keep_last=0)
    swaps = damage_dcp_on_disk(run, rng)
    keep_last = rng.randint(0, 3)
    prune_keeps_what_recovery_takes(run, swaps, recipe_body,
                                    lambda: prune(Comm(), run, keep_last=keep_last),
                                    tree_digest)


def test_keep_last_in_training_prunes_after_each_save(tmp_path):
    """DcpCheckpointer(keep_last=0) in a real FSDP2 run (dcp_w2_parity's, saves 2, 4, 6,
    8): after the save of step 8 the odd layers of step 4 are saved again, and step 4 goes
    with its tombstone; recovery takes what it takes from the fixture's untouched saves."""
    from ckpt_fixtures import VARIANTS, build

    from dev.tinytrain.launch import launch
    from dev.tinytrain.spec import TrainSpec
    spec = dict(VARIANTS[FIXTURE][0])
    spec["policy"] = {**spec["policy"], "keep_last": 0}
    run = tmp_path / "run"
    (tmp_path / "logs").mkdir()
    launch(TrainSpec(save_dir=str(run), **spec), module=VARIANTS[FIXTURE][1],
           log_dir=tmp_path / "logs")
    assert sorted(p.name for p in run.glob("step-*")) == ["step-2", "step-6", "step-8"]
    assert len(list((run / ".mpitailor-pruned").iterdir())) == 1
    untouched = build(FIXTURE)
    assert recipe_body(run).replace(str(run), "RUN") == \
        recipe_body(untouched).replace(str(untouched), "RUN")
    for d in (run, untouched):
        r = run_cli(["recover", str(d), "-o", str(tmp_path / f"out-{d.name}")], {})
        assert r.returncode == 0, r.stderr
    got, want = (composite_digest(tmp_path / f"out-{d.name}") for d in (run, untouched))
    for digest in (got, want):  # (DCP's own save id, new at every dcp.save, is in it)
        digest.pop(".metadata")
    assert got == want


def test_inspect_of_the_save_dir_shows_the_timeline_recover_takes(ckpt_copy):
    run = ckpt_copy(FIXTURE)
    assert run_cli(["prune", str(run), "--keep-last", "0"], {}).returncode == 0
    os.truncate(run / "step-6" / "__1_0.distcp", 100)
    r = run_cli(["inspect", str(run)], {})
    assert r.returncode == 0, r.stderr
    assert "from step-8: embed, layers.1, layers.3, norm, lm_head" in r.stdout, r.stdout
    assert "skipped step-6: " in r.stdout and "stepped across (pruned): step-4" in r.stdout
    import json
    rep = json.loads(run_cli(["inspect", str(run), "--json"], {}).stdout)
    assert rep["recover"]["layers"] == {k: "step-8" for k in
                                        ("embed", "layers.1", "layers.3", "norm", "lm_head")}
    assert [s["name"] for s in rep["saves"] if s["problem"]] == ["step-6"]
