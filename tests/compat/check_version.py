"""One DeepSpeed version's compatibility checks (issue 26). Run by run_compat.py with the
python of .compat/ds-<version>/, whose DeepSpeed wrote every checkpoint here and is the
judge of every export and resume: nothing of the main .venv's DeepSpeed is involved.

For ZeRO stages 1, 2 and 3, each on 2 ranks:
  train      a tiny run saving at steps 5 and 10 (this DeepSpeed's own format)
  merge      parity merge of steps 10 and 5 under mpiexec -n 2, checked by tests/merge_check
  reshard    the same merge onto 3 ranks: consolidated weights and moments equal the merge's
  export     --format fp32 of the source and of the merge, tensor for tensor equal to this
             DeepSpeed's own zero_to_fp32 of the same checkpoint
  resume     this DeepSpeed's load_checkpoint of the merge (2 ranks) and of the reshard
             (3 ranks), three more steps each, finite losses
  layerwise  layer-wise saves (parity policy), recovered and loaded by the same run, a step on

argv: VERSION OUT.json WORKDIR. Writes {stage: {check: "pass" | "fail: ..." | "skipped: ..."}}
and the DeepSpeed and torch versions; exits 0 (the verdict is in the JSON).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import deepspeed
import numpy as np
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from merge_check import _load, check_merge, parity
from merging import RECIPES, recipe_env, run_cli
from safetensors.torch import load_file

from dev.tinytrain import TrainSpec, launch
from mpitailor.formats.zero.consolidate import consolidate
from mpitailor.formats.zero.read import read_meta

RESHARD_TO = 3


def run_stage(stage: int, work: Path) -> dict[str, str]:
    """The checks of one ZeRO stage; a failed check fails those that need its output."""
    spec = TrainSpec(save_dir=str(work / "run"), world_size=2, zero_stage=stage,
                     grouping="per_layer")
    merged, resharded = work / "merged", work / "resharded"
    new, old = Path(spec.save_dir) / "global_step10", Path(spec.save_dir) / "global_step5"
    result: dict[str, str] = {}

    def check(name: str, needs: tuple[str, ...], body) -> None:
        bad = [n for n in needs if result.get(n) != "pass"]
        if bad:
            result[name] = f"skipped: {', '.join(bad)} failed"
            return
        t = time.monotonic()
        try:
            body()
            result[name] = "pass"
        except Exception as e:  # noqa: BLE001  (any failure is a verdict for the table)
            traceback.print_exc()
            first = (str(e).splitlines() or [""])[0]
            result[name] = f"fail: {type(e).__name__}: {first}"
        print(f"  stage {stage} {name}: {result[name]} ({time.monotonic() - t:.0f}s)",
              flush=True)

    check("train", (), lambda: launch(spec))
    check("merge", ("train",), lambda: merge_and_check(new, old, merged))
    check("reshard", ("merge",), lambda: reshard_and_check(new, old, merged, resharded))
    check("export", ("merge",), lambda: export_and_check(spec.save_dir, merged, work))
    check("resume", ("reshard",), lambda: resume_both(spec, merged, resharded, work))
    check("layerwise", (), lambda: layerwise(stage, work / "layerwise"))
    return result


def cli(args: list[str], env: dict[str, str] | None = None, ranks: int = 2) -> None:
    r = run_cli(args, env or {}, ranks=ranks, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"mpitailor {' '.join(args[:1])} exited {r.returncode}: "
                           + (r.stderr.strip().splitlines() or ["(no stderr)"])[-1])


def merge_and_check(new: Path, old: Path, out: Path) -> None:
    cli([str(RECIPES / "parity.yml")], recipe_env(new, old, out))
    check_merge(out, parity(new, old), base=new)


def reshard_and_check(new: Path, old: Path, plain: Path, out: Path) -> None:
    cli([str(RECIPES / "parity.yml"), "--world-size", str(RESHARD_TO)],
        recipe_env(new, old, out))
    meta = read_meta(out)
    assert meta.world_size == RESHARD_TO and meta.global_steps == 10, meta
    a, b = consolidate(read_meta(plain)), consolidate(meta)
    for kind in a:
        assert set(a[kind]) == set(b[kind]), kind
        for n in a[kind]:
            assert np.array_equal(a[kind][n], b[kind][n]), (kind, n)


def export_and_check(save_dir: str, merged: Path, work: Path) -> None:
    """Both the source save dir (its `latest`) and the merge, each against this version's
    zero_to_fp32 of the same checkpoint."""
    for src, out in ((Path(save_dir), work / "fp32_source"), (merged, work / "fp32_merged")):
        cli(["export", str(src), "-o", str(out), "--format", "fp32"], ranks=1)
        got = load_file(out / "model.safetensors")
        oracle = get_fp32_state_dict_from_zero_checkpoint(str(src))
        assert set(got) == set(oracle), (src, sorted(set(got) ^ set(oracle)))
        for key, t in got.items():
            assert t.dtype == torch.float32 and torch.equal(t, oracle[key].float()), (src, key)


def resume_both(spec: TrainSpec, merged: Path, resharded: Path, work: Path) -> None:
    for load_dir, world in ((merged, 2), (resharded, RESHARD_TO)):
        r = launch(replace(spec, save_dir=str(work / f"resumed_w{world}"), world_size=world,
                           steps=13, save_at=(), load_dir=str(load_dir),
                           load_tag="global_step10"))
        assert r["first_step"] == 10 and r["global_steps"] == 13, r
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"]), r


def layerwise(stage: int, save_dir: Path) -> None:
    spec = TrainSpec(save_dir=str(save_dir), world_size=2, zero_stage=stage,
                     grouping="per_layer", steps=6, save_at=(2, 4, 6),
                     policy={"name": "parity"}, then_resume=1)
    r = launch(spec)["resumed"]
    assert r["first_step"] == 6 and r["global_steps"] == 7, r
    assert len(r["losses"]) == 1 and math.isfinite(r["losses"][0]), r
    # A partial save's model states hold the keys this DeepSpeed's own full save holds.
    full = min((save_dir / "global_step2").glob("*model_states.pt"))
    partial = save_dir / "global_step4" / "rank_0_model_states.pt"
    want, got = set(_load(full)), set(_load(partial))
    assert want == got, sorted(want ^ got)


def main(version: str, out_json: str, workdir: str) -> None:
    assert deepspeed.__version__.split("+")[0] == version, \
        f"this venv has DeepSpeed {deepspeed.__version__}, not {version}"
    report = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "stages": {}}
    for stage in (1, 2, 3):
        t = time.monotonic()
        work = Path(workdir).resolve() / f"stage{stage}"  # recipes resolve relative paths
        report["stages"][str(stage)] = run_stage(stage, work)
        report.setdefault("seconds", {})[str(stage)] = round(time.monotonic() - t)
    Path(out_json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
