"""A short sample of the crash-point study (bench/crash_points.py, issue 44): a merge and a
prune (of ZeRO saves, and of DCP saves) killed (SIGKILL) before every k-th step of the I/O seam; after each kill nothing
incomplete is visible, and the rerun gives the clean run's bytes with nothing left behind.
A prune is also killed with the machine (bench/power_loss.py: what was not made durable
dropped), every rank is killed at once (MPITAILOR_CRASH_AT=N:all), and the emulation itself
is checked on a file replaced and a file written. The whole study (every job, both modes)
is `python -m bench.crash_points [--power-loss]`; its figures are in bench/README.md."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.crash_points import study  # noqa: E402
from bench.power_loss import PAGE, FileState, lose_data, power_loss  # noqa: E402


@pytest.mark.parametrize("job,stride,offset", [("merge", 37, 5), ("prune", 3, 2),
                                               ("prune-dcp", 4, 1)])
def test_killed_at_sampled_io_steps_nothing_is_lost_or_half_visible(tmp_path, job, stride,
                                                                     offset):
    got = study(job, tmp_path, stride, offset)
    assert got["crashed"] >= 4, got
    assert got["visible_incomplete"] == 0 and got["lost"] == 0, got["bad"]
    assert {"write", "fsync"} & set(got["kinds"]), got["kinds"]


def test_power_loss_at_sampled_io_steps_nothing_is_lost_or_half_visible(tmp_path):
    got = study("prune", tmp_path, 4, 2, mode="drop")
    assert got["crashed"] >= 3, got
    assert got["visible_incomplete"] == 0 and got["lost"] == 0, got["bad"]
    assert got["names_undone"] > 0, got  # the emulation took something back


STEPS = """
import sys
from pathlib import Path
from mpitailor.formats.io import fsync_dir, write_synced
from mpitailor.publish.staging import write_replacing
d = Path(sys.argv[1])
write_replacing(d / "f", b"new!")
write_synced(d / "g", b"x" * 10000)
fsync_dir(d)
"""


def _steps(tmp_path: Path, crash_at: str, rank: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), MPITAILOR_CRASH_AT=crash_at,
               MPITAILOR_CRASH_LOG=str(tmp_path / "log"), PMI_RANK=str(rank))
    return subprocess.run([sys.executable, "-c", STEPS, str(tmp_path / f"r{rank}")], env=env,
                          timeout=60, check=False)


def test_all_kills_every_rank_at_its_own_step(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"r{rank}").mkdir()
        assert _steps(tmp_path, "3:all", rank).returncode == -signal.SIGKILL
    steps = [line.split("\t")[:3] for line in (tmp_path / "log").read_text().splitlines()]
    assert [s for s in steps if s[1] == "3"] == [["0", "3", "fsync"], ["1", "3", "fsync"]]


@pytest.mark.parametrize("crash_at,torn,want_f", [
    (5, False, b"old"),   # the rename over f not made durable by its dir's fsync: old f back
    (6, False, b"new!"),  # made durable
    (8, False, b"new!"),  # g: written, not fsynced, its name not durable
    (8, True, b"new!"),
    (9, False, b"new!"),  # g: fsynced, its name not yet durable
])
def test_power_loss_undoes_what_was_not_made_durable(tmp_path, crash_at, torn, want_f):
    d = tmp_path / "r0"
    d.mkdir()
    (d / "f").write_bytes(b"old")
    assert _steps(tmp_path, str(crash_at)).returncode == -signal.SIGKILL
    power_loss(tmp_path / "log", {0: crash_at}, torn=torn)
    assert (d / "f").read_bytes() == want_f
    assert sorted(p.name for p in d.iterdir()) == ["f"]  # no g, no temporary file


def test_torn_keeps_a_prefix_of_unsynced_bytes(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"y" * 4 * PAGE)
    lose_data({str(f): FileState(PAGE, [(PAGE, 3 * PAGE)])}, torn=True)
    data = f.read_bytes()
    assert data == b"y" * 2 * PAGE + bytes(2 * PAGE)  # half of 3 unsynced pages, page-aligned
    lose_data({str(f): FileState(PAGE, [(PAGE, PAGE)])}, torn=False)
    assert f.read_bytes() == b"y" * PAGE  # dropped: cut to what the fsync made durable
