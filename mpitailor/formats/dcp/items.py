"""Where a DCP chunk's elements lie in its data file.

FileSystemWriter stores each chunk as one item in a `.distcp` file: by default a torch.save
zip of the chunk's tensor (read here with the torch reader, on the item's byte range:
formats/torch, Window), or, with SerializationFormat.SAFETENSORS, a tensor of the file's one
safetensors blob (found by its key in the blob's header: safetensors_items.py). Items
written through a stream transform (compression, encryption: `transform_descriptors`) are
refused: their bytes are not the tensor's.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.dcp.metadata import DcpMetadata, Item, TensorEntry
from mpitailor.formats.dcp.safetensors_items import locate_in_blob
from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.io import open_regular, read_exact, shown
from mpitailor.formats.torch import Tensor, contiguous_stride, load

_ZIP = b"PK\x03\x04"


@dataclass(frozen=True, slots=True)
class Located:
    """A chunk's elements, in row-major order: `nbytes` bytes at `offset` of `file`."""

    file: Path
    offset: int
    nbytes: int


def check_data_files(folder: Path, meta: DcpMetadata) -> None:
    """Every data file the metadata names is a regular file in folder (no link followed)
    holding every item it places there: CheckpointError naming the first that is not."""
    ends: dict[str, tuple[int, Item]] = {}
    for item in meta.items.values():
        end = item.offset + item.length
        if item.file not in ends or end > ends[item.file][0]:
            ends[item.file] = (end, item)
    for name, (end, item) in sorted(ends.items()):
        fd = open_regular(folder / name, "a DCP data file")
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if end > size:
            raise CheckpointError(f"{shown(folder / name)}: {size} bytes, but the metadata "
                                  f"places {item.fqn!r:.80} up to byte {end}; the file is "
                                  f"truncated (re-copy it from the original save)")


def check_bytes_item(folder: Path, fd: int, item: Item) -> None:
    """A bytes entry's item (anything not a tensor, torch.save'd: DCP loads it with
    torch.load(weights_only=False)) read through the torch reader's allow-list: one that
    names a global outside it (a payload that would run when the checkpoint is loaded) is a
    CheckpointError naming the file, never copied into an output."""
    path = folder / item.file
    if item.transforms:
        raise CheckpointError(f"{shown(path)} (item {item.fqn!r:.80} at byte {item.offset}): "
                              f"written through stream transforms; mpitailor reads "
                              f"untransformed items only")
    # ("client": argparse.Namespace and numpy, what a trainer's own state holds: Megatron's
    # common_state carries Megatron-LM's args)
    load(path, fd=fd, window=(item.offset, item.length), allow=("deepspeed", "client"))


def locate(folder: Path, fd: int, item: Item, entry: TensorEntry,
           sizes: tuple[int, ...]) -> Located:
    """Where the elements of chunk `item` (of tensor `entry`, its sizes `sizes`) lie in its
    data file, open as fd; CheckpointError naming the file if the item is not a contiguous
    tensor of that dtype and shape, or is transformed."""
    path = folder / item.file
    where = f"{shown(path)} (item {item.fqn!r:.80} at byte {item.offset})"
    if item.transforms:
        raise CheckpointError(f"{where}: written through stream transforms "
                              f"{', '.join(item.transforms)[:80]}; mpitailor reads "
                              f"untransformed items only (save without them)")
    if item.offset + item.length > os.fstat(fd).st_size:
        raise CheckpointError(f"{where}: the item runs past the end of the file; the file is "
                              f"truncated (re-copy it from the original save)")
    if item.safetensors:
        return Located(path, *locate_in_blob(path, fd, item, entry.dtype, sizes))
    head = read_exact(fd, 4, item.offset) if item.length >= 4 else b""
    if head != _ZIP:
        raise CheckpointError(f"{where}: not a torch.save item")
    t = load(path, fd=fd, window=(item.offset, item.length))
    size = DTYPES[entry.dtype].itemsize
    nbytes = math.prod(sizes) * size
    if not isinstance(t, Tensor) or t.storage.dtype != entry.dtype or t.shape != sizes or \
            t.stride != contiguous_stride(sizes) or t.wrapper is not None:
        raise CheckpointError(f"{where}: not a contiguous {entry.dtype} tensor of shape "
                              f"{sizes}, as its metadata says")
    return Located(path, t.storage.offset + t.storage_offset * size, nbytes)
