"""Every bad input of issue 13's list gets one clear line and exit 2, under mpiexec (every
rank finds it, rank 0 says it once), with nothing written and the sources untouched (never a
traceback or a hang)."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import tree_digest
from merging import RECIPES, run_cli
from test_merge_errors import expect_clean_failure, expect_one_error
from torch_files import torch_load

PARITY = (RECIPES / "parity.yml").read_text()


def with_patterns(patterns: str) -> str:
    return PARITY + f"layer_patterns:\n{patterns}\n"


RECIPE_CASES = {
    "invalid regex": (with_patterns("  'model\\.layers\\.(\\d+': layers.{i}"),
                      "is not a valid regular expression"),
    "unknown key": (with_patterns("  'model\\.layers\\.(\\d+)\\..*': block.{i}"),
                    "is not one of layers.{i}, embed"),
    "no layer group": (with_patterns("  'model\\.layers\\.\\d+\\..*': layers.{i}"),
                       "needs a group that captures the layer number"),
    "regex that runs for minutes": (with_patterns("  '((\\w|\\w\\w|\\.)+)+\\d{5}': embed"),
                                    "took over 1 s on parameter"),
    "duplicate key": (PARITY + "base: old\n", "duplicate key 'base'"),
    "list as a key": (PARITY + "? [a, b]\n: c\n", "a key that is a list or a mapping"),
}


@pytest.fixture
def w2(ckpt_copy):
    return ckpt_copy("w2_fp32_one")


def merge(root, tmp_path, args, out=None, ranks=2):
    out = out or tmp_path / "out" / "merged"
    env = {"NEW": str(root / "global_step10"), "OLD": str(root / "global_step5"),
           "OUT": str(out)}
    return run_cli(args, env, ranks=ranks, timeout=120), out


@pytest.mark.parametrize("case", list(RECIPE_CASES))
def test_bad_recipe(w2, tmp_path, case):
    text, message = RECIPE_CASES[case]
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(text)
    before = [tree_digest(w2)]
    r, out = merge(w2, tmp_path, [str(recipe)])
    expect_clean_failure(r, out, sources=[w2], before=before, message=message)


@pytest.mark.parametrize("case", ["binary", "huge"])
def test_a_recipe_that_is_not_one(w2, tmp_path, case):
    recipe = tmp_path / "recipe.yml"
    if case == "binary":
        recipe.write_bytes(bytes(range(256)) * 8)
        message = f"{recipe}: not a text (UTF-8) file"
    else:
        recipe.write_text(PARITY + "# " + "x" * (5 << 20) + "\n")
        message = f"{recipe}: larger than 4 MiB"
    r, out = merge(w2, tmp_path, [str(recipe)])
    expect_clean_failure(r, out, sources=[w2], before=[tree_digest(w2)], message=message)


def test_output_under_a_file(w2, tmp_path):
    (tmp_path / "afile").write_text("not a dir")
    out = tmp_path / "afile" / "merged"
    r, _ = merge(w2, tmp_path, [str(RECIPES / "parity.yml")], out=out)
    expect_one_error(r, "is a file, not a directory")
    assert (tmp_path / "afile").read_text() == "not a dir"


def test_stats_to_a_bad_path_fails_before_merging(w2, tmp_path):
    stats = tmp_path / "no" / "such" / "dir" / "stats.json"
    r, out = merge(w2, tmp_path, [str(RECIPES / "parity.yml"), "--stats", str(stats)])
    expect_clean_failure(r, out, sources=[w2], before=[tree_digest(w2)],
                         message="does not exist; create it first")


def test_crafted_param_shapes(w2, tmp_path):
    path = w2 / "global_step10" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    states = torch_load(path)
    states["param_shapes"] = [{"model.embed_tokens.weight": [-3, 2 ** 62]}]
    torch.save(states, path)
    before = [tree_digest(w2)]
    r, out = merge(w2, tmp_path, [str(RECIPES / "parity.yml")])
    expect_clean_failure(r, out, sources=[w2], before=before,
                         message="param_shapes is malformed")


def test_absurd_world_size(w2, tmp_path):
    r, out = merge(w2, tmp_path, [str(RECIPES / "parity.yml"), "--world-size", "10000000000"])
    expect_clean_failure(r, out, sources=[w2], before=[tree_digest(w2)],
                         message="is larger than the model's")
    r, _ = merge(w2, tmp_path, [str(RECIPES / "parity.yml"), "--world-size", "20000",
                                "--dry-run"])
    assert r.returncode == 0 and "padding is" in r.stderr, r.stderr


def test_a_huge_latest_file(w2, tmp_path):
    (w2 / "latest").write_text("global_step10" + " " * 10_000_000)
    recipe = tmp_path / "r.yml"
    recipe.write_text(PARITY.replace("${NEW}", str(w2)))
    r, out = merge(w2, tmp_path, [str(recipe)])
    expect_clean_failure(r, out, sources=[w2], before=[tree_digest(w2)],
                         message="longer than any tag name")


def test_a_fifo_in_place_of_a_rank_file(w2, tmp_path):
    victim = w2 / "global_step5" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    victim.unlink()
    os.mkfifo(victim)  # opening it would block forever
    r, out = merge(w2, tmp_path, [str(RECIPES / "parity.yml")])
    expect_one_error(r, "not a regular file")
    assert not out.exists()


@pytest.mark.parametrize("case", ["dangling symlink", "name too long", "read-only parent",
                                  "empty"])
def test_bad_output_path(w2, tmp_path, case):
    """-o that would be written through a link, whose staging name would not fit, whose
    parent cannot be written, or that is empty: one line on every rank, exit 2, nothing
    written (issue 26's rough edges)."""
    before = tree_digest(w2)
    out = tmp_path / "out" / "merged"
    out.parent.mkdir()
    message = {"dangling symlink": "a symbolic link (to ", "name too long": "use at most 236",
               "read-only parent": "cannot write in", "empty": "an empty path"}[case]
    arg = str(out)
    if case == "dangling symlink":
        out.symlink_to(tmp_path / "elsewhere")
    elif case == "name too long":
        out = out.parent / ("m" * 240)
        arg = str(out)
    elif case == "read-only parent":
        if os.geteuid() == 0:  # root writes anywhere: a read-only mount says no to root too
            import subprocess
            ro = tmp_path / "ro"
            ro.mkdir()
            if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                              capture_output=True).returncode != 0:
                pytest.skip("cannot mount a read-only file system here (needs root)")
            out = ro / "merged"
            arg = str(out)
        else:
            out.parent.chmod(0o555)
    elif case == "empty":
        arg = ""
    try:
        r, _ = merge(w2, tmp_path, [str(RECIPES / "parity.yml"), "-o", arg], out=out)
        expect_one_error(r, message)
        if case == "dangling symlink":
            assert not (tmp_path / "elsewhere").exists() and out.is_symlink()
        elif case != "empty":
            assert not out.exists()
        assert not list(out.parent.glob(f".{out.name[:20]}*")) if case != "empty" else True
        assert tree_digest(w2) == before
    finally:
        if case == "read-only parent" and os.geteuid() == 0:
            import subprocess
            subprocess.run(["umount", str(tmp_path / "ro")], capture_output=True)


@pytest.mark.parametrize("path", ["/tmp/" + "/".join(["d" * 200] * 25), "/tmp/" + "e" * 300])
def test_a_path_the_file_system_cannot_name(tmp_path, path):
    r = run_cli(["export", path, "-o", str(tmp_path / "x")], {}, ranks=2, timeout=120)
    # found by every rank on its own, outside any collective: still said once
    expect_one_error(r, "the file system cannot open it")
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", ["export", "merge"])
def test_max_shard_size_zero_is_refused_not_turned_into_5gb(w2, tmp_path, command):
    out = tmp_path / "out"
    if command == "export":
        args = ["export", str(w2 / "global_step10"), "-o", str(out), "--max-shard-size", "0"]
    else:
        args = [str(RECIPES / "parity.yml"), "-o", str(out), "--export", "hf",
                "--max-shard-size", "0"]
    r, _ = merge(w2, tmp_path, args, out=out)
    expect_one_error(r, "--max-shard-size 0: ")
    assert not out.exists()
