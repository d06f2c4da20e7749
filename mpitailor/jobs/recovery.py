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
from mpitailor.errors import CheckpointError, NothingToRecover, UserError
from mpitailor.formats.files import (
    LATEST,
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
from mpitailor.formats.manifest import MANIFEST
from mpitailor.formats.partial_shard import check_partial_rank
from mpitailor.formats.read import read_meta
from mpitailor.formats.shard import open_shard
from mpitailor.jobs.merge import Planned, plan_recipe
from mpitailor.jobs.readable import (
    cannot_read,
    looked_at,
    refuse_unreadable,
    still_there,
    vanished,
)
from mpitailor.jobs.readlocks import hold_sources
from mpitailor.jobs.tombstones import read_tombstones
from mpitailor.planning.layers import LayerClassifier, check_patterns
from mpitailor.planning.lineage import CannotReadNow, vet
from mpitailor.planning.plan import MergePlan
from mpitailor.planning.recipe import Recipe
from mpitailor.planning.recovery import Chain, Save, choose, recovery_recipe
from mpitailor.planning.retention import PRUNED_DIR

log = logging.getLogger(__name__)
SAVE_NAMES = ("global_step", "checkpoint-")


def find_saves(save_dir: Path, view=LOCAL) -> list[Save]:
    """Every save directly under save_dir (rank-0 metadata only), oldest first. view: the
    save dir as the job's nodes see it together (node-local storage; fsview.py)."""
    if not view.is_dir(save_dir):
        raise UserError(f"{save_dir}: no such save dir")
    check_save_dir(save_dir, view)
    found, nested = [], []
    for name in sorted(view.names(save_dir)):
        child = save_dir / name
        if name.startswith("."):
            continue  # staging dirs of interrupted saves, tombstones
        _refuse_link(child)
        if not view.is_dir(child):
            continue  # files
        try:
            save = _find_one(child, view)
        except FileNotFoundError:
            raise vanished(child) from None
        if save == "nested":
            nested.append(name)
        elif save is not None:
            found.append(save)
    if nested:
        raise UserError(f"{save_dir}: holds the save dirs {', '.join(nested)} (each with saves "
                        f"of its own), not one run's saves; give one of them, e.g. "
                        f"{save_dir / nested[0]}")
    return sorted(found, key=lambda s: (s.step, s.name))


def _refuse_link(child: Path) -> None:
    """A save that is a symbolic link is refused by name: skipped, it would read as a save
    that is gone (the saves built on it, another timeline); followed, prune would delete
    what lies elsewhere."""
    if child.is_symlink() and (child.name.startswith(SAVE_NAMES) or child.is_dir()):
        raise UserError(f"{child}: a symbolic link (to {os.readlink(child)}), where a save "
                        f"dir holds its saves; mpitailor follows no link in a save dir: "
                        f"replace it with the save itself (`cp -a`), or remove it")


def _find_one(child: Path, view) -> Save | str | None:
    """The save in child, "nested" for a save dir of its own, None for neither."""
    name = child.name
    if view.exists(child / MANIFEST):
        return None  # an earlier composite written here is not a save of this run
    if _holds_saves(child, view):
        return "nested"
    try:
        meta = read_meta(child, view)  # reads the save's lineage record too
    except (CheckpointError, OSError) as e:
        if not (name.startswith(SAVE_NAMES) or view.exists(child / PARTIAL_MANIFEST)):
            return None
        if isinstance(e, FileNotFoundError) and not os.path.lexists(child):
            raise  # the save itself went (find_saves says so), not a file of it
        why = cannot_read(e)  # not the save's record: incomplete is not proven
        return Save(name, child, None, _lineage(child, view),
                    str(e) if why else (_unfinished(child, view) or str(e)),
                    unreadable=why is not None)
    if _hf_unfinished(child, view):
        return Save(name, child, None, meta.lineage, f"{child}: an incomplete HF Trainer save "
                    f"(no {HF_LAST}, which the Trainer writes last): a save killed while it "
                    f"was written")
    return Save(name, child, meta, meta.lineage)


# An HF Trainer save writes its training args first and its trainer state last: a
# checkpoint-N with the one and not the other was killed while it was written (DeepSpeed's
# own files, `latest` included, may be complete by then; resuming from it would fail).
HF_FIRST, HF_LAST = "training_args.bin", "trainer_state.json"

def _hf_unfinished(child: Path, view) -> bool:
    return view.exists(child / HF_FIRST) and not view.exists(child / HF_LAST)


TAG_FILES = ("zero_pp_rank_", "bf16_zero_pp_rank_", "mp_rank_", "rank_0_model_states.pt",
             PARTIAL_MANIFEST)


def check_save_dir(save_dir: Path, view=LOCAL) -> None:
    """UserError for a checkpoint's tag dir given where the dir of a run's saves is expected
    (it would read as a save dir with no saves in it)."""
    if any(n.startswith(TAG_FILES) for n in view.names(save_dir)):
        raise UserError(f"{save_dir}: a checkpoint's tag dir, not a save dir; give the dir "
                        f"that holds the saves: {save_dir.parent}")


def _holds_saves(child: Path, view) -> bool:
    """A run's save dir inside the save dir (HF's checkpoint-N/ holds one tag dir, which is
    a save of this run, not a run of its own)."""
    subdirs = [n for n in view.names(child) if view.is_dir(child / n)]
    tags = [n for n in subdirs if n.startswith(SAVE_NAMES)]
    return (bool(tags) and not child.name.startswith(SAVE_NAMES)) or \
        any(n.startswith("checkpoint-") for n in tags) or \
        sum(n.startswith("global_step") for n in tags) > 1


def _unfinished(child: Path, view) -> str | None:
    """Why a save dir holding none of a save's files is skipped: a save that never finished."""
    names = view.names(child)
    inner = [child / n for n in names if view.is_dir(child / n)]
    if any(n == LATEST or n.startswith(FINISHED) for n in names) or any(
            m.startswith(FINISHED) for d in inner for m in view.names(d)):
        return None
    return (f"{child}: an incomplete save (neither DeepSpeed's model states nor "
            f"mpitailor's {PARTIAL_MANIFEST}, written last, in it): a save killed while it "
            f"was written, or being written now")


# What a save that finished holds (a partial save's rank files come before its manifest).
FINISHED = ("zero_pp_rank_", "bf16_zero_pp_rank_", "mp_rank_", PARTIAL_MANIFEST)


def _lineage(child: Path, view) -> Lineage | None:
    """The lineage of a save that cannot be read as a whole (its successors still need it)."""
    # Tags of HF's checkpoint-N (global_stepN) and Accelerate's (pytorch_model, the tag of
    # accelerator.save_state and of mpitailor's AccelerateCheckpointer).
    tags = [child / n for n in view.names(child)
            if n.startswith("global_step") or n == "pytorch_model"]
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


def _latest(save_dir: Path, view) -> str | None:
    latest = save_dir / LATEST
    if not view.exists(latest):
        return None  # a FIFO, a device or a link there is read (and refused, said) below
    try:
        return read_latest(latest, view)
    except CheckpointError as e:
        if (why := cannot_read(e, also=(errno.ELOOP,))) is not None:  # a link: refused
            # it names the timeline to take: without it an abandoned one may be chosen
            raise CannotReadNow(f"{latest}: cannot be read now ({why}); it names the save "
                                f"to resume from: fix its permissions (or the disk) and run "
                                f"again") from None
        log.warning("ignoring %s", e)
        return None


def _nothing(save_dir: Path, saves: list[Save], skipped: dict[str, str],
             view) -> Exception:
    """No usable full save: an error if any save ever finished, else nothing to recover."""
    finished = view.exists(save_dir / LATEST) or any(
        not _hf_unfinished(s.path, view) and (
            s.partial or view.exists(s.path / LATEST) or view.exists(s.path / PARTIAL_MANIFEST)
            or view.exists(s.path / SAVE_RECORD)) for s in saves)
    reasons = "; ".join(f"{n}: {why}" for n, why in skipped.items())
    if finished:
        return UserError(f"{save_dir}: no usable full checkpoint to start from ("
                         f"{reasons or 'only partial saves'}); recovery needs one complete "
                         f"full save of the timeline")
    return NothingToRecover(f"{save_dir}: no finished checkpoint: nothing to recover"
                            + (f" (incomplete: {reasons})" if reasons else ""))


def _timeline_to_recover(save_dir: Path, saves: list[Save], view=LOCAL) -> Chain:
    """The timeline to recover (planning/recovery.py's choice), or why there is none. Only
    the tombstones a save builds on are stepped across (planning/lineage.py's `vet`)."""
    found = read_tombstones(save_dir, view)
    vetted = vet(save_dir / PRUNED_DIR, saves, found.good, found.bad, found.listed)
    for save_id, why in vetted.skipped:
        log.warning("ignoring %s: not a tombstone (%s); no save builds on it",
                    save_dir / PRUNED_DIR / save_id, why)
    chain = choose(save_dir, saves, _latest(save_dir, view), vetted.pruned)
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
                 crc: bool = True, look: bool = False) -> tuple[list[Save], Chain, Placement]:
    """Collective: plan_recovery's work, returning every save found (checked: `problem`
    says why one is not usable), the chain chosen and where the files lie (prune needs all
    three). crc=False leaves out the CRC-32 pass over the chain's partial saves (the
    training side's retention after each save: they were just written and checked by
    size). look: walk each save that failed a check for what cannot be read in it
    (prune's care: it must not delete such a save; recover skips it, as it did)."""
    place = survey(comm, [save_dir], depth=3)
    found = comm.step_on(_finder(place, save_dir), find_saves, save_dir, place.fs())
    if until_step is not None:
        found = [s for s in found if s.step <= until_step]
    saves = looked_at(comm, check_saves(comm, found, place=place), place, look)
    while True:
        chain = comm.root_step(_timeline_to_recover, save_dir, saves, place.fs())
        if not crc:
            break
        names = {s.name for s in chain.partials}
        checked = check_saves(comm, [s for s in saves if s.name in names], crc_of=names,
                              place=place)
        bad = {s.name: s for s in looked_at(comm, checked, place, look)
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


def recover_recipe(comm: Comm, save_dir: str | os.PathLike, output: str | os.PathLike | None,
                   layer_patterns: Mapping[str, str] | None = None,
                   where: str = "layer_patterns", world_size: int | None = None) -> Recipe:
    """Collective: the recipe `recover` merges (the saves checked, the chain chosen);
    `where` names the patterns' origin in errors."""
    return recover_chain(comm, save_dir, output, layer_patterns, where, world_size)[0]


def recover_chain(comm: Comm, save_dir: str | os.PathLike, output: str | os.PathLike | None,
                  layer_patterns: Mapping[str, str] | None = None,
                  where: str = "layer_patterns",
                  world_size: int | None = None) -> tuple[Recipe, Chain, Placement]:
    """Collective: recover_recipe's recipe, the chain of saves it was made from (what the
    command line reports: the saves used and those skipped), and where the save dir's files
    lie (for plan_recipe: surveyed once)."""
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


def plan_recover(comm: Comm, save_dir: str | os.PathLike, output: str | os.PathLike,
                 layer_patterns: Mapping[str, str] | None = None,
                 world_size: int | None = None,
                 where: str = "layer_patterns") -> Planned:
    """Collective: the recipe and plan of `recover`."""
    recipe, _, place = recover_chain(comm, save_dir, output, layer_patterns, where, world_size)
    return plan_recipe(comm, recipe, place)


def recovered(plan: MergePlan, chain: Chain) -> str:
    """What a recovery produced, in words: the step and world size of the checkpoint, the
    saves it took layers from, and the saves it left out and why."""
    line = (f"recovered step {plan.base_meta.global_steps} for world size "
            f"{plan.out_world_size} from {', '.join(name for name, _ in plan.sources)}")
    if chain.skipped:
        line += "; skipped " + ", ".join(f"{name} ({why})" for name, why in chain.skipped)
    return line
