"""What a machine's crash (a power loss) may leave of a run killed just before step N,
rewritten on disk from the run's crash log (failpoints.io_step's lines), ALICE-style.

A SIGKILL leaves every write the kernel took; a lost machine keeps only what was made
durable. From the steps taken before the kill (the killed step itself was not):
- data: a file written since its last fsync loses what it was not made durable: "drop"
  truncates it to the size its last fsync made durable (0 if it was never fsynced) and
  zeroes what was rewritten below that; "torn" keeps its size, keeps the first half of
  its unsynced bytes (page-aligned) and zeroes the rest;
- names: a create, mkdir or rename not followed by an fsync-dir of the directory it put a
  name in (the destination's, for a rename) is undone, newest first: a rename moved back
  (the file it replaced put back from the hard link the log kept), a created file or dir
  removed.
What cannot be emulated, and is therefore trusted as durable:
- a removal (unlink, rmtree) cannot be undone: a removed file cannot come back, though after
  a real crash a removal not followed by its dir's fsync may be (counted: `removals_kept`);
- steps outside the seam: DeepSpeed's own files (the full save), locks, mkdirs below a
  staging dir, the tombstones dir, a discarded staging dir's rename;
- the last step a thread logged may not have been taken when its process died: a write,
  create or rename there is applied where it was (undone where it is found); an fsync is
  counted only once it returned (failpoints.io_done);
- a rewrite below a file's synced size loses its bytes to zeros, not to the old bytes
  (mpitailor only writes new files, whose unwritten bytes are zeros);
- a directory's fsync makes all earlier names in it durable (as on ext4 and xfs); a file's
  fsync makes no name durable (stricter than ext4, as ALICE assumes); the names not made
  durable are all undone, never only some of them (ALICE's reorderings are not tried);
- the machine is lost before a step, never after a run's last one (a prune that returned
  has not fsynced its save dir since its last removal: out of reach, as removals are);
- paths are matched as the log gives them (absolute; a descriptor's as /proc names it, links
  resolved): a study dir below a symbolic link would not match.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

PAGE = 4096
SYNCS = ("fsync", "fsync-dir")


@dataclass(frozen=True, slots=True)
class Step:
    """One line of the crash log."""

    rank: int
    n: int
    what: str
    thread: str = ""
    path: str = ""
    to: str = ""
    size: int = -1
    at: tuple[int, int] | None = None
    kept: str = ""
    absent: bool = False


def parse(log: Path) -> list[Step]:
    steps = []
    for line in log.read_text().splitlines():
        rank, n, what, *rest = line.split("\t")
        kv = dict(f.split("=", 1) for f in rest)
        at = tuple(int(x) for x in kv["at"].split("+")) if "at" in kv else None
        steps.append(Step(int(rank), -1 if n == "-" else int(n), what, kv.get("thread", ""),
                          kv.get("path", ""), kv.get("to", ""), int(kv.get("size", -1)), at,
                          kv.get("kept", ""), "absent" in kv))
    return steps


def taken(steps: list[Step], killed: dict[int, int]) -> list[Step]:
    """The steps taken before the machine went: not a killed rank's N-th step (killed: rank
    -> N), and not an fsync whose thread logged nothing after it (io_done: it returned):
    it may not have been taken when its process died."""
    last = {}
    for i, s in enumerate(steps):
        last[(s.rank, s.thread)] = i
    unsure = {i for i in last.values() if steps[i].what in SYNCS}
    return [s for i, s in enumerate(steps)
            if s.what != "done" and killed.get(s.rank) != s.n and i not in unsure]


@dataclass
class FileState:
    synced: int | None            # the size its last fsync made durable; None: never
    dirty: list = field(default_factory=list)  # (offset, length) or None (all) since then


@dataclass
class NameOp:
    """A name made, moved or removed. Its paths follow the later renames of the dirs above
    them (a file created in a staging dir lies under the output once that is renamed), and
    are moved back as the undo takes those renames back."""

    kind: str       # create, mkdir, rename, remove
    path: str       # a rename's source: where an undo puts it back
    to: str = ""
    kept: str = ""
    dir: int = -1   # the directory whose fsync makes it durable
    durable: bool = False

    def move(self, src: str, dst: str) -> None:
        """src was renamed dst: what lies at or under src moves; a rename's source is a name
        in a dir, which moves only with a dir above it."""
        self.to = _moved(self.to, src, dst)
        if self.kind != "rename":
            self.path = _moved(self.path, src, dst)
        elif self.path.startswith(src + "/"):
            self.path = dst + self.path[len(src):]


class Replay:
    """The file system's durable state as the steps leave it."""

    def __init__(self) -> None:
        self.files: dict[str, FileState] = {}
        self.ops: list[NameOp] = []
        self.dirs: dict[str, int] = {}   # dir name now -> identity (survives renames)
        self.published: list[str] = []   # destinations of renames made durable

    def dir_id(self, path: str) -> int:
        return self.dirs.setdefault(path, len(self.dirs) + 1000)

    def step(self, s: Step) -> None:
        getattr(self, "_" + s.what.replace("-", "_"))(s)

    def _create(self, s: Step) -> None:
        self.files[s.path] = FileState(None)
        self.ops.append(NameOp("create", s.path, dir=self.dir_id(os.path.dirname(s.path))))

    def _write(self, s: Step) -> None:
        # a file the log did not create: its size before this write is what it had
        state = self.files.setdefault(s.path, FileState(max(s.size, 0)))
        state.dirty.append(s.at)

    _copy = _write

    def _fsync(self, s: Step) -> None:
        self.files[s.path] = FileState(s.size)

    def _mkdir(self, s: Step) -> None:
        self.dirs[s.path] = len(self.dirs) + 1000
        self.ops.append(NameOp("mkdir", s.path, dir=self.dir_id(os.path.dirname(s.path))))

    def _rename(self, s: Step) -> None:
        for op in self.ops:
            op.move(s.path, s.to)
        self.ops.append(NameOp("rename", s.path, s.to, s.kept,
                               dir=self.dir_id(os.path.dirname(s.to))))
        self.files = {_moved(p, s.path, s.to): f for p, f in self.files.items()}
        self.dirs = {_moved(p, s.path, s.to): i for p, i in self.dirs.items()}

    def _remove(self, s: Step) -> None:
        if not s.absent:  # a crash may bring it back unless its dir is fsynced after
            self.ops.append(NameOp("remove", s.path, dir=self.dir_id(os.path.dirname(s.path))))
        self.files = {p: f for p, f in self.files.items() if not _under(p, s.path)}

    def _fsync_dir(self, s: Step) -> None:
        d = self.dir_id(s.path)
        for op in self.ops:
            if op.dir == d and not op.durable:
                op.durable = True
                if op.kind == "rename":
                    self.published.append(op.to)


def _under(p: str, root: str) -> bool:
    return p == root or p.startswith(root + "/")


def _moved(p: str, src: str, dst: str) -> str:
    return dst + p[len(src):] if _under(p, src) else p


def lose_data(files: dict[str, FileState], torn: bool) -> int:
    """Rewrite each file with unsynced bytes; return how many."""
    n = 0
    for path, state in files.items():
        if not os.path.isfile(path) or (state.synced is not None and not state.dirty):
            continue
        size = os.path.getsize(path)
        spans = _unsynced(state, size)
        if not spans:
            continue
        n += 1
        if torn:
            keep = sum(b - a for a, b in spans) // 2 // PAGE * PAGE
            _zero(path, _after(spans, keep))
        else:
            _zero(path, [(a, min(b, state.synced or 0)) for a, b in spans])
            os.truncate(path, min(size, state.synced or 0))
    return n


def _unsynced(state: FileState, size: int) -> list[tuple[int, int]]:
    """The byte ranges of a file (of `size` bytes now) not made durable, merged, in order."""
    base = state.synced or 0
    spans = [(base, size)] if size > base else []
    for at in state.dirty:
        spans.append((0, size) if at is None else (at[0], min(at[0] + at[1], size)))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def _after(spans: list[tuple[int, int]], keep: int) -> list[tuple[int, int]]:
    """The spans' bytes past their first `keep` bytes."""
    out = []
    for a, b in spans:
        take = min(keep, b - a)
        keep -= take
        if a + take < b:
            out.append((a + take, b))
    return out


def _zero(path: str, spans: list[tuple[int, int]]) -> None:
    with open(path, "r+b") as f:
        for a, b in spans:
            if b > a:
                f.seek(a)
                f.write(bytes(b - a))


def undo_names(ops: list[NameOp]) -> tuple[int, int, int]:
    """Undo the names not made durable, newest first; (undone, could not be, removals left
    removed)."""
    undone = failed = kept = 0
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op.durable:
            continue
        if op.kind == "rename":
            if os.path.lexists(op.to) and not os.path.lexists(op.path):
                os.rename(op.to, op.path)
                for before in ops[:i]:
                    before.move(op.to, op.path)
                if op.kept:
                    os.link(op.kept, op.to)
                undone += 1
            else:
                failed += 1
        elif op.kind == "create" and os.path.isfile(op.path):
            os.unlink(op.path)
            undone += 1
        elif op.kind == "mkdir" and os.path.isdir(op.path):
            shutil.rmtree(op.path)
            undone += 1
        elif op.kind == "remove":
            kept += 1
    return undone, failed, kept


def power_loss(log: Path, killed: dict[int, int], torn: bool = False) -> dict:
    """Rewrite the disk as a machine lost just before the killed steps may leave it (killed:
    rank -> the N it was killed before); what was done, and the saves or outputs whose
    publication had been made durable (`published`)."""
    replay = Replay()
    for s in taken(parse(log), killed):
        replay.step(s)
    dropped = lose_data(replay.files, torn)
    undone, failed, kept = undo_names(replay.ops)
    return {"files_cut": dropped, "names_undone": undone, "names_not_undone": failed,
            "removals_kept": kept, "published": replay.published}


def newest_save(published: list[str]) -> int:
    """The newest global_stepN whose publication (a rename into it, or of it) was durable."""
    steps = [int(m.group(1)) for p in published
             for m in [re.search(r"/global_step(\d+)(/|$)", p)] if m]
    return max(steps, default=0)
