"""Selective layer-wise checkpointing for a plain DeepSpeed training loop.

    ckpt = LayerwiseCheckpointer(engine, "ckpts", Parity(full_every=8), stats="stats.h5")
    for step in ...:
        ...
        if step % 100 == 0:
            ckpt.save()        # full or partial, as the policy says; collective

With `asynchronous=True`, a partial save hardly blocks training: the chosen layers' slices
are copied to host buffers (allocated at the first partial save for the largest one the
policy can make, reused; `max_host_bytes` bounds them) while the next step's forward and
backward run, and the engine's next optimizer step waits only if the copy is not done by
then (a step pre-hook of the optimizer DeepSpeed wraps: training/overlap.py; without one,
the copy blocks the save, as it once did); a background writer writes, fsyncs and
publishes it while training goes on. One save is in flight at a time: the next `save()`
waits for it (and says so, with the figures, when saves come faster than they are
written), and `wait()` (call it when training ends) waits for the last one. A save that
failed in the background raises PartialSaveFailed at the next `save()` or `wait()`, on every
rank; it was never published. Full saves are DeepSpeed's own, synchronous.

Recover with `python -m mpitailor recover ckpts -o merged` and resume with
`engine.load_checkpoint("merged")`. A new checkpointer (after a resume) starts a new chain
with a full save: every save records its chain and the save it builds on (a lineage), so
`recover` never mixes the saves of an abandoned timeline into a new one.
Collective: every method is called on every rank.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mpitailor import failpoints
from mpitailor.errors import UserError
from mpitailor.facade import (
    LayerClassifier,
    discard_dir,
    layer_index,
    publish_file,
)
from mpitailor.formats.zero import (
    ELEMENT,
    PARTIAL_MANIFEST,
    SAVE_RECORD,
    Lineage,
    SaveRecord,
)
from mpitailor.training.distcomm import agreed_save_id, training_comm
from mpitailor.training.overlap import StepGuard
from mpitailor.training.partial_save import save_leader, slice_elements_by_layer, take
from mpitailor.training.policies import Decision, Policy
from mpitailor.training.recorded_save import gathered_records, recording
from mpitailor.training.retention import check_keep_last, retain
from mpitailor.training.snapshot import PartialSaveFailed, host_bytes_limit, write
from mpitailor.training.stats import StatsLog, UpdateTracker, model_layer_keys
from mpitailor.training.writer import BackgroundWriter

log = logging.getLogger(__name__)
OUTPACED_S = 0.05  # a save that waits this long for the one before: saves outpace the writer


class LayerwiseCheckpointer:
    def __init__(self, engine, save_dir: str | os.PathLike, policy: Policy,
                 stats: str | os.PathLike | None = None,
                 layer_patterns: Mapping[str, str] | None = None,
                 asynchronous: bool = False, max_host_bytes: int | str | None = None,
                 keep_last: int | None = None) -> None:
        """layer_patterns: `{regex: layer key}` for parameter names the built-in rules do not
        know (see `mpitailor.planning.layers`); recorded in every save, so `recover` needs no
        flag. asynchronous: write partial saves in the background (above); max_host_bytes:
        refuse (UserError, every rank) a save whose slices need more host buffer than this:
        bytes, or a size string as --max-shard-size reads it ("2GB", "512MiB"), at least
        1 MiB (else UserError here).
        keep_last: after each published save, delete what the newest composite no longer
        needs, keeping the K newest saves (`mpitailor prune --keep-last K`; None: keep all)."""
        max_host_bytes = host_bytes_limit(max_host_bytes)  # before any collective
        self.keep_last = check_keep_last(keep_last)
        self.engine, self.save_dir, self.policy = engine, save_dir, policy
        refuse_unsupported(engine)
        classify = LayerClassifier(layer_patterns)
        self.keys = model_layer_keys(engine, classify)
        refuse_no_layers(engine, self.keys)
        policy.validate(self.keys)
        self.tracker = UpdateTracker(engine, classify) if (policy.needs_stats or stats) else None
        self.classify = classify
        self.stats = stats is not None  # every rank: the log wants every norm, every save
        self.log = StatsLog(stats, self.keys) if stats and engine.global_rank == 0 else None
        self.save_index = 0  # of the policy: published saves (a failed one does not count)
        self.staleness = {k: 0 for k in self.keys}
        self.last: dict | None = None
        self.lineage: Lineage | None = None  # of the last published save (rank 0's counts)
        # Host buffers are sized at the first partial save (_size_host_buffers), not here:
        # a run that never saves a partial one holds none.
        self.writer = BackgroundWriter(max_host_bytes) if asynchronous else None
        # the snapshot's copy overlapped with the next step: held before its optimizer step
        self.guard = StepGuard(engine) if asynchronous else None
        if asynchronous:
            _LIVE.add(self)  # end_cpu_training waits for its save in flight
            if not self.guard.installed and engine.global_rank == 0:
                log.info("asynchronous saves: %s wraps no torch optimizer to hook, so each "
                         "partial save's slices are copied to host buffers while training "
                         "waits, not during the next step", type(engine.optimizer).__name__)
        self._outpaced_at = -math.inf  # when saves last outpaced the writer (a warning)
        self._step_held = 0.0  # the guard's `waited` at the last save
        self.pending: Published | None = None  # the asynchronous save the writer holds
        self._host_sized = False
        self.timings: list[dict] = []  # per save: seconds blocked, waited, in the background

    def decide(self) -> Decision:
        """Collective: what the next save writes. Updates are measured only where needed: for
        the policy's choice (Adaptive's partial saves) and for the stats log (every save);
        rank 0 logs the attempt, with nothing saved yet."""
        full = self.policy.is_full(self.save_index)
        measure = self.tracker is not None and (self.stats or not full)
        self.last = self.tracker.measure(weights=self.stats) if measure else None
        rel = {k: v["relative_update"] for k, v in self.last.items()} if self.last else None
        decision = self.policy.decide(self.save_index, self.keys, rel, self.staleness)
        if self.log:
            self.log.attempt(self.engine.global_steps, decision.full, decision.layers,
                             self.last)
        return decision

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
               waited: float = 0.0, files: dict[str, dict] | None = None) -> None:
        """After the part of a save that blocks training. A full or synchronous save is
        published by now: the policy's state (save count, staleness), the lineage, the
        update statistics' saved copy and the log's `saved` follow it at once. An
        asynchronous one is in the writer's hands: they follow when `wait` finds it
        published, and never when it failed. For a full save, rank 0 also writes its lineage
        record into the tag dir (DeepSpeed's files are complete), with `files`: the records
        of DeepSpeed's files in it (recorded_save.py; None: not recorded).
        blocked: seconds training stood still for it; waited: of those, for the save before."""
        step = self.engine.global_steps
        if lineage is not None and decision.full and self.engine.global_rank == 0:
            write_save_record(Path(tag_dir), lineage, step, self.classify.patterns, files)
        self.timings.append({"step": step, "full": decision.full,
                             "blocked": blocked, "waited": waited, "background": math.nan,
                             "host_bytes": self.writer.host.nbytes if self.writer else 0})
        done = Published(decision, lineage, step)
        if not decision.full and self.writer is not None and self.writer.busy:
            self.pending = done
            if self.log:
                self.log.update(step, blocked_s=blocked, waited_s=waited)
            return
        if self.tracker:
            self.tracker.mark_saved(decision.layers)
        self._published(done, blocked_s=blocked, waited_s=waited)

    def _published(self, done: Published, **timings: float) -> None:
        """A save is published: the policy's state, the lineage and the log follow it."""
        if done.lineage is not None:
            self.lineage = done.lineage
        for k in self.keys:
            self.staleness[k] = 0 if k in done.decision.layers else self.staleness[k] + 1
        if self.log:
            self.log.update(done.step, saved=done.decision.layers, **timings)
        self.save_index += 1
        if self.keep_last is not None:
            retain(self.save_dir, self.keep_last)

    def save(self, tag: str | None = None, client_state: dict | None = None) -> Decision:
        """Collective: a full DeepSpeed save or a partial one, as the policy decides."""
        tag = tag or f"global_step{self.engine.global_steps}"

        def full() -> None:
            self._drop_partial(tag)
            failpoints.hit("full-save", tag)
            self.engine.save_checkpoint(self.save_dir, tag=tag, client_state=client_state or {})

        return self._save_with(
            Path(self.save_dir) / tag, full,
            lambda layers, lineage: self.save_partial(tag, layers, lineage, client_state))

    def _save_with(self, tag_dir: Path, full: Callable[[], None],
                   partial: Callable[[frozenset[str], Lineage], None],
                   prepare: Callable[[], None] | None = None) -> Decision:
        """Collective: one save, in the order every framework's checkpointer shares: wait
        for the save in flight, decide, agree the lineage, `prepare()` (the save's dir made
        ready; None: nothing to do), then the framework's own full save, `full()`, or its
        partial save of the chosen layers, `partial(layers, lineage)`, and record the save
        (tag_dir: its DeepSpeed tag dir, where a full save's lineage record goes). Blocked
        time counts from the wait on; a step that raises leaves the save unrecorded."""
        t0 = time.perf_counter()
        waited = self.wait()
        self._say_if_outpaced(waited)
        decision = self.decide()
        lineage = self.next_lineage(decision)
        if prepare is not None:
            prepare()
        files = None
        if decision.full:
            with recording(self.engine) as written:
                full()
            files = gathered_records(self.engine, written, tag_dir)
        else:
            partial(decision.layers, lineage)
        self.record(decision, lineage, tag_dir, blocked=time.perf_counter() - t0,
                    waited=waited, files=files)
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
        self._size_host_buffers()
        tracker = self.tracker
        snap = take(self.engine, save_dir, tag, layers, client_state, self.classify, lineage,
                    host=self.writer.host, on_published=on_published,
                    step_guard=self.guard)
        try:
            self.writer.start(snap, after=(lambda snap: tracker.mark_saved_from(snap.slices))
                              if tracker else None)
        except BaseException:
            self.guard.release()  # the copy never runs: the next step must not wait for it
            raise

    def _size_host_buffers(self) -> None:
        """At the first partial save: host buffers for the largest partial save the policy
        can make (within max_host_bytes), so that no later save grows them (a grown buffer's
        fresh pages fault under the copy that blocks training)."""
        if self._host_sized:
            return
        self._host_sized = True
        per_key = slice_elements_by_layer(self.engine, self.classify)
        sizes = {layers: sum(per_key.get(k, 0) for k in layers)
                 for layers in self.policy.partial_layer_sets(self.keys)}
        largest = max(sizes, key=sizes.get)
        host = self.writer.host
        host.reserve(sizes[largest])
        if self.engine.global_rank == 0:
            capped = host.nbytes < ELEMENT * sizes[largest]
            log.info("asynchronous saves: %.1f MiB of host buffers allocated on rank 0 at the "
                     "first partial save, for the largest partial save policy %s can make (fp32 "
                     "weights and both Adam moments of %d of %d layer keys)%s",
                     host.nbytes / 2**20, self.policy.name, len(largest), len(self.keys),
                     ", cut to max_host_bytes" if capped else "")

    def wait(self) -> float:
        """Collective: wait for the save in flight (asynchronous saves); seconds waited.
        Raises PartialSaveFailed, on every rank, if it failed."""
        if self.writer is None or not self.writer.busy:
            return 0.0
        row = len(self.timings) - 1
        done, self.pending = self.pending, None
        held, self._step_held = self.guard.waited - self._step_held, self.guard.waited
        try:
            snap = self.writer.join()
        except PartialSaveFailed:
            if done is not None and self.log:  # never published: its row stays unsaved
                self.log.update(done.step, saved=frozenset())
            raise
        background = snap.seconds["background"]
        if row >= 0:
            self.timings[row]["background"] = background
            self.timings[row]["step_held"] = held
        if done is not None:
            self._published(done, background_s=background, step_held_s=held)
        return snap.seconds["waited"]

    def _say_if_outpaced(self, waited: float) -> None:
        """Rank 0, at a save: a warning (at most one a minute) when it waited for the save
        before: saves come faster than the writer persists them, and training stands still."""
        if waited < OUTPACED_S or self.engine.global_rank != 0 or not self.timings:
            return
        now = time.monotonic()
        if now - self._outpaced_at < 60:
            return
        self._outpaced_at = now
        last = self.timings[-1]  # the save just waited for (wait() timed its write)
        step, background = last["step"], last["background"]
        log.warning("asynchronous saves come faster than they are written: the save of step "
                    "%s took %.2f s to write in the background, and the save of step %s waited "
                    "%.2f s for it while training stood still; save less often, or fewer layers "
                    "at a time", step, background, self.engine.global_steps, waited)

    def _drop_partial(self, tag: str) -> None:
        """A full save over an older partial checkpoint of the same tag (training resumed
        from an older save) must not leave the partial's files and manifest beside it."""
        stale = Path(self.save_dir) / tag
        if save_leader(self.engine) and (stale / PARTIAL_MANIFEST).exists():
            shutil.rmtree(stale)
        training_comm().barrier()


# The asynchronous checkpointers alive in this process (training/cpu.py's end waits for them).
_LIVE: weakref.WeakSet[LayerwiseCheckpointer] = weakref.WeakSet()


def saves_in_flight() -> list[tuple[LayerwiseCheckpointer, Path]]:
    """The live checkpointers whose writer holds a save, with that save's tag dir."""
    return [(c, c.writer.in_flight) for c in list(_LIVE)
            if c.writer is not None and c.writer.busy]


@dataclass(frozen=True, slots=True)
class Published:
    """What follows a save once it is published."""

    decision: Decision
    lineage: Lineage | None
    step: int


def fresh_save_dir(engine, out: Path, create: bool = False) -> None:
    """Collective: what an earlier save of the same name left in out (a killed save's files
    and staging dirs, or an abandoned timeline's save after a resume from an older step) is
    removed on every save leader's disk before this save writes there: its files must not mix
    with this save's. Renamed away first (leftovers.discard: a removal killed half-way leaves
    a `.NAME.mpitailor-discard` that `clean` takes). create: make out, empty."""
    if save_leader(engine):
        discard_dir(out)
        if create:
            out.mkdir(parents=True)
    training_comm().barrier()


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
                      layer_patterns: dict[str, str], files: dict[str, dict] | None) -> None:
    """Rank 0: the lineage of a full save, beside DeepSpeed's files (which ignore it), the
    layer patterns the run saves with, and the records of DeepSpeed's files (None: not
    recorded)."""
    publish_file(tag_dir / SAVE_RECORD,
                 SaveRecord(lineage, global_steps, layer_patterns, files).to_json())
