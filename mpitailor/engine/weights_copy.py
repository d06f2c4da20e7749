"""The cast units of the copy program: a rank's byte ranges of HF weights files (program's
WEIGHTS buffers), each tensor's fp32 elements read from the checkpoint its values come from
and written cast to the file's dtype through the copy engine (copyio.Copier.cast: read,
cast and CRC one chunk while the writer thread writes the one before).

A trainable parameter's elements are its fp32 master weights, read from the ranks that hold
them (byte ranges only); a frozen one's are its fragments in the model-states files, as
saved (cast to fp32 exactly, to be cast back). Tied aliases are not in the files, as
`save_pretrained` leaves them out. Every source is read where every rank sees it: an export
of node-local sources is made on one node, from copies (jobs/export_nodes.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

from mpitailor.formats.zero import CheckpointMeta, Shard, Slot, read_range
from mpitailor.planning import program
from mpitailor.planning.hf_layout import FileTensor, OutFile, WeightsPlan, runs
from mpitailor.planning.plan import MergePlan


@dataclass(frozen=True)
class Weights:
    """HF weights files to write, by plan, and where each tensor's values come from. One or
    more plans (a merge's rebuilt 16-bit weights and its `--export hf`), each in its folder
    under the output dir ("" for the dir itself); every plan holds the same tensors."""

    plans: tuple[tuple[str, WeightsPlan], ...]  # (folder, plan)
    metas: dict[str, CheckpointMeta]  # key -> checkpoint: every one the export may read
    source_of: dict[str, str]         # tensor -> its checkpoint's key
    slots: dict[str, dict[str, Slot]]  # key -> its trainable parameters by name

    @classmethod
    def of(cls, plan: WeightsPlan, meta: CheckpointMeta,
           sources: dict[str, CheckpointMeta] | None = None, folder: str = "") -> Weights:
        """The weights of `plan` from `meta`, or per tensor from sources[name] where given
        (checkpoints keyed by their path)."""
        sources = sources or {}
        metas = {str(m.path): m for m in [meta, *sources.values()]}
        names = [p.name for f in plan.files for p in f.pieces]
        return cls(((folder, plan),), metas,
                   {n: str(sources.get(n, meta).path) for n in names},
                   {key: m.layout.by_name() for key, m in metas.items()})

    @classmethod
    def of_merge(cls, plans: list[tuple[str, WeightsPlan]], merge: MergePlan) -> Weights:
        """The weights of `plans`, each tensor from the merge's source it takes its values
        from (keyed by the merge's source names, as the merge's own buffers are: one
        program reads each source shard once)."""
        metas = dict(merge.sources)
        return cls(tuple(plans), metas, dict((*merge.param_source, *merge.frozen_source)),
                   {key: m.layout.by_name() for key, m in metas.items()})

    def buffers(self, first_unit: int = 0) -> tuple[program.Buffer, ...]:
        """The copy program's buffers of every file, units from first_unit on."""
        out: list[program.Buffer] = []
        for folder, plan in self.plans:
            out += program.weights_buffers(plan, first_unit + len(out), folder)
        return tuple(out)

    @cached_property
    def files(self) -> dict[str, tuple[WeightsPlan, OutFile]]:
        """Every file, with its plan, by its path under the output dir (its buffer's
        `param`)."""
        return {program.weights_name(folder, f.name): (plan, f)
                for folder, plan in self.plans for f in plan.files}

    def runs(self, b: program.Buffer, t: program.Task) -> list[tuple[FileTensor, int, int]]:
        """Task t's elements of file b, by tensor: [(tensor, first, end element)]."""
        plan, f = self.files[b.param]
        size = plan.itemsize
        return runs(f, size, t.lo // size, t.hi // size)

    def open_all(self, get: Callable[[str, int], Shard]) -> None:
        """Open every rank of every checkpoint (in order: a damaged one is met, and named,
        by every rank that writes)."""
        for key, meta in self.metas.items():
            for r in range(meta.world_size):
                get(key, r)

    def records_read(self, ps, used: dict[tuple[str, int], set[tuple[str, int]]]) -> None:
        """Add to `used` ((checkpoint, rank) -> {(kind, sub-group)}) every fp32 record the
        ranges `ps` of a task read a slice of (merge --verify checks them whole against their
        CRC); a frozen tensor is read from the model states, which were loaded (and so
        checked) whole."""
        for piece, lo, hi in ps:
            key = self.source_of[piece.name]
            meta = self.metas[key]
            slot = self.slots[key].get(piece.name)
            if slot is None:
                continue
            for r in range(meta.world_size):
                _, first, n = meta.layout.held(slot, r)
                if max(lo, first) < min(hi, first + n):
                    used.setdefault((key, r), set()).add(("fp32", slot.subgroup))

    def write(self, copier, get: Callable[[str, int], Shard], b: program.Buffer, ps,
              out: int, at: int) -> int:
        """The ranges `ps` of one task of file b, cast, into output fd `out` from byte `at`
        on; the CRC-32 of the bytes written."""
        plan, _ = self.files[b.param]
        crc = 0
        for piece, lo, hi in ps:
            key = self.source_of[piece.name]
            meta = self.metas[key]
            shards = [get(key, r) for r in range(meta.world_size)]
            fill = _reader(shards, self.slots[key].get(piece.name), piece.name)
            crc = copier.cast(fill, lo, hi, plan.dtype, out, at, crc)
            at += (hi - lo) * plan.itemsize
        return crc


def _reader(shards: Sequence[Shard], slot: Slot | None, name: str
            ) -> Callable[[int, object], None]:
    """fill(first, into) for Copier.cast: elements of parameter `name` (flattened) from
    `first` on into the float32 array `into`."""
    if slot is None:
        return lambda lo, into: _frozen_range(shards, name, lo, into)
    return lambda lo, into: read_range(shards, slot, "fp32", lo, into)


def _frozen_range(shards: Sequence[Shard], name: str, a: int, into) -> None:
    from mpitailor.formats.torch import cast
    b, pos = a + into.size, 0
    for s in shards:  # the fragments in rank order, padded at the end (open_shard checked)
        frag = s.model["frozen_param_fragments"][name]
        x, y = max(a, pos), min(b, pos + frag.numel())
        if x < y:
            bits = frag.raw(x - pos, y - x) if frag.is_contiguous() \
                else frag.values()[x - pos: y - pos]  # a slice of a wider buffer, saved so
            cast(bits, frag.dtype, "fp32", out=into[x - a: y - a])
        pos += frag.numel()
    if pos < b:
        raise RuntimeError(f"internal error: frozen parameter {name}: elements {pos}-{b} "
                           f"held by no fragment")
