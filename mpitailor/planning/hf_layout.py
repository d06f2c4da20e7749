"""Where each tensor of consolidated HF weights goes: files, byte offsets, each rank's share.

Pure planning, no I/O and no MPI. Everything about the output files (which files, which
tensors in each, the header, every tensor's data offset) follows from names, shapes and the
dtype, so it does not depend on how many ranks write it. Two ways to group tensors into
files: by size, as transformers' `save_pretrained(max_shard_size=...)` does, or as an
existing checkpoint's weight_map says. The files' data are buffers of the copy program
(program.weights_buffers), written by the ranks as every other output is.
"""
from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.safetensors_header import header_prefix

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # "5GB", huggingface_hub's default
_SIZE = re.compile(r"(\d+)(GIB|MIB|KIB|GB|MB|KB)?", re.I)


def parse_size(text: str) -> int:
    """Bytes in a size written as transformers' `convert_file_size_to_int` reads it: an
    integer (bytes), or one with GB/MB/KB (powers of 10) or GiB/MiB/KiB (powers of 2).
    As there, a lower-case final `b` ("5Gb") means bits."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r}: write a size such as 5GB, 500MB, 2GiB or a number of bytes")
    value, unit = int(m.group(1)), (m.group(2) or "").upper()
    if unit.endswith("IB"):
        return value * 2 ** {"KIB": 10, "MIB": 20, "GIB": 30}[unit]
    size = value * 10 ** {"": 0, "KB": 3, "MB": 6, "GB": 9}[unit]
    return size // 8 if unit and text.strip().endswith("b") else size


def file_name(i: int, n: int) -> str:
    return SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def size_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names in shards, by huggingface_hub's rule: walk the tensors in order, start a new
    shard when the next one would take the current past max_bytes; a tensor bigger than
    max_bytes gets a shard of its own, placed before the shard being filled."""
    shards: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, n in sizes:
        if n > max_bytes:
            shards.append([name])
            continue
        if filled + n > max_bytes:
            shards.append(current)
            current, filled = [], 0
        current.append(name)
        filled += n
    if current:
        shards.append(current)
    return [s for s in shards if s]


def by_size(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[tuple[str, list[str]]]:
    """(file name, names) for an HF export: size-sharded, `model.safetensors` if one file."""
    shards = size_shards(sizes, max_bytes)
    return [(file_name(i, len(shards)), s) for i, s in enumerate(shards)]


def like_base(names: Sequence[str], weight_map: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(file name, names) as an existing index assigns them. Names it does not list go with
    the tensor before them (the first file for a leading one); files left empty (holding only
    tied aliases, which are not written) are dropped."""
    files: dict[str, list[str]] = {}
    unlisted, last = [], None
    for name in names:
        f = weight_map.get(name)
        if f is None:
            unlisted.append(name)
            f = last or next(iter(weight_map.values()))
        files.setdefault(f, []).append(name)
        last = f
    if unlisted:
        log.warning("the base's %s does not list %d tensor(s) (%s); they are written to the "
                    "file of the tensor before them", INDEX, len(unlisted),
                    ", ".join(unlisted[:3]) + (", ..." if len(unlisted) > 3 else ""))
    return list(files.items())


@dataclass(frozen=True, slots=True)
class FileTensor:
    """One tensor in one output file."""

    name: str
    shape: tuple[int, ...]
    offset: int  # byte offset of its data in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class OutFile:
    name: str
    prefix: bytes  # header length and JSON header, padded: the bytes before the data
    pieces: tuple[FileTensor, ...]  # in model order, which is also their order in the file
    size: int


@dataclass(frozen=True, slots=True)
class WeightsPlan:
    dtype: str  # bf16, fp16 or fp32
    files: tuple[OutFile, ...]
    index: bytes | None  # model.safetensors.index.json, if one is written

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize


def plan_weights(tensors: Sequence[tuple[str, tuple[int, ...]]], dtype: str,
                 groups: Sequence[tuple[str, Sequence[str]]], index: bool) -> WeightsPlan:
    """The files `groups` names, each with its tensors in model order (the order of
    `tensors`); with an index if `index`."""
    starts, pos = {}, 0
    shapes = dict(tensors)
    for name, shape in tensors:
        starts[name] = pos
        pos += math.prod(shape)
    files = []
    for fname, names in groups:
        names = sorted(names, key=starts.__getitem__)
        files.append(_plan_file(fname, [(n, shapes[n]) for n in names], dtype))
    weight_map = {n: f.name for f in files for n in (p.name for p in f.pieces)}
    raw = None
    if index:
        ordered = {n: weight_map[n] for n, _ in tensors}
        doc = {"metadata": {"total_size": pos * DTYPES[dtype].itemsize}, "weight_map": ordered}
        raw = json.dumps(doc, indent=2).encode()
    return WeightsPlan(dtype, tuple(files), raw)


def _plan_file(name: str, entries: list[tuple[str, tuple[int, ...]]], dtype: str) -> OutFile:
    size = DTYPES[dtype].itemsize
    prefix = header_prefix([(n, DTYPES[dtype].safetensors, shape, math.prod(shape) * size)
                            for n, shape in entries], metadata={"format": "pt"})
    pieces, offset = [], len(prefix)
    for n, shape in entries:
        pieces.append(FileTensor(n, shape, offset))
        offset += math.prod(shape) * size
    return OutFile(name, prefix, tuple(pieces), offset)


def runs(f: OutFile, itemsize: int, lo: int, hi: int) -> list[tuple[FileTensor, int, int]]:
    """Elements [lo, hi) of file f's data (its tensors' elements one after the other, from
    the end of its header) by tensor: [(tensor, first, end element within it)], in order."""
    out, pos = [], 0
    for p in f.pieces:
        a, b = max(lo, pos), min(hi, pos + p.numel)
        if a < b:
            out.append((p, a - pos, b - pos))
        pos += p.numel
    return out
