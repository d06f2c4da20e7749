"""The HF Trainer path as a user walks it (issue 18): resume that just works, per-layer
groups by default, early refusals, and a clear word from a plain Trainer."""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace

import pytest
from ckpt_fixtures import HF_MODULE, build, spec_for
from merging import run_cli

from dev.tinytrain import launch
from dev.tinytrain.launch import TrainFailed

NAME = "hf_w2_parity"  # LayerwiseTrainer: full save at 2, partial saves at 4, 6, 8


def hf(spec, **changes) -> dict:
    return launch(replace(spec, **changes), module=HF_MODULE)


@pytest.fixture
def run(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(build(NAME), root)
    return root


def test_resume_from_checkpoint_true_recovers_first(run, tmp_path):
    """train(resume_from_checkpoint=True) after partial saves: the training ranks assemble
    the composite themselves and resume from it, with the losses of an explicit recover."""
    out = tmp_path / "explicit"
    r = run_cli(["recover", str(run), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    spec = replace(spec_for(NAME, run), steps=10, save_at=(1000,))
    explicit = hf(replace(spec, save_dir=str(tmp_path / "other")), load_dir=str(out))
    auto = hf(spec, load_dir="last")
    composites = list((run / ".mpitailor-resume").glob("recovered-checkpoint-8-*"))
    assert len(composites) == 1 and (composites[0] / "mpitailor_manifest.json").exists()
    assert auto["global_steps"] == explicit["global_steps"] == 10
    # The trainer state's log carries the 8 losses before the resume; 2 are new.
    assert auto["losses"] == explicit["losses"] and len(auto["losses"]) == 10
    assert all(math.isfinite(x) for x in auto["losses"])


def test_resume_from_a_partial_checkpoint_path(run, tmp_path):
    """The path of a partial checkpoint-N: the composite of the saves up to N."""
    spec = replace(spec_for(NAME, run), steps=10, save_at=(1000,))
    upto6 = hf(spec, load_dir=str(run / "checkpoint-6"))
    assert upto6["global_steps"] == 10 and len(upto6["losses"]) == 10
    composites = list((run / ".mpitailor-resume").glob("recovered-checkpoint-6-*"))
    assert len(composites) == 1


def test_resume_from_a_checkpoint_killed_while_saved(run, tmp_path):
    """D2 of issue 41: a checkpoint-N killed half-way (no `latest`; what HF's
    get_last_checkpoint returns, as it goes by names) given as the path: the run's newest
    complete state before it, the half-written one skipped and said. inspect names it an
    incomplete save and says what to run."""
    killed = run / "checkpoint-10"
    shutil.copytree(run / "checkpoint-8" / "global_step8", killed / "global_step10")
    (killed / "global_step10" / "mpitailor_partial.json").unlink()  # killed before publishing
    r = run_cli(["inspect", str(killed)], {})
    assert r.returncode == 2 and f"{killed}: an incomplete save" in r.stderr, r.stderr
    assert f"mpitailor recover {run}" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    spec = replace(spec_for(NAME, run), steps=10, save_at=(1000,))
    resumed = hf(spec, load_dir=str(killed))
    assert resumed["global_steps"] == 10 and len(resumed["losses"]) == 10
    assert len(list((run / ".mpitailor-resume").glob("recovered-checkpoint-8-*"))) == 1


def test_per_layer_groups_by_default_make_recovery_exact(run, tmp_path):
    out = tmp_path / "out"
    r = run_cli(["recover", str(run), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "mpitailor_manifest.json").read_text())
    rules = {sg["rule"] for sg in manifest["subgroups"]}
    assert rules == {"single source"}, rules  # every Adam step exact
    assert len(manifest["subgroups"]) > 6     # one group (or two: decay) per layer


def test_plain_trainer_on_a_partial_checkpoint_names_recover(run):
    spec = replace(spec_for(NAME, run), steps=10, save_at=(1000,), hf_trainer="trainer",
                   load_dir=str(run / "checkpoint-8"))
    with pytest.raises(TrainFailed) as e:
        hf(spec)
    assert "is a partial checkpoint" in str(e.value) and "mpitailor recover" in str(e.value)


def test_a_run_without_zero_is_refused_when_the_trainer_is_made(tmp_path):
    spec = replace(spec_for(NAME, tmp_path / "run"), zero_stage=0)
    with pytest.raises(TrainFailed) as e:
        hf(spec)
    assert "LayerwiseTrainer needs DeepSpeed ZeRO" in str(e.value) and "stage 0" in str(e.value)
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # refused before training


def test_a_classifier_that_finds_no_layers_is_refused(tmp_path):
    spec = replace(spec_for(NAME, tmp_path / "run"), layer_patterns={".*": "other"})
    with pytest.raises(TrainFailed) as e:
        hf(spec)
    assert "no decoder layers recognised" in str(e.value) and "model.layers.0." in str(e.value)
