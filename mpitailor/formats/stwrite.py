"""Write a safetensors file straight from tensor memory, hashing as it goes.

`safetensors.torch.save_file` wants tensors that own their storage (so slices of one flat
buffer must be cloned first) and returns no checksum. The format is simple (8-byte header
length, JSON header, raw little-endian bytes), so this writes views in place: no copy, one
pass, fsynced, and the manifest record (size, CRC-32) comes out of the same pass.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from mpitailor.formats.dtypes import DTYPES, name_of
from mpitailor.formats.filerecord import FileRecord
from mpitailor.formats.safetensors_header import header_prefix


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> dict:
    """Write contiguous CPU tensors to a new file; return its manifest record."""
    prefix = header_prefix([(name, DTYPES[name_of(t.dtype)].safetensors, t.shape,
                             t.numel() * t.element_size())
                            for name, t in tensors.items()], metadata)
    rec = FileRecord()
    with open(path, "xb") as f:
        for chunk in (prefix, *(as_bytes(t) for t in tensors.values())):
            rec.update(chunk)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return rec.record()


def as_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("write_safetensors needs contiguous CPU tensors")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
