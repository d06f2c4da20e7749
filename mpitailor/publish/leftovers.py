"""What killed runs leave beside their outputs, and taking it back.

A run stages its output in `.NAME.mpitailor-staging` (moved to `.NAME.mpitailor-discard`
while being removed) under the lock `.NAME.mpitailor-lock`; publishing over an existing
output (partial saves) moves the old one to `.NAME.mpitailor-old` for a moment; `prune`
renames what it deletes to `.NAME.mpitailor-pruning` first, under the same lock. SIGKILL, or
a launcher that kills a rank before its clean-up ends, leaves these behind. They belong to
a dead run exactly when nobody holds their lock: `flock` is released by the kernel when its
holder dies, so a lock we can take is a stale one, and while we hold it nobody else can
start writing there.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

STAGING, DISCARD, OLD, LOCK = (".mpitailor-staging", ".mpitailor-discard", ".mpitailor-old",
                               ".mpitailor-lock")
PRUNING = ".mpitailor-pruning"  # a save or composite `prune` renamed away, being removed
SUFFIXES = (STAGING, DISCARD, OLD, LOCK, PRUNING)


def path_of(output: Path, suffix: str) -> Path:
    return output.parent / f".{output.name}{suffix}"


def take_lock(lock_path: Path) -> int | None:
    """The lock's fd, held; None when a live process holds it. OSError (ELOOP: the path is a
    symbolic link, never followed) as os.open raises it."""
    for _ in range(3):
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock_path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder unlinked the file we opened as it let go: open it again
    return None


def is_held(lock_path: Path) -> bool:
    """Whether a live process holds the lock at lock_path (none there: no). Creates and
    removes nothing (a dry run looks with it)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing lets go of the lock, if we took it
    return False


def drop_lock(lock_path: Path, fd: int) -> None:
    """Unlink the lock file, then let go of it (in this order: nobody can take a lock file
    that is about to disappear)."""
    try:
        os.unlink(lock_path)
    except FileNotFoundError:
        pass
    os.close(fd)


def remove(path: Path) -> None:
    """A file, a link (never followed) or a tree."""
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def discard(staging: Path, gone: Path) -> None:
    """Remove a staging dir that writers may still be writing into: renamed away first, so
    nothing written by path lands in it afterwards (a write then fails: its dir is gone),
    then removed. Call with its lock held."""
    if os.path.lexists(gone):
        remove(gone)
    if os.path.islink(staging):
        staging.unlink()
    elif os.path.lexists(staging):
        os.rename(staging, gone)
        remove(gone)


def find(folder: Path) -> dict[str, list[Path]]:
    """Output name -> the leftovers of its runs in folder (not recursive; links listed as
    links, never followed)."""
    found: dict[str, list[Path]] = {}
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return found
    for e in entries:
        for suffix in SUFFIXES:
            if e.name.startswith(".") and e.name.endswith(suffix) and \
                    len(e.name) > len(suffix) + 1:
                found.setdefault(e.name[1:-len(suffix)], []).append(Path(e.path))
    return found


def reclaim(folder: Path, skip: str | None = None) -> list[str]:
    """Remove the leftovers in folder of every output whose lock nobody holds (not `skip`,
    the output being acquired). A `.NAME.mpitailor-old` whose output is missing is the only
    copy of that output (killed between the two renames of a replace): it is put back, not
    removed. Returns what was done, one phrase per path."""
    done = []
    for name, paths in sorted(find(folder).items()):
        if name == skip:
            continue
        output = folder / name
        lock_path = path_of(output, LOCK)
        try:
            fd = take_lock(lock_path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                log.warning("%s: a symbolic link, not a lock; left alone", lock_path)
            continue
        if fd is None:
            continue  # a live run's
        try:
            done += _reclaim_locked(output, paths)
        finally:
            drop_lock(lock_path, fd)
    return done


def reclaim_own(output: Path) -> list[str]:
    """With output's lock held: what killed runs to the same output left."""
    paths = [path_of(output, s) for s in (STAGING, DISCARD, OLD)]
    return _reclaim_locked(output, [p for p in paths if os.path.lexists(p)])


def _reclaim_locked(output: Path, paths: list[Path]) -> list[str]:
    done = []
    for p in sorted(paths):
        if p.name.endswith(LOCK) or not os.path.lexists(p):
            continue
        if p.name.endswith(OLD) and not os.path.lexists(output) and not p.is_symlink():
            os.rename(p, output)
            done.append(f"put back {output} (from {p.name})")
            continue
        remove(p)
        done.append(f"removed {p}")
    if path_of(output, LOCK) in paths:
        done.append(f"removed {path_of(output, LOCK)}")  # by drop_lock, next
    return done
