"""Selective layer-wise checkpointing for an FSDP2 training loop that saves with PyTorch
Distributed Checkpoint (DCP), as torchtitan and a plain `fully_shard` loop do.

    ckpt = DcpCheckpointer(model, optimizer, "ckpts", Parity(full_every=4))
    for step in ...:
        ...
        if step % 100 == 0:
            ckpt.save(step, extra={"train_state": ...})   # collective

Every save is a DCP checkpoint `ckpts/step-<step>/`, written by DCP's own `dcp.save` of
`get_state_dict`'s `{"model": ..., "optim": ...}` (and `extra`, the trainer's own entries,
saved whole every time): a full save holds every entry; a partial save the chosen layers'
weights and optimizer state (`model.<param>`, `optim.state.<param>.*`) and everything
outside the parameters. Each is written into a staging dir, its files read back and
fsynced, and published by rename with its record (`mpitailor_save.json`: lineage, step,
layers, every file's size and CRC-32) written last: a save killed at any point is absent,
never half there. The policies are the ZeRO checkpointer's (Parity, Filter, Adaptive).

With `asynchronous=True`, `save()` returns once the save's tensors are staged into host
memory by DCP's stager; a background thread writes, checks and publishes it (dcp_async.py:
which collectives run where). One save is in flight at a time: the next `save()` and
`wait()` wait for it, and raise its failure (PartialSaveFailed, every rank) instead of going
on; it was never published. `stats=` logs every save as the ZeRO checkpointer's StatsLog.

Resume at any world size with `recover_for_resume("ckpts")`, which assembles the newest copy
of every layer into a DCP checkpoint (`mpitailor recover ckpts -o merged` does the same
from the command line), then `load_dcp(model, optimizer, path)`. A new checkpointer (after
a resume) starts a new chain with a full save.
Collective: every method is called on every rank.
"""
from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mpitailor.errors import UserError
from mpitailor.facade import Comm, LayerClassifier, layer_index, publishing
from mpitailor.formats.dcp import DcpSaveRecord
from mpitailor.formats.io import synced_record
from mpitailor.formats.manifest import Lineage
from mpitailor.training import dcp_state
from mpitailor.training.dcp_async import DcpWriter
from mpitailor.training.distcomm import agreed_save_id, sum_over_ranks, training_comm
from mpitailor.training.policies import Decision, Policy
from mpitailor.training.retention import check_keep_last, retain
from mpitailor.training.snapshot import PartialSaveFailed, agree
from mpitailor.training.stats import StatsLog

log = logging.getLogger(__name__)
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


class DcpCheckpointer:
    def __init__(self, model, optimizer, save_dir: str | os.PathLike, policy: Policy,
                 layer_patterns: Mapping[str, str] | None = None, options=None,
                 asynchronous: bool = False, stats: str | os.PathLike | None = None,
                 name_prefix: str = "step-", keep_last: int | None = None) -> None:
        """layer_patterns: `{regex: layer key}` for parameter names the built-in rules do not
        know, recorded in every save. options: the `StateDictOptions` the loop's
        `get_state_dict` takes (e.g. `flatten_optimizer_state_dict=True`, torchtitan's).
        asynchronous: `save()` returns once the state is staged in host memory; the write
        and the publish run in the background (dcp_async.py). stats: the HDF5 log of every
        save's update statistics and timings (rank 0; training/stats.py's StatsLog, which
        `mpitailor plot` reads). name_prefix: a save's dir is save_dir/<name_prefix><step>
        (torchtitan's `step-`; the Accelerate and HF Trainer checkpointers name theirs
        `checkpoint-`, as HF does). keep_last: after each published save, delete what the
        newest composite no longer needs, keeping the K newest saves (`mpitailor prune
        --keep-last K`; None: keep all)."""
        self.keep_last = check_keep_last(keep_last)
        self.model, self.optimizer, self.policy = model, optimizer, policy
        self.save_dir, self.options = Path(save_dir), options
        self.name_prefix = name_prefix
        self.classify = LayerClassifier(layer_patterns)
        self.keys = _layer_keys(dcp_state.model_entry_names(model), self.classify)
        policy.validate(self.keys)
        self.stats = stats is not None  # every rank: the log wants every norm, every save
        self.tracker = _Updates(model, self.classify, self.keys) \
            if policy.needs_stats or self.stats else None
        self.log = StatsLog(stats, self.keys) if stats and training_comm().rank == 0 \
            else None
        self.save_index = 0  # published saves (a failed one does not count)
        self.staleness = {k: 0 for k in self.keys}
        self.lineage: Lineage | None = None  # of the last published save
        self.writer = DcpWriter() if asynchronous else None  # collective: its own group
        self.pending: _Published | None = None  # the save the writer holds
        self.timings: list[dict] = []  # per save: seconds blocked, waited, in the background

    def save(self, step: int, extra: Mapping | None = None) -> Decision:
        """Collective: a full or partial save of this step into save_dir/step-<step>, as the
        policy decides; published when it returns, or (asynchronous) once the background has
        written it. Waits for the save in flight first, and raises its failure
        (PartialSaveFailed, every rank) instead of saving: nothing of it was published.
        Raises PartialSaveFailed (every rank) if any rank failed to write this one
        (synchronous); nothing is published then."""
        t0 = time.perf_counter()
        waited = self.wait()
        full = self.policy.is_full(self.save_index)
        measured = self.tracker.measure(weights=self.stats) \
            if self.tracker is not None and (self.stats or not full) else None
        rel = {k: v["relative_update"] for k, v in measured.items()} if measured else None
        decision = self.policy.decide(self.save_index, self.keys, rel, self.staleness)
        if self.log:
            self.log.attempt(step, decision.full, decision.layers, measured)
        save_id = agreed_save_id()
        lineage = Lineage(save_id, save_id, None) if decision.full or self.lineage is None \
            else Lineage(save_id, self.lineage.chain, self.lineage.save_id)
        state = dcp_state.full_state(self.model, self.optimizer, self.options, extra)
        if not decision.full:
            state = dcp_state.chosen_part(state, decision.layers, self.classify)
        record = DcpSaveRecord(lineage, step, None if decision.full else decision.layers,
                               self.classify.patterns, {})
        final = self.save_dir / f"{self.name_prefix}{step}"
        # the weights as this save holds them, for the update measure once it is published
        done = _Published(decision, lineage, step, self.tracker.copy(decision.layers)
                          if self.tracker is not None else None)
        if self.writer is None:
            _publish(final, state, record, training_comm(), None)
            blocked = time.perf_counter() - t0
            self.timings.append({"step": step, "full": decision.full, "blocked": blocked,
                                 "waited": 0.0, "background": math.nan})
            self._published(done, blocked_s=blocked, waited_s=0.0)
            return decision
        # agreed (one small allgather on training's group): a rank that cannot stage (host
        # memory) must not leave the others' writers waiting in a collective for it
        staged = agree(training_comm(), dcp_state.stage, state, self.writer.stager)
        self.writer.start(str(final), lambda comm, group: _publish(final, staged, record, comm,
                                                                   group))
        self.pending = done
        blocked = time.perf_counter() - t0
        self.timings.append({"step": step, "full": decision.full, "blocked": blocked,
                             "waited": waited, "background": math.nan})
        if self.log:
            self.log.update(step, blocked_s=blocked, waited_s=waited)
        return decision

    def wait(self) -> float:
        """Collective: wait for the save in flight (asynchronous saves; call it when training
        ends); seconds waited. Raises PartialSaveFailed, on every rank, if it failed: it was
        never published, and the policy goes on as if it had not been tried."""
        if self.writer is None or not self.writer.busy:
            return 0.0
        done, self.pending = self.pending, None
        try:
            waited = self.writer.join()
        except PartialSaveFailed:
            if self.log:  # never published: its row stays unsaved
                self.log.update(done.step, saved=frozenset(),
                                background_s=self.writer.background)
            raise
        self.timings[-1]["background"] = self.writer.background
        self._published(done, background_s=self.writer.background)
        return waited

    def _published(self, done: _Published, **timings: float) -> None:
        """A save is published: the policy's state, the lineage, the update measure's saved
        copy and the log follow it."""
        self.lineage = done.lineage
        for k in self.keys:
            self.staleness[k] = 0 if k in done.decision.layers else self.staleness[k] + 1
        if self.tracker is not None:
            self.tracker.adopt(done.weights)
        if self.log:
            self.log.update(done.step, saved=done.decision.layers, **timings)
        self.save_index += 1
        if self.keep_last is not None:
            retain(self.save_dir, self.keep_last)


@dataclass(frozen=True, slots=True)
class _Published:
    """What follows a save once it is published."""

    decision: Decision
    lineage: Lineage
    step: int
    weights: dict | None  # the update measure's copy of the saved layers' local weights


def _publish(final: Path, state: dict, record: DcpSaveRecord, comm: Comm, group) -> None:
    """Collective over comm (DCP's save over group, the same ranks): state saved by DCP into
    a staging dir beside final, every rank's files read back and fsynced (their records),
    the record written last and the dir published by rename (replacing a save of the same
    step from an abandoned timeline)."""
    leader = comm.rank == 0
    with publishing(final, leader) as staging:
        agree(comm, lambda: staging.acquire(None) if leader else None)
        where = staging.dir
        try:
            dcp_state.save(state, where, group)
        except Exception as e:  # noqa: BLE001 - a rank's write failed: DCP raised it on every rank
            raise PartialSaveFailed(f"save not written: {e}") from None
        files = {k: v for part in comm.allgather(agree(comm, _records, where, comm.rank))
                 for k, v in part.items()}
        done = DcpSaveRecord(record.lineage, record.global_steps, record.layers,
                             record.layer_patterns, files)
        agree(comm, lambda: staging.commit(done) if leader else None)


def _records(where: Path, rank: int) -> dict:
    """This rank's data files (DCP names them `__<rank>_<n>.distcp`), and rank 0's
    `.metadata`: each read back and fsynced; their records."""
    names = [n for n in os.listdir(where) if (m := _RANK_FILE.fullmatch(n))
             and int(m.group(1)) == rank]
    if rank == 0:
        names.append(".metadata")
    return {n: synced_record(where / n) for n in sorted(names)}


def _layer_keys(names: list[str], classify) -> list[str]:
    keys = sorted({classify(n) for n in names}, key=_key_order)
    if not any(layer_index(k) is not None for k in keys):
        sample = next((n for n in names if any(c.isdigit() for c in n)), names[0] if names
                      else "")
        raise UserError(f"no decoder layers recognised in the parameter names (e.g. "
                        f"{sample!r}); pass layer_patterns={{r'<regex with (\\d+) for the "
                        f"layer number>': 'layers.{{i}}'}} (see recipes/layer-patterns.yml)")
    return keys


def _key_order(k: str) -> tuple:
    i = layer_index(k)
    return (0, i, "") if i is not None else (1, 0, k)


class _Updates:
    """Each layer's relative update since it was last saved, ||w - w_saved|| / ||w_saved||,
    over every rank's part (Adaptive's measure, and the stats log's); the saved copy is this
    rank's parts, fp32, taken when the save is made and adopted once it is published."""

    def __init__(self, model, classify, keys: list[str]) -> None:
        self.model, self.keys = model, keys
        self.key_of = {n: classify(n) for n in dcp_state.local_parameters(model)}
        self.saved: dict = {}

    def measure(self, weights: bool = True) -> dict[str, dict[str, float]]:
        """Collective. key -> {update_norm, weight_norm, relative_update}, as the ZeRO
        checkpointer's UpdateTracker gives them (relative_update inf and update_norm NaN
        before the layer's first save; weight_norm NaN unless `weights`)."""
        import torch
        sums = torch.zeros(3 * len(self.keys), dtype=torch.float64)
        at = {k: i for i, k in enumerate(self.keys)}
        seen = set()
        for n, t in dcp_state.local_parameters(self.model).items():
            i = at.get(self.key_of[n])
            if i is None:
                continue
            if weights:
                sums[3 * i + 1] += t.float().square().sum().double()
            if n in self.saved:
                seen.add(self.key_of[n])
                sums[3 * i] += (t.float() - self.saved[n]).square().sum().double()
                sums[3 * i + 2] += self.saved[n].square().sum().double()
        sum_over_ranks(sums)
        out = {}
        for k, i in at.items():
            u, w, p = (math.sqrt(x) for x in sums[3 * i: 3 * i + 3].tolist())
            # a layer some rank holds no part of is seen where another rank saved it: the
            # sums say, not this rank's parts
            known = p > 0 or k in seen
            out[k] = {"update_norm": u if known else math.nan,
                      "weight_norm": w if weights else math.nan,
                      "relative_update": u / p if p > 0 else math.inf}
        return out

    def copy(self, layers: frozenset[str]) -> dict:
        """This rank's parts of the layers' weights now (fp32 copies)."""
        return {n: t.float().clone() for n, t in dcp_state.local_parameters(self.model).items()
                if self.key_of[n] in layers}

    def adopt(self, weights: dict) -> None:
        """weights (a copy) are the saved ones now: the save that holds them is published."""
        self.saved.update(weights)
