"""Faults during a merge: kills, a full disk, concurrent writers, damaged and hostile input.

Every test checks the same promises: a non-zero exit within a bounded time (no hang),
nothing published, the sources byte-identical, and (where the run was killed) a rerun that
succeeds with the same result as an undisturbed merge. tests/fault/README.md tabulates them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from ckpt_fixtures import build
from conftest import tree_digest
from merge_check import assert_same, check_merge, parity
from merging import MPIEXEC, RECIPES, run_cli
from torch_files import torch_load

from mpitailor.formats.torch.safeload import load

NAME = "w3_bf16_decay_tied_frozen"   # 3 partitions: uneven ownership over 2 ranks


@pytest.fixture
def run(tmp_path):
    """A private copy of a real 3-rank run, and helpers to merge it."""
    root = tmp_path / "run"
    shutil.copytree(build(NAME), root)

    def env(out, **extra):
        return {"NEW": str(root / "global_step10"), "OLD": str(root / "global_step5"),
                "OUT": str(out), **extra}
    return root, env


def same_as_reference(out, tmp_path, env) -> None:
    """Tensor for tensor what an undisturbed merge writes."""
    ref = tmp_path / "reference"
    r = run_cli([str(RECIPES / "parity.yml")], env(ref), ranks=2)
    assert r.returncode == 0, r.stderr
    for f in sorted((ref / "global_step10").iterdir()):
        assert_same(load(f), load(out / "global_step10" / f.name), f.name)


@pytest.mark.parametrize("point,rank", [("read", 1), ("write", 1), ("write", 0),
                                        ("export", 1), ("commit", 0)])
def test_kill_9_of_one_rank(run, tmp_path, point, rank):
    root, env = run
    before = tree_digest(root)
    out = tmp_path / "merged"
    export = ["--export", "universal"] if point == "export" else []
    # A hang would fail by run_cli's timeout (TimeoutExpired), not by a wall-clock assert.
    r = run_cli([str(RECIPES / "parity.yml"), *export],
                env(out, MPITAILOR_FAILPOINT=f"{point}:{rank}"), ranks=2, timeout=300)
    assert r.returncode != 0, r.returncode
    assert not out.exists()
    assert tree_digest(root) == before
    # The rerun reclaims whatever staging the killed run left, and succeeds.
    r = run_cli([str(RECIPES / "parity.yml")], env(out), ranks=2)
    assert r.returncode == 0, r.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".merged")]
    check_merge(out, parity(root / "global_step10", root / "global_step5"),
                base=root / "global_step10")
    same_as_reference(out, tmp_path, env)
    assert tree_digest(root) == before


def test_two_merges_into_one_output(run, tmp_path):
    root, env = run
    out = tmp_path / "merged"
    gate = tmp_path / "gate"
    gate.mkdir()
    slow = subprocess.Popen(  # rank 0 holds the lock, paused at a known point, until told
        [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpitailor",
         str(RECIPES / "parity.yml")],
        env={**os.environ, **env(out, MPITAILOR_FAILPOINT=f"write:0:pause={gate}")},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (gate / "reached").exists():
            assert slow.poll() is None and time.monotonic() < deadline, slow.communicate()
            time.sleep(0.05)
        r = run_cli([str(RECIPES / "parity.yml")], env(out), ranks=2, timeout=300)
        assert r.returncode == 2 and "is held by mpitailor merge (pid" in r.stderr, r.stderr
    finally:
        (gate / "go").touch()
    assert slow.wait(timeout=300) == 0, slow.communicate()[1]
    check_merge(out, parity(root / "global_step10", root / "global_step5"),
                base=root / "global_step10")


def test_full_disk(run, tmp_path):
    root, env = run
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        before = tree_digest(root)
        r = run_cli([str(RECIPES / "parity.yml")], env(disk / "merged"), ranks=2, timeout=300)
        assert r.returncode == 1 and "No space left on device" in r.stderr, r.stderr
        assert os.listdir(disk) == []          # staging removed, nothing published
        assert tree_digest(root) == before
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_symlinks_planted_at_the_staging_and_lock_paths(run, tmp_path):
    root, env = run
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine")
    out = tmp_path / "merged"
    (tmp_path / ".merged.mpitailor-staging").symlink_to(victim)
    r = run_cli([str(RECIPES / "parity.yml")], env(out), ranks=2)
    assert r.returncode == 0, r.stderr             # the planted link is removed, not followed
    assert os.listdir(victim) == ["keep"] and (victim / "keep").read_text() == "mine"
    out2 = tmp_path / "merged2"
    (tmp_path / ".merged2.mpitailor-lock").symlink_to(victim / "keep")
    r = run_cli([str(RECIPES / "parity.yml")], env(out2), ranks=2)
    assert r.returncode == 2 and "lock" in r.stderr and "symbolic link" in r.stderr, r.stderr
    assert (victim / "keep").read_text() == "mine" and not out2.exists()


def test_latest_naming_a_path_outside_is_refused(run, tmp_path):
    root, env = run
    (root / "latest").write_text("../../../etc")
    r = run_cli([str(RECIPES / "parity.yml")], {**env(tmp_path / "out"), "NEW": str(root)},
                ranks=2)
    assert r.returncode == 2 and "does not name a tag dir" in r.stderr, r.stderr


def test_pickle_payload_in_an_rng_state_is_refused(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(build("hf_w2_bf16"), root)
    marker = tmp_path / "ran"
    rng = root / "checkpoint-10" / "rng_state_1.pth"
    torch.save({"python": _Payload(marker)}, rng)
    before = tree_digest(root)
    r = run_cli([str(RECIPES / "parity.yml")],
                {"NEW": str(root / "checkpoint-10"), "OLD": str(root / "checkpoint-5"),
                 "OUT": str(tmp_path / "out")}, ranks=2)
    assert r.returncode == 2 and "refused to load" in r.stderr and "rng_state_1" in r.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()
    assert tree_digest(root) == before


def test_wrong_dtype_in_a_flat_buffer(run, tmp_path):
    root, env = run
    victim = root / "global_step5" / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    obj = torch_load(victim)
    groups = obj["optimizer_state_dict"]["fp32_flat_groups"]
    groups[1] = groups[1].detach().to(torch.bfloat16)
    torch.save(obj, victim)
    r = run_cli([str(RECIPES / "parity.yml")], env(tmp_path / "merged"), ranks=2)
    assert r.returncode == 2 and "sub-group 1 fp32 is torch.bfloat16" in r.stderr, r.stderr
    assert not (tmp_path / "merged").exists()


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_flipped_bytes_inside_a_tensor_record(run, tmp_path):
    """Detected with --verify (zip CRC-32 of every record read); without it a byte-range
    merge cannot see a flipped bit inside a record it reads only part of."""
    root, env = run
    victim = root / "global_step5" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    from mpitailor.formats.zero.read import read_meta
    from mpitailor.formats.zero.shard import open_shard
    with open_shard(read_meta(root / "global_step5"), 1) as shard:
        at = shard.offsets["exp_avg", 0] + 1000
    data = bytearray(victim.read_bytes())
    data[at] ^= 0x40
    victim.write_bytes(bytes(data))
    before = tree_digest(root)
    r = run_cli([str(RECIPES / "parity.yml"), "--verify"], env(tmp_path / "merged"), ranks=2)
    assert r.returncode == 2 and "fails its CRC-32 check" in r.stderr and victim.name in r.stderr
    assert not (tmp_path / "merged").exists() and tree_digest(root) == before
