"""Incomplete, or unreadable now? What recovery's checks found wrong with a save, sorted
into the two, because retention deletes the one and keeps the other.

Incomplete is proven only by the save's own record: no commit marker (killed mid-save), a
file the record names absent, sizes or CRC-32s that disagree with it. Anything else that
stops a read is "cannot read now" (EACCES, EIO, a stale handle, a FIFO or a link or a dir
where a file should be): it may read whole tomorrow, and it may hold the newest copy of a
layer. Two independent looks say so, and either is enough to keep the save:

- the exception: an OSError anywhere in its chain (the readers in formats/ turn them into
  one-line CheckpointErrors, `from None`, which keeps the OSError as `__context__`) whose
  errno is not absence (ENOENT) or a path that is not a dir (ENOTDIR);
- a walk of the save's tree as this process sees it, opening every file, after the checks:
  a reader that swallowed the OSError, or a file that became unreadable since, shows here
  (`looked_at`; recover's survey and prune's alike, so that a FIFO where the newest save's
  file should be is a refusal of both, never a silent step back to older copies).

And what recovery does with them: `refuse_unreadable` (recover takes no older copy of a
layer because the newer one cannot be read now) and `still_there` (a survey during which a
save went is not whole: one line, run again).
"""
from __future__ import annotations

import dataclasses
import errno
import os
import stat
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.cluster.nodes import Placement
from mpitailor.errors import MpitailorError, UserError
from mpitailor.planning.chain import Chain, Save, follow
from mpitailor.planning.lineage import CannotReadNow

# errnos that say "not there", which a save's own record can prove incomplete
ABSENT = (errno.ENOENT, errno.ENOTDIR)
# the names a save's files have: a directory by such a name is not a save's file
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".json")
MAX_ENTRIES = 100_000  # a save of 8,192 ranks has ~40,000 files
MAX_DEPTH = 3          # checkpoint-N/global_stepN/files


def cannot_read(e: BaseException, also: tuple[int, ...] = ()) -> str | None:
    """Why e says the read failed for now (its OSError's text), else None. also: more
    errnos that are not "now" for the caller."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno not in ABSENT + also:
            return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
        e = e.__cause__ or e.__context__
    return None


def odd_entry(save: Path) -> str | None:
    """The first thing in save's tree that cannot be read now or is not a plain file or dir
    (said: path and why), else None. Follows no link; reads one byte of each file (a file
    that opens reads on: a disk error deeper in shows in the checks' own exception)."""
    todo, count = [(save, 0)], 0
    while todo:
        folder, depth = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            if e.errno in ABSENT and folder != save:
                continue
            return f"{folder}: cannot be listed ({e.strerror})"
        for entry in entries:
            count += 1
            if count > MAX_ENTRIES:  # not looked at whole: not proven incomplete
                return f"{save}: more than {MAX_ENTRIES} entries; not looked at whole"
            why = _entry(Path(entry.path))
            if why is not None:
                return why
            if entry.is_dir(follow_symlinks=False) and depth < MAX_DEPTH:
                todo.append((Path(entry.path), depth + 1))
    return None


def _entry(path: Path) -> str | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: cannot be looked at ({e.strerror})"
    if stat.S_ISDIR(st.st_mode):
        return f"{path}: a directory where a file is expected" \
            if path.name.endswith(FILE_SUFFIXES) else None
    if not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        return f"{path}: {kind}, where a save holds only files"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.pread(fd, 1, 0)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: cannot be read now ({e.strerror})"
    return None


def refuse_unreadable(saves: list[Save], chain: Chain) -> None:
    """A save that cannot be read now and is on the timeline (or newer than its start: it
    may be the start) is not skipped as incomplete ones are: recovering without it would
    take older copies of its layers, silently. CannotReadNow naming it."""
    path = {s.name for s in follow(chain.full, saves) if isinstance(s, Save)} \
        if chain.full.lineage is not None else set()
    for s in saves:
        if s.unreadable and (s.name in path or s.step >= chain.full.step):
            raise CannotReadNow(f"{s.path}: cannot be read now ({s.problem}); it may hold "
                                f"the newest copy of a layer: fix what stops the read (its "
                                f"permissions, the disk, something in place of a file) and "
                                f"run again, or move it out of the save dir to recover "
                                f"without it")


def looked_at(comm: Comm, saves: list[Save], place: Placement) -> list[Save]:
    """Collective: the saves whose checks failed for a cause the exception did not name,
    walked (readable.odd_entry) and marked unreadable if something in them is. Not under
    node-local storage: one process sees only its node's files."""
    if place.node_local:
        return saves

    def look() -> list[Save]:
        out = []
        for s in saves:
            why = odd_entry(s.path) if s.problem is not None and not s.unreadable else None
            out.append(s if why is None else dataclasses.replace(
                s, problem=f"{s.problem} ({why})", unreadable=True))
        return out
    return comm.root_step(look)


def still_there(saves: list[Save]) -> None:
    for s in saves:
        if not os.path.lexists(s.path):
            raise vanished(s.path)


def vanished(path: Path) -> MpitailorError:
    return MpitailorError(f"{path}: removed while it was read (a prune, a save or `clean` "
                          f"running now?); run again")


def refuse_inside_sources(path: Path, sources, what: str) -> None:
    """UserError, one line, where a file the run writes (path: --stats) lies in a source it
    reads (sources: (name, dir) pairs, a recipe's, or every save a recovery's timeline
    needs): written there, it adds to an input or replaces one of its files (a save's
    record, and the save no longer reads). Compared where the path's folder really is."""
    real = Path(os.path.realpath(path.parent)) / path.name
    for name, src in sources:
        src = Path(os.path.realpath(src))
        if real == src or src in real.parents:
            raise UserError(f"{what} {path}: inside the source {name} ({src}), which this "
                            f"run reads and never writes (its retention would delete it "
                            f"with the save); name a path outside the sources")
