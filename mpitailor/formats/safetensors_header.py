"""The safetensors container's header: 8-byte length, then JSON, padded to 8 bytes; the data
follows. Written (header_prefix) for HF exports before any byte of data; read (parse_header,
tensor_records) for exports' bases, partial saves' fp32 files and `diff`.

A leaf of formats/ that zero/ (partial saves) and hf/ (exports) share; torch-free, so that
the planner can lay out whole files before any byte is written."""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

from mpitailor.errors import CheckpointError
from mpitailor.formats.io import MAX_SAFETENSORS_HEADER, loads, open_regular, read_exact, shown


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


def parse_header(fd: int) -> tuple[dict, int]:
    """(the JSON header, the byte offset where the data starts) of the safetensors file open
    as fd: its length within the file and the safetensors library's own limit, nesting
    bounded (boundedio.loads), a JSON object. ValueError (or EOFError, OSError) where it is
    not one."""
    size = os.fstat(fd).st_size
    n = int.from_bytes(read_exact(fd, 8, 0), "little") if size >= 8 else -1
    if not 2 <= n <= min(size - 8, MAX_SAFETENSORS_HEADER):
        raise ValueError(f"header length {n} in a file of {size} bytes")
    header = loads(read_exact(fd, n, 8))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, 8 + n


def tensor_records(header: dict, data_start: int, file_size: int
                   ) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """{name: (safetensors dtype, shape, byte offset in the file, byte count)} of every
    tensor of a parsed header, in name order; ValueError where a record is not one: its
    shape and offsets not non-negative integers, its bytes outside the data section or
    overlapping another's. What the dtype and byte count must be is the caller's to check."""
    out = {}
    for name in sorted(header):
        if name == "__metadata__":
            continue
        rec = header[name]
        if not isinstance(rec, dict):
            raise ValueError(f"tensor {name!r}: not a record")
        dtype, shape, offsets = rec.get("dtype"), rec.get("shape"), rec.get("data_offsets")
        if not (type(dtype) is str and type(shape) is list and type(offsets) is list
                and len(offsets) == 2
                and all(type(x) is int and x >= 0 for x in (*shape, *offsets))
                and offsets[0] <= offsets[1] <= file_size - data_start):
            raise ValueError(f"tensor {name!r}: dtype {dtype!r:.20}, shape {shape!r:.60}, "
                             f"bytes {offsets!r:.60}")
        out[name] = (dtype, tuple(shape), data_start + offsets[0], offsets[1] - offsets[0])
    spans = sorted((at, at + n, name) for name, (_, _, at, n) in out.items() if n)
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:  # the safetensors library refuses it: one tensor's bytes another's
            raise ValueError(f"tensors {name!r} and {other!r} overlap")
    return out


def read_header(path, what: str = "a safetensors file") -> dict:
    """The JSON header of safetensors file `path` (a regular file, no link followed: see
    parse_header); CheckpointError naming the file if it is not one."""
    return _read(path, what, lambda fd: parse_header(fd)[0])


def read_tensor_records(path, what: str = "a safetensors file"
                        ) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """The tensor_records of safetensors file `path`; CheckpointError naming the file if it
    is not one."""
    return _read(path, what, lambda fd: tensor_records(*parse_header(fd), os.fstat(fd).st_size))


def _read(path, what: str, parse):
    fd = open_regular(path, what)
    try:
        return parse(fd)
    except (OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{shown(path)}: not a readable safetensors file "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                              f"{what} is damaged") from None
    finally:
        os.close(fd)
