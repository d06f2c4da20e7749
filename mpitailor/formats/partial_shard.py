"""One rank's part of a partial checkpoint, a `Shard` (shard_protocol.py) like `RankShard`.

A partial checkpoint stores, per rank, each saved parameter's slice (stage 3: padding
included; stages 1/2: the part of the flat partition the rank holds, if any) as safetensors
records `{kind}/{name}` (fp32). `byte_ranges` (and `read_into`) serve a run of a
sub-group's flat buffer by walking the parameters that overlap it; asking for a parameter the
checkpoint does not hold is a bug in the plan, and says so. The safetensors header is parsed
here (8-byte length, JSON): the copy program needs each record's byte offset in the file.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.files import PARTIAL_MANIFEST, partial_files
from mpitailor.formats.layout import Slot
from mpitailor.formats.meta import CheckpointMeta
from mpitailor.formats.safeload import load, require_regular
from mpitailor.formats.shard_protocol import Shard


@dataclass
class PartialShard(Shard):
    """A partial checkpoint's rank: each saved parameter's slice is a record of the rank's
    layers file (`data_path`), so a run of a sub-group's buffer may span several records, and
    no buffer is a record of its own (`whole_record` is always None)."""

    records: dict[str, tuple[int, int]]  # "{kind}/{name}" -> (byte offset, byte count)
    _by_subgroup: dict[int, list[Slot]] = field(repr=False, default_factory=dict)

    @property
    def data_path(self) -> Path:
        return self.meta.files.layers_path(self.rank)

    def byte_ranges(self, kind: str, g: int, start: int, n: int) -> list[tuple[int, int, int]]:
        end, out = start + n, []
        for slot in self._by_subgroup[g]:
            first, length = self.meta.layout.span(slot, self.rank)
            lo, hi = max(start, first), min(end, first + length)
            if lo >= hi:
                continue
            key = f"{kind}/{slot.name}"
            if key not in self.records:
                raise CheckpointError(
                    f"{self.data_path}: no record {key!r}; this partial checkpoint does not "
                    f"hold that layer")
            offset, size = self.records[key]
            if (hi - first) * 4 > size:
                raise CheckpointError(f"{self.data_path}: record {key!r} is shorter than the "
                                      f"parameter's slice; the file is damaged")
            out.append((self.fd, offset + (lo - first) * 4, (hi - lo) * 4))
        return out

    def verify(self, used: set[tuple[str, int]]) -> None:
        """Nothing left to check: open_partial_shard checked every file of the rank against
        the CRC-32 its manifest recorded before anything was read."""


def check_partial_rank(meta: CheckpointMeta, rank: int, crc: bool) -> None:
    """Rank `rank`'s files of a partial checkpoint against the sizes (and, with crc, the
    CRC-32s) its manifest recorded when they were written: CheckpointError if one differs."""
    files = meta.files
    manifest = files.tag_dir / PARTIAL_MANIFEST
    records = dict(meta.partial_records)
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
    check_partial_rank(meta, rank, crc=True)
    model = load(files.model_path(rank), opaque_ok=True)
    optim = load(files.optim_path(rank))
    if int(model.get("global_steps", -1)) != meta.global_steps:
        raise CheckpointError(f"{files.model_path(rank)}: disagrees with rank 0 (global_steps); "
                              f"files from different saves?")
    path = files.layers_path(rank)
    fd = os.open(path, os.O_RDONLY)
    try:
        records = _safetensors_records(path, fd)
    except BaseException:
        os.close(fd)
        raise
    groups: dict[int, list[Slot]] = {}
    for slot in meta.layout.slots:
        groups.setdefault(slot.subgroup, []).append(slot)
    return PartialShard(meta, rank, model, optim, fd, records, groups)


def _safetensors_records(path, fd: int) -> dict[str, tuple[int, int]]:
    """{record name: (byte offset in the file, byte count)} of an fp32 safetensors file."""
    size = os.fstat(fd).st_size
    try:
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if not 2 <= n <= size - 8:
            raise ValueError(f"header length {n}")
        header = json.loads(os.pread(fd, n, 8))
        out = {}
        for key, rec in header.items():
            if key == "__metadata__":
                continue
            a, b = (int(x) for x in rec["data_offsets"])
            if rec["dtype"] != "F32" or not 0 <= a <= b <= size - 8 - n:
                raise ValueError(f"record {key!r}: {rec['dtype']} at {a}-{b}")
            out[key] = (8 + n + a, b - a)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a readable fp32 safetensors file ({e}); the partial "
                              f"checkpoint is damaged") from None
    return out
