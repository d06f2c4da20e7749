"""Holes a second hostile review found in the DCP surfaces that delete what others need or
read what others wrote (prune, link mode, export, verify, inspect), each pinned by the test
that failed before its fix.

The fixture is the real 2-rank FSDP2 run `dcp_w2_parity` (a full save at step 2, odd layers at
4, even layers at 6, odd layers at 8); every test works on its own copy."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from merging import run_cli

FIXTURE = "dcp_w2_parity"


class _Payload:
    """What a crafted bytes entry holds: unpickled with torch.load(weights_only=False), as
    DCP's default planner loads bytes entries, it calls a function (a harmless one here)."""

    def __reduce__(self):
        return (os.getpid, ())


def _save_with_payload(run: Path, out: Path) -> None:
    """A plain dcp.save of run's step-2 (real entries) plus one bytes entry whose pickle
    names posix.getpid: what a tampered save carries."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out.parent.mkdir(parents=True, exist_ok=True)
    whole = out.parent.parent / "whole.pt"
    dcp_to_torch_save(str(run / "step-2"), str(whole))
    state = torch.load(whole, weights_only=False)
    state["trainer_extra"] = _Payload()
    dcp.save(state, checkpoint_id=str(out), no_dist=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_link_mode_carries_no_pickle_payload_that_a_copy_refuses(ckpt_copy, tmp_path):
    """A copy checks every item it writes (a bytes entry through the allow-list: no payload
    carried into the output); `--link` checked none, and published a composite whose bytes
    entry dcp.load unpickles with weights_only=False: code run at the job's resume (the
    in-job resume links too). Both refuse it now, in one line naming the file."""
    run = ckpt_copy(FIXTURE)
    saves = tmp_path / "tampered"
    _save_with_payload(run, saves / "step-2")
    for extra in ([], ["--link"]):
        out = tmp_path / f"out{len(extra)}"
        r = run_cli(["recover", str(saves), "-o", str(out), *extra], {})
        assert r.returncode == 2, (extra, r.stdout, r.stderr)
        assert "posix.getpid" in r.stderr and str(saves / "step-2") in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        assert not out.exists() and not list(tmp_path.glob(".out*")), extra


def test_inspect_names_the_saves_recover_takes_and_where_the_rest_comes_from(ckpt_copy):
    """inspect SAVE_DIR said `recover step 8: step-2 and step-4, step-6, step-8` and `from
    step-2: every other entry`, while recover takes from step-6 and step-8 only (every layer
    of step-2 and step-4 saved again later) and everything outside the layers (the
    optimizer's param groups, the trainer's own state) from its base, step-8."""
    import json
    run = ckpt_copy(FIXTURE)
    r = run_cli(["inspect", str(run)], {})
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("recover"))
    assert "step-6, step-8" in line and "step-2" not in line and "step-4" not in line, line
    assert "from step-2" not in r.stdout, r.stdout
    assert "from step-8 (the base): every entry outside the layers" in r.stdout, r.stdout
    rep = json.loads(run_cli(["inspect", str(run), "--json"], {}).stdout)["recover"]
    assert (rep["sources"], rep["base"]) == (["step-6", "step-8"], "step-8")
    emitted = run_cli(["recover", str(run), "--emit-recipe"], {}).stdout
    assert "taken from: step-6, step-8." in emitted  # what recover itself says


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))


def test_recovery_says_so_when_a_pruned_saves_layers_come_from_an_older_copy(ckpt_copy):
    """prune removed step-4 because step-8 held its layers again; step-8 is damaged later
    (or deleted by hand): recovery then ends at step-6 and takes layers.1 and layers.3 from
    step-2, two steps older than the copies that went with step-4, and said only `recovered
    step 6 from step-2, step-6; skipped step-8`. The tombstone remembers the layers the
    pruned save held, and recovery names the layers rolled back."""
    import json
    run = ckpt_copy(FIXTURE)
    assert run_cli(["prune", str(run), "--keep-last", "0"], {}).returncode == 0
    tomb = next((run / ".mpitailor-pruned").iterdir())
    assert json.loads(tomb.read_text())["layers"] == ["embed", "layers.1", "layers.3",
                                                      "lm_head", "norm"]
    _flip(run / "step-8" / "__0_0.distcp", 1000)
    r = run_cli(["recover", str(run), "--emit-recipe"], {})
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if "older copies" in line]
    assert said and "layers.1, layers.3" in said[0] and "step-4" in said[0], r.stdout
    r = run_cli(["recover", str(run), "-o", str(run.parent / "out")], {})
    assert r.returncode == 0, r.stderr
    line = r.stdout.splitlines()[-1]
    assert "older copies" in line and "layers.1, layers.3" in line and "step-4" in line, line
    os.truncate(run / "step-8" / "__0_0.distcp", 100)  # (inspect reads sizes, not CRCs)
    r = run_cli(["inspect", str(run)], {})
    assert "older copies" in r.stdout and "step-4" in r.stdout, r.stdout


def _paused(args: list[str], gate: Path, point: str = "commit"):
    """The CLI run in the background, held at failpoint `point` on rank 0 until gate/go."""
    import subprocess
    import sys
    import time

    from child_env import child_env
    gate.mkdir()
    env = {**child_env(), "MPITAILOR_FAILPOINT": f"{point}:0:pause={gate}"}
    job = subprocess.Popen([sys.executable, "-m", "mpitailor", *args], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (gate / "reached").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.05)
    return job


def test_prune_keeps_an_older_composite_while_an_export_reads_it(ckpt_copy, tmp_path):
    """`export COMPOSITE` (a checkpoint given whole, not a save dir) held nothing: a prune
    meanwhile removed the composite as older than the newest one, and the export's
    --verify, which reads the source again, failed on a missing file after publishing."""
    from ckpt_fixtures import build, spec_for

    from dev.tinytrain.model import tiny_config
    run = ckpt_copy(FIXTURE)
    old = run / ".mpitailor-resume" / "recovered-step-6"
    (run / "step-8").rename(tmp_path / "step-8")
    assert run_cli(["recover", str(run), "-o", str(old)], {}).returncode == 0
    (tmp_path / "step-8").rename(run / "step-8")
    config = tmp_path / "config"
    tiny_config(spec_for(FIXTURE, build(FIXTURE))).save_pretrained(config)
    job = _paused(["export", str(old), "-o", str(tmp_path / "hf"), "--format", "hf",
                   "--config", str(config), "--verify"], tmp_path / "gate")
    try:
        r = run_cli(["prune", str(run), "--keep-last", "0"], {})
        assert r.returncode == 0, r.stderr
        assert old.is_dir(), r.stdout
        assert f"kept {old}: a live process reads it" in r.stdout, r.stdout
    finally:
        (tmp_path / "gate" / "go").touch()
        out, err = job.communicate(timeout=180)
    assert job.returncode == 0, out + err
    r = run_cli(["prune", str(run), "--keep-last", "0"], {})  # once it has ended: gone
    assert r.returncode == 0 and not old.exists(), r.stdout + r.stderr


def test_prune_keeps_a_save_a_running_dcp_merge_reads(ckpt_copy, tmp_path):
    """`merge RECIPE` of DCP saves held nothing (recover holds its sources): a prune run
    meanwhile removed step-4, which the recipe takes layer 1 from, under the merge."""
    run = ckpt_copy(FIXTURE)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"sources:\n  old: {run / 'step-4'}\n  new: {run / 'step-8'}\n"
                      f"  even: {run / 'step-6'}\n"
                      f"layers:\n  '0': even\n  '1': old\n  '2': even\n  '3': new\n"
                      f"base: new\noutput: {tmp_path / 'out'}\n")
    job = _paused(["merge", str(recipe)], tmp_path / "gate", point="write")
    try:
        r = run_cli(["prune", str(run), "--keep-last", "0"], {})
        assert r.returncode == 0, r.stderr
        assert (run / "step-4").is_dir(), r.stdout
        assert f"kept {run / 'step-4'}: a live process reads it" in r.stdout, r.stdout
    finally:
        (tmp_path / "gate" / "go").touch()
        out, err = job.communicate(timeout=180)
    assert job.returncode == 0, out + err


def test_export_of_a_save_dir_of_safetensors_dcp_saves(ckpt_copy, tmp_path):
    """export SAVE_DIR plans the newest composite in link mode, whose items lost their
    `safetensors` mark (planning/dcp_link.py rebuilt them without it): every chunk of
    FileSystemWriter(SAFETENSORS) saves was then read as a torch.save item, and the export
    refused valid saves ('not a torch.save item', one clause per rank). Now it writes the
    bytes the export of the newest save itself writes, at 1 and 2 ranks."""
    from ckpt_fixtures import build, spec_for

    from dev.tinytrain.model import tiny_config
    run = ckpt_copy("dcp_w2_fsdp2_safetensors")
    config = tmp_path / "config"
    tiny_config(spec_for("dcp_w2_fsdp2_safetensors",
                         build("dcp_w2_fsdp2_safetensors"))).save_pretrained(config)
    newest = max(run.glob("step-*"), key=lambda p: int(p.name[5:]))
    want = tmp_path / "want"
    r = run_cli(["export", str(newest), "-o", str(want), "--format", "hf", "--config",
                 str(config)], {})
    assert r.returncode == 0, r.stderr
    for ranks in (1, 2):
        out = tmp_path / f"got{ranks}"
        r = run_cli(["export", str(run), "-o", str(out), "--format", "hf", "--config",
                     str(config), "--verify"], {}, ranks=ranks)
        assert r.returncode == 0, r.stderr
        assert (out / "model.safetensors").read_bytes() == \
            (want / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", ["step-8/mpitailor_save.json", "step-6/stats.json",
                                  "step-2/mpitailor_save.json"])
def test_stats_file_inside_a_source_is_refused(ckpt_copy, tmp_path, name):
    """`recover DIR -o OUT --stats DIR/step-8/mpitailor_save.json` replaced the newest
    save's record with the stats (recover then skipped step-8: 'format None'); a stats file
    anywhere in a source save adds a file to an input, and in the full save (no source of
    the composite, but the start of the timeline) it broke every later recovery. Refused
    before anything is merged, in one line, nothing written."""
    from conftest import tree_digest
    run = ckpt_copy(FIXTURE)
    before = tree_digest(run)
    r = run_cli(["recover", str(run), "-o", str(tmp_path / "out"), "--stats",
                 str(run / name)], {})
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--stats" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert tree_digest(run) == before and not (tmp_path / "out").exists()


def test_an_output_inside_a_source_save_is_refused(ckpt_copy, tmp_path):
    """`recover DIR -o DIR/step-8/out` and `export DIR -o DIR/step-2/hf` wrote into a save
    they read (an input modified), where the save's retention then deletes it with the
    save (prune removes step-N whole). Refused in one line, nothing written."""
    from ckpt_fixtures import build, spec_for
    from conftest import tree_digest

    from dev.tinytrain.model import tiny_config
    run = ckpt_copy(FIXTURE)
    config = tmp_path / "config"
    tiny_config(spec_for(FIXTURE, build(FIXTURE))).save_pretrained(config)
    before, names = tree_digest(run), sorted(os.listdir(run))
    for args in (["recover", str(run), "-o", str(run / "step-8" / "out")],
                 ["recover", str(run), "-o", str(run / "step-2" / "out"), "--link"],
                 ["export", str(run), "-o", str(run / "step-6" / "hf"), "--format", "hf",
                  "--config", str(config)],
                 ["export", str(run / "step-2"), "-o", str(run / "step-2" / "hf"),
                  "--format", "hf", "--config", str(config)]):
        r = run_cli(args, {})
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "inside the source" in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert tree_digest(run) == before and sorted(os.listdir(run)) == names, args


def test_a_save_pruned_while_recover_surveys_it_is_said_as_such(ckpt_copy, tmp_path):
    """A prune that removes step-4 while recover is reading the saves (before it holds
    its sources): recover said `step-4: cannot be read now (... not found); it may hold
    the newest copy of a layer: fix what stops the read (its permissions, the disk ...)`,
    sending the user after a disk fault; it was removed, and a rerun recovers."""
    run = ckpt_copy(FIXTURE)
    job = _paused(["recover", str(run), "-o", str(tmp_path / "out")], tmp_path / "gate",
                  point="read/step-4")
    try:
        r = run_cli(["prune", str(run), "--keep-last", "0"], {})
        assert r.returncode == 0 and not (run / "step-4").exists(), r.stdout + r.stderr
    finally:
        (tmp_path / "gate" / "go").touch()
        out, err = job.communicate(timeout=180)
    assert job.returncode == 1, out + err
    assert f"{run / 'step-4'}: removed while it was read" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    assert run_cli(["recover", str(run), "-o", str(tmp_path / "out")], {}).returncode == 0


def test_rolled_back_layers_are_said_when_no_save_builds_on_the_tombstone_any_more(
        ckpt_copy):
    """The same, found by the prune-then-damage generator: step-8 removed by hand and
    step-6's record lost, so no save builds on step-4's tombstone; recovery (step-2 alone)
    took layers.1 and layers.3 from step-2 and said nothing of step-4's newer copies."""
    import shutil
    run = ckpt_copy(FIXTURE)
    assert run_cli(["prune", str(run), "--keep-last", "0"], {}).returncode == 0
    shutil.rmtree(run / "step-8")
    (run / "step-6" / "mpitailor_save.json").unlink()
    r = run_cli(["recover", str(run), "--emit-recipe"], {})
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if "older copies" in line]
    assert said and "layers.1, layers.3" in said[0] and "step-4" in said[0], r.stdout


def test_stats_file_inside_a_zero_save_is_refused_too(ckpt_copy, tmp_path):
    """The ZeRO recover had the same hole: `--stats DIR/global_step2/mpitailor_save.json`
    replaced the full save's record, and no recovery of the run was possible after it."""
    from conftest import tree_digest
    run = ckpt_copy("w2_parity")
    before = tree_digest(run)
    for name in ("global_step2/mpitailor_save.json", "global_step8/stats.json"):
        r = run_cli(["recover", str(run), "-o", str(tmp_path / "out"), "--stats",
                     str(run / name)], {})
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert "--stats" in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert tree_digest(run) == before and not (tmp_path / "out").exists()


def _recovery(run: Path) -> tuple[str | None, bool]:
    """What recover takes from where (its recipe less comments and paths; None: it
    refuses), and whether it names layers rolled back past a tombstone."""
    from mpitailor.cluster.comm import Comm
    from mpitailor.errors import MpitailorError
    from mpitailor.jobs.dcp_recovery import recover_dcp_chain
    from mpitailor.jobs.readlocks import release
    try:
        recipe, chain, _ = recover_dcp_chain(Comm(), run, None)
    except MpitailorError:
        return None, False
    finally:
        release()
    body = "\n".join(line for line in recipe.text.splitlines() if not line.startswith("#"))
    return body.replace(str(run), "RUN"), bool(chain.rolled_back)


def _damage_later(run: Path, plan: list[tuple[str, str, str]]) -> None:
    import shutil
    for kind, save, name in plan:
        s = run / save
        if not s.is_dir():
            continue
        f = s / name
        if kind == "rm":
            shutil.rmtree(s)
        elif kind == "record":
            (s / "mpitailor_save.json").unlink(missing_ok=True)
        elif kind == "trunc" and f.exists():
            os.truncate(f, 10)
        elif kind == "flip" and f.exists() and f.stat().st_size > 1234:
            _flip(f, 1234)


@pytest.mark.parametrize("seed", range(12))
def test_prune_then_later_damage_is_never_a_silent_rollback(ckpt_copy, tmp_path, seed):
    """The generator behind the rolled-back layers: prune (keep-last 0 to 2), then damage
    the saves left at random (a flipped byte, a file cut short, a record lost, a save
    gone), the same damage to an unpruned copy. Recovery of the pruned dir takes every layer from
    where the unpruned one does, or names the layers it takes from older copies, or
    refuses; never older copies unsaid."""
    import random
    import shutil

    from mpitailor.cluster.comm import Comm
    from mpitailor.jobs.prune import prune
    rng = random.Random(seed)
    pruned = ckpt_copy(FIXTURE)
    whole = tmp_path / "whole"
    shutil.copytree(pruned, whole)
    prune(Comm(), pruned, rng.choice([0, 0, 1, 2]))
    plan = [(rng.choice(["flip", "trunc", "record", "rm"]), rng.choice(["step-4", "step-6",
                                                                       "step-8"]),
             rng.choice(["__0_0.distcp", "__1_0.distcp"])) for _ in range(rng.randint(1, 2))]
    plan = [p for p in plan if (pruned / p[1]).is_dir()]  # (the same damage to both)
    for run in (pruned, whole):
        _damage_later(run, plan)
    (got, said), (want, _) = _recovery(pruned), _recovery(whole)
    assert got == want or got is None or said, (plan, got, want)


def test_recover_of_a_save_dir_of_torchtitans_own_saves(tmp_path):
    """docs/dcp: a dir of plain dcp.save checkpoints (torchtitan's step-N/) recovers, the
    newest taken whole. Of torchtitan's own layout it refused: 'layers 0-1 have no source
    ... add `rest: SOURCE`' (a recipe's advice to a recover user), as a save's layers were
    found by get_state_dict's `model.` keys alone. Now the composite holds step-4's
    entries, every tensor's bytes equal (torch's reader the oracle)."""
    import shutil

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    data = Path(__file__).parent / "data" / "torchtitan"
    run = tmp_path / "run"
    run.mkdir()
    for save in ("step-2", "step-4"):
        shutil.copytree(data / save, run / save)
    out = tmp_path / "out"
    r = run_cli(["recover", str(run), "-o", str(out)], {})
    assert r.returncode == 0, r.stderr
    assert "from step-4" in r.stdout, r.stdout
    got, want = {}, {}
    for src, into in ((out, got), (run / "step-4", want)):
        dcp_to_torch_save(str(src), str(tmp_path / "x.pt"))
        into.update(torch.load(tmp_path / "x.pt", weights_only=False))
    tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    assert tensors and sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in tensors)


def test_a_tombstone_of_a_save_with_many_layers_reads_back(tmp_path):
    """Tombstones now name the layers their save held, and were read bounded to 4 KiB: a
    save of many layer keys (an MoE's experts by layer pattern) left a tombstone recovery
    took for damaged, and refused the save dir."""
    from mpitailor.formats.zero import Lineage
    from mpitailor.jobs.tombstones import read_tombstones, write_tombstone
    from mpitailor.planning.chain import Pruned
    layers = frozenset(f"layers.{i}.experts.{j}" for i in range(32) for j in range(32))
    lineage = Lineage("ab" * 16, "cd" * 16, "cd" * 16)
    write_tombstone(tmp_path, Pruned("step-4", 4, lineage, layers))
    found = read_tombstones(tmp_path)
    assert not found.bad and found.good[0].layers == layers
    many = frozenset(f"{k}.w{n}" for k in layers for n in range(8))  # (over 32 KiB: a
    write_tombstone(tmp_path, Pruned("step-4", 4, lineage, many))  # node-local listing
    found = read_tombstones(tmp_path)                                # carries less)
    assert not found.bad and found.good[0].layers is None
