"""A save's file against the record the save wrote of it when it wrote the file (its size and
CRC-32): a partial save's manifest, a full save's SAVE_RECORD (training/recorded_save.py)."""
from __future__ import annotations

from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.io import FileIdentity, crc32_of
from mpitailor.formats.torch import require_regular


def check_recorded(path: Path, want: dict, saver: str, crc: bool) -> FileIdentity | None:
    """CheckpointError unless the file at path has the size (and, with crc, the CRC-32)
    recorded in `want` ({"bytes", "crc32"}) by its `saver` ("partial save", "full save");
    with crc, the identity of the file as checked (what a later open must find again)."""
    require_regular(path)
    size = path.stat().st_size
    if size != want.get("bytes"):
        raise CheckpointError(f"{path}: {size} bytes, but the {saver} wrote "
                              f"{want.get('bytes')}; the file is truncated or damaged")
    if not crc:
        return None
    with open(path, "rb") as f:
        value, checked = crc32_of(f), FileIdentity.of(f.fileno())
    if f"{value:08x}" != want.get("crc32"):
        raise CheckpointError(f"{path}: fails the CRC-32 its {saver} recorded; the file is "
                              f"corrupt (re-copy it from the original save)")
    return checked
