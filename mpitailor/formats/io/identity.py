"""What a file was when mpitailor checked it (device, inode, size, mtime), so that a later open
of it by name can tell that the name now stands for other bytes.

A merge parses and checks a source file once (and, with --verify, its CRCs), then reads it
again by name: the copy step closes its descriptors between partitions to hold few at a
time, and tensors of a loaded file are read when their values are needed. A file renamed
over that name, or rewritten in place, in between would be copied unchecked into the output;
each such open compares the identity recorded at the check and refuses a file that changed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mpitailor.display import shown
from mpitailor.errors import CheckpointError


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """A file as fstat saw it: the same name with another inode, size or mtime is another
    file (or this one written since). Not the ctime: a hard link (a backup's `cp -al`, the
    node-local gather's own links) or a chmod changes it and no byte. What this cannot see:
    a writer who rewrites the file in place and sets its mtime back (utime); --verify checks
    the bytes read against the records' CRC-32s."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, fd: int) -> FileIdentity:
        st = os.fstat(fd)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def change(self, now: FileIdentity) -> str | None:
        """What differs in `now`, in words; None if nothing does."""
        if (self.device, self.inode) != (now.device, now.inode):
            return "another file has its name now"
        if self.size != now.size:
            return f"{self.size} bytes when checked, {now.size} now"
        if self.mtime_ns != now.mtime_ns:
            return "written to since it was checked"
        return None


def require_same(fd: int, path: Path | str, identity: FileIdentity) -> None:
    """CheckpointError (one line naming `path`) if open file `fd` is not `identity`."""
    change = identity.change(FileIdentity.of(fd))
    if change is not None:
        raise changed_error(path, change)


def open_same(path: Path | str, identity: FileIdentity) -> int:
    """A read-only fd of `path`, the very file `identity` recorded; CheckpointError if the
    name is gone or now stands for another file. O_NONBLOCK: a FIFO put there does not
    block the open (its identity then differs)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise changed_error(path, f"cannot open it again: {e.strerror}") from None
    try:
        require_same(fd, path, identity)
    except BaseException:
        os.close(fd)
        raise
    return fd


def changed_error(path: Path | str, why: str) -> CheckpointError:
    # The run stops before anything is published: the output is staged until it is whole.
    return CheckpointError(f"{shown(path)}: changed while mpitailor was reading it ({why}); "
                           f"nothing was published: run again once nothing writes to the "
                           f"save dir")
