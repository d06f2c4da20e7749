"""`recover SAVE_DIR` of PyTorch Distributed Checkpoint saves: the newest copy of every layer
across a save dir of DCP saves (mpitailor's DCP checkpointer, training/dcp_checkpointer.py,
writes them: full and partial saves, each with its record), as a recipe that jobs/dcp_merge.py
merges.

The timeline is chosen as for ZeRO saves (planning/chain.py): a full save starts a chain, a
partial save names the save it builds on, the saves of another chain are never combined. A
save counts only when it is whole: its record and `.metadata` read, every data file the
metadata places items in is there at the size its record says; the saves the recovery takes
layers from have every file checked against its CRC-32 (spread over the MPI ranks). A save
that fails is skipped and said; one that cannot be read now (a permission, an I/O error)
stops the recovery when it may hold the newest copy of a layer (readable.py). A DCP
checkpoint without mpitailor's record (a plain `dcp.save`, torchtitan's) is a full save
outside any timeline, its step read from its name (`step-N`).

DCP reshards at load: the composite is written at the saves' own world size and loads at
any. Collective where it takes a comm.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from mpitailor import failpoints
from mpitailor.cluster.comm import Comm
from mpitailor.errors import CheckpointError, NothingToRecover, UserError
from mpitailor.formats.dcp import (
    METADATA,
    DcpSaveMeta,
    check_data_files,
    read_dcp_save_record,
    read_metadata,
)
from mpitailor.formats.io import FileIdentity
from mpitailor.formats.manifest import MANIFEST, SAVE_RECORD
from mpitailor.jobs.dcp_save_checks import (
    check_crcs,
    check_layers,
    check_sizes,
    record_less_checked,
    unreadable_now,
)
from mpitailor.jobs.readable import (
    refuse_inside_sources,
    refuse_unreadable,
    still_there,
    vanished,
)
from mpitailor.jobs.readlocks import hold_sources
from mpitailor.jobs.tombstones import read_tombstones
from mpitailor.planning.chain import (
    Chain,
    Save,
    choose,
    recovery_recipe,
    rolled_back_words,
    step_of_name,
)
from mpitailor.planning.layers import check_patterns
from mpitailor.planning.lineage import vet
from mpitailor.planning.recipe import Recipe
from mpitailor.planning.retention import PRUNED_DIR

log = logging.getLogger(__name__)


def holds_dcp_saves(save_dir: Path) -> bool:
    """Is save_dir a save dir of DCP saves (a dir under it with a `.metadata` or a DCP save
    record)? False for anything that cannot be listed: the ZeRO path says why."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return False
    return any(not n.startswith(".") and (os.path.lexists(save_dir / n / METADATA))
               for n in names)


def find_dcp_saves(save_dir: Path) -> list[Save]:
    """Rank 0: every DCP save directly under save_dir, read (record, metadata) and checked
    by size, oldest first. A dir that holds neither a `.metadata` nor a save record is not a
    save (dotted dirs: staging dirs of saves in progress, mpitailor's own)."""
    if os.path.lexists(save_dir / METADATA):
        raise UserError(f"{save_dir}: a DCP checkpoint itself, not a save dir of them; give "
                        f"the dir that holds the saves (e.g. {save_dir.parent})")
    found = []
    for name in sorted(os.listdir(save_dir)):
        child = save_dir / name
        if name.startswith(".") or not child.is_dir():
            continue
        try:
            if not (_there(child / METADATA) or _there(child / SAVE_RECORD)):
                continue
        except OSError as e:  # a dir that cannot be searched: it may be the newest save
            found.append(Save(name, child, None, None, f"{child}: cannot be looked into "
                              f"({e.strerror})", unreadable=True))
            continue
        if child.is_symlink():  # never read through (it leads outside the save dir), but
            # it may be the newest save: not absent, cannot be read (refused by its step);
            # unless it names a save beside it (`latest -> step-8`), read under its own name
            if _alias(save_dir, child):
                continue
            found.append(Save(name, child, None, None, "a symbolic link to a save, which "
                              "mpitailor does not read through; put the save itself there",
                              unreadable=True))
            continue
        if os.path.lexists(child / MANIFEST) and not os.path.lexists(child / SAVE_RECORD):
            continue  # an earlier merge's output, not a save
        failpoints.hit("read", name)  # (a test holds the survey here: a prune meanwhile)
        found.append(_read_save(name, child))
    return record_less_checked(sorted(found, key=lambda s: (s.step, s.name)))


def _alias(save_dir: Path, link: Path) -> bool:
    """Is link a symbolic link to a dir directly in save_dir (not itself a link), which
    find_dcp_saves reads under that dir's own name?"""
    try:
        target = os.readlink(link)
    except OSError:
        return False
    if os.sep in target.rstrip(os.sep) or target in (".", "..") or target.startswith("."):
        return False  # (only a plain name beside it: nothing outside, nothing hidden)
    beside = save_dir / target.rstrip(os.sep)
    return beside.is_dir() and not beside.is_symlink()


def _there(path: Path) -> bool:
    """Is there anything at path? OSError when it cannot be told (a dir without search
    permission: os.path.lexists would say no)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    return True


def _read_save(name: str, child: Path) -> Save:
    lineage = None
    try:
        record = read_dcp_save_record(child)
        lineage = None if record is None else record.lineage
        meta = read_metadata(child)
        check_data_files(child, meta)
        if record is not None:
            check_sizes(child, record.files, meta)
            check_layers(child, record, meta)
        step = record.global_steps if record is not None else step_of_name(name)
        return Save(name, child, DcpSaveMeta(meta, record, step), lineage)
    except (CheckpointError, OSError) as e:
        if not os.path.lexists(child):  # gone, not unreadable: a prune (or clean) meanwhile
            raise vanished(child) from None
        return Save(name, child, None, lineage, str(e).split("\n")[0],
                    unreadable=unreadable_now(e, child))


def dcp_chain(comm: Comm, save_dir: Path, until_step: int | None = None
              ) -> tuple[Chain, dict[str, FileIdentity]]:
    """Collective: find and check the saves, choose the timeline (survey_dcp_saves); a
    save that cannot be read now and may hold the newest copy of a layer stops it. Also
    the identity of every file checked: the merge refuses another file in its place (one
    swapped in since)."""
    saves, chain, identities = survey_dcp_saves(comm, save_dir, until_step)
    # a save that failed a check because it is gone now (its CRC pass ran into a prune's
    # removal) is said as such, not as one that cannot be read
    comm.root_step(still_there, [s for s in saves if s.problem is not None])
    comm.root_step(refuse_unreadable, saves, chain)
    return chain, identities


def survey_dcp_saves(comm: Comm, save_dir: Path, until_step: int | None = None,
                     crc: bool = True) -> tuple[list[Save], Chain, dict[str, FileIdentity]]:
    """Collective: every save found (checked: `problem` says why one is not usable), the
    timeline chosen, and the identities of the files checked against their CRC-32s: those
    of the saves the timeline takes entries from (a damaged one is skipped, the timeline
    chosen again). crc=False leaves the CRC pass out (the training side's retention after
    each save: just written and read back). Prune needs all three; recovery refuses
    what cannot be read now (dcp_chain)."""
    saves = comm.root_step(find_dcp_saves, save_dir)
    if until_step is not None:
        saves = [s for s in saves if s.step <= until_step]
    identities: dict[str, FileIdentity] = {}
    done: set[str] = set()  # saves whose files passed: not read again when a damaged one
    while True:             # is skipped and the timeline chosen again
        chain = comm.root_step(_timeline, save_dir, saves)
        if not crc:
            break
        names = {chain.full.name, *(s.name for s in chain.partials)} - done
        saves, passed = check_crcs(comm, saves, names)
        identities.update(passed)
        done |= names
        if all(s.problem is None for s in saves if s.name in names):
            break
    return saves, chain, identities


def _timeline(save_dir: Path, saves: list[Save]) -> Chain:
    """The timeline to recover, stepping across the saves prune removed where their
    tombstones (jobs/tombstones.py) are right; or why there is none."""
    found = read_tombstones(save_dir)
    vetted = vet(save_dir / PRUNED_DIR, saves, found.good, found.bad, found.listed)
    for save_id, why in vetted.skipped:
        log.warning("ignoring %s: not a tombstone (%s); no save builds on it",
                    save_dir / PRUNED_DIR / save_id, why)
    chain = choose(save_dir, saves, None, vetted.pruned, vetted.unused)
    if chain is not None:
        return chain
    reasons = "; ".join(f"{s.name}: {s.problem}" for s in saves if s.problem is not None)
    if any(s.lineage is not None or s.meta is not None for s in saves):
        raise UserError(f"{save_dir}: no usable full DCP save to start from ("
                        f"{reasons or 'only partial saves'}); recovery needs one complete "
                        f"full save of the timeline")
    raise NothingToRecover(f"{save_dir}: no finished DCP save: nothing to recover"
                           + (f" (incomplete: {reasons})" if reasons else ""))


def recover_dcp_chain(comm: Comm, save_dir: Path, output: Path | None,
                      layer_patterns: dict[str, str] | None = None,
                      until_step: int | None = None
                      ) -> tuple[Recipe, Chain, dict[str, FileIdentity]]:
    """Collective: the recipe `recover` merges (jobs/dcp_merge.py's run_dcp_merge), the
    chain it was made from, and the identities of the files checked (dcp_chain). Its
    sources are held (jobs/readlocks.py) until the process ends, as the ZeRO recovery holds
    them: a prune that runs meanwhile keeps them (a save published after this choice makes
    one of them superseded, and it was deleted under the merge)."""
    if layer_patterns:
        check_patterns(dict(layer_patterns), where="--layer-pattern")
    chain, identities = dcp_chain(comm, save_dir, until_step)
    if output is not None:  # (not in a save the timeline needs: its full save, say)
        comm.root_step(refuse_inside_sources, output,
                       [(s.name, s.path) for s in (chain.full, *chain.partials)], "-o")
    recipe = comm.root_step(recovery_recipe, save_dir, chain, output, layer_patterns)
    if comm.rank == 0 and (rolled := rolled_back_words(chain)) is not None:
        log.warning("recover: %s", rolled)  # (export of the save dir says nothing else)
    comm.root_step(hold_sources, [path for _, path in recipe.sources])
    return recipe, chain, identities


def recovered_dcp(recipe: Recipe, chain: Chain) -> str:
    """What a recovery produced, in words: the step, the saves it took entries from, and the
    saves it left out and why."""
    newest = [chain.full, *chain.partials][-1]
    line = f"recovered step {newest.step} from {', '.join(n for n, _ in recipe.sources)}"
    if chain.skipped:
        line += "; skipped " + ", ".join(f"{name} ({why})" for name, why in chain.skipped)
    if (rolled := rolled_back_words(chain)) is not None:
        line += f"; {rolled}"
    return line
