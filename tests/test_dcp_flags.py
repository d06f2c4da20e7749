"""`--dry-run`, `--verify` and `--stats` of DCP merges and recoveries, and `export --verify`
of a DCP checkpoint, through the real CLI on real FSDP2 saves (ckpt_fixtures: dcp_w2_fsdp2,
dcp_w2_parity's layer-wise saves), at 1 and 2 ranks: a dry run prints the plan and writes
nothing, after the checks a run makes; --verify passes a good output and fails, in one
line naming the file and the item, on one corrupted between write and publication; --stats
says each rank's files and bytes, which add up to the output."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_env import child_env
from ckpt_fixtures import build, spec_for
from merging import MPIEXEC, REPO, run_cli

from mpitailor.formats.dcp import read_metadata
from mpitailor.formats.manifest import MANIFEST

NAME = "dcp_w2_fsdp2"      # full saves at steps 2 and 4
PARITY = "dcp_w2_parity"   # layer-wise saves: full 2, odd 4, even 6, odd 8


def _recipe(tmp_path: Path, run: Path | None = None) -> Path:
    run = run or build(NAME)
    path = tmp_path / "recipe.yml"
    path.write_text(f"sources: {{s2: {run}/step-2, s4: {run}/step-4}}\n"
                    f"layers: {{even: s2, odd: s4}}\nbase: s4\n")
    return path


def _ok(r) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _one_line(r, code: int) -> str:
    assert r.returncode == code, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_merge_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    recipe = _recipe(tmp_path)
    out = _ok(run_cli(["merge", str(recipe), "-o", str(tmp_path / "out"), "--dry-run"], {}))
    assert sorted(os.listdir(tmp_path)) == ["recipe.yml"]  # no output, staging dir, lock
    rows = dict(line.split()[:2] for line in out.splitlines()
                if line.startswith(("layers.", "embed", "norm", "lm_head")))
    assert rows == {"embed": "s4", "layers.0": "s2", "layers.1": "s4", "layers.2": "s2",
                    "layers.3": "s4", "norm": "s4", "lm_head": "s4"}, out
    files = read_metadata(build(NAME) / "step-4").files
    for name in (*files, ".metadata"):
        assert any(line.startswith(name) for line in out.splitlines()), (name, out)
    assert "copy" in out and "world size   2" in out


def test_dry_runs_check_what_a_run_checks(tmp_path):
    """Sources saved otherwise, and an output that exists: one line, exit 2, as a run."""
    bad = tmp_path / "bad.yml"
    bad.write_text(f"sources: {{a: {build(NAME)}/step-2, b: {build('dcp_w3_fsdp2_groups')}"
                   f"/step-4}}\nlayers: {{even: a, odd: b}}\nbase: a\n")
    line = _one_line(run_cli(["merge", str(bad), "-o", str(tmp_path / "out"), "--dry-run"],
                             {}), 2)
    assert "merge saves of" in line and not (tmp_path / "out").exists()
    (tmp_path / "there").mkdir()
    line = _one_line(run_cli(["merge", str(_recipe(tmp_path)), "-o", str(tmp_path / "there"),
                              "--dry-run"], {}), 2)
    assert "already exists" in line


def test_recover_dry_run_at_two_ranks_link_mode(tmp_path):
    """`recover --link --dry-run` with no -o, at 2 ranks: rank 0 alone prints the plan (each
    layer from its newest save; the data files that would be linked), nothing written."""
    run = tmp_path / "run"
    shutil.copytree(build(PARITY), run)
    before = sorted(os.listdir(tmp_path))
    out = _ok(run_cli(["recover", str(run), "--link", "--dry-run"], {}, ranks=2))
    assert sorted(os.listdir(tmp_path)) == before
    assert out.count("output       ") == 1, out
    rows = dict(line.split()[:2] for line in out.splitlines() if line.startswith("layers."))
    assert rows == {"layers.0": "step-6", "layers.1": "step-8", "layers.2": "step-6",
                    "layers.3": "step-8"}, out
    assert "hard-linked" in out and "s0__0_0.distcp" in out


def test_verify_and_stats_of_a_copy_merge_at_two_ranks(tmp_path):
    stats = tmp_path / "stats.json"
    r = run_cli(["merge", str(_recipe(tmp_path)), "-o", str(tmp_path / "out"), "--verify",
                 "--stats", str(stats)], {}, ranks=2)
    assert "mpitailor: verified:" in _ok(r)
    doc = json.loads(stats.read_text())
    ranks = doc["ranks"]
    assert [s["rank"] for s in ranks] == [0, 1]
    files = [f for s in ranks for f in s["files"]]
    data = {f: (tmp_path / "out" / f).stat().st_size
            for f in read_metadata(tmp_path / "out").files}
    assert sorted(files) == sorted(data)  # every data file written by one rank
    small = (tmp_path / "out" / ".metadata").stat().st_size
    assert sum(s["bytes_written"] for s in ranks) == sum(data.values()) + small
    assert doc["bytes_written"] == sum(data.values()) + small
    assert all(set(s["seconds"]) == {"plan", "write", "publish"} for s in ranks)


def test_verify_of_a_linked_recovery(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(build(PARITY), run)
    r = run_cli(["recover", str(run), "-o", str(tmp_path / "out"), "--link", "--verify"], {})
    assert "mpitailor: verified:" in _ok(r)


def test_a_bad_stats_path_fails_before_anything_is_merged(tmp_path):
    line = _one_line(run_cli(["merge", str(_recipe(tmp_path)), "-o", str(tmp_path / "out"),
                              "--stats", str(tmp_path / "no" / "stats.json")], {}), 2)
    assert "--stats" in line and not (tmp_path / "out").exists()


def _corrupted(tmp_path: Path, args: list[str], name: str, at: int, ranks: int = 1):
    """The command run with rank 0 held after its manifest is written, before publication;
    byte `at` of staged file `name` flipped meanwhile; the finished run."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = {**child_env(), "MPITAILOR_FAILPOINT": f"commit:0:pause={gate}"}
    cmd = [sys.executable, "-m", "mpitailor", *args]
    if ranks > 1:
        cmd = [str(MPIEXEC), "-n", str(ranks), *cmd]
    p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (gate / "reached").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        out = Path(args[args.index("-o") + 1])
        staged = next(d for d in out.parent.iterdir() if d.name.startswith(f".{out.name}.")
                      and (d / name).exists())
        with open(staged / name, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x40]))
        (gate / "go").touch()
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


@pytest.mark.parametrize("ranks", [1, 2])
def test_verify_catches_an_item_corrupted_before_publication(tmp_path, ranks):
    meta = read_metadata(build(NAME) / "step-2")
    item = max((i for i in meta.items.values() if i.file == "__0_0.distcp"),
               key=lambda i: i.length)  # layers.0 (even: from s2), the largest item
    out = tmp_path / "out"
    r = _corrupted(tmp_path, ["merge", str(_recipe(tmp_path)), "-o", str(out), "--verify"],
                   "__0_0.distcp", item.offset + item.length - 8, ranks)
    line = _one_line(r, 1)
    assert line.startswith(f"mpitailor: error: --verify: {out / '__0_0.distcp'}: item "), line
    assert "differs at byte" in line and "source s" in line, line
    assert (out / MANIFEST).exists()  # published (whole when published), and said


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    from dev.tinytrain.model import tiny_config
    d = tmp_path_factory.mktemp("config")
    tiny_config(spec_for(NAME, build(NAME))).save_pretrained(d)
    return d


def test_export_verify_passes_and_catches_a_corrupted_tensor(tmp_path, config):
    r = run_cli(["export", str(build(PARITY)), "-o", str(tmp_path / "ok"), "--config",
                 str(config), "--dtype", "bf16", "--verify"], {}, ranks=2)
    assert "mpitailor: verified:" in _ok(r)
    out = tmp_path / "bad"
    r = _corrupted(tmp_path, ["export", str(build(NAME) / "step-4"), "-o", str(out),
                              "--config", str(config), "--verify"],
                   "model.safetensors", (tmp_path / "ok" / "model.safetensors").stat().st_size
                   // 2)
    line = _one_line(r, 1)
    assert f"--verify: {out / 'model.safetensors'}: tensor " in line, line
    assert "differs from DCP entry 'model." in line, line
