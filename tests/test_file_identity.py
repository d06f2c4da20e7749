"""A source file is read as the file that was checked, never as whatever its name stands for
later (hostile review 5, finding 3), and a strided flat buffer is refused in one line
(finding 9b).

A merge checks a file once (parse, --verify CRCs) and opens it again by name later: the copy
step closes its descriptors between partitions, tensors are read when their values are
needed, the files around a tag dir are loaded, then copied. A same-size file renamed over
the name in between used to be copied into the output unchecked, exit 0; every such open
now compares the identity recorded at the check (formats/io/identity.py) or reads through
the descriptor that was checked.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from child_env import child_env
from merging import MPIEXEC, REPO, run_cli
from test_merge_errors import error_lines

from mpitailor.errors import CheckpointError
from mpitailor.formats.torch import load, materialize
from mpitailor.formats.zero import extras as extras_module
from mpitailor.formats.zero import open_shard, read_extras, read_meta
from mpitailor.formats.zero.shard import flat_tensor

CHANGED = "changed while mpitailor was reading it"
OPTIM = "global_step10/zero_pp_rank_{}_mp_rank_00_optim_states.pt"
OPTIM0 = OPTIM.format(0)
TIMEOUT = 300


def plant_over(path) -> bytes:
    """Rename a same-size file of other bytes over `path` (a new inode, as a concurrent
    save or anyone who may write the save dir makes); the planted bytes."""
    size = path.stat().st_size
    other = path.with_name(path.name + ".planted")
    planted = (b"SECRET!!" * (size // 8 + 1))[:size]
    other.write_bytes(planted)
    os.replace(other, path)
    return planted


def one_error(r, code: int = 2) -> str:
    """One `mpitailor: error:` line, exit `code`, no traceback; the line."""
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = error_lines(r.stderr)
    assert len(errors) == 1 and errors[0].startswith("mpitailor: error: "), r.stderr
    return errors[0]


def nothing_published(out) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*")), "staging or lock left behind"


# -- 1: a swap while a recover is held after its checks, before its copy --------------------

@pytest.mark.parametrize("ranks", [1, 2])
def test_recover_refuses_a_rank_file_swapped_after_its_checks(ckpt_copy, tmp_path, ranks):
    """The reproducer of finding 3: `recover --verify` held at the `read` failpoint (sources
    opened and checked, nothing copied), a same-size file renamed over each rank's optim
    file. Was: exit 0, the planted bytes in the output's fp32_flat_groups[0]. Under 2 ranks
    the others wait in the same guarded step, so each finds its file swapped, and the job
    says so in one line."""
    save = ckpt_copy("w2_fp32_one")
    out, gate = tmp_path / "out", tmp_path / "gate"
    gate.mkdir()
    env = {**child_env(), "MPITAILOR_FAILPOINT": f"read:0:pause={gate}"}
    cmd = [sys.executable, "-m", "mpitailor", "recover", str(save), "-o", str(out), "--verify"]
    if ranks > 1:
        cmd = [str(MPIEXEC), "-n", str(ranks), *cmd]
    run = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (gate / "reached").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.05)
        for rank in range(ranks):
            plant_over(save / OPTIM.format(rank))
    finally:
        (gate / "go").touch()
    stdout, stderr = run.communicate(timeout=TIMEOUT)
    r = subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)
    line = one_error(r)
    assert f"{save / OPTIM0}: {CHANGED}" in line, line
    nothing_published(out)


# -- 2: every other open by name: a shard's reopen, Storage.read, materialize, extras -------

def test_a_shard_reopens_only_the_file_it_checked(ckpt_copy):
    save = ckpt_copy("w2_fp32_one")
    shard = open_shard(read_meta(save / "global_step10"), 0)
    try:
        shard.close()  # as the copy step does between partitions
        plant_over(save / OPTIM0)
        with pytest.raises(CheckpointError, match=CHANGED) as e:
            shard.reopen()
        assert str(save / OPTIM0) in str(e.value)
    finally:
        shard.close()


def test_storage_read_refuses_a_swapped_file(ckpt_copy):
    save = ckpt_copy("w2_fp32_one")
    optim = load(save / OPTIM0)
    fp32 = flat_tensor(optim, "fp32", 0)
    genuine = bytes(fp32.storage.read(0, 64))
    plant_over(save / OPTIM0)
    with pytest.raises(CheckpointError, match=CHANGED):
        fp32.storage.read(0, 64)
    with pytest.raises(CheckpointError, match=CHANGED):
        fp32.raw_bytes(0, 16)
    assert genuine != b"SECRET!!" * 8


def test_materialize_refuses_a_swapped_file(ckpt_copy):
    save = ckpt_copy("w2_fp32_one")
    optim = load(save / OPTIM0)
    plant_over(save / OPTIM0)
    with pytest.raises(CheckpointError, match=CHANGED) as e:
        materialize(optim)
    assert str(save / OPTIM0) in str(e.value)


def test_a_file_rewritten_in_place_is_refused_too(ckpt_copy):
    """Same inode, same size, other bytes: its mtime says it was written since the check."""
    save = ckpt_copy("w2_fp32_one")
    path = save / OPTIM0
    optim = load(path)
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(b"\0" * 8)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(CheckpointError, match="written to since"):
        materialize(optim)


def test_a_hard_link_or_chmod_is_no_change(ckpt_copy, tmp_path):
    """Third attack 7.05: with the ctime in the identity (77dd660), a hard link (a backup's
    `cp -al`, the node-local gather's own links) or a chmod to the same mode made a file
    read as 'changed'. Its bytes did not change: it is read."""
    save = ckpt_copy("w2_fp32_one")
    path = save / OPTIM0
    optim = load(path)
    os.link(path, tmp_path / "backup.pt")
    os.chmod(path, path.stat().st_mode)
    materialize(optim)


def test_extras_carry_the_bytes_their_load_checked(ckpt_copy, monkeypatch):
    """read_extras safe-loads a torch side file, then copies its bytes: a file renamed over
    it between the two used to be copied unchecked (a pickle payload included)."""
    root = ckpt_copy("hf_w2_fp32")
    scheduler = root / "checkpoint-10" / "scheduler.pt"
    genuine = scheduler.read_bytes()
    real_load = extras_module.load

    def load_then_swap(path, **kw):
        loaded = real_load(path, **kw)
        if path.name == scheduler.name:
            plant_over(path)
        return loaded
    monkeypatch.setattr(extras_module, "load", load_then_swap)
    carried = dict(read_extras(read_meta(root / "checkpoint-10" / "global_step10")).files)
    assert carried["scheduler.pt"] == genuine


# -- 3: a genuine torch.save whose exp_avg is a strided view --------------------------------

def strided_exp_avg(save) -> None:
    """Each rank's exp_avg of step 10 saved as big[::2] holding the same values: torch.load
    reads it exactly; mpitailor reads flat buffers in place, as one byte range."""
    for f in sorted((save / "global_step10").glob("*optim_states.pt")):
        o = torch.load(f, weights_only=False)
        state = o["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]
        x = state["exp_avg"]
        big = torch.zeros(2 * x.numel())
        big[::2] = x
        state["exp_avg"] = big[::2]
        torch.save(o, f)


def cli(*args):
    return run_cli([str(a) for a in args], {}, timeout=TIMEOUT)


@pytest.mark.parametrize("command", ["inspect", "export"])
def test_a_strided_flat_buffer_is_refused_in_one_line(ckpt_copy, tmp_path, command):
    """Was: `inspect` a traceback, `export` a bare ValueError naming no file (exit 1)."""
    save = ckpt_copy("w2_fp32_one")
    strided_exp_avg(save)
    out = tmp_path / "out"
    args = [save] if command == "inspect" else [save, "-o", out, "--format", "fp32"]
    line = one_error(cli(command, *args))
    assert "_optim_states.pt: sub-group 0 exp_avg is a strided view" in line, line
    assert "contiguous()" in line, line
    nothing_published(out)
