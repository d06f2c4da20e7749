"""slurm/start-cluster.sh refuses bad emulation options (--disk-mbps, --node-cpus) in one line,
exit 2, before it installs, starts or mounts anything (no root or Slurm needed)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

START = Path(__file__).resolve().parents[1] / "slurm" / "start-cluster.sh"


@pytest.mark.parametrize("args, says", [
    (["--node-cpus", "0.5"], "--node-cpus needs --nodes N with N >= 2"),
    (["--disk-mbps", "6"], "--disk-mbps needs --nodes N with N >= 2"),
    (["--nodes", "4", "--node-cpus", "half"], "usage:"),
    (["--nodes", "4", "--node-cpus", "0.001"], "--node-cpus 0.001: at least 0.01"),
    (["--nodes", "4", "--node-cpus"], "usage:"),
])
def test_bad_emulation_options_are_refused_in_one_line(tmp_path, args, says):
    r = subprocess.run(["bash", str(START), *args], capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", "MPITAILOR_CLUSTER_DIR": str(tmp_path)})
    assert r.returncode == 2, r
    assert r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing made
