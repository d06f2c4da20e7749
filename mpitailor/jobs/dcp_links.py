"""The link mode of a DCP merge (`merge --link`, `recover --link`, and the in-job resume):
the sources' data files hard-linked into the staging dir (planning/dcp_link.py says which,
and what the output's metadata says), each file's record taken from its save's record where
the save has one (mpitailor's DCP saves do), else computed, the files spread over the ranks.

A link is made to the file opened, not to whatever the name stands for: the source is opened
without following a link (a symbolic link or anything but a regular file there is refused by
name, as copy mode refuses it), linked by name without following one, and the link must be
that very file (device and inode): a name swapped in between is refused, its link removed.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.errors import CheckpointError, UserError
from mpitailor.formats.dcp import read_dcp_save_record
from mpitailor.formats.io import FileIdentity, open_regular, require_same, synced_record
from mpitailor.planning.dcp_link import LinkPlan
from mpitailor.planning.recipe import Recipe


def write_links(comm: Comm, recipe: Recipe, plan: LinkPlan, root: Path,
                checked: dict | None = None) -> dict[str, dict]:
    """Collective: every link made (rank 0), then its record ({"bytes", "crc32"}): the source
    save's recorded one, or the file's CRC-32 computed, files spread over the ranks by size.
    checked: the identities of files a recovery checked: each linked only as that file."""
    known = comm.root_step(_link_all, recipe, plan, root, checked or {})
    todo = sorted((n for n, rec in known.items() if "crc32" not in rec),
                  key=lambda n: (-known[n]["bytes"], n))
    load, mine = [0] * comm.size, []
    for name in todo:
        r = load.index(min(load))
        load[r] += known[name]["bytes"]
        if r == comm.rank:
            mine.append(name)
    computed = comm.step(lambda: {n: synced_record(root / n) for n in mine})
    for part in comm.allgather(computed):
        known.update(part)
    return known


def _link_all(recipe: Recipe, plan: LinkPlan, root: Path, checked: dict) -> dict[str, dict]:
    records: dict[str, dict] = {}
    saved: dict[str, dict] = {}
    for link in plan.links:
        folder = recipe.source_path(link.source)
        if link.source not in saved:
            record = read_dcp_save_record(folder)
            saved[link.source] = dict(record.files) if record is not None else {}
        size = _link(folder / link.file, root / link.name, checked.get(str(folder / link.file)))
        rec = saved[link.source].get(link.file)
        records[link.name] = dict(rec) if rec is not None and rec["bytes"] == size else \
            {"bytes": size}
    return records


def _link(src: Path, dst: Path, identity: FileIdentity | None) -> int:
    """dst made a hard link to the regular file src (the file `identity` recorded, where
    given); its size."""
    fd = open_regular(src, "a DCP data file")
    try:
        if identity is not None:
            require_same(fd, src, identity)
        st = os.fstat(fd)
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError as e:
            if e.errno == errno.EXDEV:
                raise UserError(f"{src}: on another file system than the output {dst.parent}; "
                                f"--link makes hard links, which stay on one file system: "
                                f"write the output beside the sources, or merge without "
                                f"--link (a copy)") from None
            if e.errno in (errno.EPERM, errno.EACCES, errno.ENOENT, errno.EMLINK):
                raise CheckpointError(f"{src}: cannot be hard-linked into the output "
                                      f"({e.strerror}); merge without --link (a copy)") from None
            raise
        got = os.lstat(dst)
        if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
            os.unlink(dst)
            raise CheckpointError(f"{src}: replaced while it was linked (by a link or another "
                                  f"file); nothing published: run again")
    finally:
        os.close(fd)
    return st.st_size
