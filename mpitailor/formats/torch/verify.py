"""Opt-in (`--verify`) integrity check of source records against their zip CRC-32.

A torch file is a zip archive whose every record carries a CRC-32. A merge normally reads
only the byte ranges it needs, which cannot be checked against a whole-record CRC; with
--verify each rank reads every source record it takes data from in full (more reads, as the
dry-run shows) and refuses a record whose CRC does not match: flipped bits, a torn copy.
"""
from __future__ import annotations

import os
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.io import crc32
from mpitailor.formats.torch import zip_read


def record_crcs(path: Path, fd: int) -> dict[int, tuple[int, int]]:
    """Data offset -> (CRC-32, size) of every record of the zip archive open as `fd` (the
    file at `path`)."""
    with os.fdopen(os.dup(fd), "rb") as f:  # zipfile seeks; the shard's fd is read by pread
        return {start: (crc, size) for start, size, crc in zip_read.read_records(f).values()}


def verify_records(path: Path, fd: int, offsets: set[int],
                   crcs: dict[int, tuple[int, int]]) -> None:
    """Raise CheckpointError unless every record starting at one of `offsets` matches its
    CRC-32 in `crcs` (the file's record_crcs)."""
    for off in sorted(offsets):
        if off not in crcs:
            raise CheckpointError(f"{path}: no zip record starts at byte {off}; the file "
                                  f"is damaged")
        want, size = crcs[off]
        crc, done = 0, 0
        while done < size:
            chunk = os.pread(fd, min(16 << 20, size - done), off + done)
            if not chunk:
                break
            crc = crc32(chunk, crc)
            done += len(chunk)
        if done != size or crc != want:
            raise CheckpointError(f"{path}: the record at byte {off} fails its CRC-32 check; "
                                  f"the file is corrupt (re-copy it from the original save)")
