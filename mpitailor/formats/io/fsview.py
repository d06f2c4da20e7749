"""What a checkpoint's files look like to the code that finds them: the local file system, or
the union of what every node of a job sees (node-local storage).

Finding a checkpoint (files.resolve) needs file names, `latest`, and small JSON records, never
the big rank files. Under DeepSpeed's `use_node_local_storage` each node holds only its own
ranks' files and `latest` sits on one node: no single process sees a whole checkpoint. A
`UnionView` is built from every node's `listing` of the same paths, so that the checks run
once over the whole job's files; the rank files themselves are then read only on the nodes
that hold them. Torch-free.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.io.boundedio import (
    MAX_MANIFEST_BYTES,
    kind_of,
    open_regular,
    read_small,
    shown,
    too_large,
)
from mpitailor.formats.io.crc import crc32

SMALL = 64 << 10  # files up to this size travel in a listing whole (latest, JSON records)
TAIL = 4 << 10    # of a larger file, the CRC of its last bytes (a zip's central directory,
                  # which holds every record's CRC) tells two copies apart at a glance; one
                  # several nodes hold is then compared whole (nodes.survey)


@dataclass(frozen=True, slots=True)
class Entry:
    """One path as a node sees it: a directory, or a file (size; whole if small, else a CRC
    of its tail). odd: what it is if not a plain regular file ("a symbolic link" to one, whose
    bytes are listed; "a FIFO (named pipe)", a device...: never opened, no bytes)."""

    is_dir: bool
    size: int = 0
    data: bytes | None = None
    tail_crc: int = 0
    odd: str = ""

    def same_as(self, other: "Entry") -> bool:
        return (self.is_dir, self.size, self.data, self.tail_crc, self.odd) == \
            (other.is_dir, other.size, other.data, other.tail_crc, other.odd)


class LocalView:
    """The file system as this process sees it."""

    def exists(self, p: Path) -> bool:
        return p.exists()

    def is_dir(self, p: Path) -> bool:
        return p.is_dir()

    def is_file(self, p: Path) -> bool:
        return p.is_file()

    def names(self, d: Path) -> list[str]:
        return [c.name for c in d.iterdir()]

    def read_bytes(self, p: Path, limit: int = MAX_MANIFEST_BYTES,
                   what: str = "a checkpoint's metadata file") -> bytes:
        """A small regular file's bytes (boundedio.read_small: no link followed, at most
        `limit` bytes, else CheckpointError)."""
        return read_small(p, limit, what)


LOCAL = LocalView()


class UnionView:
    """What the nodes of a job see together, from their listings (path -> Entry)."""

    def __init__(self, entries: dict[str, Entry]) -> None:
        self.entries = entries
        self.children: dict[str, list[str]] = {}
        for path in entries:
            parent = os.path.dirname(path)
            if parent != path and parent in entries:
                self.children.setdefault(parent, []).append(os.path.basename(path))

    def exists(self, p: Path) -> bool:
        return str(p) in self.entries

    def is_dir(self, p: Path) -> bool:
        return (e := self.entries.get(str(p))) is not None and e.is_dir

    def is_file(self, p: Path) -> bool:  # as Path.is_file: a regular file, or a link to one
        return (e := self.entries.get(str(p))) is not None and not e.is_dir and \
            e.odd in ("", LINK)

    def names(self, d: Path) -> list[str]:
        return sorted(self.children.get(str(d), []))

    def read_bytes(self, p: Path, limit: int = MAX_MANIFEST_BYTES,
                   what: str = "a checkpoint's metadata file") -> bytes:
        """As LocalView.read_bytes, from the listing."""
        e = self.entries.get(str(p))
        if e is None:
            raise CheckpointError(f"{shown(p)}: {what} not found on any node of this job")
        if e.is_dir or e.odd:
            raise CheckpointError(f"{shown(p)}: {'a directory' if e.is_dir else e.odd}, not a "
                                  f"regular file; {what} must be a regular file")
        if e.size > limit:
            raise too_large(p, e.size, limit, what)
        if e.data is None:
            raise CheckpointError(f"{shown(p)}: {e.size} bytes, too large to read through the "
                                  f"job's listing ({SMALL} bytes at most)")
        return e.data


def listing(root: Path, depth: int = 2) -> dict[str, Entry]:
    """root and what lies below it, `depth` levels down (a save dir, its tag dirs and their
    files), as this process sees it. Links are not followed into directories."""
    out: dict[str, Entry] = {}

    def visit(p: Path, level: int) -> None:
        try:
            st = p.stat()
        except OSError:
            return
        if stat.S_ISDIR(st.st_mode):
            out[str(p)] = Entry(True)
            if level < depth and not p.is_symlink():
                try:
                    children = sorted(p.iterdir())
                except OSError:
                    return
                for c in children:
                    visit(c, level + 1)
            return
        out[str(p)] = _file_entry(p, st)

    visit(Path(root), 0)
    return out


LINK = "a symbolic link"


def _file_entry(p: Path, st: os.stat_result) -> Entry:
    """A file's entry; a FIFO or device is described, never opened (a FIFO would block)."""
    if not stat.S_ISREG(st.st_mode):
        return Entry(False, 0, None, -1, kind_of(st.st_mode))
    odd, size = LINK if p.is_symlink() else "", st.st_size
    try:
        fd = open_regular(p, "a checkpoint file", follow=True)
    except CheckpointError:
        return Entry(False, size, None, -1, odd)  # unreadable: compared, and refused when read
    try:
        with os.fdopen(fd, "rb") as f:
            if size <= SMALL:
                return Entry(False, size, f.read(SMALL + 1), 0, odd)
            f.seek(size - TAIL)
            return Entry(False, size, None, crc32(f.read(TAIL)), odd)
    except OSError:
        return Entry(False, size, None, -1, odd)
