"""The DCP recovery fuzzer, sampled (bench/dcp_recover_fuzz.py runs it at scale), and the
regressions the attack on `recover` of DCP saves found: each damaged input recovers to
torch's own composite, skips the damaged save and says so, or stops in one line with
nothing published; a save that cannot be read now is never skipped."""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import dcp_recover_fuzzing as fz
import dcp_recover_oracle as oracle
import pytest

from dev.tinytrain.launch import launch
from dev.tinytrain.spec import TrainSpec


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A real 2-rank FSDP2 run's saves: full at step 2, odd layers at 4, even at 6."""
    root = tmp_path_factory.mktemp("dcp-recover-fuzz")
    (root / "logs").mkdir()
    launch(TrainSpec(save_dir=str(root / "run"), world_size=2, steps=6, save_at=(2, 4, 6),
                     policy={"name": "parity"}, extra={"flatten_optimizer": True}),
           module="dev.tinytrain.fsdp2_worker", log_dir=root / "logs")
    return root / "run"


def test_sampled_damage_gives_only_sound_outcomes(base, tmp_path):
    stats = oracle.run_many(base, tmp_path, len(fz.KINDS), seed=int(os.environ.get(
        "MPITAILOR_FUZZ_SEED", "7")))
    assert not stats.violations, stats.violations[:3]
    assert stats.outcomes.get("error") and stats.outcomes.get("skipped"), stats.outcomes


def _case(base: Path, tmp: Path) -> Path:
    shutil.copytree(base, tmp / "run")
    return tmp / "run"


def _edit(save: Path, **fields) -> None:
    doc = json.loads((save / fz.RECORD).read_text())
    doc.update(fields)
    (save / fz.RECORD).write_text(json.dumps(doc))


@pytest.mark.parametrize("how", ["fifo", "dir_for_file", "link_for_file", "link_for_save"])
def test_something_in_place_of_the_newest_save_refuses(base, tmp_path, how):
    run = _case(base, tmp_path)
    f = run / "step-6" / "__1_0.distcp"
    if how == "link_for_save":
        os.rename(run / "step-6", tmp_path / "away")
        os.symlink(tmp_path / "away", run / "step-6")
    else:
        os.rename(f, tmp_path / "away")
        {"fifo": os.mkfifo, "dir_for_file": os.mkdir,
         "link_for_file": lambda p: os.symlink(tmp_path / "away", p)}[how](f)
    outcome, line = fz.recover(run, tmp_path / "out")
    assert outcome == "error" and "cannot be read now" in line, line
    assert "step-6" in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, says", [
    (lambda r: r + ["layers.1"], "claims layer 'layers.1'"),
    (lambda r: r + ["layers.99"], "claims layer 'layers.99'"),
    (lambda r: [k for k in r if k != "layers.0"], "leaves out layer 'layers.0'"),
])
def test_a_record_whose_layers_disagree_with_its_metadata_is_skipped(base, tmp_path, edit,
                                                                     says):
    run = _case(base, tmp_path)
    _edit(run / "step-6", layers=edit(json.loads((run / "step-6" / fz.RECORD).read_text())
                                      ["layers"]))
    outcome, line = fz.recover(run, tmp_path / "out")
    assert outcome == "ok" and "skipped step-6" in line and says in line, line


def test_a_partial_save_that_lost_its_record_is_not_a_full_save(base, tmp_path):
    run = _case(base, tmp_path)
    (run / "step-6" / fz.RECORD).unlink()
    outcome, line = fz.recover(run, tmp_path / "out")
    assert outcome == "ok" and "recovered step 4" in line and "not a full save" in line, line


def test_a_record_pattern_that_does_not_compile_skips_its_save(base, tmp_path):
    run = _case(base, tmp_path)
    _edit(run / "step-6", layer_patterns={"(": "layers.{i}"})
    outcome, line = fz.recover(run, tmp_path / "out")
    assert outcome == "ok" and "skipped step-6" in line, line


def test_planner_data_off_its_path_is_damage(base, tmp_path):
    """(seed 48 of the fuzzer: a forged .metadata whose planner data renamed k_proj; the
    composite published did not load in torch)"""
    run = _case(base, tmp_path)
    fz.mutate(run, random.Random(48), "meta_flip_forged")
    outcome, line = fz.recover(run, tmp_path / "out")
    assert outcome == "ok" and "planner data maps" in line and "skipped step-6" in line, line


def test_a_step_beyond_int64_is_refused(base, tmp_path):
    run = _case(base, tmp_path)
    _edit(run / "step-6", global_steps=10 ** 30)
    outcome, line = fz.recover(run, tmp_path / "out")
    assert "skipped step-6" in line and "global_steps" in line, line


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    from dev.tinytrain.model import tiny_config
    d = tmp_path_factory.mktemp("config")
    tiny_config(TrainSpec(save_dir=str(d / "unused"), world_size=2)).save_pretrained(d)
    return d


def _export(src: Path, out: Path, config: Path):
    from merging import run_cli
    return run_cli(["export", str(src), "-o", str(out), "--format", "hf", "--config",
                    str(config)], {})


def test_export_of_a_partial_save_is_refused(base, tmp_path, config):
    r = _export(base / "step-4", tmp_path / "out", config)
    assert r.returncode != 0 and "a partial save" in r.stderr, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_export_checks_the_crcs_a_save_recorded(base, tmp_path, config):
    run = _case(base, tmp_path)
    f = run / "step-2" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside a tensor's elements: only the CRC sees it
    f.write_bytes(bytes(data))
    r = _export(run / "step-2", tmp_path / "out", config)
    assert r.returncode != 0 and "CRC-32" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "out").exists()
