"""Tombstones: what `prune` leaves of a save it deleted, so that recovery still follows the
saves built on it; and prune's record of them.

Recovery follows partial saves by lineage (each names its parent's save id): a deleted save
in the middle of a timeline would end it there. Before deleting a save, prune writes
`SAVE_DIR/.mpitailor-pruned/<save id>` (dotted: never listed as a save): a small JSON record
of the save's name, step and lineage, fsynced and published by rename. Recovery steps across
a missing save whose id has one; a gap without one still ends the timeline.

The record is not empty: at a fork (a rollback that left an abandoned branch) recovery takes
the newest branch, and it can only compare a deleted save with its sibling by its step.

A dotted dir is easy to lose (`cp -r DIR/*` leaves it behind), and without it a pruned
timeline reads as a rollback. So prune first writes `SAVE_DIR/mpitailor-retention/pruned.json`
(not dotted: it travels with the saves; a dir, which a composite's carried files never
include and which is no save), listing the ids it keeps tombstones for; a listed
tombstone that is missing where a save needs it, or the dir missing or not a dir, is an
error (planning/lineage.py), never a rollback. The list is rewritten before tombstones are
added (with them) and before any are removed (without them), so at every moment each id it
lists has a tombstone or is still a save: a prune killed at any point leaves it true.

Reading never fails on a tombstone no save needs: each is read on its own, bounded, and one
that is not a tombstone (or cannot be read now) comes back as a BadTombstone for `vet` to
judge by whether a save builds on it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mpitailor.display import shown
from mpitailor.errors import CheckpointError
from mpitailor.formats.io import LOCAL, fsync_dir, loads
from mpitailor.formats.zero import Lineage
from mpitailor.jobs.readable import cannot_read
from mpitailor.planning.chain import Pruned
from mpitailor.planning.lineage import BadTombstone, CannotReadNow
from mpitailor.planning.retention import PRUNED_DIR, valid_id
from mpitailor.publish.staging import write_replacing

FORMAT = "mpitailor-pruned"
RECORD = Path("mpitailor-retention") / "pruned.json"  # in the save dir: see above
RECORD_FORMAT = "mpitailor-pruned-list"
MAX_TOMBSTONE_BYTES = 64 << 10      # name, step, three ids and the layer keys (below)
MAX_LAYERS_BYTES = 32 << 10          # a tombstone naming more layers names none
MAX_LIST_BYTES = 64 << 20            # one 64-hex id per line: a million pruned saves


@dataclass(frozen=True, slots=True)
class Tombstones:
    """What save_dir holds of pruned saves: good (read), bad (not tombstones, or not
    readable now) and listed (the ids prune's record lists; empty without a record)."""

    good: tuple[Pruned, ...] = ()
    bad: tuple[BadTombstone, ...] = ()
    listed: frozenset[str] = frozenset()


def read_tombstones(save_dir: Path, view=LOCAL) -> Tombstones:
    """The tombstones of save_dir, each judged on its own. CheckpointError (CannotReadNow)
    when prune's record cannot be read, or when it lists tombstones and their dir is gone
    or not a dir."""
    folder = save_dir / PRUNED_DIR
    listed = read_record(save_dir, view)
    if not view.is_dir(folder):
        if listed:
            what = "not a directory" if view.exists(folder) else "missing"
            raise CheckpointError(
                f"{folder}: {what}, but {save_dir / RECORD} lists {len(listed)} tombstone(s) "
                f"of pruned saves; without them recovery would roll back: restore the dir from "
                f"where the save dir was copied (`cp -a SRC/. DEST` keeps hidden dirs)")
        return Tombstones(listed=listed)
    try:
        names = sorted(view.names(folder))
    except OSError as e:  # (EACCES: which tombstones a save builds on cannot be told)
        raise CannotReadNow(f"{shown(folder)}: the tombstones of pruned saves cannot be listed "
                            f"now ({cannot_read(e) or e}); fix its permissions (or the disk) "
                            f"and run again") from None
    good, bad = [], []
    for name in names:
        if not valid_id(name):
            continue  # a killed write's dotted temporary file: not a tombstone
        try:
            good.append(_read_one(folder / name, view))
        except (OSError, ValueError, KeyError, TypeError, AttributeError,
                CheckpointError) as e:
            why = cannot_read(e)
            bad.append(BadTombstone(name, why or _line(e), why is not None))
    return Tombstones(tuple(good), tuple(bad), listed)


def _read_one(path: Path, view) -> Pruned:
    raw = loads(view.read_bytes(path, MAX_TOMBSTONE_BYTES, "a tombstone"))  # bounded depth
    if raw.get("format") != FORMAT or raw["save_id"] != path.name:
        raise ValueError(f"not a tombstone of save id {path.name}")
    lineage = Lineage.from_json({k: raw[k] for k in ("save_id", "chain", "parent")})
    if not valid_id(lineage.chain) or not (lineage.parent is None or valid_id(lineage.parent)):
        raise ValueError("its chain and parent are not save ids")
    step = raw["step"]
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"step {step!r} is not a number")
    layers = raw.get("layers")  # (absent from the tombstones of before it was kept)
    if layers is not None and not (isinstance(layers, list) and
                                   all(isinstance(k, str) for k in layers)):
        raise ValueError("its layers are not a list of names")
    return Pruned(str(raw["name"]), step, lineage,
                  None if layers is None else frozenset(layers))


def _line(e: BaseException) -> str:
    return str(e).strip().split("\n")[0][:300]


def read_record(save_dir: Path, view=LOCAL) -> frozenset[str]:
    """The ids prune's record lists (empty: no record, a save dir prune never removed a
    save of the timeline from, or one pruned before the record was kept)."""
    path = save_dir / RECORD
    try:
        if not view.exists(path) and not (view is LOCAL and path.is_symlink()):
            return frozenset()
        raw = loads(view.read_bytes(path, MAX_LIST_BYTES, "prune's record"))
        ids = raw["tombstones"] if raw.get("format") == RECORD_FORMAT else None
        if not isinstance(ids, list) or not all(valid_id(i) for i in ids):
            raise ValueError(f"not a {RECORD_FORMAT} record")
        return frozenset(ids)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CheckpointError) as e:
        if (why := cannot_read(e)) is not None:
            raise CannotReadNow(f"{path}: prune's record of the tombstones cannot be read now "
                                f"({why}); fix its permissions (or the disk) and run again") \
                from None
        raise CheckpointError(f"{path}: prune's record of the tombstones is damaged "
                              f"({_line(e)}); restore it from a copy of the save dir") from None


def write_record(save_dir: Path, ids: set[str] | frozenset[str]) -> Path:
    """Record the ids prune keeps tombstones for (durably, as write_tombstone). The
    tombstones' dir is made first (durably too): a record listing ids is never there without
    it, which read_tombstones takes for a lost dir (a prune killed between the two made
    recovery refuse the save dir: bench/crash_points.py found it)."""
    final = save_dir / RECORD
    if ids:
        _folder(save_dir / PRUNED_DIR)
    _folder(final.parent)
    record = {"format": RECORD_FORMAT, "tombstones": sorted(ids)}
    write_replacing(final, json.dumps(record, indent=0).encode())
    return final


def write_tombstone(save_dir: Path, pruned: Pruned) -> Path:
    """Record pruned (durably: staging.write_replacing writes, fsyncs, renames into place,
    fsyncs the folder)."""
    if not valid_id(pruned.lineage.save_id):
        raise CheckpointError(f"{save_dir / pruned.name}: save id "
                              f"{pruned.lineage.save_id!r} is not a hex id; not pruned")
    folder = _folder(save_dir / PRUNED_DIR)
    final = folder / pruned.lineage.save_id
    record = {"format": FORMAT, "name": pruned.name, "step": pruned.step,
              **pruned.lineage.to_json(),
              **({} if pruned.layers is None else {"layers": sorted(pruned.layers)})}
    data = json.dumps(record).encode()
    if len(data) > MAX_LAYERS_BYTES:  # (read through a node-local job's listings, which
        # carry small files whole: the layers left out, their rollback then unsaid)
        data = json.dumps({k: v for k, v in record.items() if k != "layers"}).encode()
    write_replacing(final, data)
    return final


def _folder(folder: Path) -> Path:
    """folder, made if it is not there, and its making durable (its parent fsynced): the
    records written into it must not vanish with it at a power cut."""
    try:
        folder.mkdir()
    except FileExistsError:
        return folder
    fsync_dir(folder.parent)
    return folder
