"""A byte range of an open file, read as a file of its own: a DCP data file holds one
serialised item (a torch.save zip) after another, and the zip reader reads each as the file
it was written as. Read-only, by pread: the descriptor's own offset is never used."""
from __future__ import annotations

import io
import os

from mpitailor.formats.io.fileio import read_upto


class Window(io.RawIOBase):
    """Bytes [start, start + size) of file `fd` (the window's 0 is the file's `start`);
    a read past its end ends there."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        super().__init__()
        self.fd, self.start, self.size, self.pos = fd, start, size, 0

    def pread(self, n: int, offset: int) -> bytes:
        """At most n bytes at `offset` of the window (fewer where it or the file ends)."""
        if offset >= self.size or n <= 0:
            return b""
        return read_upto(self.fd, min(n, self.size - offset), self.start + offset)

    def readinto(self, b) -> int:
        data = self.pread(len(b), self.pos)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError("seek before the window's start")
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


def pread_in(f, n: int, offset: int) -> bytes:
    """At most n bytes at `offset` of f: a Window, or a file object read by its descriptor."""
    return f.pread(n, offset) if isinstance(f, Window) else read_upto(f.fileno(), n, offset)


def file_size(f) -> int:
    """The size of f: a Window's, or that of the file behind a file object."""
    return f.size if isinstance(f, Window) else os.fstat(f.fileno()).st_size
