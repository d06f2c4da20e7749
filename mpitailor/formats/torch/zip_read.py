"""Reading torch.save's zip container (zip_format.py): its records where torch's reader
(miniz) finds them, refusing what it refuses, and the `data.pkl` record's bytes."""
from __future__ import annotations

import zipfile

from mpitailor.formats.io import crc32, file_size, pread_in
from mpitailor.formats.torch.zip_format import (
    CENTRAL,
    DOS_DIRECTORY,
    LOCAL,
    MAX_FORMAT_VERSION,
    MAX_PICKLE,
    SERIAL_ID,
    TORCH_FLAGS,
    UTF8,
    VERSION,
    ZIP64_END,
    ZIP64_LOCATOR,
)


def read_records(f) -> dict[str, tuple[int, int, int]]:
    """{full record name: (data offset, size, CRC-32)} of the torch zip open as binary file
    f (or a Window of a file); zipfile.BadZipFile for a file that is not one, whose records
    lie past its end, share a name (torch reads the first, zipfile the last), have a name in
    upper case (torch writes lower case and its miniz finds a name ignoring case:
    `BYTEORDER` or a second `DATA.PKL` would be torch's record, not mpitailor's) or overlap
    (one record's bytes would be another's)."""
    size = file_size(f)
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
        _check_framing(f, end[zipfile._ECD_LOCATION], z.start_dir)  # type: ignore
        _check_central_directory(f, z.start_dir, end[zipfile._ECD_SIZE],  # type: ignore
                                 len(z.infolist()), size)
        for info in z.infolist():
            if info.filename in out:
                raise zipfile.BadZipFile(f"two records named {info.filename}")
            rest = info.filename.partition("/")[2]
            if rest != rest.lower():
                raise zipfile.BadZipFile(f"record {info.filename!r:.80}: a name torch does not "
                                         f"write (upper case)")
            if rest == "constants.pkl":
                # torch.load hands a zip holding it to torch.jit.load (TorchScript)
                raise zipfile.BadZipFile(f"record {info.filename!r:.80}: a TorchScript archive, "
                                         f"not a checkpoint")
            if info.compress_type != zipfile.ZIP_STORED:
                raise zipfile.BadZipFile(f"record {info.filename} is compressed")
            if info.compress_size != info.file_size:  # miniz refuses a stored record so
                raise zipfile.BadZipFile(f"record {info.filename}: two sizes")
            if info.flag_bits & ~TORCH_FLAGS or not (info.flag_bits & UTF8
                                                      or info.filename.isascii()):
                # torch reads names as UTF-8 (zipfile as cp437 without the flag) and refuses
                # encrypted, masked or patch records (miniz: "unsupported encryption")
                raise zipfile.BadZipFile(f"record {info.filename!r:.60}: flags "
                                         f"{info.flag_bits:#x} (encrypted, or its name not "
                                         f"UTF-8)")
            head = pread_in(f, LOCAL.size, info.header_offset)
            if len(head) < LOCAL.size or head[:4] != b"PK\x03\x04":
                raise zipfile.BadZipFile(f"record {info.filename}: no local header")
            name_len, extra_len = LOCAL.unpack(head)[-2:]
            start = info.header_offset + LOCAL.size + name_len + extra_len
            if start + info.file_size > size:
                raise zipfile.BadZipFile(f"record {info.filename} lies past the end of the file")
            out[info.filename] = (start, info.file_size, info.CRC)
            spans.append((info.header_offset, start + info.file_size, info.filename))
    spans.sort()
    for (_, end, name), (head, _, other) in zip(spans, spans[1:]):
        if head < end:
            raise zipfile.BadZipFile(f"records {name} and {other} overlap")
    return out


def _check_framing(f, end_at: int, start_dir: int) -> None:
    """Where torch and zipfile would find the zip's parts, the same: the file begins with a
    record (torch reads any other file as a legacy pickle, which weights_only=False runs
    from byte 0), and a zip64 end record lies where its locator says (miniz follows the
    locator; zipfile takes the record just before it, so a second directory would be torch's
    alone), naming the central directory zipfile read."""
    if pread_in(f, 4, 0) != b"PK\x03\x04":
        raise zipfile.BadZipFile("the file does not begin with a zip record (torch would read "
                                 "it as a legacy pickle)")
    loc_at = end_at - ZIP64_LOCATOR.size
    locator = pread_in(f, ZIP64_LOCATOR.size, loc_at) if loc_at >= 0 else b""
    if locator[:4] != b"PK\x06\x07":
        return  # no zip64 records: one end record, which both read
    _, disk, record_at, disks = ZIP64_LOCATOR.unpack(locator)
    if (disk, disks) != (0, 1):  # miniz: "unsupported multidisk archive"; zipfile takes 0 too
        raise zipfile.BadZipFile("a zip64 locator of several disks")
    bad = zipfile.BadZipFile("a zip64 end record that is not where its locator says, or that "
                             "names another central directory")
    if record_at != loc_at - ZIP64_END.size:
        raise bad
    record = pread_in(f, ZIP64_END.size, record_at)
    if len(record) != ZIP64_END.size:
        raise bad
    signature, rest, *_, cd_offset = ZIP64_END.unpack(record)
    if signature != 0x06064B50 or rest != ZIP64_END.size - 12 or cd_offset != start_dir:
        raise bad


def _check_central_directory(f, start: int, length: int, count: int, size: int) -> None:
    """The central directory as miniz (torch's reader) walks it: `count` headers that tile
    its `length` bytes exactly, each on disk 0. zipfile reads a header whose name, extra or
    comment runs past the directory's end, or that names another disk; miniz refuses both."""
    if start + length > size:
        raise zipfile.BadZipFile("the central directory runs past the end of the file")
    data = pread_in(f, length, start)
    at = 0
    for _ in range(count):
        if at + CENTRAL.size > len(data) or data[at:at + 4] != b"PK\x01\x02":
            raise zipfile.BadZipFile("a central directory header out of place")
        fields = CENTRAL.unpack_from(data, at)
        name_len, extra_len, comment_len, disk, _, attributes = fields[10:16]
        if b"\0" in data[at + CENTRAL.size:at + CENTRAL.size + name_len]:
            # zipfile ends a name at its first NUL, torch does not: each would read a
            # record the other cannot name
            raise zipfile.BadZipFile("a record name with a NUL byte in it")
        at += CENTRAL.size + name_len + extra_len + comment_len
        if at > len(data) or disk != 0:
            raise zipfile.BadZipFile("a central directory header that runs past the "
                                     "directory's end or names another disk")
        if attributes & DOS_DIRECTORY:  # miniz then reads the record as no bytes
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
    """The data.pkl record's bytes, checked against its CRC-32, once the records torch reads
    around it pass (check_markers)."""
    archive = archive_of(records)
    check_markers(f, records, archive)
    data = _record(f, records, f"{archive}/data.pkl", MAX_PICKLE)
    if data is None:
        raise zipfile.BadZipFile("no data.pkl record: not a torch file")
    return data


def check_markers(f, records: dict[str, tuple[int, int, int]], archive: str) -> None:
    """zipfile.BadZipFile unless the small records torch reads around the pickle are what it
    accepts: `byteorder` (torch refuses any but little or big; mpitailor reads
    little-endian files only), `.storage_alignment` (torch parses it with int()), the format
    `version` (torch reads 1 to 10) and `.data/serialization_id` (torch decodes it as
    UTF-8)."""
    order = _record(f, records, f"{archive}/byteorder", 16)
    if order is not None and order != b"little":
        raise zipfile.BadZipFile(f"byteorder {order[:16]!r}: mpitailor reads the files of "
                                 f"little-endian machines only")
    alignment = _record(f, records, f"{archive}/.storage_alignment", 32)
    if alignment is not None and not _parses_as_int(alignment):
        raise zipfile.BadZipFile(f".storage_alignment {alignment[:32]!r}: not a number")
    for name in ("version", ".data/version"):  # torch parses it: a format of 1 to 10
        version = _record(f, records, f"{archive}/{name}", 32)
        if version is not None and not (VERSION.fullmatch(version)
                                        and 1 <= int(version) <= MAX_FORMAT_VERSION):
            raise zipfile.BadZipFile(f"{name} {version[:32]!r}: not a torch file format "
                                     f"version (1 to {MAX_FORMAT_VERSION})")
    serial = _record(f, records, f"{archive}/{SERIAL_ID}", 1024)
    if serial is not None and not _is_utf8(serial):  # torch decodes it (after the pickle)
        raise zipfile.BadZipFile(f"{SERIAL_ID} {serial[:32]!r}: not UTF-8")


def _parses_as_int(data: bytes) -> bool:
    """Whether Python's int(), with which torch parses .storage_alignment, takes it."""
    try:
        int(data)
    except ValueError:
        return False
    return True


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _record(f, records: dict[str, tuple[int, int, int]], name: str, most: int
            ) -> bytes | None:
    """The bytes of a small record, checked against its CRC-32; None where there is none."""
    if name not in records:
        return None
    offset, size, crc = records[name]
    if size > most:
        raise zipfile.BadZipFile(f"a {name.partition('/')[2]} of {size} bytes")
    data = pread_in(f, size, offset)
    if len(data) != size or crc32(data) != crc:
        raise zipfile.BadZipFile(f"{name.partition('/')[2]} fails its CRC-32 check")
    return data
