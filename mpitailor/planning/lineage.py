"""Which tombstones a timeline may step across, checked against the saves, with no I/O.

A tombstone (`Pruned`) stands for a deleted save; recovery follows it to reach the saves
built on it (planning/chain.py's `follow`). Its file is written by prune, but whoever can
write the save dir can write one too, so it is trusted only as far as the saves agree:

- It counts only when a save's lineage passes through it: a save names it as its parent, or
  a tombstone that counts does. One that nobody builds on is never a branch to follow (a
  forged `{step: 99, parent: <the full save>}` would otherwise win every fork and end the
  timeline there), and one that cannot be read is then skipped with a warning rather than
  failing every recovery of the save dir.
- One that counts must fit: its step between its parent's and its children's, its chain
  that of the saves on both sides (a partial save names its chain; a full save is its own
  chain), and no loop. Else the save dir was tampered with: an error naming it.
- Two saves with one save id (a save copied, renamed, inside the save dir) make every
  record that names that id ambiguous: which one a child builds on, which one a tombstone
  stands for. An error naming both, before anything is followed or pruned.
- A gap (a save's parent neither there nor tombstoned) ends the timeline, as a rollback
  does, unless prune's record lists that id (the tombstone went missing: an error) or a save
  that cannot be read now might be that parent (an error too: a failure to read is never an
  absence).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mpitailor.display import shown
from mpitailor.errors import CheckpointError, MpitailorError
from mpitailor.planning.chain import Pruned, Save


class CannotReadNow(MpitailorError):
    """Something recovery or prune needs cannot be read now (permissions, I/O): exit 1,
    naming it; run again once it reads."""


@dataclass(frozen=True, slots=True)
class BadTombstone:
    """A tombstone file that is not one (garbage, too large, not a regular file) or that
    cannot be read now (unreadable: it may read again)."""

    save_id: str
    why: str
    unreadable: bool = False


@dataclass(frozen=True, slots=True)
class Vetted:
    """pruned: the tombstones some save's lineage passes through, checked; unused: the
    other good ones (no save builds on them, or a save of that id is there); skipped: (save
    id, why) of the bad ones, which no save needs (vet raised otherwise): said in a warning
    and left alone."""

    pruned: tuple[Pruned, ...]
    unused: tuple[Pruned, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()


def vet(folder: Path, saves: list[Save], pruned: tuple[Pruned, ...] = (),
        bad: tuple[BadTombstone, ...] = (), listed: frozenset[str] = frozenset()) -> Vetted:
    """The tombstones (in `folder`) recovery may step across; CheckpointError for a
    tampered timeline, CannotReadNow for one that may be whole but cannot be read now.
    listed: the save ids prune's record says it left tombstones for."""
    present = no_twins(saves)
    marks = {p.lineage.save_id: p for p in pruned if p.lineage.save_id not in present}
    bads = {b.save_id: b for b in bad if b.save_id not in present}
    unknown = [f"{s.name} ({s.problem})" for s in saves if s.unreadable and s.lineage is None]
    used: dict[str, Pruned] = {}
    for s in saves:
        if s.lineage is not None:
            _walk(folder, s, present, marks, bads, listed, unknown, used)
    # (a tombstone of a save that is there again is unused too: the save wins)
    return Vetted(tuple(sorted(used.values(), key=lambda p: (p.step, p.name))),
                  tuple(p for p in pruned if p.lineage.save_id not in used),
                  tuple((b.save_id, b.why) for b in bad))


def no_twins(saves: list[Save]) -> dict[str, Save]:
    """The saves by save id; CheckpointError naming two saves that share one."""
    present: dict[str, Save] = {}
    for s in saves:
        if s.lineage is None:
            continue
        other = present.setdefault(s.lineage.save_id, s)
        if other is not s:
            raise CheckpointError(
                f"{shown(other.path)} and {shown(s.path)}: two saves with one save id "
                f"{shown(s.lineage.save_id)} (a save copied or renamed inside the save dir?); "
                f"which one the saves after it build on cannot be told: move the copy out of "
                f"the save dir, and run again")
    return present


def _walk(folder: Path, s: Save, present: dict[str, Save], marks: dict[str, Pruned],
          bads: dict[str, BadTombstone], listed: frozenset[str], unknown: list[str],
          used: dict[str, Pruned]) -> None:
    """From save s up its parents across tombstones to a save that is there (or a gap),
    checking each tombstone against the one below it; each tombstone is checked upward
    once (used), so the whole vet is linear in the number of records."""
    child: Save | Pruned = s
    pid, seen = s.lineage.parent, set()
    while pid is not None and pid not in present:
        path = folder / pid
        if pid in bads:
            b = bads[pid]
            if b.unreadable:
                raise CannotReadNow(f"{path}: the tombstone {s.name} builds on cannot be read "
                                    f"now ({b.why}); fix its permissions (or the disk) and "
                                    f"run again")
            raise CheckpointError(f"{path}: the tombstone {s.name} builds on is damaged "
                                  f"({b.why}); restore it from a copy of the save dir")
        t = marks.get(pid)
        if t is None:
            _gap(folder, s, pid, listed, unknown)
            return
        if pid in seen:
            raise CheckpointError(f"{path}: the tombstones above {s.name} form a loop "
                                  f"(each names another as its parent); the save dir was "
                                  f"tampered with: restore {folder} from a copy")
        seen.add(pid)
        _fits(path, t, child)
        if pid in used:
            return
        used[pid] = t
        child, pid = t, t.lineage.parent
    if pid is not None and child is not s:
        _fits(folder / child.lineage.save_id, child, present[pid], below=False)


def _fits(path: Path, t: Pruned, other: Save | Pruned, below: bool = True) -> None:
    """t against the record below it (a child, below=True) or its parent save: the same
    chain, and the steps in order (a step unknown, -1, is not compared)."""
    who = f"{other.name} (step {other.step}, chain {other.lineage.chain})"
    if t.lineage.chain != other.lineage.chain:
        raise CheckpointError(f"{path}: a tombstone of chain {t.lineage.chain}, but "
                              f"{'it is the parent of' if below else 'its parent is'} {who}: "
                              f"not this timeline's; the save dir was tampered with: remove "
                              f"it, or restore it from a copy")
    if min(t.step, other.step) >= 0 and (t.step > other.step if below else
                                         other.step > t.step):
        raise CheckpointError(f"{path}: a tombstone of step {t.step}, "
                              f"{'newer than its child' if below else 'older than its parent'}"
                              f" {who}: the steps of a timeline only grow; the save dir was "
                              f"tampered with: remove it, or restore it from a copy")


def _gap(folder: Path, s: Save, pid: str, listed: frozenset[str], unknown: list[str]) -> None:
    if pid in listed:
        raise CheckpointError(f"{folder / pid}: missing, but prune's record lists it (a save "
                              f"the timeline of {s.name} builds on was pruned); without it "
                              f"recovery would roll back: restore it from where the save dir "
                              f"was copied (`cp -a SRC/. DEST` keeps hidden dirs)")
    if unknown:
        raise CannotReadNow(f"{s.name} builds on save id {pid}, which is not here, and "
                            f"{', '.join(unknown)} cannot be read now (it may be that save): "
                            f"fix its permissions (or the disk) and run again")
