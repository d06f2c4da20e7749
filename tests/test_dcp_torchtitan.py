"""torchtitan 0.3's checkpoints (issue 43, part 4), on tiny real saves its own
CheckpointManager wrote (tests/data/torchtitan/README.md): inspect reads torchtitan's layout
(the model's entries at the top level, `optimizer.state.<param>.*`); a layer-wise merge
takes each layer's weights and Adam state, the fused `wqkv`'s included, from the layer's
source (torch's own reader is the oracle); and, where /work/titan-venv (or
MPITAILOR_TITAN_PYTHON's dir) holds torchtitan, a torchtitan loop saving layer-wise through
DcpCheckpointer, killed publishing a save, resumes at another world size from the newest copy
of every layer."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from dcp_oracle import merged, torch_state
from merging import run_cli

DATA = Path(__file__).parent / "data" / "torchtitan"
S2, S4 = DATA / "step-2", DATA / "step-4"
REPO = Path(__file__).resolve().parents[1]
TITAN = Path(os.environ.get("MPITAILOR_TITAN_VENV", "/work/titan-venv"))


def titan_layer(entry: str) -> str | None:
    """The layer key of an entry of torchtitan's llama3 (model or optimizer)."""
    if m := re.search(r"(?:^|\.)layers\.(\d+)\.", entry):
        return f"layers.{m.group(1)}"
    for part, key in (("tok_embeddings.", "embed"), ("lm_head.", "lm_head")):
        if part in entry:
            return key
    if re.search(r"(?:^|\.)norm\.weight", entry):
        return "norm"
    return None


def _equal(x, y) -> bool:
    import torch
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    return x == y


def test_inspect_reads_torchtitans_layout():
    r = run_cli(["inspect", str(S4), "--json"], {})
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["layout"].startswith("torchtitan")
    assert list(report["layers"]) == ["embed", "layers.0", "layers.1", "norm", "lm_head"]
    layer0 = report["layers"]["layers.0"]
    assert layer0["params"] == 9  # wq, wk, wv (the model's split of the fused wqkv), wo, ...
    assert layer0["optimizer_state"] == ["exp_avg", "exp_avg_sq", "step"]
    assert layer0["optimizer_bytes"] > 0
    assert report["other_entries"] == ["dataloader.step", "lr_scheduler.last_epoch",
                                       "train_state.step"]


def test_merge_takes_each_layer_from_its_source(tmp_path):
    recipe = tmp_path / "recipe.yml"
    recipe.write_text(f"sources: {{a: {S2}, b: {S4}}}\nlayers: {{even: a, odd: b}}\n"
                      f"embed: a\nnorm: b\nlm_head: a\nbase: b\n")
    out = merged(tmp_path, recipe)
    got = torch_state(out, tmp_path)
    a, b = torch_state(S2, tmp_path), torch_state(S4, tmp_path)
    source = {"layers.0": a, "layers.1": b, "embed": a, "norm": b, "lm_head": a, None: b}
    assert set(got) == set(b)
    differ = 0
    for key, value in got.items():
        want = source[titan_layer(key)][key]
        assert _equal(value, want), key
        differ += not _equal(a[key], b[key])
    assert differ > 0  # the two saves differ, so the check above could fail
    wqkv = "optimizer.state.layers.0.attention.qkv_linear.wqkv.weight.exp_avg"
    assert _equal(got[wqkv], a[wqkv]) and not _equal(a[wqkv], b[wqkv])


def _torchrun(out: Path, ranks: int, *args: str, env: dict | None = None):
    cmd = [str(TITAN / "bin" / "torchrun"), "--nproc_per_node", str(ranks),
           str(REPO / "dev" / "torchtitan" / "titan_loop.py"), str(out), *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                               **(env or {})})


@pytest.mark.skipif(not (TITAN / "bin" / "torchrun").exists(),
                    reason=f"no torchtitan venv at {TITAN} (tests/data/torchtitan/README.md "
                           f"says how to make one; CI does not install torchtitan)")
def test_layerwise_torchtitan_loop_killed_in_a_save_resumes_at_another_size(tmp_path):
    r = _torchrun(tmp_path, 2, "--steps", "6", "--every", "2", "--layerwise",
                  env={"MPITAILOR_FAILPOINT": "commit/step-6:0"})
    assert r.returncode != 0
    ckpt = tmp_path / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == \
        ["step-2", "step-4"]
    # the oracle: torch's reader of both saves, each layer from its newest copy (Parity:
    # step-2 full, step-4 all but the even layers)
    a, b = torch_state(ckpt / "step-2", tmp_path), torch_state(ckpt / "step-4", tmp_path)
    assert not any(titan_layer(k) == "layers.0" for k in b) and len(b) < len(a)
    want = {k: a[k] if titan_layer(k) == "layers.0" else b[k] for k in a}
    r = _torchrun(tmp_path, 1, "--steps", "8", "--every", "2", "--layerwise", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stderr + r.stdout
    (composite,) = (ckpt / ".mpitailor-resume").iterdir()
    got = torch_state(composite, tmp_path)
    assert set(got) == set(want)
    for key, value in want.items():
        assert _equal(got[key], value), key
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 1 and result["step"] == 8 and len(result["losses"]) == 4
