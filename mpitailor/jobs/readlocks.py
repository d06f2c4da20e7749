"""Read locks: `recover` holds each save it takes layers from, shared, from the moment it
has chosen them until its process ends (or it recovers again), so that `prune`, which takes
the same lock exclusive before it deletes a save, keeps the save rather than deleting it
under the reader. Many readers share it; a reader finds a save being removed and says so.

The lock is a flock on the save's directory itself, never a file beside it: a reader leaves
nothing in the save dir, also when it is killed (the kernel lets go of the lock with the
process). Rank 0 only: prune on a shared file system runs on its job's rank 0.
"""
from __future__ import annotations

import atexit
import fcntl
import os
import time
from collections.abc import Iterable
from pathlib import Path

from mpitailor.errors import MpitailorError

_held: dict[Path, int] = {}  # save dir -> its fd, held shared by this process
_registered: list[bool] = []
# Prune holds a save exclusive for a moment (its look, a rename): waited out; longer, the
# save is being removed.
WAIT_S, POLL_S = 5.0, 0.05
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def hold_sources(saves: Iterable[Path]) -> None:
    """Hold each save shared (letting go of those an earlier call held and this one does not
    name: one it names again stays held, with no moment unheld), and see that each is still
    the dir it was. MpitailorError, one line, when one is being removed or is gone: nothing
    is then held."""
    saves = list(saves)
    for save in [s for s in _held if s not in saves]:
        os.close(_held.pop(save))
    if not _registered:
        atexit.register(release)
        _registered.append(True)
    for save in saves:
        if save in _held:
            continue
        try:
            fd = os.open(save, _DIR)
        except FileNotFoundError:
            release()
            raise MpitailorError(f"{save}: removed while recover read it (by `mpitailor "
                                 f"prune`?); run again") from None
        except OSError:
            continue  # not a dir to hold (recovery refused or took it as it is): unlocked
        if not _wait(fd, fcntl.LOCK_SH):
            os.close(fd)
            release()
            raise MpitailorError(f"{save}: being removed (`mpitailor prune` holds it); run "
                                 f"again when it is done")
        _held[save] = fd
        try:
            same = os.fstat(fd).st_ino == os.stat(save, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            release()
            raise MpitailorError(f"{save}: removed while recover read it (by `mpitailor "
                                 f"prune`?); run again")


def exclusive(save: Path) -> int | None:
    """The save dir held exclusive (its fd: close it to let go), or None while a reader
    holds it. OSError where it cannot be opened."""
    fd = os.open(save, _DIR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def is_read(save: Path) -> bool:
    """Whether a live process holds the save dir as a source (prune's look)."""
    try:
        fd = exclusive(save)
    except OSError:
        return False
    if fd is None:
        return True
    os.close(fd)
    return False


def _wait(fd: int, how: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)


def release() -> None:
    """Let go of every read lock."""
    while _held:
        os.close(_held.popitem()[1])
