"""Random timelines for retention's property: after any prune, recovery is what it was before
(the same base save, the same source for every layer), or prune refused and removed nothing.

In memory, on the planning layer's own records (planning/chain.py's Save, Pruned;
planning/retention.py; planning/lineage.py), so that thousands of timelines run in seconds:
tests/test_retention_safety.py runs a few thousand, bench/retention_fuzz.py as many as asked.
What jobs/ adds around the planner is done here as jobs/ does it, from the same functions:
the tombstones vetted before the choice (jobs/recovery.py), prune's record written before
anything goes (jobs/tombstones.py), a blocked plan refused (jobs/prune.py).

A timeline is made as a run makes one: full saves start chains, partial saves hold random
layer subsets and build on the save before, a run killed mid-save leaves an incomplete save,
a rollback resumes from an older save (what follows forks), and earlier prunes (random
--keep-last) leave tombstones and their record. Then the save dir is damaged as the review
did: saves that cannot be read at prune time (they read again after), the tombstone dir
lost, one tombstone lost, forged tombstones, a loop of tombstones, tombstones that are not
tombstones at all; and as the second review did: a save copied under another name keeping
its save id (a twin), a partial save whose chain is not its parent's, and a `latest` that
cannot be read at prune time (it names an older full save as often as not: a rollback
chosen by hand). What only a disk can hold (stray manifests inside saves, symbolic links
in place of mpitailor's own dirs, FIFOs) is tests/test_retention_safety.py's on-disk part.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from mpitailor.errors import MpitailorError
from mpitailor.formats.zero.files import Lineage
from mpitailor.planning.chain import Chain, Pruned, Save, choose
from mpitailor.planning.lineage import BadTombstone, CannotReadNow, vet
from mpitailor.planning.retention import PRUNED_DIR, plan_retention

ROOT = Path("/saves")
LAYERS = ("layers.0", "layers.1", "layers.2", "layers.3", "embed", "norm", "lm_head")
DAMAGE = ("unreadable", "lost_one", "forged", "loop", "bad", "incomplete", "twin", "chain",
          "latest", "lost_dir")  # (last: it takes every tombstone)
UNREADABLE_LATEST = "\0 a FIFO"  # `latest` as prune sees it while it cannot be read


@dataclass(frozen=True)
class Files:
    partial: bool


@dataclass(frozen=True)
class Meta:
    """What the planner reads of a CheckpointMeta."""

    global_steps: int
    files: Files
    held_layers: frozenset | None
    layer_patterns: tuple = ()

    @property
    def partial(self) -> bool:
        return self.files.partial


@dataclass
class SaveDir:
    """A save dir as recovery and prune see it: saves (oldest first), tombstones by id, the
    tombstones that are not ones, prune's record, and whether the tombstone dir is there."""

    saves: list[Save]
    tombs: dict[str, Pruned] = field(default_factory=dict)
    bad: dict[str, BadTombstone] = field(default_factory=dict)
    listed: frozenset[str] = frozenset()
    dir_ok: bool = True
    latest: str | None = None

    def copy(self) -> SaveDir:
        return SaveDir(list(self.saves), dict(self.tombs), dict(self.bad), self.listed,
                       self.dir_ok, self.latest)


def _save(name: str, step: int, sid: str, chain: str, parent: str | None,
          held: frozenset | None) -> Save:
    meta = Meta(step, Files(held is not None), held)
    return Save(name, ROOT / name, meta, Lineage(sid, chain, parent))


def make_timeline(rng: random.Random) -> SaveDir:
    """A run's save dir, as its saves, kills, rollbacks and earlier prunes leave it."""
    d = SaveDir([])
    step, head, n = 0, None, 0
    names: set[str] = set()
    for _ in range(rng.randint(2, 14)):
        n += 1
        step += rng.randint(1, 3)
        while f"global_step{step}" in names:
            step += 1
        name = f"global_step{step}"
        sid = f"{n:08x}{rng.getrandbits(32):08x}"
        roll = rng.random()
        if head is None or roll < 0.2:
            s = _save(name, step, sid, sid, None, None)
            d.latest = name  # DeepSpeed's `latest` names the last full save
        elif roll < 0.3:  # killed mid-save: no manifest, nothing the run builds on
            s = Save(name, ROOT / name, None, None, f"{ROOT / name}: an incomplete save")
        else:
            held = frozenset(rng.sample(LAYERS, rng.randint(1, len(LAYERS))))
            s = _save(name, step, sid, head.lineage.chain, head.lineage.save_id, held)
        names.add(name)
        d.saves.append(s)
        if s.meta is not None:
            head = s
        if rng.random() < 0.12 and head is not None:  # a rollback: resume from an older save
            done = [x for x in d.saves if x.meta is not None]
            head = rng.choice(done)
            step = head.step
        if rng.random() < 0.15:
            d = prune_pure(d, rng.randint(0, 3))[0]
    d.saves.sort(key=lambda s: (s.step, s.name))
    fulls = [s.name for s in d.saves if s.meta is not None and not s.partial]
    if fulls and rng.random() < 0.2:  # resume from an older full save, by hand
        d.latest = rng.choice(fulls)
    return d


def damage(d: SaveDir, rng: random.Random) -> tuple[SaveDir, SaveDir, list[str]]:
    """(the save dir as it is, the same as prune sees it now, what was done). Only
    `unreadable` differs between the two: a save that cannot be read now reads again."""
    true, kinds = d.copy(), []
    unreadable: set[str] = set()
    ids = [s.lineage.save_id for s in d.saves if s.lineage is not None] + list(d.tombs)
    for kind in DAMAGE:
        if rng.random() >= 0.14:  # (ten kinds: about a quarter of the cases undamaged)
            continue
        kinds.append(kind)
        if kind == "unreadable" and true.saves:
            unreadable |= {rng.choice(true.saves).name for _ in range(rng.randint(1, 2))}
        elif kind == "lost_dir":
            true.tombs, true.bad, true.dir_ok = {}, {}, False
        elif kind == "lost_one" and true.tombs:
            del true.tombs[rng.choice(sorted(true.tombs))]
        elif kind == "forged" and ids:
            fid = f"f0{rng.getrandbits(48):012x}"
            parent = rng.choice(ids)
            chain = rng.choice([parent, *(s.lineage.chain for s in d.saves if s.lineage)])
            true.tombs[fid] = Pruned("global_step99", rng.choice([99, rng.randint(0, 30)]),
                                     Lineage(fid, chain, parent))
        elif kind == "loop":
            a, b = (f"c{i}{rng.getrandbits(40):010x}" for i in (1, 2))
            target = rng.choice([a, *ids]) if ids else a
            true.tombs[a] = Pruned("global_step98", 98, Lineage(a, a, b))
            true.tombs[b] = Pruned("global_step97", 97, Lineage(b, b, target))
        elif kind == "bad":
            bid = rng.choice([*true.tombs, f"b0{rng.getrandbits(40):010x}"])
            true.tombs.pop(bid, None)
            true.bad[bid] = BadTombstone(bid, "not a readable JSON file")
        elif kind == "incomplete":
            done = [i for i, s in enumerate(true.saves) if s.partial]
            if done:
                i = rng.choice(done)
                true.saves[i] = replace(true.saves[i], meta=None,
                                        problem="sizes disagree with its manifest")
        elif kind == "twin":
            _twin(true, rng)
        elif kind == "chain":
            done = [i for i, s in enumerate(true.saves) if s.partial]
            if done:
                i = rng.choice(done)
                was = true.saves[i].lineage
                true.saves[i] = replace(true.saves[i], lineage=Lineage(
                    was.save_id, f"77{rng.getrandbits(56):014x}", was.parent))
    seen = true.copy()
    seen.saves = [_unreadable(s, rng) if s.name in unreadable else s for s in true.saves]
    if "latest" in kinds:
        seen.latest = UNREADABLE_LATEST
    return true, seen, kinds


def _twin(d: SaveDir, rng: random.Random) -> None:
    """A save copied under another name, its save id kept: the copy's step, parent and
    usability at random (a backup, a save renamed, one kept newer than anything)."""
    done = [s for s in d.saves if s.lineage is not None]
    if not done:
        return
    s = rng.choice(done)
    step = rng.choice([s.step, s.step + 1, 100])
    name = f"global_step{step}" if step != s.step else f"{s.name}x"
    parent = rng.choice([s.lineage.parent, f"ab{rng.getrandbits(56):014x}"])
    twin = replace(s, name=name, path=ROOT / name,
                   lineage=Lineage(s.lineage.save_id, s.lineage.chain, parent),
                   meta=replace(s.meta, global_steps=step) if s.meta else None)
    if rng.random() < 0.5:
        twin = replace(twin, meta=None, problem="global_steps disagree with its files")
    d.saves = sorted([x for x in d.saves if x.name != name] + [twin],
                     key=lambda x: (x.step, x.name))


def _unreadable(s: Save, rng: random.Random) -> Save:
    """s as a read that fails now leaves it: no metadata; its lineage record read or not."""
    return replace(s, meta=None, problem="Permission denied", unreadable=True,
                   lineage=s.lineage if rng.random() < 0.5 else None)


def recover_pure(d: SaveDir) -> tuple:
    """What `recover` makes of d: ("ok", base, step, {layer: source}), ("none",) when there
    is no usable full save, or ("error",) when it refuses (a tampered timeline, a missing
    tombstone, a save that cannot be read now)."""
    try:
        chain = choose_pure(d)
    except MpitailorError:
        return ("error",)
    if chain is None:
        return ("none",)
    path = [chain.full, *chain.partials]
    if any(s.unreadable and s.step >= chain.full.step for s in d.saves):
        return ("error",)  # jobs/recovery.py's _refuse_unreadable (coarser: never weaker)
    chosen = {k: next((p.name for p in reversed(chain.partials) if k in p.meta.held_layers),
                      chain.full.name) for k in LAYERS}
    return ("ok", path[-1].name, path[-1].step, tuple(sorted(chosen.items())))


def choose_pure(d: SaveDir, prune: bool = False) -> Chain | None:
    """As jobs/recovery.py chooses: the record checked against the tombstone dir, the
    tombstones vetted, then planning/chain.py's choice. MpitailorError if it refuses
    (prune: also while `latest` cannot be read; recover then starts from the newest full
    save, with a warning)."""
    if d.listed and not d.dir_ok:
        raise MpitailorError("tombstone dir missing")
    vetted = vet(ROOT / PRUNED_DIR, d.saves, tuple(d.tombs.values()), tuple(d.bad.values()),
                 d.listed)
    latest = d.latest
    if latest == UNREADABLE_LATEST:
        if prune:
            raise CannotReadNow("latest cannot be read now")
        latest = None
    named = next((s for s in d.saves if s.name == latest), None)
    if named is not None and named.unreadable:
        raise CannotReadNow("the save latest names cannot be read now")
    return choose(ROOT, d.saves, latest, vetted.pruned)


def prune_pure(d: SaveDir, keep_last: int) -> tuple[SaveDir, str]:
    """d after `prune --keep-last keep_last` as jobs/prune.py does it, and what happened:
    "pruned", or why it refused (then d is returned as it was)."""
    try:
        chain = choose_pure(d, prune=True)
        if chain is None:
            return d, "refused: nothing to recover"
        plan = plan_retention(ROOT, d.saves, chain, keep_last, tuple(d.tombs.values()),
                              bad=tuple(d.bad.values()), listed=d.listed)
    except MpitailorError as e:
        return d, f"refused: {type(e).__name__}"
    if plan.blocked:
        return d, "refused: blocked"
    out = d.copy()
    gone = {v.path.name for v in plan.removals if v.kind == "save"}
    new = {v.tombstone.lineage.save_id: v.tombstone for v in plan.removals if v.tombstone}
    dropped = {v.path.name for v in plan.removals if v.kind == "tombstone"}
    there = (set(out.tombs) | set(out.bad)) - dropped
    if plan.removals and (there | set(new) or out.listed):
        out.listed = frozenset(there | set(new))  # prune's record, written first
    out.saves = [s for s in out.saves if s.name not in gone]
    out.tombs = {i: p for i, p in out.tombs.items() if i not in dropped}
    out.tombs.update(new)
    if new:
        out.dir_ok = True  # write_tombstone makes the dir
    return out, "pruned"


@dataclass(frozen=True)
class Case:
    """One timeline tried: what was done to it, what prune did, and whether recovery held."""

    seed: int
    damage: tuple[str, ...]
    keep_last: int
    outcome: str
    before: tuple
    after: tuple

    @property
    def lost(self) -> bool:
        return self.outcome == "pruned" and self.after != self.before


def run_case(seed: int) -> Case:
    """One random timeline, damaged, pruned: the property's verdict on it."""
    rng = random.Random(seed)
    true, seen, kinds = damage(make_timeline(rng), rng)
    keep_last = rng.randint(0, 3)
    before = recover_pure(true)
    after_seen, outcome = prune_pure(seen, keep_last)
    if outcome != "pruned":
        return Case(seed, tuple(kinds), keep_last, outcome, before, before)
    # the same deletions on the save dir as it really is (the unreadable saves read again)
    names = {s.name for s in after_seen.saves}
    after = SaveDir([s for s in true.saves if s.name in names], after_seen.tombs,
                    after_seen.bad, after_seen.listed, after_seen.dir_ok, true.latest)
    return Case(seed, tuple(kinds), keep_last, outcome, before, recover_pure(after))
