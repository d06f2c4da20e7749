"""The package's file I/O below the checkpoint formats, its one I/O seam: bounded reads, byte
ranges of files held open (storage.py), whole files with their manifest record (fileio.py),
CRC-32, the file system a job sees.

The face (lazyface.py): what the rest of the package imports from here, by name."""
from __future__ import annotations

from mpitailor.formats.lazyface import face

EXPORTS = {
    "MAX_CONFIG_BYTES": "boundedio", "MAX_INDEX_BYTES": "boundedio",
    "MAX_MANIFEST_BYTES": "boundedio",
    "MAX_SAFETENSORS_HEADER": "boundedio", "MAX_SIDE_FILE_BYTES": "boundedio",
    "TooLarge": "boundedio", "kind_of": "boundedio", "loads": "boundedio",
    "open_regular": "boundedio", "read_bounded": "boundedio", "read_json": "boundedio",
    "read_small": "boundedio", "shown": "boundedio", "too_large": "boundedio",
    "crc32": "crc", "crc32_combine": "crc", "crc32_zeros": "crc",
    "FileRecord": "filerecord",
    "FILE_CHUNK": "fileio", "copy_synced": "fileio", "crc32_of": "fileio",
    "crc32_range": "fileio", "open_under": "fileio", "created": "fileio",
    "fsync_dir": "fileio", "fsync_file": "fileio", "read_exact": "fileio",
    "read_into": "fileio",
    "read_upto": "fileio", "synced_record": "fileio", "write_synced": "fileio",
    "CrcWriter": "storage", "close_all": "storage", "create_sized": "storage",
    "fsync_close": "storage", "kernel_copy": "storage", "open_output": "storage",
    "pread_exact": "storage", "pread_into": "storage", "pwrite_all": "storage",
    "pwrite_synced": "storage", "write_out": "storage",
    "FileIdentity": "identity", "open_same": "identity", "require_same": "identity",
    "Entry": "fsview", "LINK": "fsview", "LOCAL": "fsview", "UnionView": "fsview",
    "listing": "fsview",
    "Window": "window", "file_size": "window", "pread_in": "window",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = face(__name__, EXPORTS)
