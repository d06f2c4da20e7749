"""One DeepSpeed training run of world size 1 (NCCL on a GPU; gloo on CPU for development).

argv: spec.json result.json. Trains the tiny Llama with ZeRO stage `spec.stage` in
`spec.dtype`, one optimizer param group per layer (`per_layer_param_groups`), saving
layer-wise through `LayerwiseCheckpointer` with a `Parity` policy; or resumes with a plain
`engine.load_checkpoint(load_dir)` first. Saves are asynchronous unless spec.asynchronous
is False (the partial slices are copied to host buffers, written in the background).
`crash_after`: after that step (and its save) the
process writes its result and dies on the spot (os._exit, no barrier, no shutdown).
The result: per step loss, lr, loss scale, counters; each save; the state after a load; a
digest of the final fp32 master weights and Adam moments.
"""
from __future__ import annotations

import os
import sys
import time

from bench.gpu.common import (
    RunSpec,
    batch,
    build_llama,
    deterministic,
    digest,
    skip_shm_build,
    write_json,
)


def ds_config(spec: RunSpec) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                     "warmup_max_lr": spec.lr,
                                                     "warmup_num_steps": 6}},
        "zero_optimization": {"stage": spec.stage},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if spec.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif spec.dtype == "fp16":
        # A small window so that the dynamic loss scale moves within the run: the saved
        # DynamicLossScaler then holds a state a resume must restore.
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8,
                          "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 1}
    return config


def scaler_state(engine) -> dict | None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return None
    keys = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window",
            "cur_hysteresis", "dynamic")
    return {"class": type(scaler).__name__,
            **{k: _plain(getattr(scaler, k)) for k in keys if hasattr(scaler, k)}}


def _plain(v):
    try:
        return v.item()
    except AttributeError:
        return v


def state_digest(engine) -> dict:
    """Digests of the full fp32 master weights and both Adam moments: stage 3 through
    DeepSpeed's public accessors, in model order; stages 1/2 (whose accessors hold no Adam
    moments before a universal-checkpoint link) from the flat fp32 partitions themselves
    (world size 1: one partition per param group, padding included)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    if engine.zero_optimization_stage() in (1, 2):
        flats = engine.optimizer.single_partition_of_fp32_groups
        state = engine.optimizer.optimizer.state
        return {"fp32": digest(flats),
                "exp_avg": digest(state[f]["exp_avg"] for f in flats),
                "exp_avg_sq": digest(state[f]["exp_avg_sq"] for f in flats)}
    params = [p for p in engine.module.parameters() if p.requires_grad]
    return {"fp32": digest(safe_get_full_fp32_param(p) for p in params),
            "exp_avg": digest(safe_get_full_optimizer_state(p, "exp_avg") for p in params),
            "exp_avg_sq": digest(safe_get_full_optimizer_state(p, "exp_avg_sq")
                                 for p in params)}


def main(spec_path: str, result_path: str) -> None:
    t_start = time.perf_counter()
    spec = RunSpec.read(spec_path)
    import torch
    deterministic(spec.seed)
    import deepspeed

    from mpitailor.training import LayerwiseCheckpointer, Parity, per_layer_param_groups

    if spec.device == "cpu":
        skip_shm_build()
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        torch.cuda.set_device(0)
        deepspeed.init_distributed(dist_backend="nccl")
    model = build_llama(spec)
    engine, *_ = deepspeed.initialize(model=model,
                                      model_parameters=per_layer_param_groups(model, 0.01),
                                      config=ds_config(spec))
    t_init = time.perf_counter()
    result = {"name": spec.name, "backend": torch.distributed.get_backend(),
              "device": str(engine.device), "torch": torch.__version__,
              "deepspeed": deepspeed.__version__,
              "gpu": torch.cuda.get_device_name(0) if spec.device == "cuda" else None,
              "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                            for p in engine.module.parameters()),
              "zero_stage": engine.zero_optimization_stage(), "dtype": spec.dtype,
              "optimizer": type(engine.optimizer).__name__,
              "param_groups": len(engine.optimizer.param_groups),
              "steps": [], "saves": [], "loaded": None, "crashed": False}
    first = 0
    if spec.load_dir:
        path, client = engine.load_checkpoint(spec.load_dir, tag=spec.load_tag)
        if path is None:
            raise SystemExit(f"DeepSpeed loaded nothing from {spec.load_dir}")
        first = engine.global_steps
        result["loaded"] = {"path": str(path), "global_steps": engine.global_steps,
                            "global_samples": engine.global_samples,
                            "skipped_steps": engine.skipped_steps,
                            "lr": engine.get_lr()[0], "loss_scaler": scaler_state(engine),
                            "client_state_keys": sorted(client or {})}
    ckpt = None
    if spec.save_dir and spec.save_every:
        # extra["stats"]: an HDF5 update-statistics log (its norms are summed over the ranks
        # with an all-reduce: on NCCL through the GPU)
        ckpt = LayerwiseCheckpointer(engine, spec.save_dir, Parity(full_every=spec.full_every),
                                     asynchronous=spec.asynchronous,
                                     stats=spec.extra.get("stats"))
    t_train = time.perf_counter()
    for step in range(first + 1, spec.steps + 1):
        ids = batch(spec, step).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        value = float(loss.detach().float())
        result["steps"].append({"step": step, "loss": value, "loss_hex": value.hex(),
                                "lr": engine.get_lr()[0], "global_steps": engine.global_steps,
                                "skipped_steps": engine.skipped_steps,
                                "loss_scaler": scaler_state(engine)})
        if ckpt is not None and step % spec.save_every == 0:
            t0 = time.perf_counter()
            decision = ckpt.save(tag=f"global_step{step}",
                                 client_state={"gpu_check_step": step})
            result["saves"].append({"step": step, "full": decision.full,
                                    "layers": sorted(decision.layers),
                                    "seconds": time.perf_counter() - t0})
        if spec.crash_after == step:
            if ckpt is not None:
                ckpt.wait()   # the crash comes after this step's save is published
            result["crashed"] = True
            result["seconds"] = {"init": t_init - t_start, "train": time.perf_counter() - t_train}
            write_json(result_path, result)
            sys.stdout.flush()
            os._exit(0)   # the crash: no barrier, no process-group shutdown
    if ckpt is not None:
        ckpt.wait()
        result["save_timings"] = ckpt.timings
    result["final"] = state_digest(engine)
    result["seconds"] = {"init": t_init - t_start, "train": time.perf_counter() - t_train}
    write_json(result_path, result)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)   # DeepSpeed's threads can abort() at interpreter teardown; nothing is left


if __name__ == "__main__":
    main(*sys.argv[1:3])
