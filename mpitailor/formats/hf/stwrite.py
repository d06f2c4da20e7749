"""Write a safetensors file straight from memory, hashing as it goes.

`safetensors.torch.save_file` wants tensors that own their storage (so slices of one flat
buffer must be cloned first) and returns no checksum. The format is simple (8-byte header
length, JSON header, raw little-endian bytes), so this writes the callers' buffers in place:
no copy, one pass, fsynced, and the manifest record (size, CRC-32) comes out of the same pass.
"""
from __future__ import annotations

import math
from pathlib import Path

from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.io import write_synced
from mpitailor.formats.safetensors_header import header_prefix

# name -> (dtype name of dtypes.py, shape, the tensor's bytes, contiguous)
Tensors = dict[str, tuple[str, tuple[int, ...], memoryview]]


def write_safetensors(path: Path, tensors: Tensors, metadata: dict[str, str] | None = None
                      ) -> dict:
    """Write the tensors to a new file; return its manifest record."""
    for name, (dtype, shape, data) in tensors.items():
        if len(data) != math.prod(shape) * DTYPES[dtype].itemsize:
            raise ValueError(f"internal error: {name}: {len(data)} bytes for {dtype} x {shape}")
    prefix = header_prefix([(name, DTYPES[dtype].safetensors, shape, len(data))
                            for name, (dtype, shape, data) in tensors.items()], metadata)
    return write_synced(path, prefix, *(data for _, _, data in tensors.values()))
