"""torch.save's zip container (zip_format.py), written directly and laid out before any byte
is written.

`describe(obj)` gives every record torch.save(obj) would write, the storages by reference
(their bytes are never read); `TorchFile.layout()` places them in the file. Big storage bytes
can then be copied straight to their final offsets by other code (copy_file_range, pwrite,
several processes into one file), and the header bytes that hold CRC-32s written afterwards.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpitailor.formats.io import crc32, crc32_combine, created
from mpitailor.formats.torch import pickle_write
from mpitailor.formats.torch.tensorref import Storage
from mpitailor.formats.torch.zip_format import (
    ALIGNMENT,
    CENTRAL,
    DESCRIPTOR,
    LOCAL,
    MAX32,
    SERIAL_ID,
    UTF8,
    ZIP64_END,
    ZIP64_LOCATOR,
)

# The records torch's C++ writer adds when it closes the file (torch 2.x): the version, and
# a 40-digit serialization id (derived here from the content: see _serialization_id).
_TRAILER = (("version", b"3\n"), (SERIAL_ID, 40))


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
    data, storages = pickle_write.dumps(obj)
    records = [Record("data.pkl", len(data), data=data),
               Record(".format_version", 1, data=b"1"),
               Record(".storage_alignment", len(str(ALIGNMENT)), data=str(ALIGNMENT).encode()),
               Record("byteorder", len(sys.byteorder), data=sys.byteorder.encode())]
    records += [Record(f"data/{i}", s.nbytes, storage=s) for i, s in enumerate(storages)]
    for name, data in _TRAILER:
        if name == SERIAL_ID:
            data = _serialization_id(records, data)
        records.append(Record(name, len(data), data=data))
    return TorchFile(tuple(records), ALIGNMENT)


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
            start = pos + LOCAL.size + len(full.encode()) + 4  # 4: the "FB" field's header
            start += len(_zip64_extra(_local_zip64(size, pos)))
            data = start + (-start % alignment)  # torch's getPadding
            entries.append(ZipEntry(full, size, pos, data))
            pos = entries[-1].end
        cd_size = sum(CENTRAL.size + len(e.name.encode())
                      + len(_zip64_extra(_central_zip64(e.size, e.header_offset)))
                      for e in entries)
        return cls(tuple(entries), alignment, pos, cd_size, pos + cd_size + 56 + 20 + 22)

    def local_header(self, i: int) -> bytes:
        """Bytes at entries[i].header_offset, ending where the data begins (no CRC in them)."""
        e = self.entries[i]
        name = e.name.encode()
        z64 = _zip64_extra(_local_zip64(e.size, e.header_offset))
        pad = e.data_offset - (e.header_offset + LOCAL.size + len(name) + len(z64) + 4)
        extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        head = LOCAL.pack(0x04034B50, 0, _flags(e), 0, 0, 0, 0, 0, 0, len(name), len(extra))
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
            out.append(CENTRAL.pack(0x02014B50, 0, 0, _flags(e), 0, 0, 0, crc, small, small,
                                     len(name), len(extra), 0, 0, 0, 0,
                                     min(e.header_offset, MAX32)) + name + extra)
        n, end64 = len(self.entries), self.cd_offset + self.cd_size
        out.append(ZIP64_END.pack(0x06064B50, ZIP64_END.size - 12, 0x031E, 45, 0, 0, n, n,
                                  self.cd_size, self.cd_offset))
        out.append(ZIP64_LOCATOR.pack(0x07064B50, 0, end64, 1))
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
    return UTF8 if e.size == 0 else UTF8 | DESCRIPTOR


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
