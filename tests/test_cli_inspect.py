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


def test_inspect_table_and_clear_error(ckpt, tmp_path):
    r = run("inspect", str(ckpt("w4_fp32_per_layer", 5).parent))
    assert r.returncode == 0 and "world size   4" in r.stdout and "layers.3" in r.stdout
    r = run("inspect", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"mpitailor: error: {tmp_path / 'missing'}: "
                                             "no such checkpoint; check the path"]
