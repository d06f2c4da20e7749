"""Whole-file I/O: a new file written and fsynced with its manifest record, a file copied so,
a whole file's CRC-32, a directory fsynced, one buffer size for every whole-file read, and
the one loop that fills a buffer from a byte range of a file (read_into and read_exact: all
of it or an error; read_upto: what there is).

storage.py beside it moves byte ranges between files held open; this is its counterpart for
files read or written whole, shared by the readers and writers of formats/ and everything
above them. A file is
created here, never overwritten ("x"), and trusted only once fsynced; what is published is
then renamed into place by publish/staging.py, which fsyncs the directory. Torch-free.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from mpitailor.failpoints import io_done, io_step
from mpitailor.formats.io.crc import crc32
from mpitailor.formats.io.filerecord import FileRecord

FILE_CHUNK = 4 << 20  # bytes a whole-file read or copy holds at a time


def _fill(fd: int, offset: int, view: memoryview) -> int:
    """Read the bytes at `offset` of file `fd` into view until it is full or the file ends
    (a pread may return fewer bytes than asked anywhere); how many came."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def read_into(fd: int, offset: int, out) -> None:
    """Fill the writable buffer `out` (a numpy array, a bytearray) with the bytes at
    `offset` of file `fd`; EOFError if the file ends first."""
    view = memoryview(out).cast("B")
    done = _fill(fd, offset, view)
    if done < len(view):
        raise EOFError(f"file ends {len(view) - done} bytes early")


def read_upto(fd: int, n: int, offset: int) -> bytes:
    """The bytes at `offset` of file `fd`: n of them, fewer where the file ends first (the
    caller checks what came)."""
    out = bytearray(n)
    return bytes(out[:_fill(fd, offset, memoryview(out))])


def read_exact(fd: int, n: int, offset: int) -> bytes:
    """The n bytes at `offset` of file `fd`; EOFError if the file ends first."""
    out = bytearray(n)
    read_into(fd, offset, out)
    return bytes(out)


@contextmanager
def created(path: Path | str, buffering: int = -1) -> Iterator[BinaryIO]:
    """A new file (never an existing one) open for writing, flushed and fsynced when the
    block ends without an error."""
    io_step("create", path)
    with open(path, "xb", buffering=buffering) as f:
        yield f
        io_step("write", fd=f.fileno())  # (buffered: the bytes reach the kernel here)
        f.flush()
        fsync_fd(f.fileno())


def write_synced(path: Path | str, *chunks) -> dict:
    """A new file of the chunks (bytes-like, in order), fsynced; its manifest record, taken
    as it is written."""
    rec = FileRecord()
    with created(path) as f:
        for chunk in chunks:
            rec.update(chunk)
            f.write(chunk)
    return rec.record()


def fsync_dir(path: Path | str) -> None:
    """fsync a directory: the names created, renamed or removed in it are then durable."""
    io_step("fsync-dir", path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)
    io_done()


def copy_synced(src: BinaryIO, dst: Path | str) -> dict:
    """The rest of the open binary file src copied into the new file dst, FILE_CHUNK bytes
    at a time, fsynced; dst's manifest record, taken as it is copied."""
    rec = FileRecord()
    buf = memoryview(bytearray(FILE_CHUNK))
    with created(dst) as f:
        while n := src.readinto(buf):
            rec.update(buf[:n])
            f.write(buf[:n])
    return rec.record()


def fsync_fd(fd: int) -> None:
    """fsync an open file: one step of the seam, logged with the file and when it returns
    (the crash study's power-loss replay reads what it made durable)."""
    io_step("fsync", fd=fd)
    os.fsync(fd)
    io_done()


def fsync_file(path: Path | str) -> None:
    """fsync a file another writer has written (a trainer's own files), not following a
    link: its bytes are then durable."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def synced_record(path: Path | str) -> dict:
    """The manifest record of a file another writer has just written (DeepSpeed's
    torch.save, which writes by path), read back (from the page cache it was just written
    to), and the file fsynced. OSError if it is not a regular file one can open."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        crc, n = crc32_range(fd, 0, size)
        fsync_fd(fd)
    finally:
        os.close(fd)
    return {"bytes": n, "crc32": f"{crc:08x}"}


def crc32_range(fd: int, offset: int, n: int, crc: int = 0) -> tuple[int, int]:
    """(CRC-32, bytes read) of the n bytes at `offset` of file `fd` (continued from `crc`),
    FILE_CHUNK bytes at a time, fewer read where the file ends first. The disk is asked for
    each next chunk while the one before is checksummed (a cold read at the disk's speed,
    not half of it)."""
    pos, end = offset, offset + n
    view = memoryview(bytearray(max(1, min(n, FILE_CHUNK))))
    _advise(fd, offset, n, os.POSIX_FADV_SEQUENTIAL)
    while pos < end:
        _advise(fd, pos + len(view), min(len(view), end - pos - len(view)),
                os.POSIX_FADV_WILLNEED)
        got = os.preadv(fd, [view[:min(end - pos, len(view))]], pos)
        if got <= 0:
            break
        crc = crc32(view[:got], crc)
        pos += got
    return crc, pos - offset


def _advise(fd: int, offset: int, n: int, advice: int) -> None:
    if n > 0:
        try:
            os.posix_fadvise(fd, offset, n, advice)
        except OSError:
            pass  # only a hint


def open_under(root: Path | str, parts: tuple[str, ...]) -> int:
    """The file root/parts... open for reading, each part opened from the one before without
    following a link (a folder swapped for a link after it was looked at is not followed
    either), non-blocking (a fifo never blocks); OSError (ELOOP, ENOTDIR, ENOENT) as os.open
    raises it."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(root, flags | os.O_DIRECTORY)
    try:
        for p in parts[:-1]:
            inner = os.open(p, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        os.close(fd)


def crc32_of(f: BinaryIO) -> int:
    """CRC-32 of the rest of the open binary file f, read FILE_CHUNK bytes at a time into
    one buffer."""
    crc, buf = 0, bytearray(FILE_CHUNK)
    view = memoryview(buf)
    while n := f.readinto(buf):
        crc = crc32(view[:n], crc)
    return crc
