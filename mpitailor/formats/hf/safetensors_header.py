"""The safetensors container's header: 8-byte length, then JSON, padded to 8 bytes.
Torch-free, so that the planner can lay out whole files before any byte is written."""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

from mpitailor.errors import CheckpointError
from mpitailor.formats.io import MAX_SAFETENSORS_HEADER, loads, open_regular, shown


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


def read_header(path, what: str = "a safetensors file") -> dict:
    """The JSON header of safetensors file `path` (a regular file, no link followed; the
    header at most the safetensors library's own limit, nesting bounded); CheckpointError
    naming the file if it is not one."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        n = int.from_bytes(os.pread(fd, 8, 0), "little") if size >= 8 else -1
        if not 2 <= n <= min(size - 8, MAX_SAFETENSORS_HEADER):
            raise ValueError(f"header length {n} in a file of {size} bytes")
        header = loads(os.pread(fd, n, 8))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        return header
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{shown(path)}: not a readable safetensors file "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                              f"{what} is damaged") from None
    finally:
        os.close(fd)
