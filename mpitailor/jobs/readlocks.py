"""Read locks: `recover` holds the lock of each save it takes layers from, shared, from the
moment it has chosen them until its process ends (or it recovers again), so that `prune`,
which takes the same lock exclusive before it deletes a save (and a save being written,
which holds it exclusive too), keeps the save rather than deleting it under the reader.
Many readers share it; a reader finds a save being removed or written and says so.

The lock is the save's own (publish/leftovers.py: `.NAME.mpitailor-lock`, flock). A reader
that cannot create it (a read-only save dir) reads unlocked: nobody can delete there either
through this mount. Rank 0 only: prune on a shared file system runs on its job's rank 0.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import os
import time
from collections.abc import Iterable
from pathlib import Path

from mpitailor.errors import MpitailorError
from mpitailor.publish.leftovers import LOCK, holder_of, path_of

_held: dict[Path, int] = {}  # lock path -> fd, held shared by this process
_registered: list[bool] = []
# A lock held exclusive for a moment (prune's look with is_held, a rename) is waited out;
# one held longer is a save being removed or written.
WAIT_S, POLL_S = 5.0, 0.05


def hold_sources(saves: Iterable[Path]) -> None:
    """Take the shared lock of each save (letting go of those an earlier call took), then
    see that each is still there. MpitailorError, one line, when one is being removed or
    written (its lock held exclusive) or is gone: nothing is then held."""
    release()
    if not _registered:
        atexit.register(release)
        _registered.append(True)
    for save in saves:
        lock = path_of(save, LOCK)
        fd = _share(lock)
        if fd is None:
            release()
            raise MpitailorError(f"{save}: {holder_of(lock)} holds {lock.name} (the save is "
                                 f"being removed or written); run again when it is done")
        if fd >= 0:
            _held[lock] = fd
        if not os.path.isdir(save):
            release()
            raise MpitailorError(f"{save}: removed while recover read it (by `mpitailor "
                                 f"prune`?); run again")


def _share(lock: Path) -> int | None:
    """The lock's fd, held shared; None when it is held exclusive; -1 when it cannot be
    made (read-only save dir: read unlocked)."""
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return -1
            raise
        if not _wait_shared(fd):
            os.close(fd)
            return None
        if _same(fd, lock):
            return fd
        os.close(fd)  # its last holder unlinked the file as it let go: open it again
    return None


def _wait_shared(fd: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)


def _same(fd: int, lock: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(lock, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return False


def release() -> None:
    """Let go of every read lock; the last reader of a save removes its lock file (taken
    exclusive first, so that no one else holds it then), as publish's drop_lock does."""
    while _held:
        lock, fd = _held.popitem()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same(fd, lock):
                os.unlink(lock)
        except OSError:  # another reader holds it (it unlinks it), or it went: leave it
            pass
        finally:
            os.close(fd)
