"""HF Trainer integration: `LayerwiseTrainer`, a Trainer whose checkpoints follow a policy.

    trainer = LayerwiseTrainer(policy=Parity(full_every=8), model=..., args=..., ...)

At each of the Trainer's own save steps the policy decides: a full save is the Trainer's
usual `checkpoint-N/`; a partial save writes `checkpoint-N/` with the trainer state, rng
states, config and training args, and a partial DeepSpeed tag dir (`save_layers`). `latest`
is written last, so a `checkpoint-N/` without it is an interrupted save and is skipped by
`mpitailor recover`. Requires DeepSpeed ZeRO-3; keep `save_total_limit` unset so the
partial chain is not rotated away.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
from accelerate.utils import DeepSpeedSchedulerWrapper

from mpitailor.training.checkpointer import LayerwiseCheckpointer
from mpitailor.training.partial_save import save_layers
from mpitailor.training.policies import Policy


class LayerwiseTrainer(transformers.Trainer):
    def __init__(self, *args, policy: Policy, stats: str | os.PathLike | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layerwise_policy, self.layerwise_stats = policy, stats
        self._layerwise: LayerwiseCheckpointer | None = None

    def _save_checkpoint(self, model, trial) -> None:
        if self.deepspeed is None:
            raise RuntimeError("LayerwiseTrainer needs DeepSpeed ZeRO-3 (TrainingArguments."
                               "deepspeed)")
        run_dir = Path(self._get_output_dir(trial=trial))
        if self._layerwise is None:
            self._layerwise = LayerwiseCheckpointer(self.deepspeed, run_dir,
                                                    self.layerwise_policy, self.layerwise_stats)
        decision = self._layerwise.decide()
        lineage = self._layerwise.next_lineage(decision)
        out = run_dir / f"checkpoint-{self.state.global_step}"
        if decision.full:
            super()._save_checkpoint(model, trial)
        else:
            self._save_partial(out, decision.layers, lineage)
        self._layerwise.record(decision, lineage, out / f"global_step{self.state.global_step}")

    def _save_partial(self, out: Path, layers, lineage) -> None:
        tag = f"global_step{self.state.global_step}"
        if self.args.should_save:
            out.mkdir(parents=True, exist_ok=True)
            self.model.config.save_pretrained(out)
            self.state.save_to_json(str(out / "trainer_state.json"))
            torch.save(self.args, out / "training_args.bin")
            if self.lr_scheduler is not None and not isinstance(
                    self.lr_scheduler, DeepSpeedSchedulerWrapper):  # as Trainer does
                torch.save(self.lr_scheduler.state_dict(), out / "scheduler.pt")
        self.accelerator.wait_for_everyone()
        self._save_rng_state(str(out))
        save_layers(self.deepspeed, out, tag, layers, lineage=lineage)
        if self.args.should_save:
            (out / "latest").write_text(tag)
