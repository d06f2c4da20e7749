"""`python -m mpitailor inspect` through the real command line."""
from __future__ import annotations

import json
import subprocess
import sys


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mpitailor", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_inspect_json_describes_layers(ckpt):
    r = run("inspect", "--json", str(ckpt("w3_bf16_decay_tied_frozen", 10)))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["world_size"], rep["dtype"], rep["global_steps"]) == (3, "bf16", 10)
    assert list(rep["layers"]) == ["embed", "layers.0", "layers.1", "layers.2", "layers.3",
                                   "norm"]  # lm_head is tied to embed
    assert rep["layers"]["layers.1"]["frozen"] == 1
    assert sum(r["bytes_per_rank"] for r in rep["layers"].values()) == \
        rep["optimizer_bytes_per_rank"]


def test_inspect_describes_a_stage2_checkpoint(ckpt):
    r = run("inspect", "--json", str(ckpt("s2_w3_fp32_decay_tied_frozen", 10)))
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["zero_stage"], rep["world_size"], rep["global_steps"]) == (2, 3, 10)
    assert rep["layers"]["layers.1"]["frozen"] == 1 and rep["tied"]
    # the mean share of a rank; the groups' padding is the rest
    share = sum(r["bytes_per_rank"] for r in rep["layers"].values())
    assert 0 <= rep["optimizer_bytes_per_rank"] - share < 12 * 2 * len(rep["param_groups"])
    assert "ZeRO stage 2" in run("inspect", str(ckpt("s2_w3_fp32_decay_tied_frozen", 10))).stdout


def test_inspect_table_and_clear_error(ckpt, tmp_path):
    r = run("inspect", str(ckpt("w4_fp32_per_layer", 5).parent))
    assert r.returncode == 0 and "world size   4" in r.stdout and "layers.3" in r.stdout
    r = run("inspect", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"mpitailor: error: {tmp_path / 'missing'}: "
                                             "no such checkpoint; check the path"]


def test_inspect_tells_full_partial_and_composite(tmp_path):
    from ckpt_fixtures import build
    save = build("w2_parity")  # full save at 2, partial saves at 4, 6, 8
    full = json.loads(run("inspect", "--json", str(save / "global_step2")).stdout)
    partial = json.loads(run("inspect", "--json", str(save / "global_step4")).stdout)
    assert full["kind"] == "full" and len(full["layers"]) == 7
    assert partial["kind"] == "partial"
    assert set(partial["layers"]) == {"layers.1", "layers.3", "embed", "norm", "lm_head"}
    out = tmp_path / "recovered"
    assert run("recover", str(save), "-o", str(out)).returncode == 0
    composite = json.loads(run("inspect", "--json", str(out)).stdout)
    assert composite["kind"] == "composite"
    assert {k: v["from"] for k, v in composite["layers"].items()} == {
        "embed": "global_step8", "layers.0": "global_step6", "layers.1": "global_step8",
        "layers.2": "global_step6", "layers.3": "global_step8", "norm": "global_step8",
        "lm_head": "global_step8"}
    table = run("inspect", str(out)).stdout
    assert "kind         composite" in table and "global_step6 (6)" in table


def test_recover_prints_its_recipe_once_and_dry_runs_without_output(tmp_path):
    from ckpt_fixtures import build
    from merging import run_cli
    save = build("w2_parity")
    r = run_cli(["recover", str(save), "--emit-recipe"], {}, ranks=2)
    assert r.returncode == 0 and r.stdout.count("sources:") == 1, r.stdout
    r = run_cli(["recover", str(save), "--dry-run"], {}, ranks=2)
    assert r.returncode == 0 and "layers.0    global_step6" in r.stdout, r.stdout


def test_stats_plot_without_matplotlib_says_which_extra(tmp_path, monkeypatch):
    import pytest
    from ckpt_fixtures import build

    from mpitailor.errors import UserError
    from mpitailor.training.plot import plot_stats
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(UserError, match=r"pip install 'mpitailor\[plot\]'"):
        plot_stats(build("w2_adaptive") / "stats.h5", tmp_path / "x.png")


def test_inspect_of_a_save_dir_names_the_saves_after_latest():
    """`latest` names the full save; the partial saves after it are what recover takes the
    newest layers from: inspect SAVE_DIR says so (issue 41: it showed the full save only)."""
    from ckpt_fixtures import build
    r = run("inspect", str(build("w2_parity")))
    assert r.returncode == 0, r.stderr
    assert "newer saves  global_step4, global_step6, global_step8 (after the one `latest` " \
        "names" in r.stdout, r.stdout
    r = run("inspect", str(build("w2_parity") / "global_step8"))
    assert r.returncode == 0 and "newer saves" not in r.stdout, r.stdout
