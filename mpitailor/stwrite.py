"""Write a safetensors file straight from tensor memory, hashing as it goes.

`safetensors.torch.save_file` wants tensors that own their storage (so slices of one flat
buffer must be cloned first) and returns no checksum. The format is simple (8-byte header
length, JSON header, raw little-endian bytes), so this writes views in place: no copy, one
pass, fsynced, and the manifest record (size, CRC-32) comes out of the same pass.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from mpitailor.filerecord import FileRecord

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def header_prefix(entries: Iterable[tuple[str, str, Sequence[int], int]],
                  metadata: dict[str, str] | None = None) -> bytes:
    """The bytes before the data: header length, then the JSON header padded to 8 bytes.
    entries: (name, safetensors dtype such as "BF16", shape, bytes), in data order."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, n in entries:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> dict:
    """Write contiguous CPU tensors to a new file; return its manifest record."""
    prefix = header_prefix([(name, DTYPES[t.dtype], t.shape, t.numel() * t.element_size())
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
