"""The update-statistics log of layer-wise saving: one row per step at which a save was
attempted, `saved` only once published, and norms equal to what the saves' files say."""
from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
from ckpt_fixtures import build, spec_for
from stats_check import check_norms, read_log

from dev.tinytrain import launch
from mpitailor.formats.zero.read import read_meta
from mpitailor.training.plot import plot_stats
from mpitailor.training.stats import StatsLog

AUX = ("embed", "norm", "lm_head")
KEYS = ["embed", "layers.0", "layers.1", "norm"]


def test_rows_are_keyed_by_step(tmp_path):
    """No DeepSpeed: the log's own rules. The first row of a new log drops the rows at and
    after its step (the timeline a resume abandoned); a row of a step already there
    replaces it; `saved` stays false until updated."""
    path = tmp_path / "s.h5"
    first = StatsLog(path, KEYS)
    for step in (2, 4, 6, 8):
        first.attempt(step, step == 2, set(KEYS) if step == 2 else {"layers.0"}, None)
        first.update(step, saved=set(KEYS) if step == 2 else {"layers.0"}, blocked_s=0.5)
    resumed = StatsLog(path, KEYS)  # resumed from step 2's save: saves at 4 and 6
    resumed.attempt(4, True, set(KEYS), None)
    resumed.update(4, saved=set(KEYS))
    resumed.attempt(6, False, {"layers.1"}, None)
    resumed.attempt(6, False, {"layers.1", "embed"}, None)  # the same step again: replaced
    log = read_log(path)
    assert list(log["step"]) == [2, 4, 6]
    assert list(log["full"]) == [True, True, False]
    assert log["saved"][1].all() and not log["saved"][2].any()  # 6: chosen, not published
    assert [k for k, c in zip(KEYS, log["chosen"][2]) if c] == ["embed", "layers.1"]
    assert log["blocked_s"][0] == 0.5 and math.isnan(log["blocked_s"][1])


def test_a_resumed_run_writes_its_rows_at_its_steps_with_true_norms(tmp_path):
    """Parity saves at 2 (full), 4, 6, 8 with a stats log; then training resumes from step 2
    into the same save dir and stats file, saving at 4 (the new checkpointer's full save)
    and 6: the log holds steps 2, 4, 6, the new run's rows at its steps and the abandoned
    step 8 gone; its norms are those of the new saves' files; `stats plot` draws it."""
    root = tmp_path / "run"
    shutil.copytree(build("w2_parity"), root)
    stats = root / "stats.h5"
    before = read_log(stats)
    assert list(before["step"]) == [2, 4, 6, 8]
    spec = replace(spec_for("w2_parity", root), steps=6, save_at=(4, 6), stats=str(stats),
                   load_dir=str(root), load_tag="global_step2")
    launch(spec)
    log = read_log(stats)
    assert list(log["step"]) == [2, 4, 6]
    assert list(log["full"]) == [True, True, False]
    for name in ("saved", "weight_norm", "blocked_s"):  # step 2's row is the first run's
        np.testing.assert_array_equal(log[name][0], before[name][0])
    held6 = {k for k, s in zip(log["layers"], log["saved"][2]) if s}
    assert held6 == {"layers.1", "layers.3", *AUX} == set(read_meta(root / "global_step6")
                                                          .held_layers)
    assert log["saved"][1].all() and np.array_equal(log["chosen"][2], log["saved"][2])
    assert check_norms(root, log, (4, 6)) == len(held6)
    out = tmp_path / "stats.png"
    plot_stats(stats, out)  # the CLI's `stats plot` (its subprocess: tests/test_training.py)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
