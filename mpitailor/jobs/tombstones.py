"""Tombstones: what `prune` leaves of a save it deleted, so that recovery still follows the
saves built on it.

Recovery follows partial saves by lineage (each names its parent's save id): a deleted save
in the middle of a timeline would end it there. Before deleting a save, prune writes
`SAVE_DIR/.mpitailor-pruned/<save id>` (dotted: never listed as a save): a small JSON record
of the save's name, step and lineage, fsynced and published by rename. Recovery steps across
a missing save whose id has one; a gap without one still ends the timeline.

The record is not empty: at a fork (a rollback that left an abandoned branch) recovery takes
the newest branch, and it can only compare a deleted save with its sibling by its step.
"""
from __future__ import annotations

import json
from pathlib import Path

from mpitailor.errors import CheckpointError
from mpitailor.formats.boundedio import loads
from mpitailor.formats.files import Lineage
from mpitailor.formats.fsview import LOCAL
from mpitailor.planning.recovery import Pruned
from mpitailor.planning.retention import PRUNED_DIR, valid_id
from mpitailor.publish.staging import write_replacing

FORMAT = "mpitailor-pruned"


def read_tombstones(save_dir: Path, view=LOCAL) -> tuple[Pruned, ...]:
    """The saves prune deleted from save_dir. Names that are not save ids (a killed write's
    dotted temporary file) are not tombstones; a tombstone that cannot be read is an error:
    recovery without it would end the timeline at the gap."""
    folder = save_dir / PRUNED_DIR
    if not view.is_dir(folder):
        return ()
    found = []
    for name in sorted(view.names(folder)):
        if not valid_id(name):
            continue
        path = folder / name
        try:
            raw = loads(view.read_bytes(path))  # bounded depth: a crafted file is an error
            if raw.get("format") != FORMAT or raw["save_id"] != name:
                raise ValueError(f"not a tombstone of save id {name}")
            lineage = Lineage(name, str(raw["chain"]),
                              None if raw["parent"] is None else str(raw["parent"]))
            found.append(Pruned(str(raw["name"]), int(raw["step"]), lineage))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{path}: unreadable tombstone of a pruned save ({e}); recovery needs it to "
                f"step across that save: restore it, or remove it to recover only the saves "
                f"before the gap") from None
    return tuple(found)


def write_tombstone(save_dir: Path, pruned: Pruned) -> Path:
    """Record pruned (durably: staging.write_replacing writes, fsyncs, renames into place,
    fsyncs the folder)."""
    if not valid_id(pruned.lineage.save_id):
        raise CheckpointError(f"{save_dir / pruned.name}: save id "
                              f"{pruned.lineage.save_id!r} is not a hex id; not pruned")
    folder = save_dir / PRUNED_DIR
    folder.mkdir(exist_ok=True)
    final = folder / pruned.lineage.save_id
    record = {"format": FORMAT, "name": pruned.name, "step": pruned.step,
              **pruned.lineage.to_json()}
    write_replacing(final, json.dumps(record).encode())
    return final
