"""The Accelerate loop of docs/training.md runs as written: on 2 CPU processes it saves
layer-wise, is killed, and run again it recovers and resumes with `accelerator.load_state`, rng
included.

Then run again on 1 and on 3 processes (a job requeued on another number of GPUs): it
resumes from a composite written for its own size. And killed in its first save, it starts
afresh instead of failing at every restart.

Cost: six runs of the script, ~25 s each on the 2-core machine (most of it start-up); the
other tests, a recover of a cached fixture, a few seconds."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from doc_scripts import assert_same_checkpoint, copy_run, doc_script, run_ranks
from torch_files import torch_load

from mpitailor import recover
from mpitailor.formats.zero.read import read_meta

KILL_AT_8 = "partial-publish/checkpoint-8/pytorch_model:0"  # rank 0, publishing step 8's save


def rng(path: Path) -> tuple:
    """Accelerate's rng file, read safely (a pickle of python, numpy and torch states)."""
    s = torch_load(path, numpy=True)
    return (s["random_state"], s["numpy_random_seed"][1].tolist(),
            s["torch_manual_seed"].tolist(), s["step"])


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The job that failed: rank 0 killed (kill -9) while publishing its step-8 save."""
    root = tmp_path_factory.mktemp("accelerate-killed")
    (root / "train.py").write_text(doc_script("accelerate-example"))
    codes = run_ranks(root / "train.py", root, {"MPITAILOR_FAILPOINT": KILL_AT_8})
    assert codes[0] == -9, (root / "rank0.log").read_text()[-3000:]
    saves = root / "run"
    assert not (saves / "checkpoint-8" / "latest").exists()  # the killed save is not one
    assert (saves / "checkpoint-2" / "pytorch_model" / "mpitailor_save.json").exists()  # full
    for n in (4, 6):
        assert (saves / f"checkpoint-{n}" / "pytorch_model" / "mpitailor_partial.json").exists()
    return root


def test_the_readme_accelerate_loop_is_killed_recovers_and_resumes_with_its_rng(killed,
                                                                              tmp_path):
    saves = copy_run(killed, tmp_path) / "run"
    # Drawn by the killed run just before it died: what the resumed run must draw again.
    killed_rng = [rng(saves / "checkpoint-8" / f"random_states_{r}.pkl") for r in (0, 1)]

    codes = run_ranks(tmp_path / "train.py", tmp_path, {})  # the requeued job, as written
    assert codes == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    composite, = (saves / ".mpitailor-resume").glob("recovered-checkpoint-6-*")
    assert (composite / "latest").read_text() == "pytorch_model"
    manifest = json.loads((composite / "mpitailor_manifest.json").read_text())
    assert manifest["left_out"] == []
    for r in (0, 1):  # the newest save's rng states, carried as bytes
        name = f"random_states_{r}.pkl"
        assert (composite / name).read_bytes() == (saves / "checkpoint-6" / name).read_bytes()
    # A partial base carries DeepSpeed's recovery script as a full one does.
    assert (composite / "zero_to_fp32.py").read_bytes() == \
        (saves / "checkpoint-2" / "zero_to_fp32.py").read_bytes()
    # The resumed run's first save starts a new timeline (full), and load_state gave it the
    # step-6 rng states: steps 7 and 8 drew what the killed run drew.
    assert list((saves / "checkpoint-8" / "pytorch_model").glob("*optim_states.pt"))
    assert [rng(saves / "checkpoint-8" / f"random_states_{r}.pkl") for r in (0, 1)] == \
        killed_rng
    assert killed_rng[0] != killed_rng[1]  # each rank its own stream: the right file is seen


@pytest.mark.parametrize("world", [1, 3])
def test_the_readme_accelerate_loop_resumes_at_another_size(killed, tmp_path, world):
    """Requeued on 1 or 3 processes: the composite is written for that size, equals the
    offline `recover --world-size N` of the same saves, and the run resumes from step 6."""
    saves = copy_run(killed, tmp_path) / "run"
    offline = tmp_path / "offline"
    recover(saves, offline, world_size=world)
    codes = run_ranks(tmp_path / "train.py", tmp_path, ranks=world)
    log = (tmp_path / "rank0.log").read_text()
    assert codes == [0] * world, log[-3000:]
    composite, = (saves / ".mpitailor-resume").glob(f"recovered-checkpoint-6-*-w{world}")
    assert f"resuming from {composite} (step 6, world size {world}, resharded from world " \
           f"size 2)" in log, log[-3000:]
    # enable_cpu_training() silences DeepSpeed's deprecated collectives (dozens of lines)
    assert "all_gather_into_tensor` is deprecated" not in log, log[-3000:]
    assert_same_checkpoint(composite, offline)
    assert read_meta(composite).world_size == world
    new = read_meta(saves / "checkpoint-8" / "pytorch_model")  # the resumed run's full save
    assert (new.world_size, new.global_steps) == (world, 8)


@pytest.mark.parametrize("world", [None, 3])
def test_the_prologue_recovers_an_accelerate_run_once(killed, tmp_path, world):
    """The shipped Slurm prologue on the killed run's save dir (checkpoint-N/pytorch_model),
    at its size and another, twice: the second run reuses the first recovery (D1 of issue
    41: every run failed, leaving one more full-size recovery each time)."""
    from test_prologue import check_prologue
    saves = copy_run(killed, tmp_path / "job") / "run"
    composite = check_prologue(saves, tmp_path / "out", world, 6)
    assert (composite / "latest").read_text() == "pytorch_model"


def test_the_readme_accelerate_loop_killed_in_its_first_save_starts_afresh(tmp_path):
    (tmp_path / "train.py").write_text(doc_script("accelerate-example"))
    codes = run_ranks(tmp_path / "train.py", tmp_path,
                      {"MPITAILOR_FAILPOINT": "full-save/checkpoint-2:0"})
    assert codes[0] == -9, (tmp_path / "rank0.log").read_text()[-3000:]
    saves = tmp_path / "run"
    assert (saves / "checkpoint-2").is_dir() and not (saves / "checkpoint-2" / "latest").exists()
    codes = run_ranks(tmp_path / "train.py", tmp_path)
    log = (tmp_path / "rank0.log").read_text()
    assert codes == [0, 0], log[-3000:]
    warnings = [line for line in log.splitlines() if line.startswith("mpitailor: warning: ")]
    assert len(warnings) == 1 and "training starts from scratch" in warnings[0], log[-3000:]
    assert (saves / "checkpoint-2" / "latest").exists()
    assert read_meta(saves / "checkpoint-8" / "pytorch_model").global_steps == 8


class Payload:
    """Unpickling it touches a file: a pickle that runs code when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_recover_carries_accelerates_files_as_bytes_and_never_loads_them(tmp_path):
    """An `accelerator.save_state` dir (DeepSpeed tag `pytorch_model`, Accelerate's files
    beside it): recovered, every Accelerate file is in the output, byte for byte, and none
    was unpickled (one that runs code when loaded is copied, not run)."""
    import pickle

    from ckpt_fixtures import build

    from mpitailor import recover

    save = tmp_path / "run" / "checkpoint-10"
    shutil.copytree(build("w2_fp32_one") / "global_step10", save / "pytorch_model")
    (save / "latest").write_text("pytorch_model")
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(Payload(marker))
    files = {"random_states_0.pkl": b"rng 0", "random_states_1.pkl": b"rng 1",
             "scheduler.bin": b"scheduler", "sampler.bin": b"sampler",
             "dl_state_dict.bin": b"loader", "scaler.pt": payload,
             "custom_checkpoint_0.pkl": payload}
    for name, data in files.items():
        (save / name).write_bytes(data)
    out = tmp_path / "out"
    recover(tmp_path / "run", out)
    assert (out / "latest").read_text() == "pytorch_model"
    assert {name: (out / name).read_bytes() for name in files} == files
    assert json.loads((out / "mpitailor_manifest.json").read_text())["left_out"] == []
    assert not marker.exists()


def test_recover_follows_accelerate_saves_through_a_damaged_one(tmp_path):
    """Saves laid out as AccelerateCheckpointer's (checkpoint-N/pytorch_model; here an HF
    fixture's, renamed): a partial save whose rank file is truncated is skipped, and the
    save built on it still counts (its lineage is read from the damaged save's manifest)."""
    from ckpt_fixtures import build

    from mpitailor import recover

    run = tmp_path / "run"
    shutil.copytree(build("hf_w2_parity"), run)  # full at 2, partial at 4, 6, 8
    for n in (2, 4, 6, 8):
        (run / f"checkpoint-{n}" / f"global_step{n}").rename(
            run / f"checkpoint-{n}" / "pytorch_model")
        (run / f"checkpoint-{n}" / "latest").write_text("pytorch_model")
    damaged = run / "checkpoint-6" / "pytorch_model" / "rank_0_model_states.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])
    result = recover(run, tmp_path / "out")
    source = dict(result.layer_source)
    assert source["layers.0"] == "checkpoint-2" and source["layers.1"] == "checkpoint-8", source
    assert set(source.values()) == {"checkpoint-2", "checkpoint-8"}, source
    assert (tmp_path / "out" / "latest").read_text() == "pytorch_model"
