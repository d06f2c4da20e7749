"""Which entries of a save dir are saves: found by their files (rank-0 metadata only), each
a `Save` (planning/chain.py), usable or not; jobs/recovery.py checks and chooses them.

Nothing that might be a save is passed over on a guess. A dir that cannot be listed or
looked at now is a save that cannot be read now (`unreadable`: retention keeps it, and
prune refuses while it is there), not a dir without a save. A dir with a merge's manifest
(`mpitailor_manifest.json`) is an earlier composite, not a save, only when that manifest
reads as one and no save record lies beside it: a save record and a manifest together are
an error naming the dir; a manifest that does not read makes the dir one that cannot be
told now (unreadable, as above). Links are refused by name where a save or mpitailor's own
records should be: followed, prune would write or delete elsewhere.
"""
from __future__ import annotations

import os
from pathlib import Path

from mpitailor.display import shown
from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.io import LOCAL
from mpitailor.formats.manifest import MANIFEST, read_manifest
from mpitailor.formats.zero import (
    LATEST,
    PARTIAL_MANIFEST,
    SAVE_RECORD,
    Lineage,
    read_meta,
    read_save_record,
)
from mpitailor.jobs.readable import cannot_read, vanished
from mpitailor.planning.chain import Save
from mpitailor.planning.retention import PRUNED_DIR

SAVE_NAMES = ("global_step", "checkpoint-")
# mpitailor's own dirs in a save dir, never followed as links: the tombstones (dotted) and
# prune's record of them (planning/retention.py, jobs/tombstones.py)
OWN_DIRS = (PRUNED_DIR, "mpitailor-retention")


def find_saves(save_dir: Path, view=LOCAL) -> list[Save]:
    """Every save directly under save_dir (rank-0 metadata only), oldest first. view: the
    save dir as the job's nodes see it together (node-local storage; fsview.py)."""
    if not view.is_dir(save_dir):
        raise UserError(f"{save_dir}: no such save dir")
    check_save_dir(save_dir, view)
    found, nested = [], []
    for name in sorted(view.names(save_dir)):
        child = save_dir / name
        if name.startswith(".") and name not in OWN_DIRS:
            continue  # staging dirs of interrupted saves
        _refuse_link(child)
        if name in OWN_DIRS or not view.is_dir(child):
            continue  # prune's records (jobs/tombstones.py reads them), files
        try:
            save = _find_one(child, view)
        except FileNotFoundError:
            raise vanished(child) from None
        except OSError as e:
            if cannot_read(e) is None:
                raise
            save = Save(name, child, None, None, f"{shown(child)}: cannot be looked at now "
                        f"({cannot_read(e)})", unreadable=True)
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
    what lies elsewhere. So is a link in place of mpitailor's own dirs: prune would write
    and delete tombstones in another run's save dir."""
    if child.is_symlink() and (child.name.startswith(SAVE_NAMES) or
                               child.name in OWN_DIRS or child.is_dir()):
        what = "prune's records" if child.name in OWN_DIRS else "its saves"
        raise UserError(f"{shown(child)}: a symbolic link (to {shown(os.readlink(child))}), "
                        f"where a save dir holds {what}; mpitailor follows no link in a save "
                        f"dir: replace it with the dir itself (`cp -a`), or remove it")


def _find_one(child: Path, view) -> Save | str | None:
    """The save in child, "nested" for a save dir of its own, None for neither."""
    name = child.name
    if _lexists(child / MANIFEST, view):
        return _composite(child, view)  # an earlier composite written here, or not one
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
    if hf_unfinished(child, view):
        return Save(name, child, None, meta.lineage, f"{child}: an incomplete HF Trainer save "
                    f"(no {HF_LAST}, which the Trainer writes last): a save killed while it "
                    f"was written")
    return Save(name, child, meta, meta.lineage)


def _composite(child: Path, view) -> Save | None:
    """None for a composite (its manifest reads, no save record beside it); a dir whose
    manifest does not read is one that cannot be told now (kept, prune refuses); a save
    record beside the manifest is an error: which of the two it is cannot be told."""
    records = [d / r for d in (child, *_tags(child, view)) for r in (PARTIAL_MANIFEST,
                                                                       SAVE_RECORD)]
    record = next((r for r in records if _lexists(r, view)), None)
    if record is not None:
        raise CheckpointError(
            f"{shown(child)}: holds both a save's record ({shown(record.relative_to(child))})"
            f" and a merge's manifest ({MANIFEST}), so it is neither a save nor a composite "
            f"for sure; move the one that does not belong out of it (a merge written into a "
            f"save?), and run again")
    if view is not LOCAL and view.is_file(child / MANIFEST):
        return None  # node-local storage: a large manifest does not travel in a listing
    try:
        if read_manifest(child / MANIFEST, view).kind != "partial":
            return None
        why = "a partial save's manifest under a merge's name"
    except (CheckpointError, OSError, ValueError) as e:
        why = str(e).split("\n")[0]
    return Save(child.name, child, None, None, f"{shown(child / MANIFEST)} does not read as a "
                f"composite's manifest ({why}): the dir cannot be told from a save",
                unreadable=True)


def _lexists(path: Path, view) -> bool:
    """There, as anything (a dangling link too, on the local file system)."""
    return view.exists(path) or (view is LOCAL and path.is_symlink())


def _tags(child: Path, view) -> list[Path]:
    """The tag dirs inside an HF checkpoint-N (global_stepN) or an Accelerate save
    (pytorch_model, the tag of accelerator.save_state and of AccelerateCheckpointer)."""
    return [child / n for n in view.names(child)
            if (n.startswith("global_step") or n == "pytorch_model") and view.is_dir(child / n)]


# An HF Trainer save writes its training args first and its trainer state last: a
# checkpoint-N with the one and not the other was killed while it was written (DeepSpeed's
# own files, `latest` included, may be complete by then; resuming from it would fail).
HF_FIRST, HF_LAST = "training_args.bin", "trainer_state.json"


def hf_unfinished(child: Path, view) -> bool:
    """No trainer state (a dangling link reads as none here: the walk of a failed save,
    readable.py's odd_entry, then says it cannot be read now)."""
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
    for tag_dir in (child, *_tags(child, view)):
        for partial in (True, False):
            try:
                found = read_save_record(tag_dir, partial, view)[0]
            except CheckpointError:
                return None
            if found is not None:
                return found
    return None
