"""The naive baseline: torch.load every source rank file whole (no mmap), copy the chosen
layers' slices, torch.save (fsynced) - one process, as a simple merge script would.

    python -m bench.naive_merge RECIPE --stats FILE   (NEW/OLD/OUT in the environment)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from mpitailor.cluster.comm import Comm
from mpitailor.engine.iostats import snapshot
from mpitailor.formats.torch.safeload import load
from mpitailor.formats.zero.layout import KINDS
from mpitailor.formats.zero.shard import flat_tensor
from mpitailor.jobs.merge import plan_merge


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe")
    ap.add_argument("--stats", required=True)
    args = ap.parse_args()
    plan = plan_merge(Comm(None), args.recipe).plan
    before, t0 = snapshot(), time.perf_counter()
    out = plan.output / plan.base_meta.files.tag
    out.mkdir(parents=True)
    written = 0
    for r in range(plan.source_world_size):
        whole = {name: load(meta.files.optim_path(r), mmap=False) for name, meta in plan.sources}
        merged = whole[plan.base]
        for g, sg in enumerate(plan.subgroups):
            for run in sg.runs:
                for kind in KINDS:
                    dst = flat_tensor(merged, kind, g)
                    src = flat_tensor(whole[run.source], kind, g)
                    with torch.no_grad():  # DeepSpeed saved the fp32 groups as leaf params
                        dst[run.start: run.start + run.length] = \
                            src[run.start: run.start + run.length]
        files = plan.base_meta.files
        for path, obj in ((out / files.optim_path(r).name, merged),
                          (out / files.model_path(r).name, load(files.model_path(r), mmap=False))):
            with open(path, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            written += path.stat().st_size
        del whole, merged
    stats = {"bytes_written": written, **snapshot().since(before)}
    Path(args.stats).write_text(json.dumps({"seconds": time.perf_counter() - t0,
                                            "bytes_written": written, "ranks": [stats]}))


if __name__ == "__main__":
    main()
