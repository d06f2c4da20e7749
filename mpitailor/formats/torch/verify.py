"""Opt-in (`--verify`) integrity check of source records against their zip CRC-32.

A torch file is a zip archive whose every record carries a CRC-32. A merge normally reads
only the byte ranges it needs, which cannot be checked against a whole-record CRC; with
--verify each rank reads every source record it takes data from in full (more reads, as the
dry-run shows) and refuses a record whose CRC does not match: flipped bits, a torn copy.
"""
from __future__ import annotations

import bisect
import os
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.io import crc32_range
from mpitailor.formats.torch import zip_read


def record_crcs(path: Path, fd: int) -> dict[int, tuple[int, int]]:
    """Data offset -> (CRC-32, size) of every record of the zip archive open as `fd` (the
    file at `path`)."""
    with os.fdopen(os.dup(fd), "rb") as f:  # zipfile seeks; the shard's fd is read by pread
        return {start: (crc, size) for start, size, crc in zip_read.read_records(f).values()}


def verify_records(path: Path, fd: int, offsets: set[int],
                   crcs: dict[int, tuple[int, int]]) -> None:
    """Raise CheckpointError unless every record holding one of `offsets` (the first byte of
    a tensor read: a record's start, or inside it for a view at an offset of its storage)
    matches its CRC-32 in `crcs` (the file's record_crcs). Each record is read once."""
    starts = sorted(crcs)
    held = set()
    for off in offsets:
        i = bisect.bisect_right(starts, off) - 1
        if i < 0 or off >= starts[i] + max(crcs[starts[i]][1], 1):
            raise CheckpointError(f"{path}: no zip record holds byte {off}; the file is "
                                  f"damaged")
        held.add(starts[i])
    for off in sorted(held):
        want, size = crcs[off]
        crc, got = crc32_range(fd, off, size)
        if got < size:
            crc = None  # the record runs past the end of the file
        if crc != want:
            raise CheckpointError(f"{path}: the record at byte {off} fails its CRC-32 check; "
                                  f"the file is corrupt (re-copy it from the original save)")
