"""A short sample of the crash-point study (bench/crash_points.py, issue 44): a merge and a
prune killed (SIGKILL) before every k-th step of the I/O seam; after each kill nothing
incomplete is visible, and the rerun gives the clean run's bytes with nothing left behind.
The whole study (every step of merge, recover, export and prune) is `python -m
bench.crash_points`; its figures are in bench/README.md."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.crash_points import study  # noqa: E402


@pytest.mark.parametrize("job,stride,offset", [("merge", 37, 5), ("prune", 3, 2)])
def test_killed_at_sampled_io_steps_nothing_is_lost_or_half_visible(tmp_path, job, stride,
                                                                     offset):
    got = study(job, tmp_path, stride, offset)
    assert got["crashed"] >= 4, got
    assert got["visible_incomplete"] == 0 and got["lost"] == 0, got["bad"]
    assert {"write", "fsync"} & set(got["kinds"]), got["kinds"]
