"""Recovery's choice, with no I/O: which saves form the timeline to recover, and the recipe
that takes every layer's newest copy from them. jobs/recovery.py finds and checks the saves."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mpitailor.display import escaped
from mpitailor.formats.dcp import DcpSaveMeta
from mpitailor.formats.zero import LATEST, CheckpointMeta, Lineage
from mpitailor.planning.layers import (
    AUX_KEYS,
    OTHER,
    LayerClassifier,
    layer_index,
    layer_runs,
    sort_keys,
)
from mpitailor.planning.recipe import Recipe, recipe_from


@dataclass(frozen=True, slots=True)
class Save:
    """One save under the save dir, usable or not (then `problem` says why). unreadable: the
    problem is a read that failed now (permissions, an I/O error, something that is not a
    file where one should be), not the save's own record saying it is incomplete: it may
    read whole again, so retention never takes it for incomplete."""

    name: str
    path: Path
    meta: CheckpointMeta | DcpSaveMeta | None  # of either family: what recovery reads
    lineage: Lineage | None
    problem: str | None = None
    unreadable: bool = False

    @property
    def partial(self) -> bool:
        return self.meta is not None and self.meta.partial

    @property
    def step(self) -> int:
        return self.meta.global_steps if self.meta is not None else step_of_name(self.name)


def step_of_name(name: str) -> int:
    """The step a save's name says (global_stepN, checkpoint-N, step-N); -1 for none."""
    digits = name.rpartition("-")[2].removeprefix("global_step")
    return int(digits) if digits.isdigit() else -1


@dataclass(frozen=True, slots=True)
class Pruned:
    """A save `mpitailor prune` deleted, as its tombstone remembers it: enough for `follow`
    to step across it to the saves built on it."""

    name: str
    step: int
    lineage: Lineage
    layers: frozenset[str] | None = None  # the layers it held (None: a tombstone of before)


@dataclass(frozen=True, slots=True)
class Chain:
    """What recovery uses: a full save, the partial saves after it, and what it left out."""

    full: Save
    partials: tuple[Save, ...]
    skipped: tuple[tuple[str, str], ...]   # (save name, why)
    pruned: tuple[str, ...] = ()           # saves of the timeline deleted by prune
    # (layer, pruned save): layers whose newest copy went with a pruned save, and that no
    # usable save after it holds again (the one prune relied on damaged or gone since):
    # recovery takes them from an older copy, and says so
    rolled_back: tuple[tuple[str, str], ...] = ()


def choose(save_dir: Path, saves: list[Save], latest_tag: str | None,
           pruned: tuple[Pruned, ...] = (), orphans: tuple[Pruned, ...] = ()) -> Chain | None:
    """The timeline to recover: a usable full save and the partial saves built on it (None:
    no usable full save). latest_tag: what the save dir's `latest` names, if anything;
    pruned: the tombstones of deleted saves (`follow` steps across them); orphans: good
    tombstones no save builds on now (the saves after them damaged or gone), whose layers
    the timeline may roll back all the same (Chain.rolled_back)."""
    by_name = {s.name: s for s in saves}
    fulls = [s for s in saves if s.problem is None and not s.partial]
    skipped: dict[str, str] = {s.name: s.problem for s in saves if s.problem is not None}
    start = by_name.get(latest_tag) if latest_tag else None
    if start is not None and (start.problem is not None or start.partial):
        start = None
    if start is None and fulls:
        start = fulls[-1]
    if start is None:
        return None
    walk = follow(start, saves, pruned) if start.lineage is not None else \
        [s for s in saves if s.partial and s.step > start.step and s.lineage is None]
    path = [s for s in walk if isinstance(s, Save)]
    on_path = {s.name for s in path}
    for s in saves:
        if s is start or s.name in on_path or s.name in skipped or s.step < start.step:
            continue
        if s.step == start.step and not s.partial:
            continue
        if not s.partial:
            skipped[s.name] = (f"a full save not named by {save_dir / LATEST}"
                               if latest_tag else f"another full save of step {s.step}")
        else:
            skipped[s.name] = (f"another timeline: it does not build on {start.name} "
                               f"(an abandoned run, or a save that was replaced)")
    partials = tuple(s for s in path if s.problem is None)
    for s in path:
        if s.problem is not None:
            skipped[s.name] = s.problem
    return Chain(start, partials, tuple(sorted(skipped.items(),
                                               key=lambda kv: (by_name[kv[0]].step, kv[0]))),
                 tuple(s.name for s in walk if isinstance(s, Pruned)),
                 _rolled_back(_with_orphans(start, walk, tuple(
                     p for p in orphans if p.lineage.save_id not in {
                         s.lineage.save_id for s in saves if s.lineage is not None}))))


def _with_orphans(start: Save, walk: list, orphans: tuple[Pruned, ...]) -> list:
    """The walk with the orphan tombstones of start's chain after it, in step order: the
    layers they held are rolled back unless a usable save newer than them holds them."""
    if start.lineage is None or not orphans:
        return walk
    mine = [p for p in orphans if p.lineage.chain == start.lineage.chain and
            p.step > start.step and p not in walk]
    return sorted([*walk, *mine], key=lambda n: (n.step, n.name)) if mine else walk


def _rolled_back(walk: list[Save | Pruned]) -> tuple[tuple[str, str], ...]:
    """(layer, pruned save) for each layer a pruned save of the walk held that nothing after
    it holds again: no usable save, no pruned one (checked in its turn)."""
    out = []
    for i, node in enumerate(walk):
        if not isinstance(node, Pruned) or not node.layers:
            continue
        later: set[str] = set()
        for n in walk[i + 1:]:
            if isinstance(n, Pruned):
                later |= n.layers or set()
            elif n.problem is None and n.partial:
                later |= n.meta.held_layers
        out += [(k, node.name) for k in sort_keys(node.layers - later)]
    return tuple(out)


def rolled_back_words(chain: Chain) -> str | None:
    """chain.rolled_back in words (None: nothing rolled back)."""
    if not chain.rolled_back:
        return None
    by: dict[str, list[str]] = {}
    for layer, name in chain.rolled_back:
        by.setdefault(name, []).append(layer)
    return "; ".join(f"{', '.join(ls)} from older copies: their newest went with {name}, "
                     f"pruned because a newer save held them, which is not usable now"
                     for name, ls in by.items())


def follow(start: Save, saves: list[Save],
           pruned: tuple[Pruned, ...] = ()) -> list[Save | Pruned]:
    """The partial saves built on `start`, one on another, through unusable ones too (their
    successors still hold good layers), and across the saves prune deleted (their
    tombstones, `Pruned`, in the path); at a fork, the newest branch. A missing save that
    left no tombstone ends the path: what follows it is another timeline."""
    present = {s.lineage.save_id for s in saves if s.lineage is not None}
    children: dict[str, list[Save | Pruned]] = {}
    for s in [*saves, *(p for p in pruned if p.lineage.save_id not in present)]:
        if s.lineage is not None and s.lineage.parent is not None:
            children.setdefault(s.lineage.parent, []).append(s)
    path, node, seen = [], start, {start.lineage.save_id}
    while node.lineage is not None and children.get(node.lineage.save_id):
        node = max(children[node.lineage.save_id], key=lambda s: (s.step, s.name))
        # forged records can make a loop (a save that names itself, or a full save that
        # names a descendant as its parent): the walk ends there rather than going round
        if node.lineage.save_id in seen:
            break
        seen.add(node.lineage.save_id)
        path.append(node)
    return path


def recovery_recipe(save_dir: Path, chain: Chain, output: Path | None = None,
                    layer_patterns: dict[str, str] | None = None,
                    world_size: int | None = None) -> Recipe:
    """The recipe that assembles the newest copy of every layer of the chain (its `text`, the
    YAML a user could have written, goes into the manifest and `--emit-recipe`)."""
    full, partials = chain.full, list(chain.partials)
    if layer_patterns is None:  # as the run saved them: the newest save that recorded some
        recorded = [s.meta.layer_patterns for s in [full, *partials] if s.meta.layer_patterns]
        layer_patterns = dict(recorded[-1]) if recorded else {}
    classify = LayerClassifier(layer_patterns)
    keys = sort_keys(full.meta.layer_keys(classify))
    chosen = {}
    for key in keys:
        holders = [p for p in partials if key in p.meta.held_layers]
        chosen[key] = (holders[-1] if holders else full).name
    newest = [full, *partials][-1]
    # A save whose every layer was saved again later (even the full one) supplies nothing:
    # leave it out. The newest save is always kept: it is the base.
    used = set(chosen.values()) | {newest.name}
    recipe: dict = {"sources": {s.name: str(s.path) for s in [full, *partials]
                                if s.name in used},
                    "layers": dict(layer_runs((i, src) for k, src in chosen.items()
                                              if (i := layer_index(k)) is not None))}
    for key in (*AUX_KEYS, OTHER):
        if key in chosen:
            recipe[key] = chosen[key]
    recipe["base"] = newest.name
    if layer_patterns:
        recipe["layer_patterns"] = dict(layer_patterns)
    if output is not None:
        recipe["output"] = str(output)
    lines = [f"Generated by `mpitailor recover {save_dir}`: full checkpoint {full.name} "
             f"(step {full.step}), {len(partials)} partial checkpoint(s) of its timeline "
             f"after it; taken from: {', '.join(recipe['sources'])}."]
    lines += [f"skipped {n}: {why}" for n, why in chain.skipped]
    if chain.pruned:
        lines.append(f"stepped across, deleted by mpitailor prune: {', '.join(chain.pruned)}")
    if (rolled := rolled_back_words(chain)) is not None:
        lines.append(rolled)
    header = "".join(f"# {_comment(line)}\n" for line in lines)
    return recipe_from(recipe, origin=f"recover {save_dir}", header=header,
                       world_size=world_size)


def _comment(text: str) -> str:
    """text as one YAML comment line: a name may hold a newline (or a character YAML also
    breaks lines at), and what followed it would be a live line of the recipe."""
    return escaped(text).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
