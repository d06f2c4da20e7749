"""The safetensors container's header: 8-byte length, then JSON, padded to 8 bytes.
Torch-free, so that the planner can lay out whole files before any byte is written."""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence


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
