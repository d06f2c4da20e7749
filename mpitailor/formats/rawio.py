"""Byte-range I/O on torch-serialised files: read exactly the bytes of a tensor slice.

`torch.load(map_location="meta")` parses a file's pickle without touching tensor data and
tags every storage with its byte offset in the file (`_checkpoint_offset`). With that, a
slice of a flat buffer is one `preadv` straight into the destination tensor: no page of the
source is mapped into the process, and no byte outside the slice is read.
"""
from __future__ import annotations

import os

import torch


def file_offset(t: torch.Tensor) -> int:
    """Byte offset in its file of a tensor loaded with map_location='meta'."""
    return t.untyped_storage()._checkpoint_offset + t.storage_offset() * t.element_size()


def read_into(fd: int, offset: int, out: torch.Tensor) -> None:
    """Fill contiguous CPU tensor `out` with the bytes at `offset` of file `fd`."""
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise EOFError(f"file ends {len(view) - done} bytes early")
        done += n


def read_slice(fd: int, t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Elements [start, start+length) of meta tensor `t` (1-D), read from file `fd`."""
    out = torch.empty(length, dtype=t.dtype)
    read_into(fd, file_offset(t) + start * t.element_size(), out)
    return out


def materialize(obj, fd: int, skip: frozenset[int] = frozenset()):
    """Replace meta tensors by their values read from `fd`, except those whose id() is in
    `skip` (the big flat buffers, read later slice by slice)."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta" and id(obj) not in skip:
            return read_slice(fd, obj.reshape(-1), 0, obj.numel()).view(obj.shape)
        return obj
    if isinstance(obj, dict):
        return type(obj)((k, materialize(v, fd, skip)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(materialize(v, fd, skip) for v in obj)
    return obj
