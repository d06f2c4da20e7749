"""The checks a DCP save passes before recovery takes layers from it (jobs/dcp_recovery.py):
whole (its record and `.metadata` agree: the layers, the files and their sizes; every file
at its recorded CRC-32), or damaged (skipped and said), or unreadable now (a permission, an
I/O error, something that is not a file where one should be: recovery stops rather than take
older copies of its layers). A file whose CRC-32 was checked is remembered by its identity
(formats/io/identity.py), so that the merge that reads it later refuses another file put in
its place."""
from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.display import shown
from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.dcp import METADATA, DcpSaveMeta, split_keys
from mpitailor.formats.io import FileIdentity, crc32_range, open_regular
from mpitailor.formats.manifest import SAVE_RECORD
from mpitailor.jobs.readable import cannot_read, odd_entry
from mpitailor.planning.chain import Save
from mpitailor.planning.layers import LayerClassifier


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


def check_layers(folder: Path, record, meta) -> None:
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


def record_less_checked(saves: list[Save]) -> list[Save]:
    """A save without a record counts as a full save: one whose metadata lacks parameters
    another full save holds is not one (a partial save whose record was lost), and taken as
    full it would be recovered from with those layers missing. Skipped, said."""
    full = [s for s in saves if s.meta is not None and not s.partial]
    params = [{k.param for k in split_keys(s.meta.metadata.tensors).values()
               if k.role == "model"}
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


def check_sizes(folder: Path, files: dict, meta) -> None:
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


def check_crcs(comm: Comm, saves: list[Save], names: set[str]
               ) -> tuple[list[Save], dict[str, FileIdentity]]:
    """Collective: the recorded files of the saves named checked against their CRC-32s,
    files spread over the ranks by size; the saves, a failed one with its problem, and
    the identity of every file that passed (by path)."""
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

    def check() -> tuple[list[tuple[str, str, bool]], dict[str, FileIdentity]]:
        bad, good = [], {}
        for save, f in mine:
            s = by_name[save]
            try:
                good[str(s.path / f)] = _check_crc(s.path / f, s.meta.record.files[f])
            except (CheckpointError, OSError) as e:
                bad.append((save, str(e).split("\n")[0], unreadable_now(e, s.path)))
        return bad, good

    found, identities = {}, {}
    for bad, good in comm.allgather(comm.step(check)):
        identities.update(good)
        for save, why, now in bad:
            if save not in found or now:
                found[save] = (why, now)
    return [dataclasses.replace(s, problem=found[s.name][0], unreadable=found[s.name][1])
            if s.name in found else s for s in saves], identities


def check_recorded(folder: Path, record, meta) -> None:
    """Every file of a save at the size and CRC-32 its record took (one process)."""
    check_sizes(folder, record.files, meta)
    for name, rec in sorted(record.files.items()):
        _check_crc(folder / name, rec)


def _check_crc(path: Path, rec: dict) -> FileIdentity:
    """The file at its recorded CRC-32; its identity as checked."""
    fd = open_regular(path, "a file the save's record names")
    try:
        identity = FileIdentity.of(fd)
        crc, n = crc32_range(fd, 0, rec["bytes"])
    finally:
        os.close(fd)
    if n != rec["bytes"] or f"{crc:08x}" != rec["crc32"]:
        raise CheckpointError(f"{shown(path)}: fails the CRC-32 its save recorded; the file "
                              f"is corrupt")
    return identity
