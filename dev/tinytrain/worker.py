"""One rank of a tiny DeepSpeed ZeRO-3 run. Started by `launch`, never by hand.

argv: spec.json result.json. Rank 0 writes the result: losses per step and saved tags.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from dev.tinytrain.model import build_model, held_out_loss, task_batch
from dev.tinytrain.spec import TrainSpec
from mpitailor.training.groups import decay_param_groups, per_layer_param_groups


@dataclass
class RunNotes:
    """A user's own class in client state: DeepSpeed pickles it; mpitailor must not build it."""

    step: int
    comment: str


def client_state(spec: TrainSpec, step: int) -> dict:
    """What an ordinary training script passes to save_checkpoint(client_state=...)."""
    if not spec.client_state:
        return {}
    return {"args": argparse.Namespace(lr=spec.lr, seed=spec.seed, run="tiny"),
            "best_loss": np.float64(1.5 + step / 100), "notes": RunNotes(step, "tiny run")}


def shown_client_state(client: dict | None) -> dict:
    """The client-state objects a resume got back, as text to compare (repr is exact)."""
    return {k: repr(v) for k, v in sorted((client or {}).items())
            if k in ("args", "best_loss", "notes")}


def skip_shm_build() -> None:
    """DeepSpeed JIT-compiles a CPU shared-memory all-reduce at init (~25 s of g++).
    Training on gloo does not need it."""
    import deepspeed.comm.torch  # noqa: F401  (registers the module)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


# DeepSpeed's default buckets are 5e8 elements: 2 GB of fp32 reserved per bucket per rank,
# for a model of a few MB. Under strict overcommit (CI machines: commit limit ~12 GB) two
# 4-rank runs side by side cannot start, so the tiny runs use 20 MB buckets. Bucket sizes
# change neither the sums nor the checkpoint layout.
SMALL_BUCKETS = {"reduce_bucket_size": 5_000_000, "allgather_bucket_size": 5_000_000,
                 "stage3_prefetch_bucket_size": 5_000_000}


def ds_config(spec: TrainSpec) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                     "warmup_max_lr": spec.lr,
                                                     "warmup_num_steps": 4}},
        # extra["zero_optimization"]: more ZeRO settings (bucket sizes of a large model's run)
        "zero_optimization": {"stage": spec.zero_stage, "sub_group_size": spec.sub_group_size,
                              **SMALL_BUCKETS, **spec.extra.get("zero_optimization", {})},
        "bf16": {"enabled": spec.dtype == "bf16"},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if spec.load_universal:
        config["checkpoint"] = {"load_universal": True}
    if spec.node_local_storage:  # a save dir per node, made by its local rank 0
        config.setdefault("checkpoint", {})["use_node_local_storage"] = True
    return config


def param_groups(spec: TrainSpec, model: torch.nn.Module):
    if spec.grouping == "per_layer":
        return per_layer_param_groups(model, weight_decay=0.01)
    if spec.grouping == "decay":
        return decay_param_groups(model, weight_decay=0.01)
    return [p for p in model.parameters() if p.requires_grad]


def build_engine(spec: TrainSpec):
    """The run's DeepSpeed engine: on the CPU over gloo, or with extra["device"] = "cuda"
    (save_bench --device cuda) on the process's GPU over NCCL."""
    import deepspeed

    if spec.extra.get("device") == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed(dist_backend="nccl")
    else:
        skip_shm_build()
        deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(spec)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(spec, model),
                                      config=ds_config(spec))
    return engine


def train(spec: TrainSpec, engine, first_step: int, on_save=None) -> list[float]:
    """Train from `first_step`+1 to spec.steps; save at spec.save_at. Returns losses."""
    rank = engine.global_rank
    losses = []
    if first_step == 0 and 0 in spec.save_at:  # before the first optimizer step: no Adam state
        (on_save or _save_full)(engine, spec, 0)
    for step in range(first_step + 1, spec.steps + 1):
        ids, labels = (t.to(engine.device) for t in task_batch(spec, step, rank))
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
        if step in spec.save_at:
            (on_save or _save_full)(engine, spec, step)
        if spec.step_sleep:
            time.sleep(spec.step_sleep)
    return losses


def _save_full(engine, spec: TrainSpec, step: int) -> None:
    engine.save_checkpoint(spec.save_dir, tag=f"global_step{step}",
                           client_state=client_state(spec, step))


def main(spec_path: str, result_path: str) -> None:
    run(TrainSpec.from_json(Path(spec_path).read_text()), result_path)


def run(spec: TrainSpec, result_path: str) -> None:
    """Train as spec says; rank 0 writes the result to result_path ("-": one JSON line on
    stdout). Exits the process (shutdown)."""
    engine = build_engine(spec)
    first, client, loaded = 0, None, None
    if spec.load_dir is not None:
        path, client = engine.load_checkpoint(spec.load_dir, tag=spec.load_tag)
        if path is None:
            raise SystemExit(f"DeepSpeed loaded nothing from {spec.load_dir}/{spec.load_tag}")
        first = engine.global_steps
        loaded = loaded_by_rank(path)
    on_save = None
    if spec.policy is not None:
        from mpitailor.training.checkpointer import LayerwiseCheckpointer
        from mpitailor.training.policies import make_policy
        options = dict(spec.policy)
        keep_last = options.pop("keep_last", None)  # the checkpointer's, not the policy's
        ckpt = LayerwiseCheckpointer(engine, spec.save_dir, make_policy(options.pop("name"),
                                                                        **options),
                                     stats=spec.stats, layer_patterns=spec.layer_patterns,
                                     asynchronous=spec.async_save,
                                     max_host_bytes=spec.max_host_bytes, keep_last=keep_last)
        on_save = lambda engine, spec, step: ckpt.save(  # noqa: E731
            tag=f"global_step{step}", client_state=client_state(spec, step))
    losses = train(spec, engine, first, on_save)
    # extra["end"] == "end_cpu_training": end as the script in docs/training.md does, with no wait of
    # its own (end_cpu_training must wait for the save in flight)
    end_now = spec.extra.get("end") == "end_cpu_training"
    if spec.policy is not None and not end_now:
        ckpt.wait()  # the last asynchronous save published, or its failure raised here
    eval_loss = held_out_loss(spec, engine) if spec.eval_batches else None
    resumed = resume_own_saves(spec, engine) if spec.then_resume else None
    if engine.global_rank == 0:
        result = json.dumps(
            {"losses": losses, "first_step": first, "global_steps": engine.global_steps,
             "world_size": engine.world_size, "eval_loss": eval_loss,
             "client_state": shown_client_state(client), "resumed": resumed,
             "loaded": loaded, "save_timings": ckpt.timings if spec.policy else None})
        if result_path == "-":
            print(result, flush=True)
        else:
            Path(result_path).write_text(result)
    if end_now:
        from mpitailor.training import end_cpu_training
        end_cpu_training()
    shutdown()


def loaded_by_rank(path) -> list[list[str]]:
    """Collective: [host, file DeepSpeed loaded] of every rank, in rank order (which node
    read which checkpoint file: under node-local storage each reads its node's disk)."""
    import socket

    import torch.distributed as dist
    mine = [socket.gethostname(), str(path)]
    if not dist.is_initialized():
        return [mine]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def resume_own_saves(spec: TrainSpec, engine) -> dict:
    """Recover this run's saves on its own ranks (mpitailor.training.recover_for_resume),
    load the composite into the engine as a resume would, train spec.then_resume steps."""
    from mpitailor.training import recover_for_resume
    path = recover_for_resume(spec.save_dir)
    loaded, _ = engine.load_checkpoint(str(path))
    if loaded is None:
        raise SystemExit(f"DeepSpeed loaded nothing from {path}")
    start = engine.global_steps
    losses = train(replace(spec, steps=start + spec.then_resume, save_at=()), engine, start)
    return {"from": str(path), "first_step": start, "global_steps": engine.global_steps,
            "losses": losses}


def shutdown() -> None:
    """Leave the process group together, then exit at once. Interpreter teardown with
    DeepSpeed's and gloo's threads still alive can abort() ("terminate called without an
    active exception") after the work is done; nothing is left to clean up by then."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
