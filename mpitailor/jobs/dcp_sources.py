"""The sources of a DCP merge (and of an export of a save dir): their metadata read and
their data files checked to hold what it places there, each source file opened as the very
file a recovery checked, each item checked before a byte of it is copied or linked, and
the save ids and steps a manifest names them by. Rank 0 plans from them; every rank checks
and copies its share of their items (jobs/dcp_merge.py)."""
from __future__ import annotations

import os
from pathlib import Path

from mpitailor.formats.dcp import (
    METADATA,
    Located,
    check_bytes_item,
    check_data_files,
    locate,
    read_dcp_save_record,
    read_metadata,
)
from mpitailor.formats.io import FileIdentity, open_regular, read_upto, require_same
from mpitailor.planning.chain import step_of_name
from mpitailor.planning.dcp_plan import Copy, DcpPlan
from mpitailor.planning.recipe import Recipe

Checked = dict[str, FileIdentity]  # a source file's path -> what it was when checked


def _still(path: Path, checked: Checked) -> None:
    """CheckpointError if the file at path is not what was checked (where it was)."""
    if str(path) not in checked:
        return
    fd = open_regular(path, "a DCP .metadata file")
    try:
        require_same(fd, path, checked[str(path)])
    finally:
        os.close(fd)


def read_dcp_sources(recipe: Recipe, checked: Checked | None = None) -> dict:
    """Every source's metadata, its data files checked to hold what it places in them;
    checked: the identities of files a recovery checked (jobs/dcp_save_checks.py): a
    `.metadata` that is another file now is refused (looked at before and after it is
    read)."""
    checked = checked or {}
    metas = {}
    for name, path in recipe.sources:
        _still(path / METADATA, checked)
        metas[name] = read_metadata(path)
        _still(path / METADATA, checked)
    for name, path in recipe.sources:
        check_data_files(path, metas[name])
    return metas


def source_fd(fds: dict, c: Copy, folder: Path, checked: Checked) -> int:
    """The source data file of copy c, opened once (fds: by source and file), only as the
    very file a recovery checked where it checked it."""
    key = (c.source, c.item.file)
    if key not in fds:
        path = folder / c.item.file
        fds[key] = open_regular(path, "a DCP data file")
        if str(path) in checked:
            require_same(fds[key], path, checked[str(path)])
    return fds[key]


SMALL_ITEM = 1 << 16  # a bytes entry's item up to this size is checked once per content


def check_item(plan: DcpPlan, c: Copy, folder: Path, fd: int, passed: set
                ) -> Located | None:
    """What is copied is what the metadata says: a tensor chunk's item a torch.save of a
    contiguous tensor of its dtype and shape, a bytes entry's item a torch.save the torch
    reader's allow-list reads (no payload carried into the output). passed: the bytes of
    small bytes items already read (a run's per-parameter hyper-parameters: thousands of
    items, a few contents)."""
    if c.sizes is None:
        blob = read_upto(fd, c.item.length, c.item.offset) \
            if c.item.length <= SMALL_ITEM and not c.item.transforms else None
        if blob is None or blob not in passed:
            check_bytes_item(folder, fd, c.item)
            if blob is not None and len(blob) == c.item.length:
                passed.add(blob)
        return None
    return locate(folder, fd, c.item, plan.output.tensors[c.fqn], c.sizes)


def source_saves(recipe: Recipe) -> dict[str, dict]:
    """Each source as the manifest names it: mpitailor's save id and step from its save
    record (formats/dcp/save_record.py), for a plain DCP checkpoint none and the step of its
    name (`step-N`). Retention (jobs/prune.py) tells the newest composite by them."""
    out = {}
    for name, path in recipe.sources:
        record = read_dcp_save_record(path)
        out[name] = {"save_id": None, "global_steps": step_of_name(path.name)} \
            if record is None else {"save_id": record.lineage.save_id,
                                    "global_steps": record.global_steps}
    return out
