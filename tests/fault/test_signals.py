"""SIGTERM (scancel, timeout) and SIGINT (Ctrl-C) in the middle of a merge: every rank ends
with one line and a non-zero exit, the staging dir and lock are gone, nothing is published,
the sources are untouched, and a rerun succeeds."""
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


@pytest.mark.parametrize("sig,to,point", [
    (signal.SIGTERM, "mpiexec", "write:0"),       # what scancel / timeout send
    (signal.SIGINT, "process group", "read:1"),   # Ctrl-C in a terminal
])
def test_signal_mid_merge(run, tmp_path, sig, to, point):  # noqa: F811
    root, env = run
    before = tree_digest(root)
    out = tmp_path / "merged"
    gate = tmp_path / "gate"
    gate.mkdir()
    merge = subprocess.Popen(
        [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpitailor",
         str(RECIPES / "parity.yml"), "--no-progress"],
        # held at a known point until the signal (never released: only the signal ends it)
        env={**os.environ, **env(out, MPITAILOR_FAILPOINT=f"{point}:pause={gate}")},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: (gate / "reached").exists(), 300)
        time.sleep(0.5)  # the other rank is inside the merge too (waiting in a collective)
        if to == "mpiexec":
            merge.send_signal(sig)
        else:
            os.killpg(merge.pid, sig)
        _, err = merge.communicate(timeout=120)  # a hang fails here
    finally:
        if merge.poll() is None:
            os.killpg(merge.pid, signal.SIGKILL)
    name = signal.Signals(sig).name
    lines = [line for line in err.splitlines() if "mpitailor:" in line]
    assert sorted(lines) == [f"[rank {r}] mpitailor: interrupted by {name}: stopped, staged "
                             f"files removed, nothing published" for r in (0, 1)], err
    assert "Traceback" not in err
    assert merge.returncode != 0, merge.returncode
    # no staging, lock or output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate", "run"]
    assert tree_digest(root) == before
    r = run_cli([str(RECIPES / "parity.yml")], env(out), ranks=2)
    assert r.returncode == 0, r.stderr
    check_merge(out, parity(root / "global_step10", root / "global_step5"),
                base=root / "global_step10")
