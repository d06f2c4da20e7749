"""torch.save's zip container, written directly and laid out before any byte is written.

`describe(obj)` gives every record torch.save(obj) would write, the storages by reference
(their bytes are never read); `TorchFile.layout()` places them in the file. Big storage bytes
can then be copied straight to their final offsets by other code (copy_file_range, pwrite,
several processes into one file), and the header bytes that hold CRC-32s written afterwards.

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

import hashlib
import os
import re
import struct
import sys
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpitailor.formats import torchpickle
from mpitailor.formats.crc import crc32, crc32_combine
from mpitailor.formats.fileio import created
from mpitailor.formats.tensorref import Storage

MAX32 = 0xFFFFFFFF  # at or above it a size or offset goes to a zip64 field
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_VERSION = re.compile(rb"\d{1,3}\n?")  # torch writes b"3\n"
MAX_FORMAT_VERSION = 10  # the newest torch 2.13 reads
_DOS_DIRECTORY = 0x10  # the external attributes' directory bit
_UTF8, _DESCRIPTOR = 0x800, 0x8  # the general-purpose flags torch's writer sets
_TORCH_FLAGS = _UTF8 | _DESCRIPTOR
_SERIAL_ID = ".data/serialization_id"
ALIGNMENT = 64  # torch's storage alignment (.storage_alignment)
# The records torch's C++ writer adds when it closes the file (torch 2.x): the version, and
# a 40-digit serialization id (derived here from the content: see _serialization_id).
_TRAILER = (("version", b"3\n"), (_SERIAL_ID, 40))
MAX_PICKLE = 1 << 30  # a data.pkl larger than this is not a checkpoint's


@dataclass(frozen=True, slots=True)
class Record:
    """One record of a torch file: small ones with their bytes, storages by reference."""
    name: str  # inside the archive folder: "data.pkl", "data/0", ...
    size: int
    data: bytes | None = None
    storage: Storage | None = None  # never read here


@dataclass(frozen=True, slots=True)
class TorchFile:
    """What torch.save(obj) would write, in its order."""
    records: tuple[Record, ...]
    alignment: int

    @property
    def pickle(self) -> bytes:
        return next(r.data for r in self.records if r.name == "data.pkl")

    def storages(self) -> list[tuple[int, Record]]:
        """(index into records, record) of each storage record."""
        return [(i, r) for i, r in enumerate(self.records) if r.storage is not None]

    def layout(self, archive: str = "archive") -> ZipLayout:
        return ZipLayout.plan([(r.name, r.size) for r in self.records], archive, self.alignment)


def _serialization_id(records: list[Record], width: int) -> bytes:
    # torch derives its id from the records' CRCs, which are not known until the storages are
    # written; this one is a hash of everything known up front (names, sizes, small records'
    # bytes), so the same object gives the same file.
    h = hashlib.sha256()
    for r in records:
        h.update(f"{r.name}\0{r.size}\0".encode())
        h.update(r.data or b"")
    return str(int.from_bytes(h.digest(), "little") % 10 ** width).zfill(width).encode()


def describe(obj) -> TorchFile:
    """The records torch.save(obj) writes, without reading storages: obj holds tensors as
    tensorref.Tensor (torch's own are the training side's, which calls torch.save)."""
    data, storages = torchpickle.dumps(obj)
    records = [Record("data.pkl", len(data), data=data),
               Record(".format_version", 1, data=b"1"),
               Record(".storage_alignment", len(str(ALIGNMENT)), data=str(ALIGNMENT).encode()),
               Record("byteorder", len(sys.byteorder), data=sys.byteorder.encode())]
    records += [Record(f"data/{i}", s.nbytes, storage=s) for i, s in enumerate(storages)]
    for name, data in _TRAILER:
        if name == _SERIAL_ID:
            data = _serialization_id(records, data)
        records.append(Record(name, len(data), data=data))
    return TorchFile(tuple(records), ALIGNMENT)


# ---- reading a torch file's container ---------------------------------------------------

def read_records(f) -> dict[str, tuple[int, int, int]]:
    """{full record name: (data offset, size, CRC-32)} of the torch zip open as binary file
    f; zipfile.BadZipFile for a file that is not one, whose records lie past its end, share
    a name (torch reads the first, zipfile the last) or overlap (one record's bytes would
    be another's)."""
    size = os.fstat(f.fileno()).st_size
    out, spans = {}, []
    try:
        z = zipfile.ZipFile(f)
    except NotImplementedError as e:  # a "version needed" zipfile does not know
        raise zipfile.BadZipFile(str(e)) from None
    with z:
        # zipfile shifts every offset when the central directory does not lie where the end
        # record says (data prepended to a zip); torch (miniz) does not: two readings.
        end = zipfile._EndRecData(f)  # type: ignore[attr-defined]
        if end is None or end[zipfile._ECD_OFFSET] != z.start_dir:  # type: ignore[attr-defined]
            raise zipfile.BadZipFile("the central directory is not where the end record says")
        if end[zipfile._ECD_DISK_NUMBER] or end[zipfile._ECD_DISK_START] or not (  # type: ignore
                end[zipfile._ECD_ENTRIES_THIS_DISK] == end[zipfile._ECD_ENTRIES_TOTAL]  # type: ignore
                == len(z.infolist())):
            raise zipfile.BadZipFile("a zip of several disks, or an end record that miscounts "
                                     "its records")
        _check_central_directory(f, z.start_dir, end[zipfile._ECD_SIZE],  # type: ignore
                                 len(z.infolist()), size)
        for info in z.infolist():
            if info.filename in out:
                raise zipfile.BadZipFile(f"two records named {info.filename}")
            if info.compress_type != zipfile.ZIP_STORED:
                raise zipfile.BadZipFile(f"record {info.filename} is compressed")
            if info.compress_size != info.file_size:  # miniz refuses a stored record so
                raise zipfile.BadZipFile(f"record {info.filename}: two sizes")
            if info.flag_bits & ~_TORCH_FLAGS or not (info.flag_bits & _UTF8
                                                      or info.filename.isascii()):
                # torch reads names as UTF-8 (zipfile as cp437 without the flag) and refuses
                # encrypted, masked or patch records (miniz: "unsupported encryption")
                raise zipfile.BadZipFile(f"record {info.filename!r:.60}: flags "
                                         f"{info.flag_bits:#x} (encrypted, or its name not "
                                         f"UTF-8)")
            head = os.pread(f.fileno(), _LOCAL.size, info.header_offset)
            if len(head) < _LOCAL.size or head[:4] != b"PK\x03\x04":
                raise zipfile.BadZipFile(f"record {info.filename}: no local header")
            name_len, extra_len = _LOCAL.unpack(head)[-2:]
            start = info.header_offset + _LOCAL.size + name_len + extra_len
            if start + info.file_size > size:
                raise zipfile.BadZipFile(f"record {info.filename} lies past the end of the file")
            out[info.filename] = (start, info.file_size, info.CRC)
            spans.append((info.header_offset, start + info.file_size, info.filename))
    spans.sort()
    for (_, end, name), (head, _, other) in zip(spans, spans[1:]):
        if head < end:
            raise zipfile.BadZipFile(f"records {name} and {other} overlap")
    return out


def _check_central_directory(f, start: int, length: int, count: int, size: int) -> None:
    """The central directory as miniz (torch's reader) walks it: `count` headers that tile
    its `length` bytes exactly, each on disk 0. zipfile reads a header whose name, extra or
    comment runs past the directory's end, or that names another disk; miniz refuses both."""
    if start + length > size:
        raise zipfile.BadZipFile("the central directory runs past the end of the file")
    data = os.pread(f.fileno(), length, start)
    at = 0
    for _ in range(count):
        if at + _CENTRAL.size > len(data) or data[at:at + 4] != b"PK\x01\x02":
            raise zipfile.BadZipFile("a central directory header out of place")
        fields = _CENTRAL.unpack_from(data, at)
        name_len, extra_len, comment_len, disk, _, attributes = fields[10:16]
        at += _CENTRAL.size + name_len + extra_len + comment_len
        if at > len(data) or disk != 0:
            raise zipfile.BadZipFile("a central directory header that runs past the "
                                     "directory's end or names another disk")
        if attributes & _DOS_DIRECTORY:  # miniz then reads the record as no bytes
            raise zipfile.BadZipFile("a record marked as a directory")
    if at != len(data):
        raise zipfile.BadZipFile("a central directory whose headers do not fill it")


def archive_of(records: dict[str, tuple[int, int, int]]) -> str:
    """The folder every record name starts with ("archive" when saved to a file object);
    zipfile.BadZipFile where a record lies outside it (torch refuses such a file)."""
    first = next(iter(records), "")
    archive = first.partition("/")[0]
    stray = next((n for n in records if n.partition("/")[0] != archive or "/" not in n), None)
    if stray is not None:
        raise zipfile.BadZipFile(f"record {stray} is not in the folder {archive}/")
    if f"{archive}/version" not in records and f"{archive}/.data/version" not in records:
        raise zipfile.BadZipFile("no version record (torch writes one in every file)")
    return archive


def read_pickle(f, records: dict[str, tuple[int, int, int]]) -> bytes:
    """The data.pkl record's bytes, checked against its CRC-32, after the records torch
    reads around it: `byteorder` (torch refuses any but little or big; mpitailor reads
    little-endian files only), `.storage_alignment` (torch parses it with int()), the
    format `version` (torch reads 1 to 10) and `.data/serialization_id` (torch decodes it
    as UTF-8)."""
    archive = archive_of(records)
    order = _record(f, records, f"{archive}/byteorder", 16)
    if order is not None and order != b"little":
        raise zipfile.BadZipFile(f"byteorder {order[:16]!r}: mpitailor reads the files of "
                                 f"little-endian machines only")
    alignment = _record(f, records, f"{archive}/.storage_alignment", 32)
    try:
        alignment is None or int(alignment)
    except ValueError:
        raise zipfile.BadZipFile(f".storage_alignment {alignment[:32]!r}: not a number") \
            from None
    for name in ("version", ".data/version"):  # torch parses it: a format of 1 to 10
        version = _record(f, records, f"{archive}/{name}", 32)
        if version is not None and not (_VERSION.fullmatch(version)
                                        and 1 <= int(version) <= MAX_FORMAT_VERSION):
            raise zipfile.BadZipFile(f"{name} {version[:32]!r}: not a torch file format "
                                     f"version (1 to {MAX_FORMAT_VERSION})")
    serial = _record(f, records, f"{archive}/{_SERIAL_ID}", 1024)
    try:
        serial is None or serial.decode("utf-8")  # torch decodes it (after the pickle)
    except UnicodeDecodeError:
        raise zipfile.BadZipFile(f"{_SERIAL_ID} {serial[:32]!r}: not UTF-8") from None
    data = _record(f, records, f"{archive}/data.pkl", MAX_PICKLE)
    if data is None:
        raise zipfile.BadZipFile("no data.pkl record: not a torch file")
    return data


def _record(f, records: dict[str, tuple[int, int, int]], name: str, most: int
            ) -> bytes | None:
    """The bytes of a small record, checked against its CRC-32; None where there is none."""
    if name not in records:
        return None
    offset, size, crc = records[name]
    if size > most:
        raise zipfile.BadZipFile(f"a {name.partition('/')[2]} of {size} bytes")
    data = os.pread(f.fileno(), size, offset)
    if len(data) != size or crc32(data) != crc:
        raise zipfile.BadZipFile(f"{name.partition('/')[2]} fails its CRC-32 check")
    return data


@dataclass(frozen=True, slots=True)
class ZipEntry:
    """Where one record lies: local header, then data, then data descriptor."""
    name: str  # full zip name: "archive/data/0"
    size: int
    header_offset: int
    data_offset: int

    @property
    def zip64(self) -> bool:
        return self.size >= MAX32 or self.header_offset >= MAX32

    @property
    def data_end(self) -> int:
        return self.data_offset + self.size

    @property
    def end(self) -> int:
        return self.data_end + (0 if self.size == 0 else 24 if self.zip64 else 16)


def _zip64_extra(values: list[int]) -> bytes:
    return struct.pack(f"<HH{len(values)}Q", 1, 8 * len(values), *values) if values else b""


def _local_zip64(size: int, offset: int) -> list[int]:
    # miniz writes the local zip64 field before compressing: compressed size 0.
    return ([size, 0] if size >= MAX32 else []) + ([offset] if offset >= MAX32 else [])


def _central_zip64(size: int, offset: int) -> list[int]:
    return ([size, size] if size >= MAX32 else []) + ([offset] if offset >= MAX32 else [])


@dataclass(frozen=True, slots=True)
class ZipLayout:
    """Every byte offset of a torch file, from record names and sizes alone."""
    entries: tuple[ZipEntry, ...]
    alignment: int
    cd_offset: int  # the central directory; `tail` is written here
    cd_size: int
    size: int  # of the whole file

    @classmethod
    def plan(cls, records: Iterable[tuple[str, int]], archive: str = "archive",
             alignment: int = 64) -> ZipLayout:
        entries, pos = [], 0
        for name, size in records:
            full = f"{archive}/{name}"
            start = pos + _LOCAL.size + len(full.encode()) + 4  # 4: the "FB" field's header
            start += len(_zip64_extra(_local_zip64(size, pos)))
            data = start + (-start % alignment)  # torch's getPadding
            entries.append(ZipEntry(full, size, pos, data))
            pos = entries[-1].end
        cd_size = sum(_CENTRAL.size + len(e.name.encode())
                      + len(_zip64_extra(_central_zip64(e.size, e.header_offset)))
                      for e in entries)
        return cls(tuple(entries), alignment, pos, cd_size, pos + cd_size + 56 + 20 + 22)

    def local_header(self, i: int) -> bytes:
        """Bytes at entries[i].header_offset, ending where the data begins (no CRC in them)."""
        e = self.entries[i]
        name = e.name.encode()
        z64 = _zip64_extra(_local_zip64(e.size, e.header_offset))
        pad = e.data_offset - (e.header_offset + _LOCAL.size + len(name) + len(z64) + 4)
        extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        head = _LOCAL.pack(0x04034B50, 0, _flags(e), 0, 0, 0, 0, 0, 0, len(name), len(extra))
        return head + name + extra

    def descriptor(self, i: int, crc: int) -> bytes:
        """Bytes at entries[i].data_end: the data's CRC-32 and size (none for 0 bytes)."""
        e = self.entries[i]
        if e.size == 0:
            return b""
        fmt = "<IIQQ" if e.zip64 else "<IIII"
        return struct.pack(fmt, 0x08074B50, crc, e.size, e.size)

    def tail(self, crcs: Sequence[int]) -> bytes:
        """Bytes at cd_offset to the end: central directory, zip64 end records, end record."""
        self._check(crcs)
        out = []
        for e, crc in zip(self.entries, crcs):
            name = e.name.encode()
            extra = _zip64_extra(_central_zip64(e.size, e.header_offset))
            small = min(e.size, MAX32)
            out.append(_CENTRAL.pack(0x02014B50, 0, 0, _flags(e), 0, 0, 0, crc, small, small,
                                     len(name), len(extra), 0, 0, 0, 0,
                                     min(e.header_offset, MAX32)) + name + extra)
        n, end64 = len(self.entries), self.cd_offset + self.cd_size
        out.append(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n,
                               self.cd_size, self.cd_offset))
        out.append(struct.pack("<IIQI", 0x07064B50, 0, end64, 1))
        out.append(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                               min(self.cd_size, MAX32), min(self.cd_offset, MAX32), 0))
        return b"".join(out)

    def pieces(self, crcs: Sequence[int]) -> list[tuple[int, bytes]]:
        """(offset, bytes) of everything but the records' data, for pwrite."""
        self._check(crcs)
        out = [(e.header_offset, self.local_header(i)) for i, e in enumerate(self.entries)]
        out += [(e.data_end, self.descriptor(i, c))
                for i, (e, c) in enumerate(zip(self.entries, crcs)) if e.size]
        return out + [(self.cd_offset, self.tail(crcs))]

    def file_crc(self, crcs: Sequence[int]) -> int:
        """CRC-32 of the whole file, joined from the records' CRCs (nothing is read)."""
        self._check(crcs)
        crc = 0
        for i, (e, c) in enumerate(zip(self.entries, crcs)):
            head, desc = self.local_header(i), self.descriptor(i, c)
            crc = crc32_combine(crc, crc32(head), len(head))
            crc = crc32_combine(crc, c, e.size)
            crc = crc32_combine(crc, crc32(desc), len(desc))
        tail = self.tail(crcs)
        return crc32_combine(crc, crc32(tail), len(tail))

    def _check(self, crcs: Sequence[int]) -> None:
        if len(crcs) != len(self.entries):
            raise ValueError(f"{len(crcs)} CRCs for {len(self.entries)} records")


def _flags(e: ZipEntry) -> int:
    return 0x0800 if e.size == 0 else 0x0808


def write_torch_file(path: Path | str, obj) -> dict:
    """Write obj as torch.save would to a new file; fsync; return its manifest record
    ({"bytes", "crc32"}, as FileRecord.record()) without re-reading it."""
    tf = describe(obj)
    lay = tf.layout()
    crcs = []
    with created(path, buffering=0) as f:
        for i, (rec, e) in enumerate(zip(tf.records, lay.entries)):
            data = rec.data if rec.storage is None else rec.storage.read()
            crcs.append(crc32(data))
            for piece in (lay.local_header(i), data, lay.descriptor(i, crcs[-1])):
                _write_all(f, piece)
            if f.tell() != e.end:
                raise RuntimeError(f"internal error: {path}: {e.name} ends at {f.tell()}, "
                                   f"planned {e.end}")
        _write_all(f, lay.tail(crcs))
    return {"bytes": lay.size, "crc32": f"{lay.file_crc(crcs):08x}"}


def _write_all(f, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]
