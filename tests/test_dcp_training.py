"""Layer-wise saves of a plain FSDP2 loop with PyTorch DCP (issue 43, part 4), and their
recovery (part 2): a real FSDP2 run on 2 ranks saves with `DcpCheckpointer` and Parity (a
full save at step 2, odd layers at 4, even layers at 6); `recover` assembles the newest copy
of every layer (torch's own DCP reader is the oracle); a requeued job resumes through
`recover_for_resume` + `load_dcp` at 1, 2 and 4 ranks exactly as from the composite torch
itself assembles; a run killed publishing a save leaves no trace of it, and a damaged save is
skipped and said."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from dcp_oracle import layer_of, torch_state
from merging import run_cli

from dev.tinytrain.launch import TrainFailed, launch
from dev.tinytrain.spec import TrainSpec
from mpitailor.errors import CheckpointError
from mpitailor.formats.dcp import read_dcp_save_record

WORKER = "dev.tinytrain.fsdp2_worker"
FLAT = {"flatten_optimizer": True}


def _train(root: Path, name: str, **kw) -> dict:
    (root / "logs" / name).mkdir(parents=True, exist_ok=True)
    return launch(TrainSpec(**kw), module=WORKER, log_dir=root / "logs" / name)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dcp-layerwise")
    _train(root, "run", save_dir=str(root / "run"), world_size=2, steps=6, save_at=(2, 4, 6),
           policy={"name": "parity"}, extra=FLAT)
    return root / "run"


def _composite(saves: dict[int, Path], newest_of, tmp: Path) -> dict:
    """The composite torch's reader assembles: entry by entry from the save newest_of(layer
    key, or None outside the layers) names."""
    flats = {step: torch_state(p, tmp) for step, p in saves.items()}
    full = flats[min(flats)]
    return {key: flats[newest_of(layer_of(key))][key] for key in full}


def _equal(a: dict, b: dict) -> None:
    import torch
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    for k, v in a.items():
        same = torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k]
        assert same, k


def _parity_newest(layer: str | None) -> int:
    return 4 if layer in ("layers.1", "layers.3") else 6


def _killed_newest(layer: str | None) -> int:
    return 2 if layer in ("layers.0", "layers.2") else 4


def test_saves_hold_what_the_policy_chose_and_are_recorded(run):
    full, odd, even = (read_dcp_save_record(run / f"step-{s}") for s in (2, 4, 6))
    assert full.layers is None and full.lineage.chain == full.lineage.save_id
    assert odd.layers == {"embed", "layers.1", "layers.3", "norm", "lm_head"}
    assert even.layers == {"embed", "layers.0", "layers.2", "norm", "lm_head"}
    assert odd.lineage.parent == full.lineage.save_id == odd.lineage.chain
    assert even.lineage.parent == odd.lineage.save_id
    names = {p.name for p in (run / "step-4").iterdir()}
    assert names == {".metadata", "__0_0.distcp", "__1_0.distcp", "mpitailor_save.json"}
    assert set(odd.files) == names - {"mpitailor_save.json"}
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no staging left


def test_recover_takes_every_layer_from_its_newest_save(run, tmp_path):
    out = tmp_path / "out"
    r = run_cli(["recover", str(run), "-o", str(out)], {})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "from step-4, step-6" in r.stdout  # the full save is superseded layer by layer
    want = _composite({2: run / "step-2", 4: run / "step-4", 6: run / "step-6"},
                      _parity_newest, tmp_path)
    _equal(torch_state(out, tmp_path), want)
    two = tmp_path / "two"
    r = run_cli(["recover", str(run), "-o", str(two)], {}, ranks=2)
    assert r.returncode == 0, r.stdout + r.stderr
    for f in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        assert (out / f).read_bytes() == (two / f).read_bytes(), f


def _oracle_dir(run: Path, tmp: Path, newest_of) -> Path:
    import torch
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
    steps = sorted(int(p.name.split("-")[1]) for p in run.iterdir() if p.name.startswith("step"))
    comp = _composite({s: run / f"step-{s}" for s in steps}, newest_of, tmp)
    torch.save(comp, tmp / "oracle.pt")
    torch_save_to_dcp(str(tmp / "oracle.pt"), str(tmp / "oracle"))
    return tmp / "oracle"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_requeued_job_resumes_exactly_as_from_torchs_composite(run, tmp_path, world_size):
    saves = tmp_path / "run"
    shutil.copytree(run, saves)
    oracle = _oracle_dir(run, tmp_path, _parity_newest)
    common = dict(world_size=world_size, steps=3, save_at=())
    want = _train(tmp_path, "oracle", save_dir=str(tmp_path / "o"), load_dir=str(oracle),
                  extra={**FLAT, "first_step": 6}, **common)
    got = _train(tmp_path, "resumed", save_dir=str(tmp_path / "m"), load_dir=str(saves),
                 extra={**FLAT, "recover": True}, **common)
    assert got["losses"] == want["losses"]
    if world_size == 2:  # requeued once more: the composite written then is reused
        from mpitailor.cluster.comm import Comm
        from mpitailor.jobs.in_job_resume import recover_in_job
        point = recover_in_job(Comm(None), saves)
        assert "recovered before" in point.line, point.line
    assert len(list((saves / ".mpitailor-resume").iterdir())) == 1


def test_a_run_killed_publishing_a_save_leaves_no_trace_of_it(tmp_path):
    env = {"MPITAILOR_FAILPOINT": "commit/step-6:0"}
    with pytest.raises(TrainFailed):
        _train(tmp_path, "killed", save_dir=str(tmp_path / "run"), world_size=2, steps=6,
               save_at=(2, 4, 6), policy={"name": "parity"}, extra={**FLAT, "env": env})
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == \
        ["step-2", "step-4"]
    out = tmp_path / "out"
    r = run_cli(["recover", str(run), "-o", str(out)], {})
    assert r.returncode == 0, r.stdout + r.stderr
    want = _composite({2: run / "step-2", 4: run / "step-4"},
                      _killed_newest, tmp_path)
    _equal(torch_state(out, tmp_path), want)
    # the requeued job's resume (recover_for_resume: the test above) tidies what the kill left
    from mpitailor.cluster.comm import Comm
    from mpitailor.jobs.in_job_resume import recover_in_job
    point = recover_in_job(Comm(None), run, output_root=tmp_path / "resume")
    assert point.path is not None and "removed what interrupted saves left" in point.line
    assert not [p for p in run.iterdir() if "mpitailor-staging" in p.name]


def _damaged(run: Path, tmp_path: Path, how) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    how(copy / "step-6" / "__1_0.distcp")
    return copy


@pytest.mark.parametrize("damage,why", [
    (lambda p: os.truncate(p, p.stat().st_size - 10), "truncated"),
    (lambda p: _flip(p, p.stat().st_size // 2), "CRC-32"),
])
def test_a_damaged_save_is_skipped_and_said(run, tmp_path, damage, why):
    copy = _damaged(run, tmp_path, damage)
    out = tmp_path / "out"
    r = run_cli(["recover", str(copy), "-o", str(out)], {})
    assert r.returncode == 0, r.stdout + r.stderr
    said = r.stdout + r.stderr
    assert "skipped step-6" in said and why in said and "__1_0.distcp" in said
    want = _composite({2: run / "step-2", 4: run / "step-4"},
                      _killed_newest, tmp_path)
    _equal(torch_state(out, tmp_path), want)


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_an_unreadable_newest_save_stops_the_recovery(run, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file: no permission to take away")
    copy = _damaged(run, tmp_path, lambda p: os.chmod(p, 0))
    r = run_cli(["recover", str(copy), "-o", str(tmp_path / "out")], {})
    assert r.returncode != 0 and "cannot be read now" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit,says", [
    (lambda d: d.update(format="mpitailor-save"), "format"),
    (lambda d: d.update(global_steps=-1), "global_steps"),
    (lambda d: d.update(layers=[]), "layers"),
    (lambda d: d.update(layers="layers.1"), "layers"),
    (lambda d: d["files"].update({"../x": {"bytes": 1, "crc32": "00000000"}}), "../x"),
    (lambda d: d["files"]["__0_0.distcp"].update(bytes=True), "record of"),
    (lambda d: d["files"]["__0_0.distcp"].update(crc32="xyz"), "record of"),
    (lambda d: d.update(save_id=7), "lineage"),
    (lambda d: d.pop("files"), "files"),
])
def test_a_malformed_record_is_one_line_naming_the_file(run, tmp_path, edit, says):
    save = tmp_path / "step-4"
    shutil.copytree(run / "step-4", save)
    doc = json.loads((save / "mpitailor_save.json").read_text())
    edit(doc)
    (save / "mpitailor_save.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as e:
        read_dcp_save_record(save)
    assert str(e.value).startswith(str(save / "mpitailor_save.json")) and says in str(e.value)
    assert "\n" not in str(e.value)


def test_a_record_that_leaves_a_data_file_out_is_refused(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    rec = copy / "step-6" / "mpitailor_save.json"
    doc = json.loads(rec.read_text())
    del doc["files"]["__1_0.distcp"]
    rec.write_text(json.dumps(doc))
    r = run_cli(["recover", str(copy), "-o", str(tmp_path / "out")], {})
    assert r.returncode == 0, r.stderr
    assert "skipped step-6" in r.stdout + r.stderr and "does not record __1_0.distcp" in \
        r.stdout + r.stderr


def test_adaptive_saves_the_layers_that_moved_most(tmp_path):
    root = tmp_path
    _train(root, "adaptive", save_dir=str(root / "run"), world_size=2, steps=6,
           save_at=(2, 4, 6), policy={"name": "adaptive", "top_fraction": 0.5}, extra=FLAT)
    run = root / "run"
    held = [read_dcp_save_record(run / f"step-{s}").layers for s in (4, 6)]
    assert all(h is not None and 0 < len(h) < 7 for h in held)
    out = root / "out"
    r = run_cli(["recover", str(run), "-o", str(out)], {})
    assert r.returncode == 0, r.stdout + r.stderr

    def newest(layer):
        if layer is None:
            return 6
        return 6 if layer in held[1] else 4 if layer in held[0] else 2
    want = _composite({2: run / "step-2", 4: run / "step-4", 6: run / "step-6"}, newest, root)
    _equal(torch_state(out, root), want)


def test_link_mode_gives_the_copy_modes_composite_and_outlives_its_sources(run, tmp_path):
    saves = tmp_path / "run"
    shutil.copytree(run, saves)
    copied, linked = tmp_path / "copied", tmp_path / "linked"
    for out, more in ((copied, []), (linked, ["--link"])):
        r = run_cli(["recover", str(saves), "-o", str(out), *more], {})
        assert r.returncode == 0, r.stdout + r.stderr
    assert "linked (hard links" in r.stdout
    data = sorted(p.name for p in linked.iterdir() if p.name.endswith(".distcp"))
    assert data == ["s0__0_0.distcp", "s0__1_0.distcp", "s1__0_0.distcp", "s1__1_0.distcp"]
    assert (linked / data[0]).stat().st_ino == (saves / "step-4" / "__0_0.distcp").stat().st_ino
    want = torch_state(copied, tmp_path)
    _equal(torch_state(linked, tmp_path), want)
    assert run_cli(["verify", str(linked)], {}).returncode == 0
    shutil.rmtree(saves)  # the sources go: the composite's hard links keep their blocks
    _equal(torch_state(linked, tmp_path), want)


def test_link_mode_refuses_another_file_system_in_one_line(run, tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system here")
    out = shm / f"mpitailor-link-{os.getpid()}"
    r = run_cli(["recover", str(run), "-o", str(out), "--link"], {})
    assert r.returncode == 2 and "another file system" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_inspect_says_what_a_save_holds(run):
    r = run_cli(["inspect", str(run / "step-4"), "--json"], {})
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["save"]["kind"] == "partial" and rep["save"]["step"] == 4
    assert rep["save"]["layers"] == ["embed", "layers.1", "layers.3", "norm", "lm_head"]
    assert set(rep["layers"]) == set(rep["save"]["layers"])  # what the metadata holds
    r = run_cli(["inspect", str(run / "step-2")], {})
    assert "full save, step 2" in r.stdout, r.stdout


@pytest.mark.parametrize("link", [False, True])
def test_a_file_swapped_after_the_checks_is_refused_not_merged(run, tmp_path, link):
    """recover checks every file it takes layers from against its CRC-32 and remembers
    which file it checked: one put in its place before the merge reads it (the same size,
    another save's bytes) is refused in one line, nothing published."""
    from mpitailor.cluster.comm import Comm
    from mpitailor.jobs.dcp_merge import run_dcp_merge
    from mpitailor.jobs.dcp_recovery import recover_dcp_chain
    saves = tmp_path / "run"
    shutil.copytree(run, saves)
    out = tmp_path / "out"
    recipe, _, checked = recover_dcp_chain(Comm(None), saves, out)
    twin = saves / "step-4" / "__0_0.distcp.new"
    shutil.copyfile(saves / "step-6" / "__0_0.distcp", twin)
    os.replace(twin, saves / "step-4" / "__0_0.distcp")
    with pytest.raises(CheckpointError) as e:
        run_dcp_merge(Comm(None), recipe, link, checked)
    assert "step-4/__0_0.distcp" in str(e.value) and "\n" not in str(e.value)
    assert not out.exists()


# Asynchronous saves (DcpCheckpointer(asynchronous=True)): staged while training waits,
# written and published in the background. The same run as `run`, its saves made so.

@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("dcp-async")
    result = _train(root, "run", save_dir=str(root / "run"), world_size=2, steps=6,
                    save_at=(2, 4, 6), policy={"name": "parity"}, extra=FLAT,
                    async_save=True, stats=str(root / "stats.h5"))
    return root, result


def test_asynchronous_saves_hold_what_synchronous_saves_hold(run, async_run, tmp_path):
    root, result = async_run
    for step in (2, 4, 6):
        sync, later = run / f"step-{step}", root / "run" / f"step-{step}"
        _equal(torch_state(later, tmp_path), torch_state(sync, tmp_path))
        a, b = read_dcp_save_record(sync), read_dcp_save_record(later)
        assert a.layers == b.layers and sorted(a.files) == sorted(b.files), step
    later = [read_dcp_save_record(root / "run" / f"step-{s}").lineage for s in (2, 4, 6)]
    assert later[1].parent == later[0].save_id and later[2].parent == later[1].save_id
    assert not [p for p in (root / "run").iterdir() if p.name.startswith(".")]
    timings = result["save_timings"]
    assert [t["step"] for t in timings] == [2, 4, 6]
    assert all(t["blocked"] > 0 and t["background"] > 0 for t in timings), timings
    # the composite recover assembles from them is the synchronous saves' (torch's reader)
    out = tmp_path / "out"
    r = run_cli(["recover", str(root / "run"), "-o", str(out)], {})
    assert r.returncode == 0, r.stdout + r.stderr
    want = _composite({s: run / f"step-{s}" for s in (2, 4, 6)}, _parity_newest, tmp_path)
    _equal(torch_state(out, tmp_path), want)


def test_asynchronous_saves_stats_log(async_run, tmp_path):
    """The log of the ZeRO checkpointer's saves, for DCP saves: one row per save, saved as
    chosen once published, and each norm what the saves' own tensors say (torch's reader)."""
    import torch
    from stats_check import read_log
    root, _ = async_run
    log = read_log(root / "stats.h5")
    assert list(log["step"]) == [2, 4, 6] and list(log["full"]) == [True, False, False]
    assert np.array_equal(log["saved"], log["chosen"])
    assert all(log["blocked_s"] > 0) and all(log["background_s"] > 0)
    keys, last, compared = log["layers"], {}, 0
    for i, step in enumerate((2, 4, 6)):
        state = torch_state(root / "run" / f"step-{step}", tmp_path)
        now = {}
        for name, t in state.items():
            if name.startswith("model.") and layer_of(name) is not None:
                now.setdefault(layer_of(name), []).append(t.double().reshape(-1))
        now = {k: torch.cat(v) for k, v in now.items()}
        for k, w in now.items():
            j = keys.index(k)
            assert log["weight_norm"][i, j] == pytest.approx(float(w.norm()), rel=1e-5)
            if k in last:
                du = (w - last[k]).norm()
                assert log["update_norm"][i, j] == pytest.approx(float(du), rel=1e-4)
                assert log["relative_update"][i, j] == pytest.approx(
                    float(du / last[k].norm()), rel=1e-4)
                compared += 1
            else:
                assert math.isinf(log["relative_update"][i, j])
        last.update(now)
    assert compared == 2 * 5  # steps 4 and 6: the layers each holds


def test_a_kill_in_the_background_write_leaves_no_save_and_the_job_resumes(async_run, tmp_path):
    """Rank 0 is killed in its writer thread while it publishes the step-4 save (every file
    and the record staged, not renamed) and training goes on: no step-4 save is visible,
    the log does not call it saved. The requeued job resumes from step 2 with the losses of
    the run never killed, its writer fails a save (no space left) and says so at the next
    save on every rank, never silently, and saves on (a new chain: a full save)."""
    from stats_check import read_log
    _, whole = async_run
    saves = tmp_path / "run"
    env = {"MPITAILOR_FAILPOINT": "commit/step-4:0"}
    with pytest.raises(TrainFailed):
        _train(tmp_path, "killed", save_dir=str(saves), world_size=2, steps=6,
               save_at=(2, 4, 6), policy={"name": "parity"}, async_save=True,
               stats=str(tmp_path / "stats.h5"), extra={**FLAT, "env": env})
    assert sorted(p.name for p in saves.iterdir() if not p.name.startswith(".")) == ["step-2"]
    log = read_log(tmp_path / "stats.h5")
    assert list(log["step"]) == [2, 4] and log["chosen"][1].any() and not log["saved"][1].any()
    env = {"MPITAILOR_FAILPOINT": "commit/step-4:0:enospc"}
    got = _train(tmp_path, "resumed", save_dir=str(saves), world_size=2, steps=4,
                 save_at=(4, 5, 6), policy={"name": "parity"}, async_save=True,
                 load_dir=str(saves), extra={**FLAT, "recover": True, "keep_going": True,
                                             "env": env})
    assert got["losses"] == whole["losses"][2:]
    assert [[f[0] for f in rank] for rank in got["failed"]] == [[5], [5]], got["failed"]
    assert all("No space left" in rank[0][1] for rank in got["failed"]), got["failed"]
    assert sorted(p.name for p in saves.iterdir() if not p.name.startswith(".")) == \
        ["step-2", "step-6"]
    after = read_dcp_save_record(saves / "step-6")
    assert after.layers is None and after.lineage.parent is None
