"""SIGTERM (scancel, timeout) and SIGINT (Ctrl-C) in the middle of a merge, a `recover` or an
`export`: every rank ends with one line and exit 128 + the signal, the staging dir and lock
are gone, nothing is published, the sources are untouched, and a rerun succeeds. And what a
run killed before it could clean up (kill -9) leaves is reclaimed by the next run in the
same directory, whatever its output, or by `mpitailor clean DIR`, never a live run's."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import tree_digest
from merge_check import check_merge, parity
from merging import MPIEXEC, RECIPES, run_cli
from test_faults import run  # noqa: F401 - the fixture: a private copy of a 3-rank run


def wait_for(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def start_paused(args: list[str], env: dict, point: str, gate, timeout_wrapped: bool = False):
    """`mpiexec -n 2 python -m mpitailor ARGS` (under `timeout 300` if asked), held at a known
    point until the test signals it (never released: only the signal ends it)."""
    gate.mkdir()
    cmd = [str(MPIEXEC), "-n", "2", "-print-all-exitcodes", sys.executable, "-m", "mpitailor",
           *args]
    job = subprocess.Popen(
        ["timeout", "300", *cmd] if timeout_wrapped else cmd,
        env={**os.environ, **env, "MPITAILOR_FAILPOINT": f"{point}:pause={gate}"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: (gate / "reached").exists() or job.poll() is not None, 300)
    assert job.poll() is None, job.communicate()
    time.sleep(0.5)  # the other rank is inside the job too (writing, or in a collective)
    return job


def signal_and_wait(job, sig, to: str) -> tuple[str, str]:
    if to == "process group":
        os.killpg(job.pid, sig)
    else:
        job.send_signal(sig)
    try:
        return job.communicate(timeout=120)  # a hang fails here
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def check_interrupted(job, out_err: tuple[str, str], sig) -> None:
    """Every rank's line is out, rank 0 (which held the staging dir) exited 128 + sig.

    Once a signal has come, MPICH's mpiexec SIGKILLs the ranks still running when the first
    one exits; rank 1 waits for rank 0's clean-up, says its line and lingers so that rank 0
    exits first, and is then killed. Its status is then 128 + sig (it got out first), 0 or
    SIGKILL (as the proxy happened to record it), and mpiexec's exit is its OR of the raw
    statuses: 128 + sig, or 9 when the SIGKILL was recorded (seen on a loaded CI machine)."""
    out, err = out_err
    name = signal.Signals(sig).name
    lines = [line for line in err.splitlines() if "mpitailor:" in line]
    assert sorted(lines) == [f"[rank {r}] mpitailor: interrupted by {name}: stopped, staged "
                             f"files removed, nothing published" for r in (0, 1)], err
    assert "Traceback" not in err
    said = [line for line in out.splitlines() if "Exit codes:" in line]
    assert len(said) == 1, out
    statuses = [int(s) for s in said[0].split()[-1].split(",")]
    exited = (128 + sig) << 8  # a raw wait status: exit(128 + sig)
    assert statuses[0] == exited, (statuses, err)
    assert statuses[1] in (exited, 0, signal.SIGKILL), (statuses, err)
    either = statuses[0] | statuses[1]
    assert job.returncode == (either & 0x7F or either >> 8), (job.returncode, statuses, err)


@pytest.mark.parametrize("sig,to,point", [
    (signal.SIGTERM, "mpiexec", "write:0"),       # what scancel / timeout send
    (signal.SIGINT, "process group", "read:1"),   # Ctrl-C in a terminal
])
def test_signal_mid_merge(run, tmp_path, sig, to, point):  # noqa: F811
    root, env = run
    before = tree_digest(root)
    out = tmp_path / "merged"
    job = start_paused([str(RECIPES / "parity.yml"), "--no-progress"], env(out), point,
                       tmp_path / "gate")
    check_interrupted(job, signal_and_wait(job, sig, to), sig)
    # no staging, lock or output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate", "run"]
    assert tree_digest(root) == before
    r = run_cli([str(RECIPES / "parity.yml")], env(out), ranks=2)
    assert r.returncode == 0, r.stderr
    check_merge(out, parity(root / "global_step10", root / "global_step5"),
                base=root / "global_step10")


@pytest.mark.parametrize("command,to,point,timeout_wrapped", [
    # rank 1 held with a parameter's Universal files written, rank 0 writing the next ones:
    # rank 0's clean-up removes the staging dir while rank 1 may still write into it
    (["export", "{root}", "--format", "universal"], "mpiexec", "export:1", False),
    # `timeout 300 mpiexec ...` stopped by SIGTERM to its whole process group
    (["recover", "{root}"], "process group", "write:0", True),
])
def test_sigterm_mid_export_and_recover(run, tmp_path, command, to, point,  # noqa: F811
                                        timeout_wrapped):
    root, env = run
    before = tree_digest(root)
    out = tmp_path / "out"
    args = [a.format(root=root) for a in command] + ["-o", str(out), "--no-progress"]
    job = start_paused(args, env(out), point, tmp_path / "gate", timeout_wrapped)
    check_interrupted(job, signal_and_wait(job, signal.SIGTERM, to), signal.SIGTERM)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate", "run"]
    assert tree_digest(root) == before


def test_leftovers_of_kill_9_are_reclaimed_by_any_run_and_by_clean(run, tmp_path):  # noqa: F811
    root, env = run
    recipe = str(RECIPES / "parity.yml")

    def killed(name: str) -> None:
        r = run_cli([recipe], env(tmp_path / name, MPITAILOR_FAILPOINT="write:1"), ranks=2,
                    timeout=300)
        assert r.returncode != 0
        assert (tmp_path / f".{name}.mpitailor-staging").is_dir()  # what kill -9 leaves
        assert (tmp_path / f".{name}.mpitailor-lock").exists()

    killed("dead1")
    # A run to another output in the same directory reclaims it when it takes its own lock,
    # and is held there (its lock and staging dir live) while the rest goes on.
    held = start_paused([recipe, "--no-progress"], env(tmp_path / "held"), "write:0",
                        tmp_path / "gate")
    try:
        assert not any(p.name.startswith(".dead1.") for p in tmp_path.iterdir())
        killed("dead2")
        r = run_cli(["clean", str(tmp_path)], {})
        assert r.returncode == 0, r.stderr
        assert sorted(r.stdout.splitlines()) == [
            f"mpitailor: removed {tmp_path}/.dead2.mpitailor-{s}" for s in ("lock", "staging")]
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == [".held.mpitailor-lock", ".held.mpitailor-staging", "gate", "run"]
    finally:
        (tmp_path / "gate" / "go").touch()
    _, err = held.communicate(timeout=300)
    assert held.returncode == 0, err
    assert f"reclaimed what interrupted runs left: removed {tmp_path}/.dead1.mpitailor-" in err
    check_merge(tmp_path / "held", parity(root / "global_step10", root / "global_step5"),
                base=root / "global_step10")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate", "held", "run"]
    r = run_cli(["clean", str(tmp_path / "held" / "latest")], {})
    assert r.returncode == 2 and r.stderr.strip() == (
        f"mpitailor: error: {tmp_path / 'held' / 'latest'}: not a directory; give the "
        f"directory that holds the outputs (mpitailor clean DIR)"), r.stderr
