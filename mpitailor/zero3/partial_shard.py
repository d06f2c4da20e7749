"""One rank's part of a partial checkpoint, read with the same interface as `RankShard`.

A partial checkpoint stores, per rank, each saved parameter's slice (padding included) as
safetensors records `{kind}/{name}`. `read_into` serves a run of a sub-group's flat buffer
by walking the parameters that overlap it; asking for a parameter the checkpoint does not
hold is a bug in the plan, and says so.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from mpitailor.errors import CheckpointError
from mpitailor.zero3.files import PARTIAL_MANIFEST, CheckpointFiles, partial_files
from mpitailor.zero3.layout import Slot
from mpitailor.zero3.meta import CheckpointMeta
from mpitailor.zero3.safeload import load, require_regular


@dataclass
class PartialShard:
    meta: CheckpointMeta
    rank: int
    model: dict
    optim: dict   # DeepSpeed's optimizer state without its flat buffers
    _file: object = field(repr=False)
    _by_subgroup: dict[int, list[Slot]] = field(repr=False, default_factory=dict)

    @property
    def inner(self) -> dict:
        return self.optim["optimizer_state_dict"]["optimizer_state_dict"]

    def read_into(self, kind: str, g: int, start: int, out: torch.Tensor) -> None:
        end = start + out.numel()
        for slot in self._by_subgroup[g]:
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.length)
            if lo >= hi:
                continue
            key = f"{kind}/{slot.name}"
            try:
                part = self._file.get_slice(key)[lo - slot.offset: hi - slot.offset]
            except Exception:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(
                    f"{self.meta.files.layers_path(self.rank)}: no record {key!r}; this partial "
                    f"checkpoint does not hold that layer") from None
            out[lo - start: hi - start].copy_(part)

    def read(self, kind: str, g: int, start: int = 0, length: int | None = None) -> torch.Tensor:
        size = self.meta.layout.subgroup_sizes[g]
        out = torch.empty(size - start if length is None else length, dtype=torch.float32)
        self.read_into(kind, g, start, out)
        return out

    def close(self) -> None:
        self._file = None

    def __enter__(self) -> "PartialShard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_partial_rank(files: CheckpointFiles, rank: int, crc: bool) -> None:
    """Rank `rank`'s files of a partial checkpoint against the sizes (and, with crc, the
    CRC-32s) its manifest recorded when they were written: CheckpointError if one differs."""
    manifest = files.tag_dir / PARTIAL_MANIFEST
    try:
        records = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest}: unreadable ({e}); the partial save is damaged") \
            from None
    for name in partial_files(rank).values():
        path, want = files.tag_dir / name, records.get(name)
        if not isinstance(want, dict):
            raise CheckpointError(f"{manifest}: no record of {name}; the partial save is "
                                  f"damaged")
        require_regular(path)
        size = path.stat().st_size
        if size != want.get("bytes"):
            raise CheckpointError(f"{path}: {size} bytes, but the partial save wrote "
                                  f"{want.get('bytes')}; the file is truncated or damaged")
        if crc and f"{_crc32(path):08x}" != want.get("crc32"):
            raise CheckpointError(f"{path}: fails the CRC-32 its partial save recorded; the "
                                  f"file is corrupt (re-copy it from the original save)")


def _crc32(path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def open_partial_shard(meta: CheckpointMeta, rank: int) -> PartialShard:
    """Rank `rank`'s part, checked whole against its manifest first (what is read must be
    what was written: a partial save records a CRC-32 for every file)."""
    files = meta.files
    check_partial_rank(files, rank, crc=True)
    model = load(files.model_path(rank), opaque_ok=True)
    optim = load(files.optim_path(rank))
    if int(model.get("global_steps", -1)) != meta.global_steps:
        raise CheckpointError(f"{files.model_path(rank)}: disagrees with rank 0 (global_steps); "
                              f"files from different saves?")
    try:
        handle = safe_open(str(files.layers_path(rank)), "pt")
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{files.layers_path(rank)}: unreadable ({e}); the partial "
                              f"checkpoint is damaged") from None
    groups: dict[int, list[Slot]] = {}
    for slot in meta.layout.slots:
        groups.setdefault(slot.subgroup, []).append(slot)
    return PartialShard(meta, rank, model, optim, handle, groups)
