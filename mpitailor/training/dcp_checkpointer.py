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
from collections.abc import Mapping
from pathlib import Path

from mpitailor.errors import UserError
from mpitailor.facade import LayerClassifier, layer_index, publishing
from mpitailor.formats.dcp import DcpSaveRecord
from mpitailor.formats.io import synced_record
from mpitailor.formats.manifest import Lineage
from mpitailor.training import dcp_state
from mpitailor.training.distcomm import agreed_save_id, sum_over_ranks, training_comm
from mpitailor.training.policies import Decision, Policy
from mpitailor.training.snapshot import PartialSaveFailed, agree

log = logging.getLogger(__name__)
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


class DcpCheckpointer:
    def __init__(self, model, optimizer, save_dir: str | os.PathLike, policy: Policy,
                 layer_patterns: Mapping[str, str] | None = None, options=None,
                 name_prefix: str = "step-") -> None:
        """layer_patterns: `{regex: layer key}` for parameter names the built-in rules do not
        know, recorded in every save. options: the `StateDictOptions` the loop's
        `get_state_dict` takes (e.g. `flatten_optimizer_state_dict=True`, torchtitan's).
        name_prefix: a save's dir is save_dir/<name_prefix><step> (torchtitan's `step-`;
        the Accelerate and HF Trainer checkpointers name theirs `checkpoint-`, as HF does)."""
        self.model, self.optimizer, self.policy = model, optimizer, policy
        self.save_dir, self.options = Path(save_dir), options
        self.name_prefix = name_prefix
        self.classify = LayerClassifier(layer_patterns)
        self.keys = _layer_keys(dcp_state.model_entry_names(model), self.classify)
        policy.validate(self.keys)
        self.tracker = _Updates(model, self.classify, self.keys) if policy.needs_stats else None
        self.save_index = 0
        self.staleness = {k: 0 for k in self.keys}
        self.lineage: Lineage | None = None

    def save(self, step: int, extra: Mapping | None = None) -> Decision:
        """Collective: a full or partial save of this step into save_dir/step-<step>, as the
        policy decides; published when it returns. Raises PartialSaveFailed (every rank) if
        any rank failed; nothing is published then."""
        rel = self.tracker.measure() if self.tracker is not None and \
            not self.policy.is_full(self.save_index) else None
        decision = self.policy.decide(self.save_index, self.keys, rel, self.staleness)
        save_id = agreed_save_id()
        lineage = Lineage(save_id, save_id, None) if decision.full or self.lineage is None \
            else Lineage(save_id, self.lineage.chain, self.lineage.save_id)
        state = dcp_state.full_state(self.model, self.optimizer, self.options, extra)
        if not decision.full:
            state = dcp_state.chosen_part(state, decision.layers, self.classify)
        record = DcpSaveRecord(lineage, step, None if decision.full else decision.layers,
                               self.classify.patterns, {})
        _publish(self.save_dir / f"{self.name_prefix}{step}", state, record)
        self.lineage = lineage
        for k in self.keys:
            self.staleness[k] = 0 if k in decision.layers else self.staleness[k] + 1
        if self.tracker is not None:
            self.tracker.mark_saved(decision.layers)
        self.save_index += 1
        return decision


def _publish(final: Path, state: dict, record: DcpSaveRecord) -> None:
    """Collective: state saved by DCP into a staging dir beside final, every rank's files
    read back and fsynced (their records), the record written last and the dir published
    by rename (replacing a save of the same step from an abandoned timeline)."""
    comm = training_comm()
    leader = comm.rank == 0
    with publishing(final, leader) as staging:
        agree(comm, lambda: staging.acquire(None) if leader else None)
        where = staging.dir
        try:
            dcp_state.save(state, where)
        except Exception as e:  # a rank's write failed: DCP raised it on every rank
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
    over every rank's part (Adaptive's measure); the saved copy is this rank's parts, fp32."""

    def __init__(self, model, classify, keys: list[str]) -> None:
        self.model, self.keys = model, keys
        self.key_of = {n: classify(n) for n in dcp_state.local_parameters(model)}
        self.saved: dict = {}

    def measure(self) -> dict[str, float]:
        import torch
        sums = torch.zeros(2 * len(self.keys), dtype=torch.float64)
        at = {k: i for i, k in enumerate(self.keys)}
        for n, t in dcp_state.local_parameters(self.model).items():
            i = at.get(self.key_of[n])
            if i is None or n not in self.saved:
                continue
            sums[2 * i] += (t.float() - self.saved[n]).square().sum().double()
            sums[2 * i + 1] += self.saved[n].square().sum().double()
        sum_over_ranks(sums)
        out = {}
        for k, i in at.items():
            u, w = math.sqrt(sums[2 * i]), math.sqrt(sums[2 * i + 1])
            out[k] = math.inf if w == 0 else u / w
        return out

    def mark_saved(self, layers: frozenset[str]) -> None:
        for n, t in dcp_state.local_parameters(self.model).items():
            if self.key_of[n] in layers:
                self.saved[n] = t.float().clone()
