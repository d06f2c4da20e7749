"""Retention's choice, with no I/O: which saves, composites and tombstones `prune` removes,
and why each of the others stays. jobs/prune.py finds them and deletes what this decides.

What the newest composite (what `recover` would assemble now) needs is never removed: the
full save its timeline starts from, the newest save (its base) and every save that holds
the newest copy of a layer. Nor is anything that may be in progress: a save newer than the
newest usable one, or one a live process holds (its lock, a staging dir beside it). The
`keep_last` newest saves of the recovered timeline (its full save, the partial saves after
it, and the older saves before it) are kept whatever they hold, and so is every other save
at least as new as the oldest of them. The rest goes: saves of older chains, abandoned
timelines, incomplete saves older than the newest usable one, and partial saves of the
timeline whose every layer a newer one holds again.

A save of the timeline that goes leaves a tombstone (planning/chain.py's `Pruned`), so
that recovery steps across it; a tombstone no remaining save builds on goes too, and one
that is not a tombstone (planning/lineage.py: damaged, unreadable) stays.

Nothing goes on a guess. A save that cannot be read now (`Save.unreadable`: permissions, an
I/O error, not a file where one should be) is not incomplete: it may hold the newest copy of
a layer, and every verdict depends on reading all of them (it may be the full save that
starts the timeline, or the parent of the saves after it). While one is there the plan is
`blocked`: prune removes nothing and says which; it goes on only once they read. (A plan
that removes nothing is blocked too while such a save is kept only because it cannot be
read: prune did not do its job, and says so.)

And nothing goes unproven: before a plan that removes anything stands, recovery of what it
leaves (the tombstones it writes included) is replayed from the same full save, and must
take every layer from where it takes it now (`prove`); else `Unproven`, and nothing goes.
The rules above should make that always so; the replay is what makes a save dir whose own
records disagree (a partial save of another chain than its parent's) a refusal instead of
a tombstone that recovery then rejects.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from mpitailor.display import shown
from mpitailor.errors import CheckpointError, MpitailorError
from mpitailor.planning.chain import Chain, Pruned, Save, choose
from mpitailor.planning.lineage import BadTombstone, vet

PRUNED_DIR = ".mpitailor-pruned"  # in the save dir: one tombstone per pruned save, by id
_HEX = re.compile(r"[0-9a-f]{8,64}")
UNREAD = "cannot be read now"  # how a verdict kept for that alone starts


class Unproven(CheckpointError):
    """Recovery after the plan would not be what it is now (the save dir's own records
    disagree): prune removes nothing (exit 2)."""


def valid_id(save_id: str | None) -> bool:
    """A save id that can name a file: lower-case hex, as the checkpointer makes them."""
    return save_id is not None and _HEX.fullmatch(save_id) is not None


@dataclass(frozen=True, slots=True)
class Composite:
    """A `recovered-*` dir, as its manifest says it was assembled (problem: unreadable)."""

    path: Path
    base_path: str | None = None
    base_save_id: str | None = None
    base_step: int | None = None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """What happens to one path, and why. kind: save, composite or tombstone; tombstone:
    recorded before a save of the timeline is removed."""

    kind: str
    path: Path
    remove: bool
    why: str
    tombstone: Pruned | None = None


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    """Every verdict, saves oldest first, then composites, then tombstones. blocked: the
    saves that cannot be read now; while there are any, a plan with removals is refused."""

    newest: str
    keep_last: int
    verdicts: tuple[Verdict, ...] = field(default_factory=tuple)
    blocked: tuple[Verdict, ...] = ()

    @property
    def removals(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if v.remove)


def _order(s: Save | Pruned) -> tuple[int, str]:
    return (s.step, s.name)


def plan_retention(save_dir: Path, saves: list[Save], chain: Chain, keep_last: int,
                   pruned: tuple[Pruned, ...] = (), composites: tuple[Composite, ...] = (),
                   busy: dict[str, str] | None = None, bad: tuple[BadTombstone, ...] = (),
                   listed: frozenset[str] = frozenset()) -> RetentionPlan:
    """The verdicts on every save of save_dir (`saves`, checked; `chain`, what recovery
    chose from them), every composite and every tombstone (pruned: those read; bad: those
    that are not tombstones; listed: the ids prune's record lists). busy: path -> why a
    live process may be writing it (kept). Raises what planning/lineage.py's `vet` raises
    for a tombstone a save needs that is not right."""
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0, got {keep_last}")
    busy = busy or {}
    folder = save_dir / PRUNED_DIR
    vetted = vet(folder, saves, pruned, bad, listed)
    newest = (chain.partials or (chain.full,))[-1]
    verdicts = [_judge_save(s, chain, newest, keep_last, _window(saves, chain, keep_last),
                            busy) for s in saves]
    verdicts = _mark(verdicts, saves, vetted.pruned + vetted.unused, folder)
    verdicts += [Verdict("tombstone", folder / i, False, f"not a tombstone ({why}); no save "
                         f"builds on it: left alone") for i, why in vetted.skipped]
    verdicts += [_judge_composite(c, save_dir, newest, busy) for c in composites]
    blocked = tuple(v for s, v in zip(saves, verdicts) if s.unreadable)
    if blocked and any(v.remove for v in verdicts):
        # every verdict was taken from a view with these saves missing: none stands
        verdicts = [v if not v.remove else Verdict(v.kind, v.path, False, f"would go ({v.why}"
                                                   f"), but nothing goes while a save cannot "
                                                   f"be read") for v in verdicts]
    else:  # (one kept for another reason too, the newest, one in progress: no matter)
        blocked = tuple(v for v in blocked if v.why.startswith(UNREAD))
        prove(save_dir, saves, chain, verdicts, pruned, bad, listed)
    return RetentionPlan(newest.name, keep_last, tuple(verdicts), blocked)


def prove(save_dir: Path, saves: list[Save], chain: Chain, verdicts: list[Verdict],
          pruned: tuple[Pruned, ...], bad: tuple[BadTombstone, ...],
          listed: frozenset[str]) -> None:
    """Unproven unless recovery of what the verdicts leave (less what they remove, with
    the tombstones they write, under the record prune then writes), started from the same
    full save, takes every layer from the save it takes it from now."""
    removals = [v for v in verdicts if v.remove]
    if not removals:
        return
    gone = {v.path for v in removals if v.kind == "save"}
    dropped = {v.path.name for v in removals if v.kind == "tombstone"}
    new = {v.tombstone.lineage.save_id: v.tombstone for v in removals if v.tombstone}
    left = [s for s in saves if s.path not in gone]
    tombs = tuple(p for p in pruned if p.lineage.save_id not in dropped | set(new))
    there = {p.lineage.save_id for p in pruned} | {b.save_id for b in bad}
    record = frozenset((there - dropped) | set(new))  # as jobs/prune.py's _record writes it
    try:
        vetted = vet(save_dir / PRUNED_DIR, left, tombs + tuple(new.values()), bad, record)
        after = choose(save_dir, left, chain.full.name, vetted.pruned)
    except MpitailorError as e:
        why = str(e).split("; the save dir was tampered with")[0]
        raise _unproven(save_dir, f"the tombstones it would write do not fit the saves around "
                                  f"them ({why})") from None
    was, now = _sources(chain), _sources(after) if after is not None else None
    if was != now:
        raise _unproven(save_dir, _difference(was, now))


def _sources(chain: Chain) -> tuple:
    """What a recovery of chain is made of: its full save, its base (the newest save),
    the save each layer a partial save holds comes from, and the layer patterns."""
    held: dict[str, str] = {}
    for p in chain.partials:  # oldest first: the newest holder wins
        held.update(dict.fromkeys(p.meta.held_layers, p.name))
    patterns = [s.meta.layer_patterns for s in (chain.full, *chain.partials)
                if s.meta.layer_patterns]
    return (chain.full.name, (chain.partials or (chain.full,))[-1].name, held,
            dict(patterns[-1]) if patterns else {})


def _difference(was: tuple, now: tuple | None) -> str:
    if now is None:
        return "after it recovery would find no usable full save"
    if was[:2] != now[:2]:
        return (f"recovery would start from {shown(now[0])} and end at {shown(now[1])} after "
                f"it, not {shown(was[0])} and {shown(was[1])}")
    layer = next((k for k in sorted({*was[2], *now[2]}) if was[2].get(k) != now[2].get(k)),
                 None)
    if layer is not None:
        return (f"recovery would take {layer} from {shown(now[2].get(layer, now[0]))} after "
                f"it, not from {shown(was[2].get(layer, was[0]))}")
    return "recovery would read the layers by other layer patterns after it"


def _unproven(save_dir: Path, why: str) -> Unproven:
    return Unproven(f"{shown(save_dir)}: prune removes nothing: it cannot show that recovery "
                    f"after it is what it is now: {why}; the saves' own lineage records "
                    f"disagree (a save edited, or copied in from another run?): check the "
                    f"saves named, and run prune again")


def _window(saves: list[Save], chain: Chain, keep_last: int) -> tuple[int, str] | None:
    """The oldest (step, name) keep_last protects; None: keep_last is 0."""
    if keep_last == 0:
        return None
    full = chain.full
    timeline = [s for s in saves if s.problem is None and _order(s) < _order(full)]
    timeline += [full, *chain.partials]
    return _order(timeline[-keep_last]) if keep_last <= len(timeline) else (-2, "")


def _judge_save(s: Save, chain: Chain, newest: Save, keep_last: int,
                window: tuple[int, str] | None, busy: dict[str, str]) -> Verdict:
    def keep(why: str) -> Verdict:
        return Verdict("save", s.path, False, why)

    def drop(why: str) -> Verdict:
        return Verdict("save", s.path, True, why)

    full = chain.full
    if s.name == full.name:
        return keep("the full save the recovered timeline starts from (the base every "
                    "partial save after it needs)")
    if s.name == newest.name:
        return keep("the newest save of the recovered timeline (the composite's base)")
    if _order(s) > _order(newest):
        state = f"not usable yet ({s.problem})" if s.problem else "usable"
        return keep(f"newer than the newest usable save {newest.name}, {state}: a save in "
                    f"progress, or one recovery will take up")
    if str(s.path) in busy:
        return keep(busy[str(s.path)])
    if s.unreadable:
        return keep(f"{UNREAD} ({s.problem}): it may hold the newest copy of a "
                    f"layer; fix its permissions (or the disk) and run prune again")
    if window is not None and _order(s) >= window:
        return keep(f"within --keep-last {keep_last} (as new as the {keep_last} newest saves "
                    f"of the recovered timeline)")
    if s.lineage is not None and not valid_id(s.lineage.save_id):
        return keep(f"its save id {s.lineage.save_id!r} is not a hex id: prune cannot record "
                    f"it, and recovery may need it to follow the saves after it")
    partials = [p.name for p in chain.partials]
    if s.name in partials:
        later = chain.partials[partials.index(s.name) + 1:]
        held = set().union(*(p.meta.held_layers for p in later))
        left = sorted(s.meta.held_layers - held)
        if left:
            return keep(f"holds the newest copy of {', '.join(left)}")
        return drop(f"every layer it holds is saved again by a newer save of the timeline "
                    f"({', '.join(p.name for p in later)})")
    if s.step < 0 and s.lineage is None:  # (a plain DCP save named `final`: its step is
        # read from its name, and -1 would make it older than any save)
        return keep("no save record and no step in its name: prune cannot tell how old it "
                    "is; left alone")
    if s.problem is not None:
        return drop(f"incomplete by its own record ({s.problem}), and older than the "
                    f"newest usable save {newest.name}")
    if _order(s) < _order(full):
        return drop(f"older than {full.name}, the full save the recovered timeline starts "
                    f"from (an older chain, or saves before it)")
    if s.step == full.step and not s.partial:
        return keep(f"another full save of step {s.step} beside {full.name}; left alone")
    why = dict(chain.skipped).get(s.name, f"it does not build on {full.name}")
    return drop(f"not on the recovered timeline: {why}")


def _mark(verdicts: list[Verdict], saves: list[Save], pruned: tuple[Pruned, ...],
          folder: Path) -> list[Verdict]:
    """Tombstones for the removed saves between two remaining saves of a timeline (a
    remaining save builds on them, and they on a remaining one), and the old tombstones
    nobody needs any more, removed."""
    gone = {s.name for s, v in zip(saves, verdicts) if v.remove}
    staying = [s for s in saves if s.name not in gone and s.lineage is not None]
    staying_ids = {s.lineage.save_id for s in staying}
    marks: dict[str, Pruned] = {p.lineage.save_id: p for p in pruned}
    for s in saves:
        if s.name in gone and s.lineage is not None:
            marks[s.lineage.save_id] = Pruned(s.name, s.step, s.lineage, frozenset(
                s.meta.held_layers) if s.partial else None)
    needed: set[str] = set()
    for s in staying:  # marks between a remaining save and a remaining ancestor are needed
        pid, between = s.lineage.parent, []
        # (a loop of the saves' own records, which vet does not walk, ends the walk)
        while pid is not None and pid in marks and pid not in staying_ids and \
                pid not in between:
            between.append(pid)
            pid = marks[pid].lineage.parent
        if pid in staying_ids:
            needed.update(between)
    out = [v if not (v.remove and s.lineage is not None and s.lineage.save_id in needed)
           else Verdict(v.kind, v.path, True, v.why, marks[s.lineage.save_id])
           for s, v in zip(saves, verdicts)]
    for p in pruned:
        if p.lineage.save_id not in needed:
            why = "a save of that id is back" if p.lineage.save_id in staying_ids else \
                "no remaining save builds on it"
            out.append(Verdict("tombstone", folder / p.lineage.save_id, True,
                               f"tombstone of the pruned {p.name}: {why}"))
    return out


def _judge_composite(c: Composite, save_dir: Path, newest: Save,
                     busy: dict[str, str]) -> Verdict:
    def keep(why: str) -> Verdict:
        return Verdict("composite", c.path, False, why)

    if c.problem is not None:
        return keep(f"not a readable composite ({c.problem}); left alone")
    if str(c.path) in busy:
        return keep(busy[str(c.path)])
    base = Path(c.base_path or "")
    if base != save_dir and save_dir not in base.parents:
        return keep(f"assembled from {base}, outside {save_dir}; left alone")
    newest_id = newest.lineage.save_id if newest.lineage is not None else None
    # (an HF checkpoint-N's composite names its tag dir, checkpoint-N/global_stepN)
    if (base == newest.path or newest.path in base.parents) and c.base_save_id == newest_id:
        return keep(f"the newest composite: assembled from {newest.name}, as recover would "
                    f"assemble it now")
    if c.base_step is None or c.base_step > newest.step:
        return keep(f"assembled from {base.name} (step {c.base_step}), not older than the "
                    f"newest usable save {newest.name}; left alone")
    return Verdict("composite", c.path, True,
                   f"older than the newest composite: assembled from {base.name} (step "
                   f"{c.base_step}); recover would assemble from {newest.name} (step "
                   f"{newest.step}) now")
