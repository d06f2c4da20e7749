"""Byte ranges of files held open: every read, write, kernel copy and fsync of the executor,
the exports and the replication of outputs between nodes goes through these few calls (whole
files go through fileio.py beside it; together, the package's one I/O seam).

Kept apart from the copy engine (engine/copyio.py) so that the rules of the file system live
in one place: a pread or pwrite may move fewer bytes than asked (loop), a short read means a
truncated source (say so, with its path), copy_file_range is missing across file systems
(tell the caller to copy by hand), writeback is started as bytes are written (writeback.py),
and an output is durable only after its fsync.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.failpoints import io_step
from mpitailor.formats.io import writeback
from mpitailor.formats.io.crc import crc32
from mpitailor.formats.io.fileio import fsync_fd, read_exact

KERNEL_CHUNK = 64 << 20  # bytes per copy_file_range call: large, yet writeback starts early
_NO_KERNEL_COPY = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def pread_into(fd: int, view: memoryview, offset: int, path: str, left: int) -> int:
    """Read up to len(view) bytes at offset into view; return how many (> 0). A failed or
    empty read is the source's fault, and says so with its path and the `left` bytes of the
    range that did not come."""
    try:
        got = os.preadv(fd, [view], offset)
    except OSError as e:
        raise CheckpointError(f"{path}: read failed ({e}); the file is damaged") from None
    if got <= 0:
        raise CheckpointError(f"{path}: ends {left} bytes early at offset {offset}; the file "
                              f"is truncated")
    return got


def pread_exact(fd: int, n: int, offset: int, path: str) -> bytes:
    """Exactly n bytes at offset (a short file is a truncated one)."""
    try:
        return read_exact(fd, n, offset)
    except EOFError:
        raise CheckpointError(f"{path}: ends before byte {offset + n}; the file is "
                              f"truncated") from None


def pwrite_all(fd: int, data, offset: int) -> None:
    """pwrite all of data (pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    io_step("write", fd=fd, at=(offset, len(view)))
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_out(fd: int, data, offset: int) -> None:
    """pwrite a chunk and start its writeback (the final fsync then waits for little)."""
    pwrite_all(fd, data, offset)
    writeback.start(fd, offset, len(data))


def kernel_copy(src: int, off: int, n: int, dst: int, dst_off: int, path: str) -> int:
    """Copy n bytes inside the kernel (copy_file_range: no pass through this process, a
    reflink where the file system shares extents); return how many it copied, fewer than n
    only where the file systems cannot (the caller copies the rest through its buffers)."""
    done = 0
    while done < n:
        io_step("copy", fd=dst, at=(dst_off + done, min(n - done, KERNEL_CHUNK)))
        try:
            k = os.copy_file_range(src, dst, min(n - done, KERNEL_CHUNK), off + done,
                                   dst_off + done)
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise  # a full disk, an I/O error: as any write's
            return done
        if k == 0:
            raise CheckpointError(f"{path}: ends {n - done} bytes early at offset "
                                  f"{off + done}; the file is truncated")
        writeback.start(dst, dst_off + done, k)
        done += k
    return done


def create_sized(path: Path, size: int, head: bytes = b"") -> int:
    """A new file (never an existing one) of `size` bytes, `head` at its start, the rest
    zeros until written; returns its descriptor, open for writing."""
    io_step("create", path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pwrite_all(fd, head, 0)
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_output(path: Path) -> int:
    """An output file made earlier (create_sized), open for writing more of it."""
    return os.open(path, os.O_WRONLY)


def pwrite_synced(path: Path, pieces: Iterable[tuple[int, bytes]]) -> None:
    """Write each (offset, data) of pieces into the output file at path, then fsync it."""
    fd = open_output(path)
    try:
        for offset, data in pieces:
            pwrite_all(fd, data, offset)
        fsync_fd(fd)
    finally:
        os.close(fd)


def fsync_close(fds: dict) -> None:
    """fsync and close every file of fds (any key -> descriptor), emptying it; one that
    fails is closed all the same, and the others are left for close_all."""
    while fds:
        _, fd = fds.popitem()
        try:
            fsync_fd(fd)
        finally:
            os.close(fd)


def close_all(fds: dict) -> None:
    """Close every file of fds without syncing them (a failed job's outputs), emptying it."""
    while fds:
        os.close(fds.popitem()[1])


class CrcWriter:
    """Writes keyed byte streams that arrive in pieces, in order (the MPI exchange's write
    callback), each at its place, and keeps each stream's running CRC-32: the bytes are
    checked as they land, without reading them back. place(key) -> (descriptor, offset of
    the stream's byte 0)."""

    def __init__(self, place: Callable[[int], tuple[int, int]]) -> None:
        self.place = place
        self.crcs: dict[int, int] = {}

    def write(self, key: int, off: int, data: bytes) -> int:
        """Write the piece at the stream's offset off; return the stream's CRC-32 so far."""
        fd, base = self.place(key)
        pwrite_all(fd, data, base + off)
        crc = self.crcs[key] = crc32(data, self.crcs.get(key, 0))
        return crc
