"""One rank's files of a checkpoint, opened for byte-range reads and checked against rank 0.

`open_shard` gives a `Shard` (shard_protocol.py): a `RankShard` for a full checkpoint, a
`PartialShard` (partial_shard.py) for a partial one. In a full one the optimizer file is
parsed without reading its big buffers (see rawio.py); the fp32 master weights and both Adam
moments are then read slice by slice with `read_into`. The model-states file is small
(placeholders, shapes, counters); its tensors are read when their values are needed.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.io import open_regular, require_same
from mpitailor.formats.torch import Tensor, load, rawio, record_crcs, verify_records
from mpitailor.formats.zero.files import SAVE_RECORD
from mpitailor.formats.zero.frozen import check_frozen_fragments
from mpitailor.formats.zero.layout import ELEMENT, KINDS
from mpitailor.formats.zero.meta import CheckpointMeta
from mpitailor.formats.zero.names import check_model_names
from mpitailor.formats.zero.partial_shard import open_partial_shard
from mpitailor.formats.zero.read import flat_mappings_agree
from mpitailor.formats.zero.recorded import check_recorded
from mpitailor.formats.zero.shard_protocol import Shard

_CRC = re.compile(r"[0-9a-f]{8}")  # a record's CRC-32 as mpitailor writes it


@dataclass
class RankShard(Shard):
    """A full checkpoint's rank: model states (loaded) and the optim file, whose flat buffers
    are records of their own (read in place, each with its CRC in the zip)."""

    offsets: dict[tuple[str, int], int]  # (kind, sub-group) -> byte offset in the optim file
    _records: dict[int, tuple[int, int]] | None = field(default=None, repr=False)

    @property
    def data_path(self) -> Path:
        return self.meta.files.optim_path(self.rank)

    def byte_ranges(self, kind: str, g: int, start: int, n: int) -> list[tuple[int, int, int]]:
        return [(self.fd, self.offsets[kind, g] + start * ELEMENT, n * ELEMENT)]

    def whole_record(self, kind: str, g: int) -> tuple[int, int] | None:
        return self._crcs().get(self.offsets[kind, g])

    def verify(self, used: set[tuple[str, int]]) -> None:
        """Check the rank's files whole against the records its save wrote of them (a full
        save through mpitailor's checkpointers: SAVE_RECORD), else the records of these
        buffers against the CRCs in the zip (a save by DeepSpeed itself). The model-states
        file stages 1/2 share among all ranks is checked with rank 0's shard only."""
        wants = recorded_files(self.meta, self.rank)
        if wants is None:
            verify_records(self.data_path, self.fd, {self.offsets[k] for k in used},
                           self._crcs())
            return
        for path, want in wants:
            if path == self.data_path:
                checked = check_recorded(path, want, "full save", crc=True)
                require_same(self.fd, path, checked)  # what is copied is what was checked
            elif not self.meta.files.flat or self.rank == 0:
                check_recorded(path, want, "full save", crc=True)

    def _crcs(self) -> dict[int, tuple[int, int]]:
        """The optim file's records (record_crcs), its zip directory read once."""
        if self._records is None:
            self._records = record_crcs(self.data_path, self.fd)
        return self._records


def open_shard(meta: CheckpointMeta, rank: int) -> Shard:
    """Open rank `rank`'s files; raise CheckpointError if they disagree with rank 0's.

    A full checkpoint's rank is a `RankShard`, a partial checkpoint's a `PartialShard`."""
    if meta.files.partial:
        return open_partial_shard(meta, rank)
    model_path, optim_path = meta.files.model_path(rank), meta.files.optim_path(rank)
    model = load(model_path, opaque_ok=True)
    if rank != 0 and not meta.files.flat:  # stage 1/2: one model-states file for all ranks
        _check_model_agrees(meta, model, model_path)
    check_model_names(model_path, model)
    check_frozen_fragments(meta, model, model_path)
    # One descriptor for the load, the checks and the copy: what is copied is what was
    # checked, whatever the name stands for later (reopen() checks it is still this file).
    fd = open_regular(optim_path, "a ZeRO optim file", follow=True)
    try:
        optim = load(optim_path, fd=fd)
        if meta.layout.flat:
            _check_flat_rank(meta, optim, rank, optim_path)
        offsets = _flat_offsets(meta, optim, rank, os.fstat(fd).st_size, optim_path)
        flats = frozenset(id(flat_tensor(optim, kind, g, meta.layout.flat))
                          for kind, g in offsets)
        optim = rawio.copied(optim, fd, flats)
        if rank != 0:
            _check_same_save(meta, optim, optim_path)
        for path, want in recorded_files(meta, rank) or ():  # sizes: free, so always
            check_recorded(path, want, "full save", crc=False)
        return RankShard(meta, rank, model, optim, fd, offsets)
    except BaseException:
        os.close(fd)
        raise


def recorded_files(meta: CheckpointMeta, rank: int) -> list[tuple[Path, dict]] | None:
    """(path, record) of rank `rank`'s model-states and optim files, as the full save's
    SAVE_RECORD records them; None where it does not record the rank's optim file (a save
    by DeepSpeed itself; a rank of another node, where each node keeps its own files: rank
    0's record lists its node's). CheckpointError if it records that but not the model
    states, or either not as {bytes, crc32}: a damaged record is not a reason to check less."""
    records = dict(meta.file_records)
    paths = (meta.files.model_path(rank), meta.files.optim_path(rank))
    if paths[1].name not in records:
        return None
    record = meta.files.tag_dir / SAVE_RECORD
    out = []
    for path in paths:
        want = records.get(path.name)
        if not (isinstance(want, dict) and type(want.get("bytes")) is int
                and want["bytes"] >= 0 and isinstance(want.get("crc32"), str)
                and _CRC.fullmatch(want["crc32"])):
            raise CheckpointError(f"{record}: no record of {path.name} as {{bytes, crc32}}; "
                                  f"the save record is damaged (verify it: mpitailor verify "
                                  f"{meta.files.tag_dir})")
        out.append((path, want))
    return out


@contextmanager
def open_all_shards(meta: CheckpointMeta) -> Iterator[list[Shard]]:
    """Every rank's shard, in rank order; all closed on exit, also when one fails to open."""
    with ExitStack() as stack:
        yield [stack.enter_context(open_shard(meta, r)) for r in range(meta.world_size)]


def _check_model_agrees(meta: CheckpointMeta, model: dict, path) -> None:
    try:
        shapes = [{n: tuple(s) for n, s in g.items()} for g in model.get("param_shapes", [])]
    except (TypeError, AttributeError, ValueError):
        shapes = None  # malformed: cannot agree
    expect = [{s.name: s.shape for s in meta.layout.subgroup_slots(g)}
              for g in range(len(meta.layout.subgroup_sizes))]
    if shapes != expect or int(model.get("global_steps", -1)) != meta.global_steps:
        raise CheckpointError(f"{path}: disagrees with rank 0's model states "
                              f"(param_shapes or global_steps); files from different runs?")


def _check_same_save(meta: CheckpointMeta, optim: dict, path) -> None:
    """A rank's optimizer file belongs to the save rank 0's files describe: its Adam steps
    are rank 0's (DeepSpeed steps every sub-group on every rank together). A file copied in
    from another step would otherwise merge that step's weights and moments without a word."""
    try:
        osd = optim["optimizer_state_dict"]
        state = osd["base_optimizer_state" if meta.layout.flat else "optimizer_state_dict"]
        state = state["state"]
        steps = tuple(float(_scalar(state.get(g, {}).get("step", 0)))
                      for g in range(len(meta.subgroup_steps)))
    except (KeyError, TypeError, AttributeError, ValueError):
        raise CheckpointError(f"{path}: no Adam state where rank 0's file has one; files "
                              f"from different runs?") from None
    if steps != meta.subgroup_steps:
        g = next(i for i, (a, b) in enumerate(zip(steps, meta.subgroup_steps)) if a != b)
        raise CheckpointError(
            f"{path}: from another save: its Adam step is {steps[g]:g} where rank 0's files "
            f"(step {meta.global_steps}) have {meta.subgroup_steps[g]:g} (sub-group {g}); "
            f"put this save's own file back")


def _scalar(value) -> float:
    return value.item() if isinstance(value, Tensor) else value


def _check_flat_rank(meta: CheckpointMeta, optim: dict, rank: int, path) -> None:
    try:
        osd = optim["optimizer_state_dict"]
        mappings = osd.get("param_slice_mappings")
        counts = osd["partition_count"]
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{path}: not a DeepSpeed ZeRO stage 1/2 optim file") from None
    counts = counts if isinstance(counts, (list, tuple)) else [counts]
    if any(int(c) != meta.world_size for c in counts) or (
            mappings is not None and not flat_mappings_agree(mappings, meta.layout, rank)):
        raise CheckpointError(f"{path}: disagrees with rank 0's files (partition count or "
                              f"parameter placement); files from different runs?")


def flat_tensor(optim: dict, kind: str, g: int, flat: bool = False) -> Tensor:
    """Sub-group g's flat buffer of kind fp32/exp_avg/exp_avg_sq in a loaded optim dict
    (flat: a stage 1/2 file)."""
    osd = optim["optimizer_state_dict"]
    if kind == "fp32":
        return osd["single_partition_of_fp32_groups" if flat else "fp32_flat_groups"][g]
    return osd["base_optimizer_state" if flat else "optimizer_state_dict"]["state"][g][kind]


def without_flat_buffers(osd: dict) -> dict:
    """DeepSpeed's ZeRO optimizer state (the optim file's `optimizer_state_dict`, stage 3
    or 1/2) minus the fp32 flat groups and Adam moments: counters, loss scaler, param
    groups, steps."""
    flat = "base_optimizer_state" in osd
    fp32, inner_key = ("single_partition_of_fp32_groups", "base_optimizer_state") if flat \
        else ("fp32_flat_groups", "optimizer_state_dict")
    osd = {k: v for k, v in osd.items() if k != fp32}
    inner = dict(osd[inner_key])
    inner["state"] = {g: {"step": st["step"]} for g, st in inner["state"].items()}
    osd[inner_key] = inner
    return osd


def _adam_state(optim: dict, flat: bool) -> bool:
    """Does the optim file hold any Adam state? torch's Adam creates it at the first step,
    so a save made before that has an empty `state` (what `accelerator.save_state` before
    training writes); a damaged file is left to the checks that follow."""
    try:
        osd = optim["optimizer_state_dict"]
        state = osd["base_optimizer_state" if flat else "optimizer_state_dict"]["state"]
        return bool(state)
    except (KeyError, TypeError):
        return True


def _torch_name(dtype: str) -> str:
    """torch's spelling of a dtype, which messages name ("torch.bfloat16")."""
    return f"torch.{DTYPES[dtype].torch}"


def _flat_offsets(meta: CheckpointMeta, optim: dict, rank: int, size: int, path) -> dict:
    """Byte offset of every flat buffer, checked against the layout and the file size."""
    offsets = {}
    if meta.layout.subgroup_sizes and not _adam_state(optim, meta.layout.flat):
        raise CheckpointError(
            f"{path}: saved before the first optimizer step: it holds no Adam state "
            f"(exp_avg, exp_avg_sq), only the initial weights; save after at least one "
            f"training step, or take the initial weights from the model itself")
    try:
        for g in range(len(meta.layout.subgroup_sizes)):
            for kind in KINDS:
                n = meta.layout.buffer_size(kind, g, rank)
                t = flat_tensor(optim, kind, g, meta.layout.flat)
                if t.dtype != "fp32" or t.numel() != n:  # not a tensor: AttributeError
                    raise CheckpointError(
                        f"{path}: sub-group {g} {kind} is {_torch_name(t.dtype)} x "
                        f"{t.numel()}, expected float32 x {n}; files from different runs?")
                if not t.is_contiguous():  # read in place, one byte range: it must be one
                    raise CheckpointError(
                        f"{path}: sub-group {g} {kind} is a strided view (shape {t.shape}, "
                        f"stride {t.stride}), not a contiguous flat buffer as DeepSpeed saves "
                        f"it; save the file again with the buffer made contiguous "
                        f"(tensor.contiguous())")
                offsets[kind, g] = t.file_offset
                if offsets[kind, g] + n * ELEMENT > size:
                    raise CheckpointError(f"{path}: sub-group {g} {kind} lies past the end of "
                                          f"the file; the file is truncated")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise CheckpointError(f"{path}: optimizer state incomplete (sub-group buffers "
                              f"missing); not a DeepSpeed ZeRO-3 optim file") from None
    return offsets
