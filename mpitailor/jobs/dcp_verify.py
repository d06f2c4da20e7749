"""`--verify` of a DCP merge or recovery (copy and link mode): the published output read
back and checked against the plan, after publication, three ways:

1. Every file the manifest records: its size and CRC-32 as recorded, and no file it does
   not record (jobs/verify.py, the `verify` command's check, spread over the ranks). The
   data files' CRC-32s were taken from the sources' bytes as they were copied (link mode:
   the save's own record, or the file read once), so a byte that changed on its way to the
   disk, or after, differs.
2. The output's `.metadata` read back (formats/dcp) places every entry where the plan
   does: the same tensors, chunks and bytes entries, each item in the same file at the same
   offset and length.
3. Every item of the output read back and compared byte for byte with the source item the
   plan takes it from (a chunk of a safetensors blob, written as a torch.save item: its
   zip headers with what the plan makes of them, its data with the source chunk's bytes),
   items spread over the ranks, balanced by bytes. This needs no record: it catches a copy
   that wrote the right bytes to the wrong place as well as a flipped bit.

A difference is one line naming the file and the item (and how many more differ), exit 1:
the output stays published (it was whole when published; `verify OUT` says the same later),
and the line says to delete it and run again. Collective: every rank calls verify_dcp_merge.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.display import shown
from mpitailor.errors import MpitailorError
from mpitailor.formats.dcp import (
    METADATA,
    DcpMetadata,
    Item,
    locate,
    read_metadata,
    zip_item,
)
from mpitailor.formats.io import crc32_range, open_regular, read_upto, require_same
from mpitailor.jobs.verify import run_verify

COMPARE_CHUNK = 1 << 22  # bytes read at a time from each side


@dataclass(frozen=True, slots=True)
class Verified:
    files: int          # files checked against the manifest (size, CRC-32)
    items: int          # items compared with their sources
    bytes: int          # bytes read back: files whole, and the items again


@dataclass(frozen=True, slots=True)
class _Check:
    """One output item and the source item the plan takes it from."""

    fqn: str
    offsets: tuple[int, ...] | None
    out_file: str
    out_offset: int
    length: int
    source: str
    src_path: Path
    item: Item                                   # the source's
    zip_of: tuple[str, tuple[int, ...]] | None  # (dtype, sizes) of a safetensors chunk


class VerifyFailed(MpitailorError):
    """The output differs from what was planned (exit 1, as `verify` exits)."""


def verify_dcp_merge(comm: Comm, planned, checked: dict | None = None) -> Verified:
    """Collective: the three checks of the module's doc on the published output of
    `planned` (jobs/dcp_merge.py's DcpMergePlan); VerifyFailed, one line, if any differs."""
    output = planned.recipe.output
    recorded = run_verify(comm, output)
    expected = planned.plan.output if planned.linked is None else planned.linked.output
    meta_diff = comm.root_step(_metadata_differs, output, expected)
    checks = _checks(planned)
    mine = _share([c.length for c in checks], comm.size)[comm.rank]
    found = comm.step(_compare_all, output, planned.plan, [checks[i] for i in mine],
                      checked or {})
    differ = [line for part in comm.allgather(found) for line in part]
    if differ or recorded.differ or meta_diff:
        comm.root_step(_fail, output, differ, recorded.differ, meta_diff)
    compared = sum(c.length for c in checks)
    return Verified(recorded.files, len(checks), recorded.bytes + compared)


def _fail(output: Path, items: list[str], recorded: list[str], meta: str | None) -> None:
    """The first difference, items before records (an item's line names file and item)."""
    lines = [*items, *([meta] if meta else []), *recorded]
    more = f" ({len(lines) - 1} more difference(s): `mpitailor verify {shown(output)}` " \
           f"lists the files)" if len(lines) > 1 else ""
    raise VerifyFailed(f"--verify: {lines[0]}{more}; {shown(output)} was published but does "
                       f"not hold what was planned: delete it and run again")


def _metadata_differs(output: Path, expected: DcpMetadata) -> str | None:
    """Rank 0: where the output's `.metadata`, read back, places an entry otherwise than
    planned, in words; None where it agrees."""
    try:
        got = read_metadata(output)
    except MpitailorError as e:
        return f"{shown(output / METADATA)}: cannot be read back ({e})"
    if got.tensors != expected.tensors:
        bad = next(f for f in {*got.tensors, *expected.tensors}
                    if got.tensors.get(f) != expected.tensors.get(f))
        return f"{shown(output / METADATA)}: tensor {bad!r:.100} differs from the plan's"
    if tuple(got.bytes_entries) != tuple(expected.bytes_entries):
        return f"{shown(output / METADATA)}: its bytes entries differ from the plan's"
    for index in sorted({*got.items, *expected.items}, key=repr):
        if got.items.get(index) != expected.items.get(index):
            return (f"{shown(output / METADATA)}: item {index[0]!r:.100} (chunk at "
                    f"{index[1]}) is placed otherwise than planned")
    return None


def _checks(planned) -> list[_Check]:
    """Every output item with its source's, in the plan's order (the same on every rank)."""
    plan, recipe, linked = planned.plan, planned.recipe, planned.linked
    out = []
    for c in plan.copies:
        src = recipe.source_path(c.source) / c.item.file
        if linked is not None:  # the item where it lies, in the linked file
            placed = linked.output.items[c.fqn, c.offsets]
            out.append(_Check(c.fqn, c.offsets, placed.file, placed.offset, placed.length,
                              c.source, src, c.item, None))
            continue
        zip_of = (plan.output.tensors[c.fqn].dtype, c.sizes) if c.item.safetensors else None
        out.append(_Check(c.fqn, c.offsets, c.file, c.offset, c.length, c.source, src,
                          c.item, zip_of))
    return out


def _share(sizes: list[int], ranks: int) -> list[list[int]]:
    """Check indices to ranks, largest first to the least loaded."""
    load, out = [0] * ranks, [[] for _ in range(ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = load.index(min(load))
        out[r].append(i)
        load[r] += sizes[i]
    return out


def _compare_all(output: Path, plan, checks: list[_Check], checked: dict) -> list[str]:
    """This rank's items compared; a line for each that differs."""
    fds: dict[Path, int] = {}

    def fd_of(path: Path, what: str) -> int:
        if path not in fds:
            fds[path] = open_regular(path, what)
            if str(path) in checked:  # the very file a recovery checked
                require_same(fds[path], path, checked[str(path)])
        return fds[path]
    differ = []
    try:
        for c in checks:
            out_fd = fd_of(output / c.out_file, "a DCP data file of the output")
            src_fd = fd_of(c.src_path, "a DCP data file")
            why = _compare_item(c, plan, out_fd, src_fd)
            if why is not None:
                differ.append(f"{shown(output / c.out_file)}: item {c.fqn!r:.100}"
                              f"{'' if c.offsets is None else f' (chunk at {list(c.offsets)})'}"
                              f" {why} {shown(c.src_path)} (source {c.source}, the plan's)")
    finally:
        for fd in fds.values():
            os.close(fd)
    return differ


def _compare_item(c: _Check, plan, out_fd: int, src_fd: int) -> str | None:
    if c.zip_of is None:
        return _compare(out_fd, c.out_offset, src_fd, c.item.offset, c.length)
    dtype, sizes = c.zip_of
    z = zip_item(dtype, sizes)
    located = locate(c.src_path.parent, src_fd, c.item, plan.output.tensors[c.fqn], sizes)
    data_crc, _ = crc32_range(src_fd, located.offset, located.nbytes)
    for at, data in z.pieces(data_crc):
        if read_upto(out_fd, len(data), c.out_offset + at) != data:
            return (f"at byte {at}: its torch.save headers differ from those planned for "
                    f"the safetensors chunk of")
    return _compare(out_fd, c.out_offset + z.data_offset, src_fd, located.offset,
                    located.nbytes)


def _compare(out_fd: int, out_at: int, src_fd: int, src_at: int, n: int) -> str | None:
    """None if the n bytes at out_at of out_fd equal those at src_at of src_fd; else how
    they differ (the first byte that does), to be followed by the source's name."""
    done = 0
    while done < n:
        k = min(COMPARE_CHUNK, n - done)
        a, b = read_upto(out_fd, k, out_at + done), read_upto(src_fd, k, src_at + done)
        if a != b:
            if len(a) < k:
                return f"ends at byte {done + len(a)} of {n}, in"
            if len(b) < k:
                return f"is longer than its source item, which ends at byte {done + len(b)} in"
            first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            return f"differs at byte {done + first} of {n} from its source item in"
        done += k
    return None
