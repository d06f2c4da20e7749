"""Layer-wise saves in the HF Trainer with FSDP2 (`TrainingArguments(fsdp=True, fsdp_config=
{"version": 2, "state_dict_type": "SHARDED_STATE_DICT", ...})`), and its resume at any world
size.

    trainer = DcpLayerwiseTrainer(model=model, args=args, train_dataset=data, policy=Parity())
    trainer.train(resume_from_checkpoint=True)   # recovers first; from scratch on a first start

Why not the Trainer's own layout: it saves the model and the optimizer as two DCP
checkpoints (`checkpoint-N/pytorch_model_fsdp_0/`, `optimizer_0/`), its state as files beside
them (`trainer_state.json`, `scheduler.pt`, `rng_state_<rank>.pth`). A layer-wise save's
record, its atomic publication and `recover`'s composite are those of one DCP checkpoint
(DcpCheckpointer's: dcp_checkpointer.py), and the composite carries no file but the
checkpoint's. So each save, `checkpoint-N/` (as HF names it), is one DCP checkpoint written by
DcpCheckpointer, with `model.<param>` and `optim.*` entries (`get_state_dict` of the FSDP2
model and its optimizer: what HF's FSDP save writes, under one roof), the Trainer's state as
entries beside them, saved whole every time (`hf_trainer.state`, TrainerState as its JSON;
`hf_trainer.scheduler`, the scheduler's `state_dict()`) and each rank's random generators
(`rng.<rank>`, dcp_trainer_state.py). A composite takes those from the newest save.

`train(resume_from_checkpoint=...)` (True, the output dir, or a `checkpoint-N` to resume from
the saves up to it) first assembles the checkpoint with recover_for_resume, then runs the
Trainer's own resume: its trainer_state.json is written from `hf_trainer.state` into a small
dir beside the composite (`.mpitailor-resume/<name>.hf/`), which the Trainer is given as the
checkpoint (so it restores its step, skips the batches seen and restores its callbacks as
always); the model, optimizer and scheduler are loaded from the DCP checkpoint with
`load_dcp` (DCP's `dcp.load` and `set_state_dict`, what HF's FSDP load does) where the
Trainer loads them, the rng where it loads the rng. HF's rotation would delete the full save the partial saves build on:
`save_total_limit` is applied by mpitailor's retention instead (`prune --keep-last
save_total_limit` after each save, jobs/prune.py).
Collective: every method is called on every rank.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

from mpitailor.training import dependencies

with dependencies(__name__):
    import transformers
    from transformers.trainer_callback import ExportableState

from mpitailor.facade import RESUME_DIR, publish_file
from mpitailor.formats.zero import hf_checkpoint_step
from mpitailor.training import dcp_state
from mpitailor.training.dcp_checkpointer import DcpCheckpointer
from mpitailor.training.dcp_trainer_state import restore_rng, rng_entry, rng_to_load
from mpitailor.training.distcomm import training_comm
from mpitailor.training.policies import Policy
from mpitailor.training.resume import recover_for_resume

SAVE_PREFIX = "checkpoint-"
STATE_NAME = "trainer_state.json"


class DcpLayerwiseTrainer(transformers.Trainer):
    def __init__(self, *args, policy: Policy, layer_patterns: Mapping[str, str] | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.layerwise_policy = policy
        self.layer_patterns = dict(layer_patterns or {})
        self._dcp: DcpCheckpointer | None = None
        self._dcp_point: Path | None = None  # the DCP checkpoint this run resumes from
        self._dcp_loaded: dict = {}

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """As Trainer.train; resume_from_checkpoint=True, the output dir or a checkpoint-N
        first assembles the checkpoint to resume from, for this job's world size
        (collective); with no finished save yet, training starts from scratch."""
        if resume_from_checkpoint:
            self._dcp_point = self._resume_point(resume_from_checkpoint)
            resume_from_checkpoint = None if self._dcp_point is None else \
                str(self._state_dir(self._dcp_point))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _resume_point(self, wanted: str | bool) -> Path | None:
        if wanted is True:
            return recover_for_resume(self.args.output_dir)
        path = Path(wanted)
        step = hf_checkpoint_step(path.name)
        if step is not None:  # a checkpoint-N: the newest state of the saves up to it
            return recover_for_resume(path.parent, until_step=step)
        return recover_for_resume(path)  # the run's output dir

    def _state_dir(self, point: Path) -> Path:
        """Collective: the dir holding the trainer_state.json of the checkpoint at point (as
        saved in it), which the Trainer is given to resume from; written by rank 0."""
        saved = dcp_state.load_entries({"hf_trainer": {"state": ""}}, point)
        where = Path(self.args.output_dir) / RESUME_DIR / f"{point.name}.hf"

        def write() -> None:
            where.mkdir(parents=True, exist_ok=True)
            publish_file(where / STATE_NAME, saved["hf_trainer"]["state"].encode())
        training_comm().root_step(write)
        return where

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._dcp_point is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # else: loaded with the optimizer (load_dcp loads both), next

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._dcp_point is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        rank = self.args.process_index
        want = {"hf_trainer": {"scheduler": self.lr_scheduler.state_dict()},
                **rng_to_load(self._dcp_point, rank)}
        self._dcp_loaded = dcp_state.load_dcp(self.model_wrapped, self.optimizer.optimizer,
                                              self._dcp_point, None, want)
        self.lr_scheduler.load_state_dict(self._dcp_loaded["hf_trainer"]["scheduler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._dcp_point is None:
            return super()._load_rng_state(checkpoint)
        restore_rng(self._dcp_loaded, self.args.process_index)

    def _save_checkpoint(self, model, trial) -> None:
        """A full or partial save of this step into <output_dir>/checkpoint-<step>, as the
        policy decides (collective); published when it returns."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        if self._dcp is None:
            self._dcp = DcpCheckpointer(self.model_wrapped, self.optimizer.optimizer,
                                        self._get_output_dir(trial=trial),
                                        self.layerwise_policy, self.layer_patterns,
                                        name_prefix=SAVE_PREFIX,
                                        keep_last=self.args.save_total_limit)
        for cb in [c for c in self.callback_handler.callbacks + [self.control]
                   if isinstance(c, ExportableState)]:  # as Trainer._save_checkpoint does
            name, state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(state)
            else:
                self.state.stateful_callbacks[name] = state
        text = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"
        extra = {"hf_trainer": {"state": text, "scheduler": self.lr_scheduler.state_dict()},
                 **rng_entry(self.args.process_index)}
        self._dcp.save(self.state.global_step, extra=extra)

