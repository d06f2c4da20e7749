"""One rank of test_async_save's placeholder check (started by dev.tinytrain.launch).

argv: spec.json result.json. Trains two steps, then writes the module states a partial save
makes (mpitailor: placeholders made directly, no partitioning) and the ones DeepSpeed's own
save_checkpoint makes (checkpoint_event_prologue partitions every parameter, the persistent
ones too; the epilogue gathers them back), both with torch.save, and says whether the bytes
are equal. Rank 0 writes the result.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from dev.tinytrain.spec import TrainSpec
from dev.tinytrain.worker import build_engine, shutdown, train
from mpitailor.training.partial_save import model_states
from mpitailor.training.snapshot import torch_bytes


def main(spec_path: str, result_path: str) -> None:
    spec = TrainSpec.from_json(Path(spec_path).read_text())
    engine = build_engine(spec)
    train(spec, engine, 0)
    params = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
    gathered = sum(p.data.numel() > 0 for p in params)  # the persistent ones, between steps
    ours = torch_bytes(model_states(engine)["module"])
    gathered_after = sum(p.data.numel() > 0 for p in params)  # ours left them as they were
    engine.optimizer.checkpoint_event_prologue()
    try:
        theirs = torch_bytes(engine.module_state_dict())
    finally:
        engine.optimizer.checkpoint_event_epilogue()
    result = {"equal": ours == theirs, "bytes": len(ours), "params": len(params),
              "gathered": gathered, "gathered_after": gathered_after}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if engine.global_rank == 0:
        Path(result_path).write_text(json.dumps(everyone))
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
