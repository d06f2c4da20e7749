"""DCP chunks written as safetensors (`FileSystemWriter(serialization_format=SAFETENSORS)`):
found in their data file's blob, and rewritten as the torch.save items `dcp.load` reads.

That writer (torch 2.13) writes a data file's bytes entries first, as items of their own,
then every tensor chunk of the file as one safetensors blob: its header names each chunk by
its key and lists `DCP_SHARDING_INFO` (each key's `saved_offsets`) in `__metadata__`. The
`.metadata` places every chunk of the file at the blob's start with the chunk's byte count
as its length: no chunk's bytes lie where it says. torch's own FileSystemReader then
`torch.load`s that range and fails: such a checkpoint is written but not read back by torch
2.13 (its HuggingFaceStorageReader reads `*.safetensors` files only). Here the blob's header
is read (bounded, checked: formats/safetensors_header.py) and the chunk found by its key;
a merge writes it out as the default writer would have, a torch.save zip of the chunk
(`zip_item`), its bytes copied into the zip's storage record.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

from mpitailor.errors import CheckpointError
from mpitailor.formats.dtypes import DTYPES, from_safetensors
from mpitailor.formats.io import MAX_SAFETENSORS_HEADER, crc32, loads, read_exact, shown
from mpitailor.formats.safetensors_header import tensor_records
from mpitailor.formats.torch import Tensor, contiguous_stride, zip_write

SHARDING_KEY = "DCP_SHARDING_INFO"  # torch's _hf_utils.CUSTOM_METADATA_KEY
_CACHE_SIZE = 64  # blobs whose parsed header is kept (a merge reads a file's chunks in turn)


@dataclass(frozen=True, slots=True)
class Blob:
    """A parsed safetensors blob: {key: (dtype, shape, byte offset in the file, bytes)} and
    each key's saved offsets (its chunk's place in its tensor)."""

    records: dict[str, tuple[str, tuple[int, ...], int, int]]
    saved_offsets: dict[str, tuple[int, ...]]


_blobs: dict[tuple, Blob] = {}


def read_blob(path, fd: int, start: int) -> Blob:
    """The blob at byte `start` of the data file at path (open as fd), parsed once per file
    version; CheckpointError naming the file where it is not a safetensors blob DCP wrote."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, start)
    if key not in _blobs:
        try:
            blob = _parse(fd, start, st.st_size)
        except (OSError, EOFError, ValueError) as e:
            raise CheckpointError(f"{shown(path)}: no safetensors blob DCP wrote at byte "
                                  f"{start}, where its metadata places safetensors chunks "
                                  f"({str(e).splitlines()[0][:160] if str(e) else type(e).__name__}"
                                  f"); re-copy the file from the original save") from None
        if len(_blobs) >= _CACHE_SIZE:
            _blobs.pop(next(iter(_blobs)))
        _blobs[key] = blob
    return _blobs[key]


def _parse(fd: int, start: int, size: int) -> Blob:
    n = int.from_bytes(read_exact(fd, 8, start), "little") if size - start >= 8 else -1
    if not 2 <= n <= min(size - start - 8, MAX_SAFETENSORS_HEADER):
        raise ValueError(f"header length {n} with {size - start} bytes left in the file")
    header = loads(read_exact(fd, n, start + 8))
    if type(header) is not dict:
        raise ValueError("the header is not a JSON object")
    records = tensor_records(header, start + 8 + n, size)
    meta = header.get("__metadata__")
    info = meta.get(SHARDING_KEY) if isinstance(meta, dict) else None
    info = loads(info) if type(info) is str else None
    if type(info) is not dict:
        raise ValueError(f"no {SHARDING_KEY} in its __metadata__")
    saved = {}
    for name, rec in info.items():
        offsets = rec.get("saved_offsets") if isinstance(rec, dict) else None
        if type(offsets) is not list or not all(type(o) is int and o >= 0 for o in offsets):
            raise ValueError(f"{SHARDING_KEY} of {name!r:.80}: saved_offsets "
                             f"{offsets!r:.60} are not offsets")
        saved[name] = tuple(offsets)
    return Blob(records, saved)


def locate_in_blob(path, fd: int, item, dtype: str, sizes: tuple[int, ...]) -> tuple[int, int]:
    """(byte offset in the file, byte count) of chunk `item` (of a tensor of `dtype`, this
    chunk of `sizes`) in its file's blob, checked to be that chunk: its key in the header,
    of that dtype and shape, saved at the item's offsets. CheckpointError naming the file
    and key otherwise."""
    where = f"{shown(path)} (safetensors chunk {item.fqn!r:.80} of the blob at byte " \
            f"{item.offset})"
    blob = read_blob(path, fd, item.offset)
    rec = blob.records.get(item.fqn)
    nbytes = math.prod(sizes) * DTYPES[dtype].itemsize
    if rec is None:
        raise CheckpointError(f"{where}: not in the blob's header; the metadata places it "
                              f"there (a data file of another save?)")
    st_dtype, shape, at, n = rec
    if from_safetensors(st_dtype) != dtype or shape != sizes or n != nbytes:
        raise CheckpointError(f"{where}: a {st_dtype!s:.20} tensor of shape {shape} "
                              f"({n} bytes), the metadata says {DTYPES[dtype].safetensors} "
                              f"of shape {sizes}")
    if blob.saved_offsets.get(item.fqn) != tuple(item.offsets or ()):
        raise CheckpointError(f"{where}: saved at offsets "
                              f"{blob.saved_offsets.get(item.fqn)}, the metadata says "
                              f"{tuple(item.offsets or ())}")
    return at, n


@dataclass(frozen=True, slots=True)
class ZipItem:
    """A chunk written as torch.save writes it (what `dcp.load` reads): `length` bytes, the
    chunk's own bytes at `data_offset` of them, the rest given by `pieces`."""

    layout: zip_write.ZipLayout
    records: tuple  # (bytes or None: the storage) per zip record
    storage: int    # index of the storage record

    @property
    def length(self) -> int:
        return self.layout.size

    @property
    def data_offset(self) -> int:
        return self.layout.entries[self.storage].data_offset

    def crcs(self, data_crc: int) -> list[int]:
        return [data_crc if r is None else crc32(r) for r in self.records]

    def pieces(self, data_crc: int) -> list[tuple[int, bytes]]:
        """(offset in the item, bytes) of everything but the chunk's bytes: the zip's
        headers, and the small records (pickle, version) whole."""
        return self.layout.pieces(self.crcs(data_crc)) + [
            (e.data_offset, r) for e, r in zip(self.layout.entries, self.records)
            if r is not None and r]

    def crc(self, data_crc: int) -> int:
        """The CRC-32 of the whole item, from its data's (nothing is read)."""
        return self.layout.file_crc(self.crcs(data_crc))


@functools.lru_cache(maxsize=4096)  # a model's chunks come in a few shapes
def zip_item(dtype: str, sizes: tuple[int, ...]) -> ZipItem:
    """How torch.save(chunk) lays out a contiguous chunk of dtype and sizes (zip_write)."""
    storage = Tensor.empty(math.prod(sizes), dtype).storage
    tf = zip_write.describe(Tensor(storage, 0, sizes, contiguous_stride(sizes)))
    storages = [i for i, _ in tf.storages()]
    return ZipItem(tf.layout(), tuple(None if r.storage is not None else r.data
                                      for r in tf.records), storages[0])

