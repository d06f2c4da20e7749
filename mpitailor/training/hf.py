"""HF Trainer integration: `LayerwiseTrainer`, a Trainer whose checkpoints follow a policy.

    trainer = LayerwiseTrainer(policy=Parity(full_every=8), model=..., args=..., ...)
    trainer.train(resume_from_checkpoint=True)     # after a failure: recovers, then resumes

At each of the Trainer's own save steps the policy decides: a full save is the Trainer's
usual `checkpoint-N/`; a partial save writes `checkpoint-N/` with the trainer state, rng
states, config and training args, and a partial DeepSpeed tag dir (`save_layers`). `latest`
is written last, so a `checkpoint-N/` without it is an interrupted save and is skipped by
`mpitailor recover`. `train(resume_from_checkpoint=True | path)` assembles the composite of
the newest saves on the training ranks first (training/resume.py) and resumes from it.

By default the optimizer gets one param group per layer (HF's optimizer, hyper-parameters
and decay/no-decay split otherwise unchanged), so that every Adam step of a composite is
exact; `per_layer_groups=False` keeps HF's two groups. Requires DeepSpeed ZeRO-3 with the
optimizer made by the Trainer (no "optimizer" section in the DeepSpeed config: DeepSpeed
would build its own from one group). `save_total_limit` is applied by mpitailor's retention
(jobs/prune.py) instead of HF's rotation, which would rotate the full save the partial saves
build on away.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from mpitailor.training import dependencies

with dependencies(__name__):
    import torch
    import transformers
    from accelerate.utils import DeepSpeedSchedulerWrapper

from mpitailor import failpoints
from mpitailor.errors import UserError
from mpitailor.facade import RESUME_DIR, LayerClassifier, layer_index, publish_file
from mpitailor.formats.zero import LATEST, PARTIAL_MANIFEST, hf_checkpoint_step
from mpitailor.training.checkpointer import LayerwiseCheckpointer, fresh_save_dir
from mpitailor.training.notice import make_visible
from mpitailor.training.policies import Policy
from mpitailor.training.recorded_save import sync_loop_files
from mpitailor.training.resume import recover_for_resume, reshard_for_resume
from mpitailor.training.snapshot import host_bytes_limit

log = logging.getLogger(__name__)


class LayerwiseTrainer(transformers.Trainer):
    def __init__(self, *args, policy: Policy, stats: str | os.PathLike | None = None,
                 layer_patterns: Mapping[str, str] | None = None,
                 per_layer_groups: bool = True, asynchronous: bool = False,
                 max_host_bytes: int | str | None = None, **kwargs) -> None:
        """asynchronous, max_host_bytes: partial saves written in the background, as
        LayerwiseCheckpointer's (train() waits for the last one before it returns)."""
        max_host_bytes = host_bytes_limit(max_host_bytes)
        super().__init__(*args, **kwargs)
        self.asynchronous, self.max_host_bytes = asynchronous, max_host_bytes
        self.layerwise_policy, self.layerwise_stats = policy, stats
        self.layer_patterns = dict(layer_patterns or {})
        self.per_layer_groups = per_layer_groups
        self._classify = LayerClassifier(self.layer_patterns)
        self._layerwise: LayerwiseCheckpointer | None = None
        self._refuse_early()

    def _refuse_early(self) -> None:
        """What would fail at the first partial save, said when the Trainer is made."""
        config = getattr(self.args, "hf_deepspeed_config", None)
        stage = ((config.config if config is not None else {}).get("zero_optimization") or
                 {}).get("stage") if config is not None else None
        if stage not in (1, 2, 3):
            raise UserError(f"LayerwiseTrainer needs DeepSpeed ZeRO (TrainingArguments"
                            f"(deepspeed=...) with zero_optimization.stage 1, 2 or 3); got "
                            f"{'no DeepSpeed config' if config is None else f'stage {stage}'}")
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        if not any(layer_index(self._classify(n)) is not None for n in names):
            sample = next((n for n in names if any(c.isdigit() for c in n)), names[0])
            raise UserError(f"LayerwiseTrainer: no decoder layers recognised in the parameter "
                            f"names (e.g. {sample!r}); pass layer_patterns={{r'<regex with "
                            f"(\\d+) for the layer number>': 'layers.{{i}}'}}")

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """HF's optimizer, its groups split by layer (each keeps its hyper-parameters)."""
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(model)
        if not (fresh and self.per_layer_groups):
            return optimizer
        names = {id(p): n for n, p in (model or self.model).named_parameters()}
        groups = []
        for group in optimizer.param_groups:
            by_layer: dict[str, list] = {}
            for p in group["params"]:
                by_layer.setdefault(self._classify(names[id(p)]), []).append(p)
            groups += [{**group, "params": ps} for ps in by_layer.values()]
        # Regrouped in place (no step taken yet, so no state): any torch optimizer allows it.
        optimizer.param_groups = []
        for group in groups:
            optimizer.add_param_group(group)
        return optimizer

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """As Trainer.train; resume_from_checkpoint=True, the run's output dir or the path of
        a checkpoint-N first assembles the checkpoint to resume from, for this job's world
        size (collective); with no finished save yet, training starts from scratch."""
        if resume_from_checkpoint:
            point = self._resume_point(resume_from_checkpoint)
            resume_from_checkpoint = None if point is None else str(point)
            if point is not None:
                self._say_missing_rng(point)
        result = super().train(resume_from_checkpoint, *args, **kwargs)
        if self._layerwise is not None:
            self._layerwise.wait()  # the last asynchronous save is published (or raises)
        return result

    def _say_missing_rng(self, point: Path) -> None:
        """HF says at INFO only (unseen) that a process has no RNG state to resume: a job
        back on another number of ranks than saved. Rank 0 says which start afresh."""
        world = self.args.world_size
        if self.args.process_index != 0:
            return
        names = ["rng_state.pth"] if world == 1 else [f"rng_state_{r}.pth" for r in range(world)]
        missing = [n for n in names if not (point / n).is_file()]
        if missing:
            make_visible()
            log.warning("%s holds no %s (saved by another number of ranks): those random "
                        "streams start afresh, the rest resume exactly", point,
                        ", ".join(missing))

    def _resume_point(self, wanted: str | bool) -> Path | None:
        if wanted is True:
            return recover_for_resume(self.args.output_dir)
        path = Path(wanted)
        step = hf_checkpoint_step(path.name) if path.is_dir() else None
        if step is not None and (any(path.glob(f"global_step*/{PARTIAL_MANIFEST}"))
                                 or not (path / LATEST).exists()):
            # A partial checkpoint-N; or one killed while it was saved, which HF's
            # get_last_checkpoint returns all the same (it goes by names): the run's newest
            # complete state up to it, the incomplete save skipped, and said.
            return recover_for_resume(path.parent, until_step=step)
        if any(path.glob("checkpoint-*")):  # the run's output dir
            return recover_for_resume(path)
        # a full checkpoint (or a composite): as it is, or resharded for this world size
        return reshard_for_resume(path, Path(self.args.output_dir) / RESUME_DIR)

    def _save_checkpoint(self, model, trial) -> None:
        if self.deepspeed is None:
            raise RuntimeError("LayerwiseTrainer needs DeepSpeed ZeRO-3 (TrainingArguments."
                               "deepspeed)")
        run_dir = Path(self._get_output_dir(trial=trial))
        if self._layerwise is None:
            self._layerwise = LayerwiseCheckpointer(
                self.deepspeed, run_dir, self.layerwise_policy, self.layerwise_stats,
                self.layer_patterns, self.asynchronous, self.max_host_bytes,
                keep_last=self.args.save_total_limit)
        out = run_dir / f"checkpoint-{self.state.global_step}"

        def full() -> None:
            # HF's rotation deletes the oldest checkpoint-N dirs, which would take the full
            # save the partial ones build on: save_total_limit is the checkpointer's
            # keep_last instead (mpitailor prune's rules), applied once the save is published.
            limit, self.args.save_total_limit = self.args.save_total_limit, None
            try:
                super(LayerwiseTrainer, self)._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = limit

        self._layerwise._save_with(
            out / f"global_step{self.state.global_step}", full,
            lambda layers, lineage: self._save_partial(out, layers, lineage),
            prepare=lambda: fresh_save_dir(self.deepspeed, out))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Late in a full save (Trainer._save_checkpoint): ZeRO-3's DeepSpeed files, `latest`
        # included, may be whole by now (save_model writes them), HF's trainer state is not.
        failpoints.hit("full-save", Path(output_dir).name)
        super()._save_optimizer_and_scheduler(output_dir)

    def _save_partial(self, out: Path, layers, lineage) -> None:
        """A partial checkpoint-N; on failure, nothing of it is left (it had no `latest`)."""
        created = not out.exists()
        try:
            self._write_partial(out, layers, lineage)
        except BaseException:
            if self.args.should_save and created:
                shutil.rmtree(out, ignore_errors=True)
            raise

    def _write_partial(self, out: Path, layers, lineage) -> None:
        tag = f"global_step{self.state.global_step}"
        if self.args.should_save:
            out.mkdir(parents=True, exist_ok=True)
            self.model.config.save_pretrained(out)
            # What a full checkpoint-N holds besides the weights, so that a composite whose
            # base is this save carries it too: the generation config (as save_pretrained
            # writes it) and DeepSpeed's recovery scripts (as save_checkpoint copies them).
            if self.model.can_generate() and getattr(self.model, "generation_config", None):
                self.model.generation_config.save_pretrained(out)
            self.deepspeed._copy_recovery_script(str(out))
            self.state.save_to_json(str(out / "trainer_state.json"))
            torch.save(self.args, out / "training_args.bin")
            if self.lr_scheduler is not None and not isinstance(
                    self.lr_scheduler, DeepSpeedSchedulerWrapper):  # as Trainer does
                torch.save(self.lr_scheduler.state_dict(), out / "scheduler.pt")
        self.accelerator.wait_for_everyone()
        self._save_rng_state(str(out))
        world = self.args.world_size
        sync_loop_files(self.deepspeed, out, "rng_state.pth" if world <= 1
                        else f"rng_state_{self.args.process_index}.pth")
        # `latest` last, once the tag dir is published (by the writer, if asynchronous);
        # whole or not at all (a crash while it is written leaves no half of a name)
        self._layerwise.save_partial(tag, layers, lineage, save_dir=out,
                                     on_published=lambda: publish_file(out / LATEST,
                                                                       tag.encode()))
