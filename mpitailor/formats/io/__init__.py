"""The package's file I/O below the checkpoint formats: bounded reads, byte ranges, whole
files with their manifest record, CRC-32, the file system a job sees.

The face (lazyface.py): what the rest of the package imports from here, by name."""
from __future__ import annotations

from mpitailor.formats.lazyface import face

EXPORTS = {
    "MAX_CONFIG_BYTES": "boundedio", "MAX_INDEX_BYTES": "boundedio",
    "MAX_MANIFEST_BYTES": "boundedio", "MAX_RECORD_BYTES": "boundedio",
    "MAX_SAFETENSORS_HEADER": "boundedio", "MAX_SIDE_FILE_BYTES": "boundedio",
    "TooLarge": "boundedio", "kind_of": "boundedio", "loads": "boundedio",
    "open_regular": "boundedio", "read_bounded": "boundedio", "read_json": "boundedio",
    "read_small": "boundedio", "shown": "boundedio", "too_large": "boundedio",
    "crc32": "crc", "crc32_combine": "crc", "crc32_zeros": "crc",
    "FILE_CHUNK": "fileio", "copy_synced": "fileio", "crc32_of": "fileio", "created": "fileio",
    "read_exact": "fileio", "read_into": "fileio", "write_synced": "fileio",
    "FileIdentity": "identity", "open_same": "identity", "require_same": "identity",
    "Entry": "fsview", "LINK": "fsview", "LOCAL": "fsview", "UnionView": "fsview",
    "listing": "fsview",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = face(__name__, EXPORTS)
