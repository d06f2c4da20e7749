"""`prune`: delete what the newest composite of a save dir no longer needs.

The decision (planning/retention.py) is taken once, from the saves as `recover` checks and
chooses them; deleting is separate (`apply_plan`), so that under node-local storage each
node's leader applies the same decision to its own disk. Each path goes by a rename to a
hidden `.NAME.mpitailor-pruning` first, under the path's lock, then by rmtree: a prune killed
half-way leaves nothing that looks like a save, and `mpitailor clean` takes what it left. A
save of the timeline leaves its tombstone (jobs/tombstones.py) before it goes, and prune's
record of the tombstones is written before anything goes.

Prune fails safe: it deletes nothing while a save cannot be read now (the plan is
`blocked`: exit 1, naming it) or while a tombstone a save builds on is not right (vet's
error); one prune of a save dir at a time (its lock); and a save is deleted only if it is
the same dir that was judged (a save published again under its name since is kept).

Collective where it takes a `comm`.
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from mpitailor import failpoints
from mpitailor.cluster.comm import Comm
from mpitailor.display import escaped, shown
from mpitailor.errors import CheckpointError, MpitailorError, UserError
from mpitailor.formats.io import LOCAL, fsync_dir
from mpitailor.formats.manifest import MANIFEST, read_manifest
from mpitailor.jobs import readlocks
from mpitailor.jobs.clean import not_a_dir
from mpitailor.jobs.dcp_recovery import holds_dcp_saves, survey_dcp_saves
from mpitailor.jobs.recovery import survey_saves
from mpitailor.jobs.tombstones import (
    RECORD,
    read_record,
    read_tombstones,
    write_record,
    write_tombstone,
)
from mpitailor.planning.retention import (
    PRUNED_DIR,
    Composite,
    RetentionPlan,
    Verdict,
    plan_retention,
    valid_id,
)
from mpitailor.publish.leftovers import (
    LOCK,
    PRUNING,
    STAGING,
    drop_lock,
    holder_of,
    is_held,
    path_of,
    remove,
    take_lock,
)

log = logging.getLogger(__name__)
RESUME_DIR = ".mpitailor-resume"  # where the in-job resume writes composites (jobs/in_job_resume.py)
COMPOSITE_PREFIX = "recovered-"


class PruneFailed(MpitailorError):
    """A runtime failure while deleting (exit 1); what was removed before it is said."""


class PruneRefused(MpitailorError):
    """Prune removed nothing: what it would decide on cannot be read now, or another prune
    of the save dir is running (exit 1)."""


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What prune decided and did: `lines`, one per path (removed, kept, and why)."""

    save_dir: Path
    plan: RetentionPlan
    dry_run: bool
    lines: tuple[str, ...]

    @property
    def removed(self) -> tuple[Path, ...]:
        return () if self.dry_run else tuple(v.path for v in self.plan.removals)


def prune(comm: Comm, save_dir: str | os.PathLike, keep_last: int,
          composites: str | os.PathLike | None = None, dry_run: bool = False,
          crc: bool = True) -> PruneReport:
    """Collective: decide (plan_prune), then delete: on rank 0 where every rank sees the
    same files, else on each node's first rank, on its own disk. dry_run: delete nothing;
    the report says what would go. crc: check the chain's partial saves against their
    CRC-32s first, as recover does (the training side's retention after each save leaves
    it out: survey_saves)."""
    save_dir, composites = check_args(save_dir, keep_last, composites)
    lock = path_of(save_dir / PRUNED_DIR, LOCK)  # one prune of a save dir at a time
    fd = None if dry_run else comm.root_step(_take_prune_lock, lock, save_dir)
    try:
        plan, node_local, idents = plan_prune(comm, save_dir, keep_last, composites, crc)
        if plan.blocked:
            raise PruneRefused(_refusal(plan))
        from mpitailor.cluster.nodes import Nodes
        appliers = Nodes.of(comm).leaders() if node_local else [0]
        lines = comm.step(lambda: apply_plan(save_dir, plan, dry_run, idents)
                          if comm.rank in appliers else None)
        lines = comm.bcast(lines, root=0)
    finally:
        if fd is not None and comm.rank == 0:
            drop_lock(lock, fd)
    return PruneReport(save_dir, plan, dry_run, tuple(lines))


def _take_prune_lock(lock: Path, save_dir: Path) -> int:
    try:
        fd = take_lock(lock)
    except OSError as e:
        raise PruneFailed(f"{lock}: cannot take prune's lock ({e.strerror or e}); prune "
                          f"writes in {save_dir}: run it where the save dir is writable") from e
    if fd is None:
        raise PruneRefused(f"{save_dir}: another prune of it is running ({holder_of(lock)} "
                           f"holds {lock.name}); run prune again when it ends")
    return fd


def _refusal(plan: RetentionPlan) -> str:
    names = "; ".join(f"{v.path} {v.why.split(': it may hold')[0]}" for v in plan.blocked)
    return (f"prune removed nothing: {names}. A save that cannot be read may hold the newest "
            f"copy of a layer, and every verdict depends on reading all of them: fix its "
            f"permissions (or the disk) and run prune again")


def check_args(save_dir: str | os.PathLike, keep_last: int,
               composites: str | os.PathLike | None) -> tuple[Path, Path | None]:
    """Bad input, said before anything is read: UserError naming the path and the fix."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise UserError(f"--keep-last {keep_last}: give a count >= 0 (the newest saves of the "
                        f"recovered timeline kept whatever they hold)")
    paths = [(Path(save_dir), "SAVE_DIR, the dir of a run's saves")]
    if composites is not None:
        paths.append((Path(composites), "--composites DIR, where recovered-* composites are "
                                        "written (the Slurm prologue's OUT_PARENT)"))
    for path, what in paths:
        if (state := not_a_dir(path)) is not None:
            raise UserError(f"{path}: {state}; give {what}")
    return (Path(save_dir).resolve(),
            None if composites is None else Path(composites).resolve())


def plan_prune(comm: Comm, save_dir: Path, keep_last: int, composites: Path | None = None,
               crc: bool = True) -> tuple[RetentionPlan, bool, dict[str, tuple[int, int]]]:
    """Collective: the retention plan (the same on every rank), whether the save dir is
    node-local, and what each path to remove was when judged (device, inode; empty under
    node-local storage, where each node has its own). The saves are found and checked as
    `recover` does; the composites, the tombstones and the locks are read on rank 0."""
    resume = save_dir / RESUME_DIR
    if resume.is_symlink():  # followed, prune would delete composites wherever it points
        raise UserError(f"{shown(resume)}: a symbolic link (to {shown(os.readlink(resume))}), "
                        f"where the in-job resume keeps this save dir's composites; prune "
                        f"follows no link in a save dir: replace it with the dir itself, or "
                        f"give the dir it points to as --composites DIR")
    for own in (save_dir / PRUNED_DIR, save_dir / RECORD.parent):
        # followed, prune would write its tombstones there and remove those no save of
        # this dir builds on: another run's, whose recovery then refuses
        if own.is_symlink():
            raise UserError(f"{shown(own)}: a symbolic link (to {shown(os.readlink(own))}), "
                            f"where prune keeps the tombstones of this save dir's pruned "
                            f"saves; prune follows no link in a save dir: replace it with "
                            f"a copy of the dir it points to (`cp -a`)")
    if comm.root_step(holds_dcp_saves, save_dir):  # (DCP saves lie on a shared disk)
        saves, chain, _ = survey_dcp_saves(comm, save_dir, crc=crc)
        view, node_local = LOCAL, False
    else:
        saves, chain, place = survey_saves(comm, save_dir, crc=crc, prune=True)
        view, node_local = place.fs(), place.node_local
    folders = [resume] + ([composites] if composites is not None else [])

    def decide() -> tuple[RetentionPlan, dict[str, tuple[int, int]]]:
        found = [c for f in folders for c in find_composites(f)]
        busy = {str(s.path): why for s in saves if (why := _busy(s.path)) is not None}
        busy.update({str(c.path): why for c in found if (why := _busy(c.path)) is not None})
        tombs = read_tombstones(save_dir, view)
        plan = plan_retention(save_dir, saves, chain, keep_last, tombs.good, tuple(found),
                              busy, tombs.bad, tombs.listed)
        idents = {} if node_local else {
            str(v.path): ident for v in plan.removals if (ident := _ident(v.path))}
        return plan, idents
    plan, idents = comm.root_step(decide)
    return plan, node_local, idents


def _ident(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def find_composites(folder: Path) -> list[Composite]:
    """The `recovered-*` dirs in folder, as their manifests describe them (a dir without a
    readable merge manifest: its problem)."""
    if not folder.is_dir():
        return []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        raise PruneRefused(f"prune removed nothing: {shown(folder)} cannot be listed now "
                           f"({e.strerror or e}); it holds composites prune judges: fix its "
                           f"permissions (or the disk) and run prune again") from None
    found = []
    for entry in entries:
        if not entry.name.startswith(COMPOSITE_PREFIX) or \
                not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        try:
            m = read_manifest(path / MANIFEST)
            if m.kind != "merge":
                raise CheckpointError(f"{path / MANIFEST}: a {m.kind} manifest, not a merge's")
            base = m["sources"][m["base"]]
            found.append(Composite(path, str(base["path"]), base.get("save_id"),
                                   int(base["global_steps"])))
        except (CheckpointError, KeyError, TypeError, ValueError) as e:
            found.append(Composite(path, problem=str(e)))
    return found


def _busy(path: Path) -> str | None:
    """Why a live process may be writing path (its lock held, its staging dir there, or a
    held lock inside it: an HF checkpoint-N stages its tag dir there), else None."""
    locks = [path_of(path, LOCK)] + [path / n for n in _names(path) if n.endswith(LOCK)]
    for lock in locks:
        try:
            if is_held(lock):
                return f"a live process holds {lock.name}: being written"
        except OSError as e:  # a FIFO, a link, a dir by a lock's name; or unreadable
            raise PruneRefused(f"prune removed nothing: {shown(lock)}: cannot tell whether a "
                               f"live process holds it ({e.strerror or e}); a lock is a "
                               f"regular file: remove it if nothing writes {shown(path)}, "
                               f"and run prune again") from None
    if readlocks.is_read(path):
        return "a live process reads it (a recover holds it as a source)"
    if os.path.lexists(path_of(path, STAGING)):
        return (f"{path_of(path, STAGING).name} lies beside it (a save in progress, or a "
                f"killed one: `mpitailor clean` reclaims it)")
    return None


def _names(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def apply_plan(save_dir: Path, plan: RetentionPlan, dry_run: bool = False,
               idents: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """Carry out plan on this process's view of the disk: one line per verdict. Saves and
    composites go under their lock, renamed away first, and only if they are what was
    judged (idents: path -> (device, inode) then); a save of the timeline leaves its
    tombstone before. Prune's record of the tombstones is written first. Raises
    PruneFailed (saying what went before) on an I/O error."""
    lines: list[str] = []
    if plan.blocked:  # (prune refuses such a plan; a caller of apply_plan must too)
        raise PruneRefused(_refusal(plan))
    if not dry_run:
        lines += _reclaim_pruning(save_dir)
    if not dry_run and plan.removals:
        try:
            _record(save_dir, plan)
        except OSError as e:
            raise PruneFailed(f"prune: cannot write {save_dir / RECORD} ({e.strerror or e}); "
                              f"nothing removed") from e
    for v in plan.verdicts:
        if not v.remove:
            lines.append(f"kept {v.path}: {v.why}")
        elif dry_run:
            mark = "; its tombstone lets recovery step across it" if v.tombstone else ""
            lines.append(f"would remove {v.path}: {v.why}{mark}")
        else:
            try:
                lines.append(_apply(save_dir, v, (idents or {}).get(str(v.path))))
            except OSError as e:
                done = sum(line.startswith("removed") for line in lines)
                raise PruneFailed(f"prune: cannot remove {v.path} ({e.strerror or e}); "
                                  f"{done} path(s) removed before it; run prune again") from e
    if not dry_run and any(line.startswith("removed") for line in lines):
        # the removals made durable, as publishing is: a pruned save must not come back
        # after a machine crash once prune has said it is gone
        for folder in sorted({save_dir} | {v.path.parent for v in plan.verdicts if v.remove}):
            if folder.is_dir():
                fsync_dir(folder)
    lines = [escaped(line) for line in lines]  # (a name may hold a newline: one line each)
    for line in lines:
        log.debug("prune: %s", line)
    return lines


def _reclaim_pruning(folder: Path) -> list[str]:
    """What a prune killed while it removed a save left in folder: `.NAME.mpitailor-pruning`
    (the save renamed away, its removal begun; recovery no longer sees it), removed under
    NAME's lock if nobody holds it. A rerun of prune finishes the job (bench/crash_points.py
    found such a dir left for `clean` alone)."""
    done = []
    for entry in sorted(_names(folder)):
        if not (entry.startswith(".") and entry.endswith(PRUNING)):
            continue
        name = entry[1:-len(PRUNING)]
        lock = path_of(folder / name, LOCK)
        try:
            fd = take_lock(lock)
        except OSError:
            continue  # not a lock we can take: `clean` says why
        if fd is None:
            continue  # a live prune's
        try:
            failpoints.io_step("remove", folder / entry)
            remove(folder / entry)
            done.append(f"removed {folder / entry}: left by a prune that was killed")
        finally:
            drop_lock(lock, fd)
    return done


def _record(save_dir: Path, plan: RetentionPlan) -> None:
    """Prune's record (jobs/tombstones.py): the tombstones there after this prune, written
    before any is added or removed, so that each id it lists has one or is still a save."""
    folder = save_dir / PRUNED_DIR
    there = {n for n in os.listdir(folder) if valid_id(n)} if folder.is_dir() else set()
    gone = {v.path.name for v in plan.removals if v.kind == "tombstone"}
    new = {v.tombstone.lineage.save_id for v in plan.removals if v.tombstone is not None}
    ids = (there - gone) | new
    if ids or read_record(save_dir):
        write_record(save_dir, ids)


def _apply(save_dir: Path, v: Verdict, ident: tuple[int, int] | None = None) -> str:
    if v.kind == "tombstone":
        failpoints.io_step("remove", v.path)
        v.path.unlink(missing_ok=True)
        return f"removed {v.path}: {v.why}"
    lock = path_of(v.path, LOCK)
    try:
        fd = take_lock(lock)
    except OSError as e:
        return f"kept {v.path}: cannot take its lock {lock.name} ({e.strerror or e})"
    if fd is None:
        return f"kept {v.path}: a live process took {lock.name} just now"
    held = None
    try:
        if not os.path.lexists(v.path):
            return f"kept nothing of {v.path}: already gone (removed by another process)"
        held = readlocks.exclusive(v.path)
        if held is None:
            return f"kept {v.path}: a live process reads it (a recover) just now"
        if ident is not None and _ident(v.path) != ident:
            return f"kept {v.path}: not the dir that was judged (written again since)"
        if v.tombstone is not None:
            write_tombstone(save_dir, v.tombstone)
        linked = _linked(v.path)
        gone = path_of(v.path, PRUNING)
        if os.path.lexists(gone):
            failpoints.io_step("remove", gone)
            remove(gone)
        failpoints.io_step("rename", v.path, gone)
        os.rename(v.path, gone)
        failpoints.io_step("remove", gone)
        remove(gone)
    finally:
        if held is not None:
            os.close(held)
        drop_lock(lock, fd)
    return f"removed {v.path}: {v.why}" + ("; its tombstone lets recovery step across it"
                                           if v.tombstone else "") + linked


def _linked(path: Path) -> str:
    """What of path's files stays on disk when it goes, in words: files with another hard
    link (a composite merged with --link shares its sources' data files; the file system
    counts the links, and frees a file's blocks with its last name)."""
    count = size = 0
    for folder, _, names in os.walk(path):  # (follows no link)
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if st.st_nlink > 1 and stat.S_ISREG(st.st_mode):
                count, size = count + 1, size + st.st_size
    if not count:
        return ""
    return (f"; {count} of its files ({size / 1e9:.3f} GB) stay on disk, hard-linked "
            f"elsewhere (a composite made with --link): freed when their last link goes")
