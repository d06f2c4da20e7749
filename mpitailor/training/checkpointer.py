"""Selective layer-wise checkpointing for a plain DeepSpeed training loop.

    ckpt = LayerwiseCheckpointer(engine, "ckpts", Parity(full_every=8), stats="stats.h5")
    for step in ...:
        ...
        if step % 100 == 0:
            ckpt.save()        # full or partial, as the policy says; collective

With `asynchronous=True`, a partial save blocks training only while the chosen layers'
slices are copied to host buffers (allocated once, reused; `max_host_bytes` bounds them);
a background writer writes, fsyncs and publishes it while training goes on. One save is in
flight at a time: the next `save()` waits for it, and `wait()` (call it when training ends)
waits for the last one. A save that failed in the background raises PartialSaveFailed at
the next `save()` or `wait()`, on every rank; it was never published. Full saves are
DeepSpeed's own, synchronous.

Recover with `python -m mpitailor recover ckpts -o merged` and resume with
`engine.load_checkpoint("merged")`. A new checkpointer (after a resume) starts a new chain
with a full save: every save records its chain and the save it builds on (a lineage), so
`recover` never mixes the saves of an abandoned timeline into a new one.
Collective: every method is called on every rank.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from mpitailor.errors import UserError
from mpitailor.formats.files import PARTIAL_MANIFEST, SAVE_RECORD, Lineage
from mpitailor.planning.layers import LayerClassifier, layer_index
from mpitailor.publish.staging import fsync_dir, write_synced
from mpitailor.training.distcomm import training_comm
from mpitailor.training.partial_save import all_slices_elements, save_leader, take
from mpitailor.training.policies import Decision, Policy
from mpitailor.training.snapshot import write
from mpitailor.training.stats import StatsLog, UpdateTracker, model_layer_keys
from mpitailor.training.writer import BackgroundWriter


class LayerwiseCheckpointer:
    def __init__(self, engine, save_dir: str | os.PathLike, policy: Policy,
                 stats: str | os.PathLike | None = None,
                 layer_patterns: Mapping[str, str] | None = None,
                 asynchronous: bool = False, max_host_bytes: int | None = None) -> None:
        """layer_patterns: `{regex: layer key}` for parameter names the built-in rules do not
        know (see `mpitailor.planning.layers`); recorded in every save, so `recover` needs no
        flag. asynchronous: write partial saves in the background (above); max_host_bytes:
        refuse (UserError, every rank) a save whose slices need more host buffer than this."""
        self.engine, self.save_dir, self.policy = engine, save_dir, policy
        refuse_unsupported(engine)
        classify = LayerClassifier(layer_patterns)
        self.keys = model_layer_keys(engine, classify)
        refuse_no_layers(engine, self.keys)
        policy.validate(self.keys)
        self.tracker = UpdateTracker(engine, classify) if (policy.needs_stats or stats) else None
        self.classify = classify
        self.log = StatsLog(stats, self.keys) if stats and engine.global_rank == 0 else None
        self.save_index = 0
        self.staleness = {k: 0 for k in self.keys}
        self.last: dict | None = None
        self.lineage: Lineage | None = None  # of the last save (rank 0's is what counts)
        self.writer = BackgroundWriter(max_host_bytes, all_slices_elements(engine)) \
            if asynchronous else None
        self.timings: list[dict] = []  # per save: seconds blocked, waited, in the background

    def decide(self) -> Decision:
        """Collective (measures updates when tracking): what the next save writes."""
        self.last = self.tracker.measure() if self.tracker else None
        rel = {k: v["relative_update"] for k, v in self.last.items()} if self.last else None
        return self.policy.decide(self.save_index, self.keys, rel, self.staleness)

    def next_lineage(self, decision: Decision) -> Lineage:
        """Collective: the lineage of the save about to be written (a full save starts a
        chain); rank 0's save id on every rank, so that every node's copy of a save's
        manifest (node-local storage) records the same lineage."""
        save_id = agreed_save_id()
        if decision.full or self.lineage is None:
            return Lineage(save_id, save_id, None)
        return Lineage(save_id, self.lineage.chain, self.lineage.save_id)

    def record(self, decision: Decision, lineage: Lineage | None = None,
               tag_dir: str | os.PathLike | None = None, blocked: float = math.nan,
               waited: float = 0.0) -> None:
        """After a save: staleness, snapshots and the stats log. For a full save, rank 0
        also writes its lineage record into the tag dir (DeepSpeed's files are complete).
        blocked: seconds training stood still for it; waited: of those, for the save before."""
        if lineage is not None:
            if decision.full and self.engine.global_rank == 0:
                write_save_record(Path(tag_dir), lineage, self.engine.global_steps,
                                  self.classify.patterns)
            self.lineage = lineage
        for k in self.keys:
            self.staleness[k] = 0 if k in decision.layers else self.staleness[k] + 1
        if self.tracker:
            self.tracker.mark_saved(decision.layers)
        if self.log:
            self.log.append(self.engine.global_steps, decision.full, set(decision.layers),
                            self.last, blocked=blocked, waited=waited)
        self.timings.append({"step": self.engine.global_steps, "full": decision.full,
                             "blocked": blocked, "waited": waited, "background": math.nan,
                             "host_bytes": self.writer.host.nbytes if self.writer else 0})
        self.save_index += 1

    def save(self, tag: str | None = None, client_state: dict | None = None) -> Decision:
        """Collective: a full DeepSpeed save or a partial one, as the policy decides."""
        t0 = time.perf_counter()
        waited = self.wait()
        tag = tag or f"global_step{self.engine.global_steps}"
        decision = self.decide()
        lineage = self.next_lineage(decision)
        if decision.full:
            self._drop_partial(tag)
            self.engine.save_checkpoint(self.save_dir, tag=tag, client_state=client_state or {})
        else:
            self.save_partial(tag, decision.layers, lineage, client_state)
        self.record(decision, lineage, Path(self.save_dir) / tag,
                    blocked=time.perf_counter() - t0, waited=waited)
        return decision

    def save_partial(self, tag: str, layers, lineage: Lineage | None,
                     client_state: dict | None = None, save_dir: str | os.PathLike | None = None,
                     on_published=None) -> None:
        """Collective: a partial save of `layers`, now or (asynchronous) in the background.
        on_published: run by the save's leaders once it is published (HF's `latest`)."""
        save_dir = self.save_dir if save_dir is None else save_dir
        if self.writer is None:
            write(take(self.engine, save_dir, tag, layers, client_state, self.classify,
                       lineage, on_published=on_published), training_comm())
            return
        self.wait()
        self.writer.start(take(self.engine, save_dir, tag, layers, client_state,
                               self.classify, lineage, host=self.writer.host,
                               on_published=on_published))

    def wait(self) -> float:
        """Collective: wait for the save in flight (asynchronous saves); seconds waited.
        Raises PartialSaveFailed, on every rank, if it failed."""
        if self.writer is None or not self.writer.busy:
            return 0.0
        row = len(self.timings) - 1
        snap = self.writer.join()
        if row >= 0:
            self.timings[row]["background"] = snap.seconds["background"]
            if self.log:
                self.log.set(row, "background_s", snap.seconds["background"])
        return snap.seconds["waited"]

    def _drop_partial(self, tag: str) -> None:
        """A full save over an older partial checkpoint of the same tag (training resumed
        from an older save) must not leave the partial's files and manifest beside it."""
        stale = Path(self.save_dir) / tag
        if save_leader(self.engine) and (stale / PARTIAL_MANIFEST).exists():
            shutil.rmtree(stale)
        if dist.is_initialized():
            dist.barrier()


def agreed_save_id() -> str:
    """Collective: a fresh id, rank 0's on every rank."""
    box = [uuid.uuid4().hex]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def refuse_unsupported(engine) -> None:
    """Layer-wise saving reads ZeRO's partitioned fp32 buffers: refuse any other engine
    when the checkpointer is made, not at its first partial save."""
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") \
        else None
    if stage not in (1, 2, 3):
        raise UserError(f"layer-wise saving needs DeepSpeed ZeRO (stage 1, 2 or 3); this "
                        f"engine runs stage {stage}. Enable zero_optimization, or save with "
                        f"engine.save_checkpoint")
    if stage in (1, 2) and not hasattr(engine.optimizer, "single_partition_of_fp32_groups"):
        raise UserError(f"layer-wise saving at ZeRO stage {stage} reads DeepSpeed's ZeRO "
                        f"optimizer; this engine runs {type(engine.optimizer).__name__} "
                        f"(bf16 with fp32 gradient accumulation at stage 1): use "
                        f"data_types.grad_accum_dtype bf16, or stage 2 or 3")


def refuse_no_layers(engine, keys: list[str]) -> None:
    """A classifier that finds no decoder layers would make every 'partial' save a full one
    under the key `other`: refuse, showing a parameter name to write a pattern for."""
    if any(layer_index(k) is not None for k in keys):
        return
    names = [n for g in engine._get_zero_param_shapes() for n in g]
    sample = next((n for n in names if any(c.isdigit() for c in n)), names[0] if names else "")
    raise UserError(f"no decoder layers recognised in the parameter names (e.g. {sample!r}); "
                    f"pass layer_patterns={{r'<regex with (\\d+) for the layer number>': "
                    f"'layers.{{i}}'}} (see recipes/layer-patterns.yml)")


def write_save_record(tag_dir: Path, lineage: Lineage, global_steps: int,
                      layer_patterns: dict[str, str]) -> None:
    """Rank 0: the lineage of a full save, beside DeepSpeed's files (which ignore it), and
    the layer patterns the run saves with."""
    record = {"format": "mpitailor-save", **lineage.to_json(), "global_steps": global_steps,
              "layer_patterns": layer_patterns}
    tmp = tag_dir / f".{SAVE_RECORD}.tmp"
    if tmp.exists():
        tmp.unlink()
    write_synced(tmp, json.dumps(record, indent=2).encode())
    os.replace(tmp, tag_dir / SAVE_RECORD)
    fsync_dir(tag_dir)
