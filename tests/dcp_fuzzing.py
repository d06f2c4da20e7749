"""Random damage to a real DCP `.metadata` and the reader's verdict on it (issue 43): shared
by tests/test_dcp_read.py (a short run) and bench/dcp_fuzz.py (a long one).

Each input is the file with bytes flipped, cut short, or a run of its own bytes spliced in
elsewhere (pickle opcodes, lengths and memo indexes land in new places). The property: the
reader returns a value that passed its checks (every chunk of every tensor stored, inside
the checkpoint dir), or raises CheckpointError in one line; nothing else, and no input takes
long."""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.dcp import read_metadata
from mpitailor.formats.dtypes import DTYPES


def mutate(good: bytes, rng: random.Random) -> bytes:
    data = bytearray(good)
    kind = rng.randrange(3)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:
        del data[rng.randrange(len(data)):]
    else:
        a, b = sorted(rng.randrange(len(data)) for _ in range(2))
        at = rng.randrange(len(data))
        data[at:at] = data[a:b][:4096]
    return bytes(data)


def run(folder: Path, good: bytes, count: int, seed: int) -> dict:
    """Write `count` damaged copies of `good` to folder/.metadata in turn and read each.
    AssertionError on an input that breaks the property; the outcomes otherwise."""
    rng = random.Random(seed)
    out = {"inputs": count, "read": 0, "refused": 0, "worst_s": 0.0}
    for _ in range(count):
        data = mutate(good, rng)
        (folder / ".metadata").write_bytes(data)
        t = time.perf_counter()
        try:
            meta = read_metadata(folder)
        except CheckpointError as e:
            assert "\n" not in str(e), str(e)
            out["refused"] += 1
        else:
            for fqn, t_ in meta.tensors.items():
                assert all((fqn, c.offsets) in meta.items for c in t_.chunks)
            out["read"] += 1
        out["worst_s"] = max(out["worst_s"], time.perf_counter() - t)
    return out


def run_blob(folder: Path, count: int, seed: int) -> dict:
    """Damage the safetensors blob of a data file of the DCP checkpoint in folder (chunks
    FileSystemWriter(SAFETENSORS) wrote; the damage within its header's first 4 KiB, where
    lengths, names and offsets lie) `count` times, and locate every chunk the metadata
    places in it. The property: each chunk is found inside the file and of its size, or
    CheckpointError in one line."""
    from mpitailor.formats.dcp import locate
    meta = read_metadata(folder)
    starts = {(i.file, i.offset) for i in meta.items.values() if i.safetensors}
    name, start = max(starts)
    path = folder / name
    good = path.read_bytes()
    chunks = [(fqn, t, c) for fqn, t in meta.tensors.items() for c in t.chunks
              if meta.items[fqn, c.offsets].file == name]
    rng = random.Random(seed)
    out = {"inputs": count, "chunks": len(chunks), "located": 0, "refused": 0}
    for _ in range(count):
        head = mutate(good[start:start + 4096], rng)
        path.write_bytes(good[:start] + head + good[start + 4096:])
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        try:
            for fqn, t, c in chunks:
                try:
                    loc = locate(folder, fd, meta.items[fqn, c.offsets], t, c.sizes)
                except CheckpointError as e:
                    assert "\n" not in str(e), str(e)
                    out["refused"] += 1
                else:
                    assert loc.offset + loc.nbytes <= size and loc.nbytes == \
                        c.numel * DTYPES[t.dtype].itemsize, (fqn, loc)
                    out["located"] += 1
        finally:
            os.close(fd)
    path.write_bytes(good)
    return out
