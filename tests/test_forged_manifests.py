"""Forged manifests (issue 32, A2): every field of a partial save's manifest is checked
against bounds and against the files before anything is sized from it. `recover` skips a
save that fails, says why, and falls back to the older saves of the timeline; a merge (or
inspect) that names it refuses it in one line naming the file; nothing runs away.

The saves are real DeepSpeed runs (`w2_parity`: a full save at 2, partial saves at 4, 6, 8;
fp32, ZeRO-3, two ranks); the CLI runs under a 2 GB address-space limit and a timeout, so a
field that sizes a loop or an allocation fails the test instead of the machine."""
from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
from child_env import child_env
from conftest import tree_digest
from merge_check import check_merge
from merging import MPIEXEC, REPO
from test_merge_errors import expect_clean_failure, expect_one_error

import mpitailor
from mpitailor.errors import CheckpointError
from mpitailor.formats.zero.read import read_meta

MEMORY = 2 << 30  # bytes of address space per process: a runaway fails, a normal run fits
TIMEOUT = 120     # seconds: a runaway is killed, a normal run takes a few
AUX = ("embed", "norm", "lm_head")
# A merge that takes its odd layers from the (forged) newer save and the rest from the full save.
RECIPE = ("sources: {new: '${NEW}', old: '${OLD}'}\nlayers: {odd: new, even: old}\n"
          "embed: new\nnorm: new\nlm_head: new\nbase: new\noutput: ${OUT}\n")


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def cli(args: list[str], env: dict[str, str] | None = None, ranks: int = 1):
    """The real CLI (under mpiexec for ranks > 1), bounded in memory and time."""
    full = child_env()
    full.update(env or {})
    cmd = [sys.executable, "-m", "mpitailor", *args]
    if ranks > 1:
        cmd = [str(MPIEXEC), "-n", str(ranks), *cmd]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=REPO, preexec_fn=_bounded)


def forge(tag_dir, edit, name: str = "mpitailor_partial.json") -> None:
    """Rewrite a manifest with `edit(doc)` applied (the rank files are left as they are)."""
    path = tag_dir / name
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def setter(key, value):
    def edit(doc):
        doc[key] = value
    return edit


@pytest.fixture
def run(ckpt_copy):
    return ckpt_copy("w2_parity")


def recovered_without_step8(root, out, r) -> str:
    """recover skipped global_step8, said why (the reason returned), and took every layer
    from the older saves: what skipping a damaged save means."""
    assert r.returncode == 0, r.stderr
    skip = [line for line in r.stderr.splitlines() if "skipping global_step8" in line]
    assert len(skip) == 1, r.stderr
    assert (out / "latest").read_text() == "global_step6"
    s4, s6 = root / "global_step4", root / "global_step6"
    check_merge(out, {"layers.0": s6, "layers.2": s6, "layers.1": s4, "layers.3": s4,
                      **{k: s6 for k in AUX}}, base=s6)
    return skip[0]


# --- world_size ----------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1_000_000_000, -1, 0, 1, 3, "2", 2.5, True, None])
def test_a_forged_world_size_is_skipped_by_recover(run, tmp_path, world):
    """world_size 10^9 used to grow rank 0 past 1.1 GB until a timeout killed it; -1 named
    `zero_pp_rank_-1`. Now it is checked against the rank files present, and the save is
    skipped with that reason."""
    forge(run / "global_step8", setter("world_size", world))
    before = tree_digest(run)
    out = tmp_path / "out"
    r = cli(["recover", str(run), "-o", str(out)])
    why = recovered_without_step8(run, out, r)
    assert "mpitailor_partial.json: world_size" in why and "_-1" not in r.stderr, why
    assert tree_digest(run) == before


def test_a_forged_world_size_is_refused_by_a_merge(run, tmp_path):
    forge(run / "global_step8", setter("world_size", 1_000_000_000))
    before = [tree_digest(run)]
    recipe, out = tmp_path / "r.yml", tmp_path / "out" / "merged"
    recipe.write_text(RECIPE)
    env = {"NEW": str(run / "global_step8"), "OLD": str(run / "global_step2"), "OUT": str(out)}
    r = cli([str(recipe)], env, ranks=2)
    expect_clean_failure(r, out, sources=[run], before=before,
                         message=f"{run / 'global_step8' / 'mpitailor_partial.json'}: "
                                 f"world_size 1000000000")


# --- layers the files do not hold ----------------------------------------------------------

def claim(*layers):
    def edit(doc):
        doc["layers"] = sorted({*doc["layers"], *layers})
    return edit


def test_a_layer_the_files_do_not_hold_makes_recover_skip_the_save(run, tmp_path):
    """Step 8 saved layers 1 and 3; its manifest is made to claim layer 0 too. recover used
    to fail in the copy ("no record ..."); now it skips the save and names the file."""
    forge(run / "global_step8", claim("layers.0"))
    out = tmp_path / "out"
    r = cli(["recover", str(run), "-o", str(out)], ranks=2)
    why = recovered_without_step8(run, out, r)
    assert "layers.0" in why and "rank_0_layers.safetensors" in why, why


def test_a_layer_the_model_does_not_have_makes_recover_skip_the_save(run, tmp_path):
    forge(run / "global_step8", claim("layers.99"))
    out = tmp_path / "out"
    r = cli(["recover", str(run), "-o", str(out)])
    why = recovered_without_step8(run, out, r)
    assert "layers.99" in why, why


def test_forged_layer_patterns_make_recover_skip_the_save(run, tmp_path):
    """The patterns a save recorded are a claim too: one that is no regex used to fail the
    whole recovery (the newest save's patterns classify every layer)."""
    forge(run / "global_step8", setter("layer_patterns", {"(": "embed"}))
    out = tmp_path / "out"
    r = cli(["recover", str(run), "-o", str(out)])
    why = recovered_without_step8(run, out, r)
    assert "mpitailor_partial.json: layer_patterns: '(' is not a valid regular" in why, why


def test_a_layer_the_files_do_not_hold_is_refused_by_a_merge(run, tmp_path):
    forge(run / "global_step8", claim("layers.0", "layers.2"))
    recipe, out = tmp_path / "r.yml", tmp_path / "out" / "merged"
    recipe.write_text(RECIPE.replace("{odd: new, even: old}", "{even: new, odd: old}"))
    before = [tree_digest(run)]
    env = {"NEW": str(run / "global_step8"), "OLD": str(run / "global_step2"), "OUT": str(out)}
    r = cli([str(recipe)], env, ranks=2)
    expect_clean_failure(r, out, sources=[run], before=before,
                         message="rank_0_layers.safetensors: no record 'fp32/model.layers.0.")
    assert "the manifest claims a layer its files do not hold" in r.stderr, r.stderr


# --- dtype ---------------------------------------------------------------------------------

def test_a_dtype_forged_to_bf16_is_skipped_by_recover(run, tmp_path):
    """A bf16 manifest on an fp32 run used to name the output's optimizer files bf16_*,
    which DeepSpeed's fp32 resume cannot find. Through the Python API this time."""
    forge(run / "global_step8", setter("dtype", "bf16"))
    out = tmp_path / "out"
    result = mpitailor.recover(run, out)
    assert {src for _, src in result.layer_source} == {"global_step4", "global_step6"}
    assert (out / "latest").read_text() == "global_step6"
    assert not list(out.rglob("bf16_*"))
    assert len(list(out.rglob("zero_pp_rank_*_optim_states.pt"))) == 2
    r = cli(["inspect", str(run / "global_step8")])
    expect_one_error(r, "mpitailor_partial.json: dtype 'bf16', but")


# --- version fields ------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["", None, "x.y", 1.1, "1", "-1.0", "0.9"])
def test_an_invalid_format_version_is_called_invalid(run, version):
    forge(run / "global_step8", setter("format_version", version))
    with pytest.raises(CheckpointError) as e:
        read_meta(run / "global_step8")
    msg = str(e.value)
    assert "\n" not in msg and "newer" not in msg and "did not complete" not in msg, msg
    assert f"mpitailor_partial.json: manifest format_version {version!r}" in msg, msg


def test_an_empty_format_version_is_skipped_by_recover_as_invalid(run, tmp_path):
    """`""` used to say "written by a newer mpitailor; upgrade" (and "did not complete")."""
    forge(run / "global_step8", setter("format_version", ""))
    out = tmp_path / "out"
    r = cli(["recover", str(run), "-o", str(out)])
    why = recovered_without_step8(run, out, r)
    assert "format_version '' is not a version string" in why and "newer" not in why, why


def test_a_merge_manifest_of_a_newer_major_version_is_refused(run, tmp_path):
    out = tmp_path / "recovered"
    mpitailor.recover(run, out)
    forge(out, setter("format_version", "1.7"), "mpitailor_manifest.json")  # a newer minor
    assert cli(["inspect", str(out)]).returncode == 0
    forge(out, setter("format_version", "2.0"), "mpitailor_manifest.json")
    for target in (out, out / "global_step8"):
        r = cli(["inspect", str(target)])
        expect_one_error(r, f"{out / 'mpitailor_manifest.json'}: manifest format_version 2.0 "
                            f"was written by a newer mpitailor")


# --- every other field ---------------------------------------------------------------------

def _files_record(doc):
    doc["files"]["rank_1_layers.safetensors"]["bytes"] = "647712"


FIELD_CASES = {
    "layers a string": (setter("layers", "layers.1"), "layers"),
    "layers not names": (setter("layers", [1, 3]), "layers"),
    "layers repeated": (setter("layers", ["embed", "embed"]), "layers"),
    "more layers than the model has": (setter("layers", [f"layers.{i}" for i in range(99)]),
                                       "layers"),
    "zero_stage 7": (setter("zero_stage", 7), "zero_stage"),
    "zero_stage a string": (setter("zero_stage", "3"), "zero_stage"),
    "zero_stage 2 on a stage 3 save": (setter("zero_stage", 2), "zero_stage"),
    "dtype unknown": (setter("dtype", "fp64"), "dtype"),
    "dtype fp16 on fp32": (setter("dtype", "fp16"), "dtype"),
    "global_steps of another save": (setter("global_steps", 6), "global_steps"),
    "layout of another model": (setter("layout_sha256", "0" * 64), "layout_sha256"),
    "a file record's size a string": (_files_record, "rank_1_layers.safetensors"),
    "files a list": (setter("files", ["rank_0_layers.safetensors"]), "files"),
    "a file record outside the dir": (lambda d: d["files"].update(
        {"../x": {"bytes": 1, "crc32": "00000000"}}), "files"),
    "format of another tool": (setter("format", "other"), "format"),
    "kind merge": (setter("kind", "merge"), "kind"),
    "lineage parent a number": (lambda d: d["lineage"].update(parent=5), "lineage"),
}


@pytest.mark.parametrize("case", list(FIELD_CASES))
def test_every_field_is_checked(run, case):
    edit, field = FIELD_CASES[case]
    forge(run / "global_step8", edit)
    with pytest.raises(CheckpointError) as e:
        read_meta(run / "global_step8")
    msg = str(e.value)
    assert "\n" not in msg and str(run / "global_step8") in msg and field in msg, msg


def test_an_unreadable_manifest_is_reported_not_taken_for_no_save(run, tmp_path):
    """A failure to read is never an absence: the save is skipped with the reason."""
    (run / "global_step8" / "mpitailor_partial.json").write_text('{"world_size": ')
    out = tmp_path / "out"
    r = cli(["recover", str(run), "-o", str(out)])
    why = recovered_without_step8(run, out, r)
    assert "mpitailor_partial.json: unreadable" in why, why


def test_the_checks_pass_every_real_partial_save(ckpt):
    """Every partial save of the layer-wise fixtures (stages 1, 2 and 3, fp32 and bf16, HF)
    passes the checks: they refuse forgeries, not what mpitailor writes."""
    from ckpt_fixtures import build

    from mpitailor.formats.zero.partial_shard import check_partial_rank
    from mpitailor.planning.layers import LayerClassifier
    for name in ("w2_parity", "s2_w3_bf16_parity", "s1_w2_parity", "hf_s2_w2_parity",
                 "w2_adaptive", "w2_parity_async"):
        for manifest in build(name).rglob("mpitailor_partial.json"):
            meta = read_meta(manifest.parent)
            for rank in range(meta.world_size):
                check_partial_rank(meta, rank, crc=True, classifier=LayerClassifier)
