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
import socket
import stat
from pathlib import Path

from mpitailor import failpoints
from mpitailor.display import escaped, shown
from mpitailor.errors import MergeFailed

log = logging.getLogger(__name__)

STAGING, DISCARD, OLD, LOCK = (".mpitailor-staging", ".mpitailor-discard", ".mpitailor-old",
                               ".mpitailor-lock")
PRUNING = ".mpitailor-pruning"  # a save or composite `prune` renamed away, being removed
SUFFIXES = (STAGING, DISCARD, OLD, LOCK, PRUNING)


def path_of(output: Path, suffix: str) -> Path:
    return output.parent / f".{output.name}{suffix}"


# What this process is, as the locks it takes say (holder_of): the CLI names its command.
_holder = ["an mpitailor process (a training run's layer-wise save, or the Python API)"]


def set_holder(what: str) -> None:
    """Name this process in the locks it takes from now on (say `mpitailor clean`)."""
    _holder[0] = what


def take_lock(lock_path: Path) -> int | None:
    """The lock's fd, held, with this process named in the file (holder_of); None when a
    live process holds it. OSError as os.open raises it (ELOOP: the path is a symbolic
    link, never followed), or EINVAL where something other than a regular file lies there
    (a FIFO: a lock taken on it, drop_lock would unlink someone's FIFO)."""
    for _ in range(3):
        fd = os.open(lock_path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o644)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file, as a lock is", str(lock_path))
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
            _name_holder(fd)
            return fd
        os.close(fd)  # its holder unlinked the file we opened as it let go: open it again
    return None


def _name_holder(fd: int) -> None:
    text = f"{_holder[0]} (pid {os.getpid()} on {socket.gethostname()})\n"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode("utf-8", "backslashreplace"), 0)
    except OSError:  # a lock that says nothing still locks
        pass


def holder_of(lock_path: Path) -> str:
    """Who holds the lock at lock_path, as its holder wrote it (escaped, first line, at
    most 200 bytes read); a generic phrase when it says nothing (an older mpitailor, or
    read between its taking and its writing)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            raw = os.pread(fd, 200, 0) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        finally:
            os.close(fd)
    except OSError:
        raw = b""
    text = escaped(raw.decode("utf-8", "replace").split("\n")[0].strip())
    return text or "another mpitailor process (it did not say which)"


def is_held(lock_path: Path) -> bool:
    """Whether a live process holds the lock at lock_path (none there: no). Creates and
    removes nothing (a dry run looks with it). OSError for what no lock is: a link (ELOOP),
    or not a regular file (EINVAL; a FIFO opened without O_NONBLOCK would block forever)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file, as a lock is", str(lock_path))
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing lets go of the lock, if we took it
    return False


def drop_lock(lock_path: Path, fd: int) -> None:
    """Unlink the lock file, then let go of it (in this order: nobody can take a lock file
    that is about to disappear). An OSError of the unlink is raised after the fd is closed."""
    try:
        os.unlink(lock_path)
    except FileNotFoundError:
        pass
    finally:
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
    links, never followed). OSError when folder cannot be listed."""
    found: dict[str, list[Path]] = {}
    with os.scandir(folder) as it:
        entries = list(it)
    for e in entries:
        for suffix in SUFFIXES:
            if e.name.startswith(".") and e.name.endswith(suffix) and \
                    len(e.name) > len(suffix) + 1:
                found.setdefault(e.name[1:-len(suffix)], []).append(Path(e.path))
    return found


def reclaim(folder: Path, skip: str | None = None,
            failed: list[str] | None = None) -> list[str]:
    """Remove the leftovers in folder of every output whose lock nobody holds (not `skip`,
    the output being acquired). A `.NAME.mpitailor-old` whose output is missing is the only
    copy of that output (killed between the two renames of a replace): it is put back, not
    removed. Returns what was done, one phrase per path. What could not be looked at or
    removed goes to `failed`, one phrase per path (None: logged as warnings)."""
    done: list[str] = []
    sink = _Failures(failed)
    try:
        found = find(folder)
    except OSError as e:
        sink.add(folder, "cannot list it", e)
        return done
    for name, paths in sorted(found.items()):
        if name == skip:
            continue
        output = folder / name
        lock_path = path_of(output, LOCK)
        try:
            fd = take_lock(lock_path)
        except OSError as e:
            why = "a symbolic link, not a lock; left alone" if e.errno == errno.ELOOP else \
                f"not removed: cannot take the lock {shown(lock_path)}"
            for p in [p for p in paths if p != lock_path] or [lock_path]:
                sink.add(p, why, e)
            continue
        if fd is None:
            continue  # a live run's
        try:
            failpoints.hit("reclaim", name)
            done += _reclaim_locked(output, paths, sink)
        finally:
            try:
                drop_lock(lock_path, fd)
            except OSError as e:
                sink.add(lock_path, "cannot remove it", e)
            else:
                if lock_path in paths:
                    done.append(f"removed {shown(lock_path)}")
    return done


def reclaim_own(output: Path) -> list[str]:
    """With output's lock held: what killed runs to the same output left. MergeFailed when
    some of it cannot be removed (the new run cannot stage there)."""
    paths = [path_of(output, s) for s in (STAGING, DISCARD, OLD)]
    failed: list[str] = []
    done = _reclaim_locked(output, [p for p in paths if os.path.lexists(p)], _Failures(failed))
    if failed:
        raise MergeFailed(f"cannot clear what an interrupted run left: {'; '.join(failed)}; "
                          f"remove it by hand")
    return done


class _Failures:
    """Where reclaim's failures go: a caller's list, or the log."""

    def __init__(self, into: list[str] | None) -> None:
        self.into = into

    def add(self, path: Path, why: str, error: OSError) -> None:
        if error.errno != errno.ELOOP:
            why += f" ({error.strerror})"
        if self.into is None:
            log.warning("%s: %s", shown(path), why)
        else:
            self.into.append(f"{shown(path)}: {why}")


def _reclaim_locked(output: Path, paths: list[Path], failed: _Failures) -> list[str]:
    done = []
    for p in sorted(paths):
        if p.name.endswith(LOCK) or not os.path.lexists(p):
            continue
        try:
            if p.name.endswith(OLD) and not os.path.lexists(output) and not p.is_symlink():
                os.rename(p, output)
                done.append(f"put back {shown(output)} (from {shown(p.name)})")
                continue
            remove(p)
        except OSError as e:
            failed.add(p, "cannot remove it", e)
            continue
        done.append(f"removed {shown(p)}")
    return done
