"""Staging, locking and atomic publication of every output mpitailor writes: a merge, an
export, a partial save. Called by the ranks that write its metadata (rank 0, or every node's
leader under node-local storage).

Output is written into a hidden staging dir beside the target; `Staging.commit` (or
`commit_on_leaders`, when every node keeps its own copy) is the one way it is published:
the manifest written last, the tree fsynced, one rename, the parent fsynced. Readers see
the old state or the whole new output, never a part of it. A single file (the save record
of a full save, a tombstone, --stats) is published by `write_replacing`. A
lock file beside the target keeps two merges from writing the same output. What a killed
run left beside its output (publish/leftovers.py) is reclaimed by the next run that writes
in the same directory, whatever its output.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mpitailor import failpoints
from mpitailor.cluster.comm import Comm
from mpitailor.display import shown
from mpitailor.errors import MergeFailed, UserError
from mpitailor.formats.io import created, fsync_dir, write_synced
from mpitailor.formats.manifest import Manifest
from mpitailor.publish import interrupt, leftovers
from mpitailor.publish.leftovers import DISCARD, LOCK, OLD, STAGING, path_of

log = logging.getLogger(__name__)


class Staging:
    """replace: publishing over an existing output is allowed (a partial save of a step that
    training reached again after resuming from an older save, as DeepSpeed's own save
    overwrites its tag); merges and exports never overwrite."""

    def __init__(self, output: Path, replace: bool = False) -> None:
        self.output = output
        self.replace = replace
        self.dir = path_of(output, STAGING)
        self.lock_path = path_of(output, LOCK)
        self._lock_fd = -1
        self._unwatch = None
        # The signal watcher removes the staging dir while the main thread may be publishing
        # it: one of the two goes first, whole.
        self._guard = threading.RLock()
        self._published = False

    def acquire(self, tag: str | None) -> Path:
        """Take the lock and create the staging dir (with an empty `tag` dir in it, if
        given); reclaim what killed runs left in the output's directory. Returns the
        staging dir."""
        check_output_name(self.output)
        if os.path.islink(self.output):
            raise UserError(f"{self.output}: a symbolic link (to {os.readlink(self.output)}); "
                            f"mpitailor never writes through a link: name the directory to "
                            f"create")
        self._refuse_existing()
        _make_parent(self.output)
        try:
            fd = leftovers.take_lock(self.lock_path)
        except OSError as e:
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise UserError(f"{self.output}: cannot write in {self.output.parent} "
                                f"({e.strerror}); choose a writable place for the output") \
                    from None
            if e.errno not in (errno.ELOOP, errno.EINVAL):
                raise
            what = "a symbolic link" if e.errno == errno.ELOOP else "not a regular file"
            raise UserError(f"{self.lock_path}: the lock path is {what}; mpitailor never "
                            f"follows links or takes other files there (remove it if "
                            f"nobody planted it on purpose)") from None
        if fd is None:
            raise UserError(f"{self.output}: its lock {self.lock_path} is held by "
                            f"{leftovers.holder_of(self.lock_path)}; wait for it to end, or "
                            f"pick another output")
        self._lock_fd = fd
        self._unwatch = interrupt.on_interrupt(self._interrupted)
        try:
            done = leftovers.reclaim_own(self.output)
            self._refuse_existing()  # an old copy put back
        except BaseException:
            self.release()
            raise
        done += leftovers.reclaim(self.output.parent, skip=self.output.name)
        if done:
            log.warning("reclaimed what interrupted runs left: %s", "; ".join(done))
        failpoints.io_step("mkdir", self.dir)
        self.dir.mkdir()
        if tag is not None:
            (self.dir / tag).mkdir()
        return self.dir

    def _refuse_existing(self) -> None:
        if os.path.lexists(self.output) and not self.replace:
            raise UserError(f"{self.output}: output already exists; remove it or choose "
                            f"another output path (mpitailor never overwrites)")

    def commit(self, manifest: Manifest) -> int:
        """Publish the staged output: its manifest written last (the commit marker), then
        `_publish`. Returns the bytes the manifest records."""
        written = self._stage(manifest)
        failpoints.hit("commit", self.output.name)
        self._publish()
        return written

    def _stage(self, manifest: Manifest) -> int:
        write_synced(self.dir / manifest.file_name, manifest.to_json())
        return manifest.bytes_written

    def _publish(self) -> None:
        """fsync the staged tree, then rename it to the output in one step (not once a signal
        has come: its clean-up removes the staging dir instead)."""
        fsync_tree(self.dir)
        with self._guard:
            go = not interrupt.stopping()
            if go:
                if self.replace:
                    _replace(self.dir, self.output)
                elif os.path.lexists(self.output):
                    raise MergeFailed(f"{self.output}: appeared while merging (written by "
                                      f"something other than mpitailor?); nothing published")
                else:
                    failpoints.io_step("rename", self.dir, self.output)
                    os.rename(self.dir, self.output)
                self._published = True
        if not go:
            interrupt.settle()
        fsync_dir(self.output.parent)

    def abandon(self) -> None:
        """Remove our staging dir (never one we do not hold the lock for)."""
        with self._guard:
            if self._lock_fd >= 0 and not self._published:
                leftovers.discard(self.dir, path_of(self.output, DISCARD))

    def _interrupted(self) -> str | None:
        """From the signal watcher, while the main thread may still be writing here."""
        try:
            self.abandon()
        finally:
            self.release()
        return f"{self.output} was published before the signal" if self._published else None

    def release(self) -> None:
        with self._guard:
            if self._unwatch is not None:
                self._unwatch()
                self._unwatch = None
            if self._lock_fd >= 0:
                leftovers.drop_lock(self.lock_path, self._lock_fd)
                self._lock_fd = -1

    def wait_released(self, timeout: float = 3.0) -> None:
        """On a rank that writes into a staging dir another rank holds, from the signal
        watcher: wait until the holder has removed it and let go of the lock (the launcher
        kills the holder once this rank exits), at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        paths = (self.dir, path_of(self.output, DISCARD), self.lock_path)
        while any(os.path.lexists(p) for p in paths) and time.monotonic() < deadline:
            time.sleep(0.01)


@contextlib.contextmanager
def staged(comm: Comm, output: Path, leaders: list[int], tag: str | None = None
           ) -> Iterator[Staging]:
    """Collective: the one acquire -> write -> commit skeleton of what a job publishes (a
    merge, an export, either with node-local output). The leaders (rank 0 alone, or each
    node's first rank where every node keeps its own copy) take the output's lock and make
    its staging dir (with an empty `tag` dir) in one guarded step; the block writes into
    `.dir` and ends with commit_on_leaders; whatever it leaves unpublished is abandoned and
    the lock released, published or not (holding)."""
    staging = Staging(output)
    with holding(staging, comm.rank in leaders):
        comm.step(lambda: staging.acquire(tag) if comm.rank in leaders else None)
        yield staging


def commit_on_leaders(comm: Comm, staging: Staging, leaders: list[int],
                      manifest: Callable[[], Manifest]) -> int:
    """Collective: Staging.commit on the leaders of `staged`. Each leader builds and writes
    its manifest (a node's, where every node keeps its own copy); only once every leader has
    does each publish its copy, so that a node that failed to stage leaves no node with a
    published output. Returns the bytes the first leader's manifest records."""
    mine = comm.rank in leaders
    written = comm.step(lambda: staging._stage(manifest()) if mine else 0)
    comm.step(lambda: failpoints.hit("commit", staging.output.name) if mine else None)
    comm.step(lambda: staging._publish() if mine else None)
    return comm.bcast(written, leaders[0])


def _replace(staged: Path, output: Path) -> None:
    """Publish staged as output over an existing one: the old output is moved aside first and
    removed only once the new one is in place (put back if the rename fails)."""
    old = path_of(output, OLD)
    if os.path.lexists(output):
        failpoints.io_step("remove", old)
        shutil.rmtree(old, ignore_errors=True)
        failpoints.io_step("rename", output, old)
        os.rename(output, old)
    try:
        failpoints.io_step("rename", staged, output)
        os.rename(staged, output)
    except OSError:
        if os.path.lexists(old):
            os.rename(old, output)
        raise
    # Both renames durable before the old output goes: else a crash of the machine could
    # keep the removal's unlinks and lose the renames, leaving the old output half gone.
    fsync_dir(output.parent)
    failpoints.io_step("remove", old)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def holding(staging: Staging, mine: bool):
    """On the ranks that hold the staging dir (mine): abandon it if anything fails inside,
    and release the lock at the end, published or not. On every rank: once a signal has
    come, never leave (interrupt.settle): a failure here is then the clean-up's doing, and
    the watcher ends the process."""
    unwatch = None if mine else interrupt.before_exit(staging.wait_released)
    try:
        yield staging
    except BaseException:
        interrupt.settle()
        if mine:
            staging.abandon()
        raise
    finally:
        interrupt.settle()
        if mine:
            staging.release()
        else:
            unwatch()


NAME_MAX = 255  # bytes in one file name (Linux file systems)
STAGING_EXTRA = len(STAGING) + 1  # the staging dir: "." + name + this (DISCARD: as long)


def check_output_name(output: Path) -> None:
    """An output whose staging dir's name would be too long, or that has no name at all:
    refused up front (else a raw OSError, or the current directory)."""
    name = output.name
    if not name or name in (".", ".."):
        raise UserError(f"{str(output)!r}: not a directory name; give the output directory "
                        f"to create")
    if len(os.fsencode(name)) + STAGING_EXTRA > NAME_MAX:
        raise UserError(f"{output}: the name is {len(os.fsencode(name))} bytes; mpitailor stages "
                        f"the output beside it under a name {STAGING_EXTRA} bytes longer and "
                        f"a file name holds {NAME_MAX}: use at most "
                        f"{NAME_MAX - STAGING_EXTRA} bytes")


def _make_parent(output: Path) -> None:
    """Create the output's parent dirs; a file in their place is the user's to fix."""
    for p in (output.parent, *output.parent.parents):
        if os.path.lexists(p):
            if not p.is_dir():
                raise UserError(f"{output}: {p} is a file, not a directory; choose an output "
                                f"path under a directory")
            break
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{output}: cannot create its parent directory ({e.strerror})") from None


def check_writable_file(path: Path, what: str) -> None:
    """A file the run will write at its end (say --stats): refuse a bad path up front,
    never after the merge is published."""
    parent = path.parent
    if os.path.islink(path):
        raise UserError(f"{what} {shown(path)}: a symbolic link (to "
                        f"{shown(os.readlink(path))}); mpitailor never writes through a link: "
                        f"name the file itself")
    if path.is_dir():
        raise UserError(f"{what} {path}: a directory; name a file")
    if os.path.lexists(path) and not path.is_file():
        raise UserError(f"{what} {shown(path)}: not a regular file (a device, FIFO or "
                        f"socket); name a file to create or replace")
    if not parent.is_dir():
        raise UserError(f"{what} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{what} {path}: directory {parent} is not writable")


def write_replacing(path: Path, data: bytes) -> None:
    """Write a whole file or nothing: a temporary file beside it, fsynced, renamed over it.
    What a killed write of this host left beside it (its process gone) is removed first:
    nothing else would ever remove it (bench/crash_points.py found them)."""
    host = socket.gethostname()
    _sweep_temporaries(path.parent, host)
    tmp = path.parent / f".mpitailor-{host}-{os.getpid()}.tmp"  # short: any name of path fits
    try:
        with created(tmp) as f:
            f.write(data)
        failpoints.io_step("rename", tmp, path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


_TEMPORARY = re.compile(r"\.mpitailor-(.+)-(\d+)\.tmp")


def _sweep_temporaries(folder: Path, host: str) -> None:
    """Remove folder's temporary files of write_replacing made on this host by processes
    that are gone (another host's may be in flight: a shared file system)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = _TEMPORARY.fullmatch(name)
        if m is None or m.group(1) != host or _alive(int(m.group(2))):
            continue
        failpoints.io_step("remove", folder / name)
        with contextlib.suppress(OSError):
            os.unlink(folder / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or a number no process has: leave it
    return True


def make_dirs_under(root: Path, folder: Path) -> None:
    """Create folder and its parents up to, not including, root (a staging dir): never
    mkdir(parents=True), which would bring back a staging dir that a signal's clean-up
    has just removed (then left behind when the process ends). A folder that would not lie
    under root once `..` is resolved is refused: the names in it come from checkpoints."""
    resolved = Path(os.path.normpath(folder))
    if resolved != Path(root) and Path(root) not in resolved.parents:
        raise MergeFailed(f"internal error: {folder} is not a folder under {root}")
    missing = []
    for p in (folder, *folder.parents):
        if p == root or os.path.isdir(p):
            break
        missing.append(p)
    for p in reversed(missing):
        p.mkdir(exist_ok=True)


def fsync_tree(root: Path) -> None:
    for dirpath, _, _ in os.walk(root):
        fsync_dir(Path(dirpath))
