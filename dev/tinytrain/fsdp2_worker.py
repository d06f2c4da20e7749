"""One rank of a tiny FSDP2 run saved with PyTorch Distributed Checkpoint, as a new user of
torchtitan or a plain FSDP2 loop saves one. Started by `launch(spec, module=...)`.

The model is the tiny HF model of the spec (model.py); every decoder layer is
`fully_shard`ed, then the root; AdamW; at each step of `save_at`, `get_state_dict` of model
and optimizer and `dcp.save({"model": ..., "optim": ...})` into SAVE_DIR/step-N (torchtitan's
naming). extra["flatten_optimizer"]: the optimizer's state dict keyed by parameter names
(`optim.state.<fqn>.exp_avg`, `optim.param_groups.<fqn>.lr`; torchtitan's), else torch's
default (`optim.param_groups.0.lr`). spec.load_dir: first `dcp.load` that checkpoint (at
this run's world size: DCP reshards) and `set_state_dict`, then train spec.steps more
steps from step extra["first_step"] on. spec.policy: save with mpitailor's DcpCheckpointer
(that policy; the step saved as `train_state.step`); extra["recover"]: spec.load_dir is such
a save dir, resumed from with recover_for_resume + load_dcp (the step it holds);
spec.async_save: the checkpointer's saves written in the background (`wait()` after the
last step); spec.stats: its HDF5 log. extra["keep_going"]: a save that failed
(PartialSaveFailed, raised at the next save or the wait) is noted, on every rank, and
training goes on. extra["writer"]: "safetensors" saves with `FileSystemWriter(
serialization_format=SerializationFormat.SAFETENSORS)` (each data file's chunks one
safetensors blob), "hf" with `HuggingFaceStorageWriter(save_distributed=True)` (per-rank
`*.safetensors` files of the model's weights alone); the default writer otherwise. argv:
spec.json result.json. Rank 0 writes the result: losses per step, the saves begun (`saved`:
a call that returned), the checkpointer's timings per save, every rank's failed saves
(`failed`: per rank, [the step of the call that raised, its message]), the loop's seconds
(its saves and the wait for the last included) and the last wait's.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

from dev.tinytrain.model import build_model, task_batch
from dev.tinytrain.spec import TrainSpec


def run(spec: TrainSpec, result_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(spec.seed)
    model = build_model(spec)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    options = StateDictOptions(flatten_optimizer_state_dict=bool(
        spec.extra.get("flatten_optimizer")))
    first = int(spec.extra.get("first_step", 0))
    ckpt = None
    if spec.policy is not None:  # layer-wise saves (mpitailor's DcpCheckpointer)
        from mpitailor.training import DcpCheckpointer, make_policy
        policy = dict(spec.policy)
        keep_last = policy.pop("keep_last", None)  # the checkpointer's, not the policy's
        ckpt = DcpCheckpointer(model, opt, spec.save_dir, make_policy(**policy),
                               options=options, asynchronous=spec.async_save,
                               stats=spec.stats, keep_last=keep_last)
    if spec.load_dir is not None and spec.extra.get("recover"):
        # a requeued job: the newest copy of every layer of its save dir, at any world size
        from mpitailor.training import load_dcp, recover_for_resume
        path = recover_for_resume(spec.load_dir)
        if path is not None:
            first = int(load_dcp(model, opt, path, options,
                                 {"train_state": {"step": 0}})["train_state"]["step"])
    elif spec.load_dir is not None:
        msd, osd = get_state_dict(model, opt, options=options)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=spec.load_dir)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
    losses, saved, failed = [], [], []
    t0 = time.perf_counter()
    for step in range(first + 1, first + spec.steps + 1):
        ids, labels = task_batch(spec, step, rank)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if step in spec.save_at and ckpt is not None:
            if _saved(failed, spec, step, ckpt.save, step,
                      extra={"train_state": {"step": step}}):
                saved.append(f"step-{step}")
        elif step in spec.save_at:
            msd, osd = get_state_dict(model, opt, options=options)
            out = Path(spec.save_dir) / f"step-{step}"
            # (the HF writer puts bytes entries, the optimizer's param groups, before its
            # files' safetensors header, where no reader finds them: the model only)
            state = {"model": msd} if spec.extra.get("writer") == "hf" else \
                {"model": msd, "optim": osd}
            dcp.save(state, checkpoint_id=str(out),
                     storage_writer=_writer(spec.extra.get("writer"), out))
            saved.append(out.name)
    t1 = time.perf_counter()
    if ckpt is not None:
        _saved(failed, spec, first + spec.steps, ckpt.wait)
    last_wait = time.perf_counter() - t1
    seconds = time.perf_counter() - t0
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, failed)
    if rank == 0:
        Path(result_path).write_text(json.dumps({
            "losses": losses, "saved": saved, "world_size": dist.get_world_size(),
            "save_timings": ckpt.timings if ckpt is not None else [], "failed": every,
            "loop_seconds": seconds, "last_wait": last_wait}))
    dist.barrier()
    dist.destroy_process_group()


def _writer(kind: str | None, out: Path):
    """The storage writer extra["writer"] names; None: dcp.save's default."""
    if kind is None:
        return None
    if kind == "safetensors":
        from torch.distributed.checkpoint.filesystem import SerializationFormat
        return dcp.FileSystemWriter(str(out),
                                    serialization_format=SerializationFormat.SAFETENSORS)
    if kind == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        return HuggingFaceStorageWriter(str(out), save_distributed=True)
    raise ValueError(f"writer {kind!r}")


def _saved(failed: list, spec: TrainSpec, step: int, call, *args, **kwargs) -> bool:
    """call(*args, **kwargs) (a save, the wait) at step; False, and the failure noted, when it
    raised the failure of a save (extra["keep_going"]; else it ends the run)."""
    from mpitailor.training.snapshot import PartialSaveFailed
    try:
        call(*args, **kwargs)
    except PartialSaveFailed as e:
        if not spec.extra.get("keep_going"):
            raise
        failed.append([step, str(e)])
        return False
    return True


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(TrainSpec.from_json(Path(sys.argv[1]).read_text()), sys.argv[2])
    # The work is done and the process group left: exit at once. Interpreter teardown with
    # gloo's threads still alive can abort() ("terminate called without an active
    # exception", exit -6) on one rank now and then (worker.py's shutdown says the same).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
