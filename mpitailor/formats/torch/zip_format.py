"""torch.save's zip container: the facts zip_read.py checks and zip_write.py reproduces.

Container facts relied on (torch 2.x: PyTorchStreamWriter over miniz 3, zip64 mode on; each
checked byte for byte against torch.save in tests/test_ptzip.py):

- Every name is "<archive>/<record>"; <archive> is "archive" when torch.save writes to a file
  object. Record order: data.pkl, .format_version ("1"), .storage_alignment ("64"), byteorder,
  data/0 .. data/N-1 (keys in order of first appearance in the pickle), then the two records
  the C++ writer adds when it closes: version ("3\\n") and .data/serialization_id.
- Records are stored (method 0) with time and date 0, back to back with no gaps: the next
  local header starts where the previous record ends.
- Local header: flags 0x0808 (bit 3: sizes and CRC follow the data; bit 11: UTF-8), CRC and
  sizes 0. A record of 0 bytes has flags 0x0800 and no descriptor. Its extra field is a zip64
  field (id 1) when size or header offset is >= 0xFFFFFFFF (size then as uncompressed size
  followed by a compressed size of 0, since miniz writes it before compressing; then the
  offset), followed by torch's "FB" field of 'Z' bytes that pads the data start to a
  multiple of the storage alignment (64).
- Data descriptor after the data: PK\\7\\8, CRC, sizes: 32-bit (16 bytes), or 64-bit (24
  bytes) when the record has a zip64 field.
- Central directory entries: versions 0, the same flags, CRC, sizes and offset (0xFFFFFFFF
  where the value does not fit, the value then in a zip64 field: both sizes, then offset).
  No padding field. Then a zip64 end record (made by 0x031E, needs 45) and its locator,
  always, even for a small file; then the end record.

What torch.load checks: the central directory (miniz: every record lies inside the file,
zip64 fields where a value is 0xFFFFFFFF), the folder of the first name, the version record;
it finds a record's data from its local header's name and extra lengths. It does not check
CRCs (zipfile does). With .format_version >= 1 it may also compute storage offsets itself,
walking from data/0 and assuming miniz's exact padding and descriptor sizes
(torch.utils.serialization.config.load.calculate_storage_offsets, map_location="meta"):
which is why this module reproduces those rather than writing a plainer zip.
"""
from __future__ import annotations

import re
import struct

MAX32 = 0xFFFFFFFF  # at or above it a size or offset goes to a zip64 field
LOCAL = struct.Struct("<IHHHHHIIIHH")  # local header: 30 bytes
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header: 46 bytes
# zip64 end record (signature, size of the rest: 44, versions, disks, entries on this disk
# and in all, directory size and offset): 56 bytes; its locator (disk, offset, disks): 20
ZIP64_END = struct.Struct("<IQHHIIQQQQ")
ZIP64_LOCATOR = struct.Struct("<IIQI")
VERSION = re.compile(rb"\d{1,3}\n?")  # torch writes b"3\n"
MAX_FORMAT_VERSION = 10  # the newest torch 2.13 reads
DOS_DIRECTORY = 0x10  # the external attributes' directory bit
UTF8, DESCRIPTOR = 0x800, 0x8  # the general-purpose flags torch's writer sets
TORCH_FLAGS = UTF8 | DESCRIPTOR
SERIAL_ID = ".data/serialization_id"
ALIGNMENT = 64  # torch's storage alignment (.storage_alignment)
MAX_PICKLE = 1 << 30  # a data.pkl larger than this is not a checkpoint's
