"""Layer-wise saves in an Accelerate loop with FSDP2 (`FullyShardedDataParallelPlugin(
fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")`), and its resume at any world size.

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    ckpt = AccelerateDcpCheckpointer(accelerator, "run", Parity())
    step = ckpt.resume()                # 0 on a first start, else the step resumed from
    ...
        ckpt.save(step)                 # collective: run/checkpoint-<step>

Why not `accelerator.save_state`'s layout: it writes the model and the optimizer as two DCP
checkpoints (`pytorch_model_fsdp_0/` with `model.<param>`, `optimizer_0/` with
`optimizer.state.<param>.*`) and Accelerate's state as pickles beside them. A layer-wise
save's record, its atomic publication and `recover`'s composite are those of one DCP
checkpoint (DcpCheckpointer's: dcp_checkpointer.py), and the composite carries no file but
the checkpoint's. So each save here is one DCP checkpoint written by DcpCheckpointer, with
`model.<param>` and `optim.*` entries (what `get_state_dict` of the prepared model and
optimizer gives: what Accelerate's own save_fsdp_model / save_fsdp_optimizer write, under one
roof) and Accelerate's own state as entries beside them, saved whole every time: its step
counter (`accelerate.step`), every prepared scheduler's and `register_for_checkpointing`
object's `state_dict()`, the loop's step (`train_state.step`) and each rank's random
generators (`rng.<rank>`, dcp_trainer_state.py). A composite takes those from the newest
save, so `resume()` gets them back from it as the layers: `load_dcp` (DCP's `dcp.load` and
`set_state_dict`, what Accelerate's load_fsdp_model / load_fsdp_optimizer do) and then each
object's own `load_state_dict`. `accelerator.load_state` does not read it (it looks for the
two dirs); a full save's `accelerator.save_state` is not needed beside it. Not saved:
prepared dataloaders' sampler state and a GradScaler (a loop that needs them saves them in
`extra`).
Collective: every method is called on every rank.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from mpitailor.training import dcp_state
from mpitailor.training.dcp_checkpointer import DcpCheckpointer
from mpitailor.training.dcp_trainer_state import restore_rng, rng_entry, rng_to_load
from mpitailor.training.policies import Decision, Policy
from mpitailor.training.resume import recover_for_resume

SAVE_PREFIX = "checkpoint-"


class AccelerateDcpCheckpointer:
    def __init__(self, accelerator, save_dir: str | os.PathLike, policy: Policy,
                 layer_patterns: Mapping[str, str] | None = None,
                 keep_last: int | None = None) -> None:
        """accelerator: after `prepare` of one model (FSDP2) and its optimizer. keep_last:
        after each save, `prune --keep-last K` of save_dir (None: keep every save)."""
        if len(accelerator._models) != 1 or len(accelerator._optimizers) != 1:
            raise ValueError(f"AccelerateDcpCheckpointer saves one prepared model and its "
                             f"optimizer; the accelerator holds {len(accelerator._models)} "
                             f"models and {len(accelerator._optimizers)} optimizers")
        self.accelerator = accelerator
        self.model = accelerator._models[0]
        self.optimizer = accelerator._optimizers[0].optimizer  # under AcceleratedOptimizer
        self.save_dir = Path(save_dir)
        self.dcp = DcpCheckpointer(self.model, self.optimizer, save_dir, policy,
                                   layer_patterns, name_prefix=SAVE_PREFIX,
                                   keep_last=keep_last)

    def save(self, step: int, extra: Mapping | None = None) -> Decision:
        """Collective: a full or partial save of this step into save_dir/checkpoint-<step>,
        as the policy decides, Accelerate's state and extra (the loop's own entries) whole
        in it; published when it returns."""
        acc = self.accelerator
        state = {"accelerate": {"step": acc.step,
                                "schedulers": {str(i): s.state_dict()
                                               for i, s in enumerate(acc._schedulers)},
                                "custom": {str(i): o.state_dict()
                                           for i, o in enumerate(acc._custom_objects)}},
                 "train_state": {"step": step}, **rng_entry(acc.process_index),
                 **(extra or {})}
        return self.dcp.save(step, extra=state)

    def resume(self, extra: dict | None = None) -> int:
        """Collective: the model, optimizer and Accelerate's state loaded from the newest
        copy of every layer in save_dir (recover_for_resume: a composite at this job's
        world size when partial saves follow the full one), and extra filled in place;
        the step saved. 0, and nothing loaded, when no save ever finished."""
        path = recover_for_resume(self.save_dir)
        if path is None:
            return 0
        acc = self.accelerator
        rank = acc.process_index
        want = {"accelerate": {"step": 0,
                               "schedulers": {str(i): s.state_dict()
                                              for i, s in enumerate(acc._schedulers)},
                               "custom": {str(i): o.state_dict()
                                          for i, o in enumerate(acc._custom_objects)}},
                "train_state": {"step": 0}, **rng_to_load(path, rank), **(extra or {})}
        got = dcp_state.load_dcp(self.model, self.optimizer, path, None, want)
        mine = got["accelerate"]
        acc.step = int(mine["step"])
        for i, s in enumerate(acc._schedulers):
            s.load_state_dict(mine["schedulers"][str(i)])
        for i, o in enumerate(acc._custom_objects):
            o.load_state_dict(mine["custom"][str(i)])
        restore_rng(got, rank)
        for k in extra or {}:
            extra[k] = got[k]
        return int(got["train_state"]["step"])
