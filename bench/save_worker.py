"""One rank of the save benchmark (started by bench/save_bench.py through tinytrain.launch).

Trains one step, then times, side by side and repeated, a full `engine.save_checkpoint` and
`save_layers` under the parity and filter policies on the same engine, synchronous and
asynchronous (the time training is blocked: the slices copied to host buffers; the background
write is timed apart, joined before the next save). Rank 0 writes JSON.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist

from mpitailor.publish.staging import fsync_tree
from mpitailor.tinytrain.spec import TrainSpec
from mpitailor.tinytrain.worker import build_engine, shutdown, train
from mpitailor.training.partial_save import all_slices_elements, save_layers, take
from mpitailor.training.policies import Filter, Parity
from mpitailor.training.stats import model_layer_keys
from mpitailor.training.writer import BackgroundWriter


def fsync_tree_files(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_tree(root)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(spec_path: str, result_path: str) -> None:
    spec = TrainSpec.from_json(Path(spec_path).read_text())
    reps = int(spec.extra.get("reps", 3))
    engine = build_engine(spec)
    train(spec, engine, 0)
    keys = model_layer_keys(engine)
    policies = {"parity": Parity(), "filter": Filter(always=(0, 1, -2, -1), every=4)}
    cycle = {"parity": [1, 2], "filter": [1, 2, 3, 4]}  # the partial saves of one cycle
    writer = BackgroundWriter(reserve=all_slices_elements(engine))  # as the checkpointer does
    cases = ("full", "full+fsync", "parity", "filter", "parity-async", "filter-async")
    rows = []
    save_dir = Path(spec.save_dir)
    for rep in range(reps):
        for case in cases:
            policy = case.removesuffix("-async")
            for idx in ([0] if case.startswith("full") else cycle[policy]):
                tag = f"{case}-{rep}-{idx}"
                dist.barrier()
                t = time.perf_counter()
                if case.startswith("full"):
                    engine.save_checkpoint(str(save_dir), tag=tag)
                    if case == "full+fsync":  # durable, as save_layers always is
                        fsync_tree_files(save_dir / tag)
                elif case.endswith("-async"):
                    layers = policies[policy].decide(idx, keys).layers
                    snap = take(engine, save_dir, tag, layers, host=writer.host)
                    writer.start(snap)
                else:
                    layers = policies[policy].decide(idx, keys).layers
                    save_layers(engine, save_dir, tag, layers)
                background, parts = None, None
                if case.endswith("-async"):  # training would go on now: this rank's stall
                    parts = {k: snap.seconds[k] for k in ("gather", "copy", "serialise")}
                    seconds = time.perf_counter() - t
                    background = writer.join().seconds["background"]
                    dist.barrier()
                else:  # a collective save ends when every rank's part is done
                    dist.barrier()
                    seconds = time.perf_counter() - t
                if engine.global_rank == 0:
                    rows.append({"case": case, "rep": rep, "save_index": idx,
                                 "seconds": seconds, "background": background, "parts": parts,
                                 "host_bytes": writer.host.nbytes, "bytes": du(save_dir / tag)})
                    shutil.rmtree(save_dir / tag)
                dist.barrier()
    if engine.global_rank == 0:
        Path(result_path).write_text(json.dumps({"rows": rows, "layers": len(keys)}))
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
