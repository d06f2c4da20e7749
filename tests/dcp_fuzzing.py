"""Random damage to a real DCP `.metadata` and the reader's verdict on it (issue 43): shared
by tests/test_dcp_read.py (a short run) and bench/dcp_fuzz.py (a long one).

Each input is the file with bytes flipped, cut short, or a run of its own bytes spliced in
elsewhere (pickle opcodes, lengths and memo indexes land in new places). The property: the
reader returns a value that passed its checks (every chunk of every tensor stored, inside
the checkpoint dir), or raises CheckpointError in one line; nothing else, and no input takes
long."""
from __future__ import annotations

import random
import time
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.dcp import read_metadata


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
