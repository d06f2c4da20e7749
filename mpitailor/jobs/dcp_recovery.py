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

import dataclasses
import os
import stat
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.display import shown
from mpitailor.errors import CheckpointError, NothingToRecover, UserError
from mpitailor.formats.dcp import (
    METADATA,
    DcpSaveMeta,
    check_data_files,
    read_dcp_save_record,
    read_metadata,
    split_key,
)
from mpitailor.formats.io import crc32_range, open_regular
from mpitailor.formats.manifest import MANIFEST, SAVE_RECORD
from mpitailor.jobs.readable import cannot_read, odd_entry, refuse_unreadable
from mpitailor.planning.chain import Chain, Save, choose, recovery_recipe
from mpitailor.planning.layers import LayerClassifier, check_patterns
from mpitailor.planning.recipe import Recipe


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
        if not (os.path.lexists(child / METADATA) or os.path.lexists(child / SAVE_RECORD)):
            continue
        if child.is_symlink():  # never read through (it leads outside the save dir), but
            # it may be the newest save: not absent, cannot be read (refused by its step)
            found.append(Save(name, child, None, None, "a symbolic link to a save, which "
                              "mpitailor does not read through; put the save itself there",
                              unreadable=True))
            continue
        if os.path.lexists(child / MANIFEST) and not os.path.lexists(child / SAVE_RECORD):
            continue  # an earlier merge's output, not a save
        found.append(_read_save(name, child))
    return _record_less_checked(sorted(found, key=lambda s: (s.step, s.name)))


def _read_save(name: str, child: Path) -> Save:
    lineage = None
    try:
        record = read_dcp_save_record(child)
        lineage = None if record is None else record.lineage
        meta = read_metadata(child)
        _check_planner_data(child, meta)
        check_data_files(child, meta)
        if record is not None:
            _check_sizes(child, record.files, meta)
            _check_layers(child, record, meta)
        step = record.global_steps if record is not None else _step_of(name)
        return Save(name, child, DcpSaveMeta(meta, record, step), lineage)
    except (CheckpointError, OSError) as e:
        return Save(name, child, None, lineage, str(e).split("\n")[0],
                    unreadable=unreadable_now(e, child))


def unreadable_now(e: BaseException, save: Path) -> bool:
    """Does e (or the save's tree as it is now) say the save cannot be read now, rather
    than that it is incomplete? The readers refuse a FIFO, a dir or a link where a file
    should be with no OSError behind it: without this look it would be skipped as damaged
    and older copies of its layers taken, silently."""
    return cannot_read(e) is not None or odd_entry(save) is not None or \
        _odd_file(save) is not None


def _odd_file(save: Path) -> str | None:
    """The first of the save's own file names (.metadata, the record, a data file) that is
    there but not a regular file (readable.odd_entry passes a dir by these names)."""
    try:
        names = os.listdir(save)
    except OSError as e:
        return f"{save}: cannot be listed ({e.strerror})"
    for name in names:
        if name in (METADATA, SAVE_RECORD) or name.endswith(".distcp"):
            try:
                mode = os.lstat(save / name).st_mode
            except FileNotFoundError:
                continue
            except OSError as e:
                return f"{save / name}: cannot be looked at ({e.strerror})"
            if not stat.S_ISREG(mode):
                return f"{save / name}: not a regular file"
    return None


def _check_planner_data(folder: Path, meta) -> None:
    """Each planner_data path joins to its key (DCP flattens the state dict so): one that
    does not makes torch's loader look for an entry no one saved, and an output made from
    it does not load. (Belongs in formats/dcp/metadata.py's reader; checked here meanwhile.)"""
    for key, path in meta.planner_data.items():
        if ".".join(map(str, path)) != key:
            raise CheckpointError(f"{folder / METADATA}: planner data maps {key!r:.80} to "
                                  f"{path!r:.80}, which is not its path; the .metadata is "
                                  f"damaged")


def _check_layers(folder: Path, record, meta) -> None:
    """A partial save's record names exactly the layers its metadata holds (with the
    patterns it was saved with): a layer claimed but not held, or held but not claimed,
    is a damaged record, and recovery would take the wrong copy of that layer."""
    if record.layers is None:
        return
    try:
        held = DcpSaveMeta(meta, record, record.global_steps).layer_keys(
            LayerClassifier(dict(record.layer_patterns)))
    except UserError as e:  # the record's own patterns: a damaged record, not a user's
        raise CheckpointError(f"{folder / SAVE_RECORD}: {str(e).splitlines()[0]}") from None
    odd = sorted(record.layers ^ held)
    if odd:
        claimed = odd[0] in record.layers
        raise CheckpointError(
            f"{folder / SAVE_RECORD}: {'claims' if claimed else 'leaves out'} layer "
            f"{odd[0]!r:.80}, which the save's .metadata "
            f"{'does not hold' if claimed else 'holds'}; the record is damaged")


def _record_less_checked(saves: list[Save]) -> list[Save]:
    """A save without a record counts as a full save: one whose metadata lacks parameters
    another full save holds is not one (a partial save whose record was lost), and taken as
    full it would be recovered from with those layers missing. Skipped, said."""
    full = [s for s in saves if s.meta is not None and not s.partial]
    params = [{k.param for f in s.meta.metadata.tensors if (k := split_key(f)).role == "model"}
              for s in full]
    union = set().union(*params) if params else set()
    out = []
    for s, held in zip(full, params):
        if s.meta.record is None and held != union:
            lacks = sorted(union - held)[0]
            s = dataclasses.replace(s, meta=None, problem=(
                f"{s.path}: no save record, and its .metadata lacks {lacks!r:.80}, "
                f"which other full saves hold; not a full save (a partial save whose record "
                f"was lost?)"))
        out.append(s)
    keep = {s.name: s for s in out}
    return [keep.get(s.name, s) for s in saves]


def _step_of(name: str) -> int:
    digits = name.rpartition("-")[2].removeprefix("global_step")
    return int(digits) if digits.isdigit() else -1


def _check_sizes(folder: Path, files: dict, meta) -> None:
    """Every file the record names is there at its recorded size, and the record names
    `.metadata` and every data file the metadata places items in (a record that leaves one
    out would leave it unchecked)."""
    missing = sorted({METADATA, *meta.files} - set(files))
    if missing:
        raise CheckpointError(f"{folder / SAVE_RECORD}: does not record {missing[0]}, which "
                              f"the save holds; the record is damaged")
    for name, rec in files.items():
        fd = open_regular(folder / name, "a file the save's record names")
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size != rec["bytes"]:
            raise CheckpointError(f"{folder / name}: {size} bytes, but the save wrote "
                                  f"{rec['bytes']}; the file is truncated or damaged")


def check_crcs(comm: Comm, saves: list[Save], names: set[str]) -> list[Save]:
    """Collective: the recorded files of the saves named checked against their CRC-32s,
    files spread over the ranks by size; the saves, a failed one with its problem."""
    work = sorted(((s.name, f, rec["bytes"]) for s in saves if s.name in names
                   and s.meta is not None and s.meta.record is not None
                   for f, rec in s.meta.record.files.items()), key=lambda w: (-w[2], w[:2]))
    load, mine = [0] * comm.size, []
    for save, f, size in work:
        r = load.index(min(load))
        load[r] += size
        if r == comm.rank:
            mine.append((save, f))
    by_name = {s.name: s for s in saves}

    def check() -> list[tuple[str, str, bool]]:
        bad = []
        for save, f in mine:
            s = by_name[save]
            try:
                _check_crc(s.path / f, s.meta.record.files[f])
            except (CheckpointError, OSError) as e:
                bad.append((save, str(e).split("\n")[0], unreadable_now(e, s.path)))
        return bad

    found = {}
    for part in comm.allgather(comm.step(check)):
        for save, why, now in part:
            if save not in found or now:
                found[save] = (why, now)
    return [dataclasses.replace(s, problem=found[s.name][0], unreadable=found[s.name][1])
            if s.name in found else s for s in saves]


def check_recorded(folder: Path, record, meta) -> None:
    """Every file of a save at the size and CRC-32 its record took (one process)."""
    _check_sizes(folder, record.files, meta)
    for name, rec in sorted(record.files.items()):
        _check_crc(folder / name, rec)


def _check_crc(path: Path, rec: dict) -> None:
    fd = open_regular(path, "a file the save's record names")
    try:
        crc, n = crc32_range(fd, 0, rec["bytes"])
    finally:
        os.close(fd)
    if n != rec["bytes"] or f"{crc:08x}" != rec["crc32"]:
        raise CheckpointError(f"{shown(path)}: fails the CRC-32 its save recorded; the file "
                              f"is corrupt")


def dcp_chain(comm: Comm, save_dir: Path, until_step: int | None = None) -> Chain:
    """Collective: find and check the saves, choose the timeline; the saves it takes layers
    from checked against their CRC-32s (a damaged one is skipped, the timeline chosen
    again)."""
    saves = comm.bcast(comm.root_step(find_dcp_saves, save_dir))
    if until_step is not None:
        saves = [s for s in saves if s.step <= until_step]
    while True:
        chain = comm.root_step(_timeline, save_dir, saves)
        names = {chain.full.name, *(s.name for s in chain.partials)}
        checked = check_crcs(comm, saves, names)
        if all(s.problem is None for s in checked if s.name in names):
            break
        saves = checked
    comm.root_step(refuse_unreadable, saves, chain)
    return chain


def _timeline(save_dir: Path, saves: list[Save]) -> Chain:
    chain = choose(save_dir, saves, None)
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
                      until_step: int | None = None) -> tuple[Recipe, Chain]:
    """Collective: the recipe `recover` merges (jobs/dcp_merge.py's run_dcp_merge), and the
    chain it was made from."""
    if layer_patterns:
        check_patterns(dict(layer_patterns), where="--layer-pattern")
    chain = dcp_chain(comm, save_dir, until_step)
    recipe = comm.root_step(recovery_recipe, save_dir, chain, output, layer_patterns)
    return recipe, chain


def recovered_dcp(recipe: Recipe, chain: Chain) -> str:
    """What a recovery produced, in words: the step, the saves it took entries from, and the
    saves it left out and why."""
    newest = [chain.full, *chain.partials][-1]
    line = f"recovered step {newest.step} from {', '.join(n for n, _ in recipe.sources)}"
    if chain.skipped:
        line += "; skipped " + ", ".join(f"{name} ({why})" for name, why in chain.skipped)
    return line
