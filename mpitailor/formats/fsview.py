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
import zlib
from dataclasses import dataclass
from pathlib import Path

SMALL = 64 << 10  # files up to this size travel in a listing whole (latest, JSON records)
TAIL = 4 << 10    # of a larger file, the CRC of its last bytes (a zip's central directory,
                  # which holds every record's CRC) tells two copies apart


@dataclass(frozen=True, slots=True)
class Entry:
    """One path as a node sees it: a directory, or a file (size; whole if small, else a CRC
    of its tail)."""

    is_dir: bool
    size: int = 0
    data: bytes | None = None
    tail_crc: int = 0

    def same_as(self, other: "Entry") -> bool:
        return (self.is_dir, self.size, self.data, self.tail_crc) == \
            (other.is_dir, other.size, other.data, other.tail_crc)


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

    def read_bytes(self, p: Path, limit: int = -1) -> bytes:
        with open(p, "rb") as f:
            return f.read(limit)


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

    def is_file(self, p: Path) -> bool:
        return (e := self.entries.get(str(p))) is not None and not e.is_dir

    def names(self, d: Path) -> list[str]:
        return sorted(self.children.get(str(d), []))

    def read_bytes(self, p: Path, limit: int = -1) -> bytes:
        e = self.entries.get(str(p))
        if e is None or e.is_dir:
            raise FileNotFoundError(f"{p}: on no node of this job")
        if e.data is None:
            raise OSError(f"{p}: {e.size} bytes, too large to read through the job's listing")
        return e.data if limit < 0 else e.data[:limit]


def listing(root: Path, depth: int = 2) -> dict[str, Entry]:
    """root and what lies below it, `depth` levels down (a save dir, its tag dirs and their
    files), as this process sees it. Links are not followed into directories."""
    out: dict[str, Entry] = {}

    def visit(p: Path, level: int) -> None:
        try:
            st = p.stat()
        except OSError:
            return
        if p.is_dir():
            out[str(p)] = Entry(True)
            if level < depth and not p.is_symlink():
                try:
                    children = sorted(p.iterdir())
                except OSError:
                    return
                for c in children:
                    visit(c, level + 1)
            return
        out[str(p)] = _file_entry(p, st.st_size)

    visit(Path(root), 0)
    return out


def _file_entry(p: Path, size: int) -> Entry:
    try:
        with open(p, "rb") as f:
            if size <= SMALL:
                return Entry(False, size, f.read(SMALL + 1))
            f.seek(size - TAIL)
            return Entry(False, size, None, zlib.crc32(f.read(TAIL)))
    except OSError:
        return Entry(False, size, None, -1)  # unreadable: compared, and refused when read
