"""Damaged, foreign and hostile checkpoints give one clear line, never a crash or code run."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from ckpt_fixtures import tag_dir as fixture_tag_dir
from merging import run_cli
from torch_files import torch_load

from mpitailor.errors import CheckpointError
from mpitailor.formats.torch.safeload import load
from mpitailor.formats.zero.files import resolve
from mpitailor.formats.zero.read import read_meta
from mpitailor.formats.zero.shard import open_shard


class Payload:
    """Pickles as a call to os.system: what a malicious checkpoint would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("which", ["model", "optim"])
def test_pickle_payload_is_refused_and_never_runs(ckpt_copy, tmp_path, which):
    root = ckpt_copy("w2_fp32_one")
    meta = read_meta(root / "global_step5")
    marker = tmp_path / "payload-ran"
    victim = meta.files.model_path(0) if which == "model" else meta.files.optim_path(0)
    obj = torch_load(victim)
    obj["innocent_looking_key"] = Payload(marker)
    torch.save(obj, victim)
    # The payload is real: unsafe unpickling would run it (proved on a throwaway file).
    probe = tmp_path / "probe.pt"
    torch.save({"x": Payload(tmp_path / "probe-ran")}, probe)
    torch.load(probe, weights_only=False)
    assert (tmp_path / "probe-ran").exists()

    with pytest.raises(CheckpointError) as e:
        read_meta(root / "global_step5")
    msg = one_line(e)
    assert str(victim) in msg and "refused" in msg and "posix.system" in msg
    assert not marker.exists()


@pytest.mark.parametrize("victim", ["bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
                                    "zero_pp_rank_1_mp_rank_00_model_states.pt"])
def test_missing_rank_file(ckpt_copy, victim):
    root = ckpt_copy("w3_bf16_decay_tied_frozen")
    (root / "global_step5" / victim).unlink()
    with pytest.raises(CheckpointError) as e:
        resolve(root / "global_step5")
    assert f"missing {victim}" in one_line(e)


def test_truncated_file(ckpt_copy):
    root = ckpt_copy("w2_fp32_one")
    victim = root / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        read_meta(root / "global_step10")
    msg = one_line(e)
    assert str(victim) in msg and "truncated" in msg


def test_rank_files_from_another_run_disagree(ckpt_copy, ckpt):
    root = ckpt_copy("w2_fp32_one")
    foreign = fixture_tag_dir("w2_bf16_per_layer", 10) / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    shutil.copy(foreign, root / "global_step10" / foreign.name)
    meta = read_meta(root / "global_step10")
    with pytest.raises(CheckpointError) as e:
        open_shard(meta, 1)
    assert "disagrees with rank 0" in one_line(e)


def _rewrite_optim(path, change) -> None:
    """Rewrite a (trusted, test-made) stage 1/2 optimizer file with `change` applied."""
    sd = torch.load(path, weights_only=False)
    change(sd["optimizer_state_dict"])
    torch.save(sd, path)


@pytest.mark.parametrize("change,says", [
    # BF16_Optimizer (bf16 + stage 1 + fp32 gradient accumulation) writes no zero_stage
    (lambda osd: osd.pop("zero_stage"), "BF16_Optimizer"),
    (lambda osd: osd.update(base_optimizer_state=[{}]), "elastic"),
    (lambda osd: osd["param_alignment_paddings"][1].__setitem__(0, 4), "parameter_alignment"),
    # round_robin_gradients reorders parameters: their fragments move
    (lambda osd: osd["param_slice_mappings"][1].update(
        {k: type(v)(numel=v.numel, start=v.start + 1)
         for k, v in osd["param_slice_mappings"][1].items()}), "round_robin_gradients"),
])
def test_stage12_layouts_it_cannot_rebuild_are_refused(ckpt_copy, change, says):
    tag = ckpt_copy("s2_w2_bf16_per_layer") / "global_step10"
    _rewrite_optim(tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", change)
    with pytest.raises(CheckpointError) as e:
        read_meta(tag)
    assert says in one_line(e)


def test_stage12_rank_file_from_another_world_size_is_refused(ckpt, ckpt_copy):
    tag = ckpt_copy("s2_w2_bf16_per_layer") / "global_step10"
    other = ckpt("s2_w3_fp32_decay_tied_frozen", 10)
    shutil.copy(other / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError) as e:
        open_shard(read_meta(tag), 1)
    assert "different runs" in one_line(e)


def test_stage12_without_optimizer_files_is_not_a_zero_checkpoint(ckpt_copy):
    tag = ckpt_copy("s1_w2_fp32_one") / "global_step10"
    for f in tag.glob("*optim_states.pt"):
        f.unlink()
    with pytest.raises(CheckpointError) as e:
        read_meta(tag)
    assert "without ZeRO" in one_line(e)


def test_save_dir_with_latest_and_hf_checkpoint_are_recognised(ckpt):
    save_dir = ckpt("w2_fp32_one", 10).parent
    assert resolve(save_dir).tag == "global_step10"
    hf = resolve(ckpt("hf_w2_fp32", 5))
    assert (hf.tag, hf.world_size, hf.save_dir.name) == ("global_step5", 2, "checkpoint-5")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError) as e:
        resolve(tmp_path)
    assert "neither a DeepSpeed tag dir" in one_line(e)
    with pytest.raises(CheckpointError) as e:
        resolve(tmp_path / "nope")
    assert "no such checkpoint" in one_line(e)


def test_a_missing_last_rank_model_file_is_named_and_called_incomplete(ckpt_copy, tmp_path):
    tag = ckpt_copy("w3_bf16_decay_tied_frozen") / "global_step10"
    (tag / "zero_pp_rank_2_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError) as e:
        read_meta(tag)
    assert one_line(e).endswith("missing zero_pp_rank_2_mp_rank_00_model_states.pt (optim "
                                "states for ranks 0..2, model states for 0..1); the "
                                "checkpoint is incomplete")
    # export of that tag dir says the same, not "nothing to recover"
    from merging import run_cli
    r = run_cli(["export", str(tag), "-o", str(tmp_path / "x")], {})
    assert r.returncode == 2 and "zero_pp_rank_2_mp_rank_00_model_states.pt" in r.stderr, \
        r.stderr


@pytest.mark.parametrize("name,optim", [
    ("w2_fp32_one", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("s2_w2_bf16_per_layer", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")])
def test_a_rank_file_from_another_step_is_refused_by_merge_and_export(ckpt_copy, tmp_path,
                                                                      name, optim):
    """Rank 1's optimizer file of step 5 copied into step 10: merge and export refuse it in
    one line naming the file (it would have carried step-5 weights and moments)."""
    from merging import RECIPES, run_cli
    root = ckpt_copy(name)
    shutil.copy(root / "global_step5" / optim, root / "global_step10" / optim)
    want = f"{optim}: from another save: its Adam step is 5 where rank 0's files (step 10)"
    r = run_cli(["export", str(root / "global_step10"), "-o", str(tmp_path / "x"),
                 "--format", "fp32"], {}, ranks=2)
    assert r.returncode == 2 and r.stderr.count(want) == 1, r.stderr  # once, for both ranks
    env = {"NEW": str(root / "global_step10"), "OLD": str(root / "global_step5"),
           "OUT": str(tmp_path / "m")}
    r = run_cli([str(RECIPES / "parity.yml")], env, ranks=2)
    assert r.returncode == 2 and r.stderr.count(want) == 1, r.stderr  # once, for both ranks
    assert not (tmp_path / "x").exists() and not (tmp_path / "m").exists()
    r = run_cli(["inspect", str(root / "global_step10")], {})
    assert r.returncode == 2 and want in r.stderr, r.stderr


def test_recover_skips_a_save_with_a_rank_file_from_another_step(ckpt_copy, tmp_path):
    """recover checks every rank file of every save: the step-10 save with rank 1's step-5
    optimizer file is skipped, said with its reason, and the step-5 save recovered."""
    from merging import run_cli
    root = ckpt_copy("w2_fp32_one")  # full saves at 5 and 10; latest: global_step10
    optim = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(root / "global_step5" / optim, root / "global_step10" / optim)
    out = tmp_path / "out"
    r = run_cli(["recover", str(root), "-o", str(out)], {}, ranks=2)
    assert r.returncode == 0, r.stderr
    assert "skipping global_step10" in r.stderr and "from another save" in r.stderr, r.stderr
    assert read_meta(out).global_steps == 5


def test_a_save_before_the_first_optimizer_step_says_so(ckpt, tmp_path):
    """A real one-rank DeepSpeed ZeRO-3 save made before the first optimizer step (what
    `accelerator.save_state` before training writes): its Adam state is empty."""
    from merging import run_cli
    saved_at_step_0 = ckpt("w1_step0", 0).parent  # the save dir
    optim = saved_at_step_0 / "global_step0" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    assert load(optim)["optimizer_state_dict"]["optimizer_state_dict"]["state"] \
        == {}
    with pytest.raises(CheckpointError) as e:
        open_shard(read_meta(saved_at_step_0), 0)
    msg = one_line(e)
    assert msg.startswith(f"{optim}: saved before the first optimizer step: it holds no Adam "
                          f"state") and "not a DeepSpeed" not in msg
    out = tmp_path / "x"
    r = run_cli(["export", str(saved_at_step_0), "-o", str(out), "--format", "fp32"], {})
    assert r.returncode == 2 and "saved before the first optimizer step" in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.parametrize("name", ["s1_w2_fp32_one", "s2_w2_bf16_per_layer"])
def test_stage12_weights_older_than_the_fp32_state_are_warned_of(ckpt_copy, caplog, name):
    """Stage 1/2 model states hold the whole model's weights, which DeepSpeed keeps equal to
    the fp32 master weights cast down (the untouched save: no warning). The step-5 file
    copied into step 10 is older than the optimizer files: one warning naming it."""
    from mpitailor.formats.zero import read
    root = ckpt_copy(name)
    tag = root / "global_step10"
    with caplog.at_level("WARNING", logger="mpitailor.formats.zero.read"):
        read_meta(tag)
        assert caplog.records == []
        victim = tag / "mp_rank_00_model_states.pt"
        shutil.copy(root / "global_step5" / victim.name, victim)
        read.read_meta(tag)
        read.read_meta(tag)   # said once per file
    [record] = caplog.records
    msg = record.getMessage()
    assert "\n" not in msg and msg.startswith(f"{victim}: its model weights (module, ")
    assert "are not the fp32 master weights" in msg and "put back" in msg


def _rename_params(tag, renames: dict[str, str]) -> None:
    """Rename parameters in every rank's model states (trusted, test-made files)."""
    for path in sorted(tag.glob("*model_states.pt")):
        sd = torch.load(path, weights_only=False)
        sd["param_shapes"] = [type(g)((renames.get(k, k), v) for k, v in g.items())
                              for g in sd["param_shapes"]]
        torch.save(sd, path)


@pytest.mark.parametrize("name", ["../../../ESCAPED", "/tmp/ABSOLUTE", "a..b", "__metadata__",
                                  "x/y", "bad\nname", ""])
def test_a_parameter_name_that_is_no_name_is_refused(ckpt_copy, tmp_path, name):
    """Helper attack 13 (CRITICAL) and 11: the Universal export made zero/<name>/ of each
    parameter's name, so `../` names created files beside the output and inside the input,
    and an absolute one a folder anywhere; `__metadata__` made an HF export the safetensors
    library refuses. Such a name is refused where the checkpoint is read, in one line, and
    an export writes nothing anywhere."""
    save = ckpt_copy("w2_fp32_one")
    tag = save / "global_step10"
    _rename_params(tag, {"lm_head.weight": name})
    with pytest.raises(CheckpointError) as e:
        read_meta(tag)
    assert "not a parameter name" in one_line(e)
    before = {p for p in tmp_path.rglob("*")}
    r = run_cli(["export", str(save), "-o", str(tmp_path / "out"), "--format", "universal"], {})
    assert r.returncode == 2 and "not a parameter name" in r.stderr, r.stderr
    assert {p for p in tmp_path.rglob("*")} == before


def test_frozen_names_and_param_groups_that_the_files_do_not_hold_are_refused(ckpt_copy):
    """Helper attack 08: a frozen_param_shapes naming a trainable parameter, and param_groups
    naming sub-group 10**20 (--world-size 3), ended recover with a bare `KeyError` or
    `IndexError` line naming no file (exit 1). Now one line naming the file, where the save is
    read (so recover skips the save, as a damaged one)."""
    tag = ckpt_copy("w2_fp32_one") / "global_step10"
    model = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    sd = torch.load(model, weights_only=False)
    sd["frozen_param_shapes"] = {"model.norm.weight": (64,)}
    torch.save(sd, model)
    with pytest.raises(CheckpointError) as e:
        read_meta(tag)
    assert "both trainable" in one_line(e) and str(model) in one_line(e)
    sd["frozen_param_shapes"] = {"model.extra.weight": (64,)}  # no fragment saved for it
    torch.save(sd, model)
    with pytest.raises(CheckpointError, match="no entry in frozen_param_fragments"):
        read_meta(tag)
    sd.pop("frozen_param_shapes")
    torch.save(sd, model)
    optim = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    osd = torch.load(optim, weights_only=False)
    osd["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][0]["params"] = [10**20]
    torch.save(osd, optim)
    with pytest.raises(CheckpointError) as e:
        read_meta(tag)
    assert "param_groups name sub-groups" in one_line(e) and str(optim) in one_line(e)


def test_a_strided_stage12_flat_group_is_refused_in_one_line(ckpt_copy):
    """The stage 1/2 twin of helper attack 14 (read_meta samples the flat fp32 group to
    compare with the 16-bit weights): a strided view torch reads fine gave a bare ValueError
    naming no file."""
    tag = ckpt_copy("s2_w2_bf16_per_layer") / "global_step10"

    def strided(osd):
        t = osd["single_partition_of_fp32_groups"][0]
        big = torch.zeros(2 * t.numel())
        big[::2] = t
        osd["single_partition_of_fp32_groups"][0] = big[::2]
    _rewrite_optim(tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", strided)
    with pytest.raises(CheckpointError) as e:
        read_meta(tag)
    assert "is a strided view" in one_line(e) and "optim_states.pt" in one_line(e)


def test_a_short_frozen_fragment_is_refused_where_its_rank_is_opened(ckpt_copy, tmp_path):
    """Second attack 6.03: rank 1's fragment of a frozen parameter cut to 10 elements: the
    exports joined the ranks' fragments end to end, so later elements came from the wrong
    place (another tensor's values in the HF and fp32 exports, exit 0) and a reshard ended in
    a bare ValueError."""
    save = ckpt_copy("w3_bf16_decay_tied_frozen")
    tag = save / "global_step10"
    path = tag / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    sd = torch.load(path, weights_only=False)
    name = next(iter(sd["frozen_param_fragments"]))
    sd["frozen_param_fragments"][name] = sd["frozen_param_fragments"][name][:10].clone()
    torch.save(sd, path)
    meta = read_meta(tag)  # rank 0's files are whole
    with pytest.raises(CheckpointError) as e:
        open_shard(meta, 1)
    assert f"frozen parameter {name}'s fragment" in one_line(e) and str(path) in one_line(e)
    r = run_cli(["export", str(save), "-o", str(tmp_path / "fp32"), "--format", "fp32"], {})
    assert r.returncode == 2 and "fragment" in r.stderr and not (tmp_path / "fp32").exists()


def test_module_keys_and_buffer_names_of_every_rank_are_bounded(ckpt_copy):
    """Attack 6.06 and 6.11: the layer rules' regular expressions backtrack with the square
    of a key's length, and a stage-3 merge classifies each rank's own module keys (those in
    its buffer_names): a key 'norm' * 60,000 in rank 1's file cost a recover ~60 s. Every
    rank's module keys and buffer names are bounded as parameter names."""
    tag = ckpt_copy("w2_fp32_one") / "global_step10"
    path = tag / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    sd = torch.load(path, weights_only=False)
    sd["module"]["norm" * 1000 + "x"] = torch.zeros(1)
    sd["buffer_names"] = [*sd.get("buffer_names", []), "norm" * 1000 + "x"]
    torch.save(sd, path)
    meta = read_meta(tag)  # rank 0's file is whole
    with pytest.raises(CheckpointError) as e:
        open_shard(meta, 1)
    assert "not a parameter name" in one_line(e) and str(path) in one_line(e)


def test_a_strided_frozen_fragment_is_read_and_a_partial_saves_are_checked(ckpt_copy, tmp_path):
    """Third attack 7.04 and 7.07: DeepSpeed saves a frozen parameter as param.detach().cpu(),
    so a column slice of a wider buffer keeps its strides: such a fragment of the right length
    is read (3fdbe0e refused it), and exported to the same values. A partial save's fragments
    go through the same check (only those it holds)."""
    from mpitailor.formats.zero.consolidate import consolidate
    from mpitailor.formats.zero.frozen import check_frozen_fragments
    save = ckpt_copy("w3_bf16_decay_tied_frozen")
    tag = save / "global_step10"
    name, before = None, None
    for r in range(3):
        path = tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        sd = torch.load(path, weights_only=False)
        name = next(iter(sd["frozen_param_fragments"]))
        frag = sd["frozen_param_fragments"][name]
        wide = torch.zeros(frag.numel(), 2, dtype=frag.dtype)
        wide[:, 1] = frag
        sd["frozen_param_fragments"][name] = wide[:, 1]  # stride (2,)
        torch.save(sd, path)
    meta = read_meta(tag)
    got = consolidate(meta, kinds=("fp32",))["fp32"][name]
    want = torch.cat([torch.load(fixture_tag_dir("w3_bf16_decay_tied_frozen", 10)
                                 / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
                                 weights_only=False)["frozen_param_fragments"][name]
                      for r in range(3)]).float()[:got.size].reshape(got.shape)
    assert (torch.from_numpy(got) == want).all()
    from mpitailor.formats.torch import Tensor
    model = {"frozen_param_fragments": {name: Tensor.of_bytes(bytes(20), "bf16", (10,))}}
    check_frozen_fragments(meta, {"frozen_param_fragments": {}}, tag, only_present=True)
    with pytest.raises(CheckpointError, match="fragment is not the"):
        check_frozen_fragments(meta, model, tag, only_present=True)
