"""Layer-wise saves in an Accelerate loop (an `Accelerator` with a DeepSpeed ZeRO plugin).

    model, optimizer = accelerator.prepare(model, optimizer)
    if resuming:
        accelerator.load_state(recover_for_resume("run"))   # composite of the newest saves
    ckpt = AccelerateCheckpointer(accelerator, "run", Parity())
    ...
        ckpt.save()                 # collective: run/checkpoint-N (N: the global step)

Every save is a directory laid out as `accelerator.save_state(dir)` lays one out, so that
`load_state` reads a recovered composite as it reads its own saves: DeepSpeed's tag dir
`pytorch_model/`, `latest`, and Accelerate's own files (`random_states_{i}.pkl`, which also
holds Accelerate's step counter; `scheduler.bin` for a scheduler DeepSpeed does not own;
samplers; `scaler.pt`; `custom_checkpoint_{i}.pkl` of `register_for_checkpointing`). A full
save is `accelerator.save_state` itself. A partial save writes Accelerate's files as
save_state does, with Accelerate's own functions, then the chosen layers as a partial tag dir,
and `latest` last: a `checkpoint-N/` without `latest` is an interrupted save, which
`recover` skips. A merge carries Accelerate's files of its base (the newest save) as bytes.
Collective: every method is called on every rank.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from mpitailor.training import dependencies

with dependencies(__name__):
    from accelerate.checkpointing import save_accelerator_state, save_custom_state
    from accelerate.utils import MODEL_NAME, DeepSpeedSchedulerWrapper

from mpitailor import failpoints
from mpitailor.errors import UserError
from mpitailor.facade import publish_file
from mpitailor.formats.zero import LATEST, Lineage
from mpitailor.training.checkpointer import LayerwiseCheckpointer, fresh_save_dir
from mpitailor.training.policies import Decision, Policy
from mpitailor.training.recorded_save import sync_loop_files

SAVE_PREFIX = "checkpoint-"  # as HF's: recover names, orders and reports them alike


class AccelerateCheckpointer(LayerwiseCheckpointer):
    def __init__(self, accelerator, save_dir: str | os.PathLike, policy: Policy,
                 stats: str | os.PathLike | None = None,
                 layer_patterns: Mapping[str, str] | None = None,
                 asynchronous: bool = False, max_host_bytes: int | str | None = None,
                 keep_last: int | None = None) -> None:
        """As LayerwiseCheckpointer's arguments, with the Accelerator (after `prepare`)
        in place of the engine."""
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        if wrapped is None:
            raise UserError("AccelerateCheckpointer needs an Accelerator with a DeepSpeed "
                            "plugin (Accelerator(deepspeed_plugin=...)), made before it and "
                            "after accelerator.prepare(model, optimizer, ...)")
        if accelerator.project_configuration.automatic_checkpoint_naming:
            raise UserError("AccelerateCheckpointer names its saves itself (SAVE_DIR/"
                            "checkpoint-N): make the Accelerator without ProjectConfiguration("
                            "automatic_checkpoint_naming=True)")
        super().__init__(wrapped.engine, save_dir, policy, stats, layer_patterns,
                         asynchronous, max_host_bytes, keep_last)
        self.accelerator = accelerator

    def save(self, tag: str | None = None, client_state: dict | None = None) -> Decision:
        """Collective: SAVE_DIR/checkpoint-N (N: the engine's global step), full or partial
        as the policy decides. A save of the same N left by an abandoned timeline is replaced.
        Accelerate's save takes no client state: register objects with
        `accelerator.register_for_checkpointing` instead."""
        if tag is not None or client_state:
            raise UserError("AccelerateCheckpointer.save() takes no tag or client_state: saves "
                            "are named checkpoint-N, and Accelerate keeps other state through "
                            "accelerator.register_for_checkpointing")
        out = Path(self.save_dir) / f"{SAVE_PREFIX}{self.engine.global_steps}"

        def full() -> None:
            failpoints.hit("full-save", out.name)
            self.accelerator.save_state(str(out))

        def partial(layers: frozenset[str], lineage: Lineage) -> None:
            self._save_accelerate_files(out)
            sync_loop_files(self.engine, out,
                            f"random_states_{self.accelerator.state.process_index}.pkl")
            self.save_partial(MODEL_NAME, layers, lineage, save_dir=out,
                              on_published=lambda: publish_file(out / LATEST,
                                                                MODEL_NAME.encode()))

        return self._save_with(out / MODEL_NAME, full, partial,
                               prepare=lambda: fresh_save_dir(self.engine, out, create=True))

    def _save_accelerate_files(self, out: Path) -> None:
        """What accelerator.save_state writes besides the DeepSpeed model, written by
        Accelerate's own functions (every rank its rng states; the main process the rest)."""
        acc = self.accelerator
        each_node = acc.project_configuration.save_on_each_node
        schedulers = [s for s in acc._schedulers if not isinstance(s, DeepSpeedSchedulerWrapper)]
        save_accelerator_state(str(out), [], [], schedulers, acc._dataloaders,
                               acc.state.process_index, acc.step, acc.scaler,
                               save_on_each_node=each_node)
        for i, obj in enumerate(acc._custom_objects):
            save_custom_state(obj, str(out), i, save_on_each_node=each_node)
        if self.engine.global_rank == 0:  # as DeepSpeed's save_checkpoint does in a full one
            self.engine._copy_recovery_script(str(out))
        acc.wait_for_everyone()
