"""The in-job resume: the checkpoint a training job resumes from, for its world size.

The training side (training/resume.py) calls these through mpitailor/facade.py, on its
ranks seen as a `Comm`: they check the saves and write the composite checkpoint together, as
`mpiexec python -m mpitailor recover` would, into a hidden dir under the save dir
(`RESUME_DIR`), where later recoveries do not mistake it for a save. The composite is
written for the world size of the job that resumes (a job requeued on another number of
GPUs resumes as it is); a composite of the same newest save at the same world size is
reused.

Collective: every function here that takes a `comm` is called on every rank. What the job
resumes from is not logged here: each result carries that line, which the training side
says on rank 0 under its own logger (what recovery and the merge log, the saves skipped,
they log as `recover` does).
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.errors import CheckpointError, NothingToRecover
from mpitailor.formats.manifest import MANIFEST, MergeFields, read_manifest
from mpitailor.formats.zero import read_meta
from mpitailor.jobs.clean import clean
from mpitailor.jobs.dcp_merge import run_dcp_merge
from mpitailor.jobs.dcp_recovery import dcp_chain, holds_dcp_saves
from mpitailor.jobs.merge import MergeOptions, plan_recipe, run_merge
from mpitailor.jobs.prune import RESUME_DIR
from mpitailor.jobs.readlocks import hold_sources, release
from mpitailor.jobs.recovery import find_saves, plan_recovery
from mpitailor.planning.chain import Chain, recovery_recipe, rolled_back_words
from mpitailor.planning.recipe import recipe_from
from mpitailor.publish.leftovers import DISCARD, discard, path_of


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a training job resumes from, and the line that says so."""

    path: Path | None         # None: training starts from scratch
    line: str | None = None   # what the training side logs on rank 0 (None: nothing)
    level: int = logging.INFO  # of `line`


def recover_in_job(comm: Comm, save_dir: str | os.PathLike, until_step: int | None = None,
                   output_root: str | os.PathLike | None = None) -> ResumePoint:
    """Collective: the newest full save itself when no partial save follows it and the world
    size is the same, else a composite of its timeline (saves after `until_step` left out)
    in output_root (default: save_dir/RESUME_DIR), resharded when the job came back at
    another size. No path when no save ever finished (a first start, or a job killed
    during its first save); what such a save left behind is removed, and the line, a
    warning, says what."""
    save_dir = Path(save_dir).resolve()
    if not comm.root_step(save_dir.exists):
        return ResumePoint(None, f"no save dir {save_dir} yet: training starts from scratch")
    if comm.root_step(holds_dcp_saves, save_dir):
        return _recover_dcp(comm, save_dir, until_step, output_root)
    try:
        chain, place = plan_recovery(comm, save_dir, until_step=until_step)
    except NothingToRecover as e:
        left = comm.root_step(_unfinished, save_dir)
        comm.root_step(_reclaim, save_dir, left)
        return ResumePoint(None, f"{e}; training starts from scratch" + (
            f" (removed what an interrupted save left: {', '.join(left)})" if left else ""),
            logging.WARNING)
    world = comm.size
    came_from = _origin(chain)
    # What killed saves left (staging dirs, stale locks) would otherwise stay until the next
    # partial save or `mpitailor clean`; no save of this job runs yet.
    tidied = comm.root_step(_tidy, save_dir)
    if not chain.partials and chain.full.meta.world_size == world:
        return ResumePoint(chain.full.path, f"resuming from the full save {chain.full.path} "
                                            f"itself (step {chain.full.step}, world size "
                                            f"{world}): no partial save follows it{tidied}")
    base = chain.partials[-1] if chain.partials else chain.full
    out_root = Path(output_root) if output_root is not None else save_dir / RESUME_DIR
    save_id = base.lineage.save_id[:12] if base.lineage else "x"
    out = out_root / f"recovered-{base.name}-{save_id}-w{world}"
    resharded = "" if chain.full.meta.world_size == world else \
        f", resharded from world size {chain.full.meta.world_size}"
    where = f"resuming from {out} (step {base.step}, world size {world}{resharded})"
    with _holding(comm, chain, not place.node_local):
        reused = _written_once(comm, out, base, world, lambda: recovery_recipe(
            save_dir, chain, out, None, None if chain.full.meta.world_size == world else world),
            place)
    return ResumePoint(out, f"{where}, recovered{' before' if reused else ''} from {came_from}"
                            f"{tidied}")


def _recover_dcp(comm: Comm, save_dir: Path, until_step: int | None,
                 output_root: str | os.PathLike | None) -> ResumePoint:
    """Collective: recover_in_job of a save dir of DCP saves. DCP reshards at load: the
    newest full save itself when no partial save follows it, else the composite of its
    timeline at the saves' own world size (reused when already written), its data files
    hard links to the saves' (planning/dcp_link.py) unless output_root puts it elsewhere."""
    try:
        chain, checked = dcp_chain(comm, save_dir, until_step)
    except NothingToRecover as e:
        return ResumePoint(None, f"{e}; training starts from scratch", logging.WARNING)
    tidied = comm.root_step(_tidy, save_dir)
    if not chain.partials:
        return ResumePoint(chain.full.path, f"resuming from the full save {chain.full.path} "
                                            f"itself (step {chain.full.step}): no partial save "
                                            f"follows it{tidied}")
    base = chain.partials[-1]
    out_root = Path(output_root) if output_root is not None else save_dir / RESUME_DIR
    out = out_root / f"recovered-{base.name}-{base.lineage.save_id[:12]}"
    writers = len(chain.full.meta.metadata.files)
    reused = comm.root_step(_is_recovery_of, out, base, writers)
    if not reused:  # linked where it lies beside the saves: a resume in metadata time
        with _holding(comm, chain):
            run_dcp_merge(comm, comm.root_step(recovery_recipe, save_dir, chain, out),
                          link=output_root is None, checked=checked)
    return ResumePoint(out, f"resuming from {out} (step {base.step}), recovered"
                            f"{' before' if reused else ''} from {_origin(chain)}{tidied}",
                       logging.WARNING if chain.rolled_back else logging.INFO)


@contextmanager
def _holding(comm: Comm, chain, hold: bool = True):
    """The chain's saves held (read locks, rank 0) while the composite is written from them,
    so that a prune running meanwhile (another job's, a user's) keeps them; let go after:
    the composite is whole then (a linked one shares its files' blocks), and the job's own
    retention after its next save must be free to remove them."""
    if hold:
        comm.root_step(hold_sources, [s.path for s in (chain.full, *chain.partials)])
    try:
        yield
    finally:
        if hold:
            comm.root_step(release)


def reshard_in_job(comm: Comm, checkpoint: str | os.PathLike,
                   output_root: str | os.PathLike) -> ResumePoint:
    """Collective: a checkpoint (a full save, or a composite) to resume from as it is when it
    was written for this job's world size (no line); else resharded for it into output_root
    (reused when already there)."""
    path = Path(checkpoint).resolve()
    meta = comm.root_step(read_meta, path)
    world = comm.size
    if meta.world_size == world:
        return ResumePoint(path)
    out = Path(output_root).resolve() / f"resharded-{path.name}-w{world}"
    where = (f"resuming from {out} (step {meta.global_steps}, world size {world}), {path} "
             f"resharded from world size {meta.world_size}")
    reused = _written_once(comm, out, (path, meta.files.tag_dir), world, lambda: recipe_from(
        {"sources": {"saved": str(path)}, "layers": {"rest": "saved"}, "output": str(out)},
        origin=f"resume from {path}", world_size=world))
    return ResumePoint(out, f"{where}{' before' if reused else ''}")


def _written_once(comm: Comm, out: Path, base, world: int, recipe_of, place=None) -> bool:
    """Collective: True when out already is the composite of base for world (reused), else
    False, having written it from the recipe rank 0 makes (recipe_of()); place: where its
    sources lie, when already surveyed (plan_recipe)."""
    if comm.root_step(_is_recovery_of, out, base, world):
        return True
    recipe = comm.root_step(recipe_of)
    run_merge(comm, plan_recipe(comm, recipe, place), MergeOptions())
    return False


def _origin(chain: Chain) -> str:
    if not chain.partials:
        return f"the full save {chain.full.name} alone (no partial save follows it)"
    rolled = rolled_back_words(chain)
    return (f"the full save {chain.full.name} and the partial saves "
            f"{', '.join(p.name for p in chain.partials)} (newest copy of every layer"
            f"{f'; {rolled}' if rolled else ''})")


def _is_recovery_of(out: Path, base, world: int) -> bool:
    """A published composite (manifest last) of that very save, for that world size. base:
    a Save (the same save id, where the saves record one, else the same path: a save dir or
    its tag dir) or the paths a checkpoint goes by."""
    try:  # bounded, versioned: a composite dir is read as any checkpoint is
        merge = read_manifest(out / MANIFEST).fields
        if not isinstance(merge, MergeFields):
            return False  # an export's or a partial save's: not a composite
        source = merge.sources[merge.base]  # either missing (ABSENT): TypeError, KeyError
        if merge.world_size != world:
            return False
    except (CheckpointError, KeyError, TypeError):
        return False  # absent, or not a composite of ours: another is written
    if isinstance(base, tuple):
        return Path(source["path"]) in base
    if base.lineage is not None:
        return source.get("save_id") == base.lineage.save_id
    return Path(source["path"]) in (base.path, base.meta.files.tag_dir)


def _tidy(save_dir: Path) -> str:
    """Rank 0: remove what killed writers left in save_dir (publish/leftovers.py: never what
    a live process holds); the words that say so, or ""."""
    done = clean(save_dir).done
    return f" (removed what interrupted saves left: {', '.join(done)})" if done else ""


def _unfinished(save_dir: Path) -> list[str]:
    """Rank 0: the saves (none finished: recovery found nothing) an interrupted run left."""
    return [s.name for s in find_saves(save_dir)]


def _reclaim(save_dir: Path, names: list[str]) -> None:
    """Rank 0 (one remover: two would race inside the same trees): the staging dirs and
    stale locks of killed writers (publish/leftovers.py), then the unfinished saves, each
    moved aside first (a removal killed half-way leaves a `.NAME.mpitailor-discard` that
    `clean` takes). Under node-local storage the other nodes' parts stay: the next save of the
    same name starts from an empty dir (the HF and Accelerate templates make it so)."""
    clean(save_dir)
    for name in names:
        discard(save_dir / name, path_of(save_dir / name, DISCARD))
