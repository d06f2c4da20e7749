"""`recover`: the newest consistent copy of every layer across a save dir, as a recipe, and
the plan that merges it.

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
import errno
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.cluster.nodes import Placement, shard_paths, survey
from mpitailor.display import shown
from mpitailor.errors import CheckpointError, NothingToRecover, UserError
from mpitailor.formats.dcp import METADATA as DCP_METADATA
from mpitailor.formats.io import LOCAL, TooLarge
from mpitailor.formats.zero import (
    LATEST,
    MAX_TAG_BYTES,
    PARTIAL_MANIFEST,
    SAVE_RECORD,
    STAGE12_MODEL,
    check_partial_rank,
    model_file,
    open_shard,
    partial_files,
    read_latest,
)
from mpitailor.jobs.readable import (
    cannot_read,
    looked_at,
    refuse_unreadable,
    still_there,
)
from mpitailor.jobs.readlocks import hold_sources
from mpitailor.jobs.saves import find_saves, hf_unfinished
from mpitailor.jobs.tombstones import read_tombstones
from mpitailor.planning.chain import Chain, Save, choose, recovery_recipe
from mpitailor.planning.layers import LayerClassifier, check_patterns
from mpitailor.planning.lineage import CannotReadNow, vet
from mpitailor.planning.plan import MergePlan
from mpitailor.planning.recipe import Recipe
from mpitailor.planning.retention import PRUNED_DIR

log = logging.getLogger(__name__)


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
            found.setdefault(i, (str(e), cannot_read(e) is not None))

    def mine() -> list[tuple[int, str, bool]]:
        problems = []
        for i, r in [item for item in items if owner.get(item) == comm.rank]:
            try:
                _check_rank(saves[i], r, saves[i].name in crc_of)
            except (CheckpointError, OSError) as e:
                # unreadable now (not incomplete): retention must keep it (readable.py)
                problems.append((i, str(e), cannot_read(e) is not None))
        return problems

    for part in comm.allgather(comm.step(mine)):
        for i, why, now in part:
            if i not in found or now:  # a rank that cannot read it outweighs one that can
                found[i] = (why, now or found.get(i, ("", False))[1])
    return [dataclasses.replace(s, problem=found[i][0], unreadable=found[i][1])
            if i in found else s for i, s in enumerate(saves)]


def _check_rank(save: Save, rank: int, crc: bool) -> None:
    if save.partial:
        check_partial_rank(save.meta, rank, crc=crc, classifier=LayerClassifier)
    else:
        with open_shard(save.meta, rank):  # parses both files, checks every buffer's extent
            pass


def _latest(save_dir: Path, view, strict: bool = False) -> str | None:
    """The tag `latest` names; None without one, or (recover) for one that names no tag,
    said in a warning: recovery then starts from the newest complete full save. strict
    (prune): a `latest` there that names no tag is a refusal, for it names the timeline
    prune keeps: exit 1 when it may read in a moment (not a regular file, or empty, as a
    reader sees it while DeepSpeed rewrites it), 2 for one that holds something else."""
    latest = save_dir / LATEST
    if not (view.exists(latest) or (strict and view is LOCAL and latest.is_symlink())):
        return None  # a FIFO, a device or a link there is read (and refused, said) below
    try:
        return read_latest(latest, view)
    except CheckpointError as e:
        if (why := cannot_read(e, also=(errno.ELOOP,))) is not None:  # a link: refused
            # it names the timeline to take: without it an abandoned one may be chosen
            raise CannotReadNow(f"{shown(latest)}: cannot be read now ({why}); it names the "
                                f"save to resume from: fix its permissions (or the disk) and "
                                f"run again") from None
        if strict:
            raise _unusable_latest(latest, view, e) from None
        log.warning("ignoring %s", e)
        return None


def _unusable_latest(latest: Path, view, e: CheckpointError) -> Exception:
    """Prune's refusal of a `latest` that names no tag (e: why, as read_latest said it)."""
    try:
        raw = view.read_bytes(latest, MAX_TAG_BYTES, "a `latest` file")
        now = not raw.strip()  # empty: being rewritten (DeepSpeed truncates, then writes)
    except TooLarge:
        now = False
    except CheckpointError:
        now = True  # not a regular file (a FIFO, a dir, a link), or gone
    what = "run prune again in a moment (DeepSpeed rewrites it at each save; an empty one " \
        "is being rewritten)" if now else "fix it (the tag of the save to resume from, e.g. " \
        "global_step10) or remove it, and run prune again"
    line = str(e).split("\n")[0]
    return (CannotReadNow if now else UserError)(
        f"prune removes nothing: {line}; `latest` names the save to resume from, and prune "
        f"keeps that save's timeline: {what}")


def _nothing(save_dir: Path, saves: list[Save], skipped: dict[str, str],
             view) -> Exception:
    """No usable full save: an error if any save ever finished, else nothing to recover."""
    finished = view.exists(save_dir / LATEST) or any(
        not hf_unfinished(s.path, view) and (
            s.partial or view.exists(s.path / LATEST) or view.exists(s.path / PARTIAL_MANIFEST)
            or view.exists(s.path / SAVE_RECORD)) for s in saves)
    reasons = "; ".join(f"{n}: {why}" for n, why in skipped.items())
    try:
        children = sorted(view.names(save_dir))
    except OSError:
        children = []
    dcp = [p for p in (save_dir, *(save_dir / n for n in children))
           if view.exists(p / DCP_METADATA)]
    if dcp:  # never "nothing to recover": a prologue would start the job from scratch
        return UserError(f"{dcp[0]}: a PyTorch Distributed Checkpoint (DCP: FSDP2, "
                         f"torchtitan); `recover`, `inspect` and `verify` read DCP saves, "
                         f"this command does not yet")
    if finished:
        return UserError(f"{save_dir}: no usable full checkpoint to start from ("
                         f"{reasons or 'only partial saves'}); recovery needs one complete "
                         f"full save of the timeline")
    return NothingToRecover(f"{save_dir}: no finished checkpoint: nothing to recover"
                            + (f" (incomplete: {reasons})" if reasons else ""))


def _timeline_to_recover(save_dir: Path, saves: list[Save], view=LOCAL,
                         strict: bool = False) -> Chain:
    """The timeline to recover (planning/chain.py's choice), or why there is none. Only
    the tombstones a save builds on are stepped across (planning/lineage.py's `vet`).
    strict: prune's reading of `latest` (_latest)."""
    found = read_tombstones(save_dir, view)
    vetted = vet(save_dir / PRUNED_DIR, saves, found.good, found.bad, found.listed)
    for save_id, why in vetted.skipped:
        log.warning("ignoring %s: not a tombstone (%s); no save builds on it",
                    save_dir / PRUNED_DIR / save_id, why)
    tag = _latest(save_dir, view, strict)
    named = next((s for s in saves if s.name == tag), None)
    if named is not None and named.unreadable:  # the save to resume from, for all we know
        raise CannotReadNow(f"{shown(named.path)}: cannot be read now ({named.problem}); "
                            f"{shown(save_dir / LATEST)} names it as the save to resume from: "
                            f"fix its permissions (or the disk) and run again")
    chain = choose(save_dir, saves, tag, vetted.pruned, vetted.unused)
    if chain is None:
        raise _nothing(save_dir, saves, {s.name: s.problem for s in saves
                                         if s.problem is not None}, view)
    return chain


def plan_recovery(comm: Comm, save_dir: Path,
                  until_step: int | None = None) -> tuple[Chain, Placement]:
    """Collective: find, check and choose; partial saves the chain uses are checked against
    their CRC-32s (a damaged one is skipped and the chain chosen again). until_step: leave
    out saves after this step (resume from an older point). Also where the save dir's files
    lie: the survey that a merge of the chain then reuses (plan_recipe's `place`)."""
    saves, chain, place = survey_saves(comm, save_dir, until_step)
    comm.root_step(refuse_unreadable, saves, chain)
    if comm.rank == 0:
        for name, why in chain.skipped:
            log.warning("recover: skipping %s: %s", name, why)
    return chain, place


def survey_saves(comm: Comm, save_dir: Path, until_step: int | None = None,
                 crc: bool = True, prune: bool = False) -> tuple[list[Save], Chain, Placement]:
    """Collective: plan_recovery's work, returning every save found (checked: `problem`
    says why one is not usable), the chain chosen and where the files lie (prune needs all
    three). crc=False leaves out the CRC-32 pass over the chain's partial saves (the
    training side's retention after each save: they were just written and checked by
    size). Each save that failed a check is walked for what cannot be read in it (a FIFO,
    a dir or a link where a file should be): such a save cannot be read now, not
    incomplete (readable.py). prune: `latest` must name a tag (_latest's strict)."""
    place = survey(comm, [save_dir], depth=3)
    found = comm.step_on(_finder(place, save_dir), find_saves, save_dir, place.fs())
    if until_step is not None:
        found = [s for s in found if s.step <= until_step]
    saves = looked_at(comm, check_saves(comm, found, place=place), place)
    while True:
        chain = comm.root_step(_timeline_to_recover, save_dir, saves, place.fs(), prune)
        if not crc:
            break
        names = {s.name for s in chain.partials}
        checked = check_saves(comm, [s for s in saves if s.name in names], crc_of=names,
                              place=place)
        bad = {s.name: s for s in looked_at(comm, checked, place)
               if s.problem is not None}
        if not bad:
            break
        saves = [bad.get(s.name, s) for s in saves]
    if not place.node_local:  # a save that went while we read: the reading is not whole
        comm.root_step(still_there, saves)
    return saves, chain, place


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


def recover_chain(comm: Comm, save_dir: str | os.PathLike, output: str | os.PathLike | None,
                  layer_patterns: Mapping[str, str] | None = None,
                  where: str = "layer_patterns",
                  world_size: int | None = None) -> tuple[Recipe, Chain, Placement]:
    """Collective: what `recover` merges: the recipe (the saves checked, the chain chosen;
    `where` names the patterns' origin in errors), the chain of saves it was made from (what
    the command line reports: the saves used and those skipped), and where the save dir's
    files lie (for plan_recipe: surveyed once). The one entry of a recovery; plan_recovery
    (the chain alone) and survey_saves (every save found, for prune) lie under it."""
    if layer_patterns:
        check_patterns(dict(layer_patterns), where=where)
    save_dir = Path(save_dir).resolve()
    chain, place = plan_recovery(comm, save_dir)
    recipe = comm.root_step(recovery_recipe, save_dir, chain,
                            None if output is None else Path(output).resolve(),
                            dict(layer_patterns) if layer_patterns else None, world_size)
    if not place.node_local:  # held until the process ends, or it recovers again
        comm.root_step(hold_sources, [path for _, path in recipe.sources])
    return recipe, chain, place


def recovered(plan: MergePlan, chain: Chain) -> str:
    """What a recovery produced, in words: the step and world size of the checkpoint, the
    saves it took layers from, and the saves it left out and why."""
    line = (f"recovered step {plan.base_meta.global_steps} for world size "
            f"{plan.out_world_size} from {', '.join(name for name, _ in plan.sources)}")
    if chain.skipped:
        line += "; skipped " + ", ".join(f"{name} ({why})" for name, why in chain.skipped)
    return line
