"""`recover`: the newest consistent copy of every layer across a save dir, as a recipe.

Saves form timelines. A full save starts a chain; a partial save records its chain and the
save it builds on (mpitailor's checkpointer writes these lineage records). Recovery starts
from the full save the save dir's `latest` names (or, without a usable one, the newest
complete full save) and follows the partial saves built on it, one after another: saves of
another chain (an abandoned run after a rollback) are never combined with it.

A save counts only when every rank's files are there and whole: each rank's model and
optimizer files parse and hold every buffer they promise; a partial save's files match the
sizes of its manifest, and the files the merge will read match its CRC-32s. A save that
fails is skipped and reported, never taken as "no save"; recovery fails only when no full
save of the timeline is usable, and says "nothing to recover" (exit 3) only when the save
dir holds no finished save at all.

Collective where it takes a `comm`: the per-rank file checks are spread over the MPI ranks.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import yaml

from mpitailor.cluster.comm import Comm
from mpitailor.cluster.nodes import Placement, shard_paths, survey
from mpitailor.errors import CheckpointError, NothingToRecover, UserError
from mpitailor.formats import CheckpointMeta
from mpitailor.formats.extras import MANIFEST
from mpitailor.formats.files import (
    PARTIAL_MANIFEST,
    SAVE_RECORD,
    STAGE12_MODEL,
    Lineage,
    model_file,
    partial_files,
    read_latest,
    read_save_record,
)
from mpitailor.formats.fsview import LOCAL
from mpitailor.formats.partial_shard import check_partial_rank
from mpitailor.formats.read import read_meta
from mpitailor.formats.shard import open_shard
from mpitailor.planning.layers import AUX_KEYS, OTHER, LayerClassifier, layer_index, sort_keys

log = logging.getLogger(__name__)
SAVE_NAMES = ("global_step", "checkpoint-")


@dataclass(frozen=True, slots=True)
class Save:
    """One save under the save dir, usable or not (then `problem` says why)."""

    name: str
    path: Path
    meta: CheckpointMeta | None
    lineage: Lineage | None
    problem: str | None = None

    @property
    def partial(self) -> bool:
        return self.meta is not None and self.meta.files.partial

    @property
    def step(self) -> int:
        if self.meta is not None:
            return self.meta.global_steps
        digits = self.name.rpartition("-")[2].removeprefix("global_step")
        return int(digits) if digits.isdigit() else -1


@dataclass(frozen=True, slots=True)
class Chain:
    """What recovery uses: a full save, the partial saves after it, and what it left out."""

    full: Save
    partials: tuple[Save, ...]
    skipped: tuple[tuple[str, str], ...]   # (save name, why)


def find_saves(save_dir: Path, view=LOCAL) -> list[Save]:
    """Every save directly under save_dir (rank-0 metadata only), oldest first. view: the
    save dir as the job's nodes see it together (node-local storage; fsview.py)."""
    if not view.is_dir(save_dir):
        raise UserError(f"{save_dir}: no such save dir")
    found = []
    for name in sorted(view.names(save_dir)):
        child = save_dir / name
        if name.startswith(".") or not view.is_dir(child) or child.is_symlink():
            continue  # staging dirs of interrupted saves, files
        if view.exists(child / MANIFEST):
            continue  # an earlier composite written here is not a save of this run
        try:
            meta = read_meta(child, view)  # reads the save's lineage record too
        except (CheckpointError, OSError) as e:
            if name.startswith(SAVE_NAMES) or view.exists(child / PARTIAL_MANIFEST):
                found.append(Save(name, child, None, _lineage(child, view), str(e)))
            continue
        found.append(Save(name, child, meta, meta.lineage))
    return sorted(found, key=lambda s: (s.step, s.name))


def _lineage(child: Path, view) -> Lineage | None:
    """The lineage of a save that cannot be read as a whole (its successors still need it)."""
    tags = [child / n for n in view.names(child) if n.startswith("global_step")]
    for tag_dir in (child, *(p for p in tags if view.is_dir(p))):
        for partial in (True, False):
            try:
                found = read_save_record(tag_dir, partial, view)[0]
            except CheckpointError:
                return None
            if found is not None:
                return found
    return None


def check_saves(comm: Comm, saves: list[Save], crc_of: set[str] = frozenset(),
                place: Placement | None = None) -> list[Save]:
    """Collective: check every rank's files of every usable save, spread over the MPI ranks
    (under node-local storage, over the ranks of the node that holds them). Partial saves
    named in crc_of also have their files checked against their CRC-32s."""
    items = [(i, r) for i, s in enumerate(saves) if s.problem is None
             for r in range(s.meta.world_size)]
    owner, found = {}, {}
    for k, (i, r) in enumerate(items):
        if place is None or not place.node_local:
            owner[i, r] = k % comm.size
            continue
        try:
            owner[i, r] = place.reader(shard_paths(saves[i].meta, r), k)
        except CheckpointError as e:
            found.setdefault(i, str(e))

    def mine() -> list[tuple[int, str]]:
        problems = []
        for i, r in [item for item in items if owner.get(item) == comm.rank]:
            try:
                _check_rank(saves[i], r, saves[i].name in crc_of)
            except (CheckpointError, OSError) as e:
                problems.append((i, str(e)))
        return problems

    for part in comm.allgather(comm.step(mine)):
        for i, why in part:
            found.setdefault(i, why)
    return [dataclasses.replace(s, problem=found[i]) if i in found else s
            for i, s in enumerate(saves)]


def _check_rank(save: Save, rank: int, crc: bool) -> None:
    if save.partial:
        check_partial_rank(save.meta, rank, crc=crc)
    else:
        with open_shard(save.meta, rank):  # parses both files, checks every buffer's extent
            pass


def choose(save_dir: Path, saves: list[Save], view=LOCAL) -> Chain:
    """The timeline to recover: a usable full save and the partial saves built on it."""
    latest_tag = _latest(save_dir, view)
    by_name = {s.name: s for s in saves}
    fulls = [s for s in saves if s.problem is None and not s.partial]
    skipped: dict[str, str] = {s.name: s.problem for s in saves if s.problem is not None}
    start = by_name.get(latest_tag) if latest_tag else None
    if start is not None and (start.problem is not None or start.partial):
        start = None
    if start is None and fulls:
        start = fulls[-1]
    if start is None:
        raise _nothing(save_dir, saves, skipped, view)
    path = _follow(start, saves) if start.lineage is not None else \
        [s for s in saves if s.partial and s.step > start.step and s.lineage is None]
    on_path = {s.name for s in path}
    for s in saves:
        if s is start or s.name in on_path or s.name in skipped or s.step < start.step:
            continue
        if s.step == start.step and not s.partial:
            continue
        if not s.partial:
            skipped[s.name] = (f"a full save not named by {save_dir / 'latest'}"
                               if latest_tag else f"another full save of step {s.step}")
        else:
            skipped[s.name] = (f"another timeline: it does not build on {start.name} "
                               f"(an abandoned run, or a save that was replaced)")
    partials = tuple(s for s in path if s.problem is None)
    for s in path:
        if s.problem is not None:
            skipped[s.name] = s.problem
    return Chain(start, partials, tuple(sorted(skipped.items(),
                                               key=lambda kv: (by_name[kv[0]].step, kv[0]))))


def _follow(start: Save, saves: list[Save]) -> list[Save]:
    """The partial saves built on `start`, one on another, through unusable ones too (their
    successors still hold good layers); at a fork, the newest branch."""
    children: dict[str, list[Save]] = {}
    for s in saves:
        if s.lineage is not None and s.lineage.parent is not None:
            children.setdefault(s.lineage.parent, []).append(s)
    path, node = [], start
    while node.lineage is not None and children.get(node.lineage.save_id):
        node = max(children[node.lineage.save_id], key=lambda s: (s.step, s.name))
        path.append(node)
    return path


def _latest(save_dir: Path, view) -> str | None:
    latest = save_dir / "latest"
    if not view.is_file(latest):
        return None
    try:
        return read_latest(latest, view)
    except CheckpointError as e:
        log.warning("ignoring %s", e)
        return None


def _nothing(save_dir: Path, saves: list[Save], skipped: dict[str, str],
             view) -> Exception:
    """No usable full save: an error if any save ever finished, else nothing to recover."""
    finished = view.exists(save_dir / "latest") or any(
        s.partial or view.exists(s.path / "latest") or view.exists(s.path / PARTIAL_MANIFEST)
        or view.exists(s.path / SAVE_RECORD) for s in saves)
    reasons = "; ".join(f"{n}: {why}" for n, why in skipped.items())
    if finished:
        return UserError(f"{save_dir}: no usable full checkpoint to start from ("
                         f"{reasons or 'only partial saves'}); recovery needs one complete "
                         f"full save of the timeline")
    return NothingToRecover(f"{save_dir}: no finished checkpoint: nothing to recover"
                            + (f" (incomplete: {reasons})" if reasons else ""))


def plan_recovery(comm: Comm, save_dir: Path, until_step: int | None = None) -> Chain:
    """Collective: find, check and choose; partial saves the chain uses are checked against
    their CRC-32s (a damaged one is skipped and the chain chosen again). until_step: leave
    out saves after this step (resume from an older point)."""
    place = survey(comm, [save_dir], depth=3)
    found = comm.step_on(_finder(place, save_dir), find_saves, save_dir, place.fs())
    if until_step is not None:
        found = [s for s in found if s.step <= until_step]
    saves = check_saves(comm, found, place=place)
    while True:
        chain = comm.root_step(choose, save_dir, saves, place.fs())
        names = {s.name for s in chain.partials}
        checked = check_saves(comm, [s for s in saves if s.name in names], crc_of=names,
                              place=place)
        bad = {s.name: s for s in checked if s.problem is not None}
        if not bad:
            break
        saves = [bad.get(s.name, s) for s in saves]
    if comm.rank == 0:
        for name, why in chain.skipped:
            log.warning("recover: skipping %s: %s", name, why)
    return chain


RANK0_FILES = (model_file(0), STAGE12_MODEL, partial_files(0)["model"])


def _finder(place: Placement, save_dir: Path) -> int:
    """The rank that reads the saves' metadata: under node-local storage, the first rank of
    the node holding the most rank-0 files (DeepSpeed's rank 0 and its node's disk)."""
    if not place.node_local:
        return 0
    counts: dict[int, int] = {}
    for path, nodes in place.holders.items():
        if Path(path).name in RANK0_FILES:
            for n in nodes:
                counts[n] = counts.get(n, 0) + 1
    return place.nodes.leader(max(counts, key=lambda n: (counts[n], -n)) if counts else 0)


def recovery_recipe(save_dir: Path, chain: Chain, output: Path | None = None,
                    layer_patterns: dict[str, str] | None = None) -> str:
    """The YAML recipe that assembles the newest copy of every layer of the chain."""
    full, partials = chain.full, list(chain.partials)
    if layer_patterns is None:  # as the run saved them: the newest save that recorded some
        recorded = [s.meta.layer_patterns for s in [full, *partials] if s.meta.layer_patterns]
        layer_patterns = dict(recorded[-1]) if recorded else {}
    classify = LayerClassifier(layer_patterns)
    keys = sort_keys({classify(s.name) for s in full.meta.layout.slots} |
                     {classify(n) for n, _ in full.meta.frozen_shapes})
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
                    "layers": _layer_ranges(chosen)}
    for key in (*AUX_KEYS, OTHER):
        if key in chosen:
            recipe[key] = chosen[key]
    recipe["base"] = newest.name
    if layer_patterns:
        recipe["layer_patterns"] = dict(layer_patterns)
    if output is not None:
        recipe["output"] = str(output)
    header = (f"# Generated by `mpitailor recover {save_dir}`: full checkpoint {full.name} "
              f"(step {full.step}), {len(partials)} partial checkpoint(s) of its timeline "
              f"after it; taken from: {', '.join(recipe['sources'])}.\n")
    header += "".join(f"# skipped {n}: {why}\n" for n, why in chain.skipped)
    return header + yaml.safe_dump(recipe, sort_keys=False)


def _layer_ranges(chosen: dict[str, str]) -> dict[str, str]:
    """{'0-3': a, '4': b, ...} from layer key -> source, merging consecutive layers."""
    idx = sorted((i, src) for k, src in chosen.items() if (i := layer_index(k)) is not None)
    out, start = {}, 0
    for j, (i, src) in enumerate(idx):
        last = j + 1 == len(idx) or idx[j + 1][1] != src
        if last:
            first = idx[start][0]
            out[f"{first}-{i}" if i != first else str(i)] = src
            start = j + 1
    return out
