"""A rank's share of the HF weights files of a DCP export (planning/dcp_hf.py), written in
place: each output element read from the chunk that holds it, where formats/dcp `locate`
says the chunk's elements lie in its data file (each item checked to be the contiguous
tensor its metadata says before a byte of it is read), copied through the copy engine
(copyio.Copier: bounded chunks, CRC-32 on the way) or, for --dtype, cast on the way
(Copier.cast, bit for bit torch's `.to(dtype)`).

No rank holds more than the copier's chunks of tensor data; the files are created at their
final size with their headers before any rank writes (jobs/dcp_export.py).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from mpitailor.engine.copyio import Copier
from mpitailor.formats.dcp import DcpMetadata, Located, locate
from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.io import (
    FileIdentity,
    close_all,
    fsync_close,
    open_output,
    open_regular,
    pread_into,
    require_same,
)
from mpitailor.planning.dcp_hf import DcpHfPlan, Run, pieces, runs_of
from mpitailor.planning.hf_layout import runs


class ChunkSources:
    """The checkpoint's data files (opened on first use) and its chunks' places (located
    on first use: a rank reads only the items of its share)."""

    def __init__(self, folder: Path, meta: DcpMetadata, paths: Mapping[str, Path],
                 checked: Mapping[str, FileIdentity]) -> None:
        self.folder, self.meta, self.paths, self.checked = folder, meta, paths, checked
        self.fds: dict[str, int] = {}
        self.located: dict[tuple[str, int], Located] = {}
        self.runs: dict[str, tuple[list[Run], list[int]]] = {}

    def tensor_runs(self, fqn: str) -> tuple[list[Run], list[int]]:
        if fqn not in self.runs:
            rs = runs_of(self.meta.tensors[fqn])
            self.runs[fqn] = (rs, [r.start for r in rs])
        return self.runs[fqn]

    def chunk(self, fqn: str, i: int) -> tuple[int, Located]:
        """(fd of its data file, where its elements lie) of chunk i of tensor fqn."""
        entry = self.meta.tensors[fqn]
        c = entry.chunks[i]
        item = self.meta.items[fqn, c.offsets]
        path = self.paths.get(item.file, self.folder / item.file)
        if item.file not in self.fds:
            self.fds[item.file] = fd = open_regular(path, "a DCP data file")
            if str(path) in self.checked:  # the very file a recovery checked, not another
                require_same(fd, path, self.checked[str(path)])
        fd = self.fds[item.file]
        if (fqn, i) not in self.located:
            self.located[fqn, i] = locate(path.parent, fd, replace(item, file=path.name),
                                          entry, c.sizes)
        return fd, self.located[fqn, i]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def write_share(folder: Path, meta: DcpMetadata, plan: DcpHfPlan, root: Path,
                share: list[tuple[int, int, int]], paths: Mapping[str, Path] | None = None,
                checked: Mapping[str, FileIdentity] | None = None
                ) -> dict[str, list[tuple[int, int, int]]]:
    """This rank's share [(file index, first, end element)] of the files in root (made, at
    their final size), written and fsynced; {file: [(first byte, bytes, CRC-32)]}. The
    metadata's data files lie in folder, or where paths says (a composite planned in link
    mode: its files are the sources'); checked: the identities of files a recovery
    checked, each opened only as that very file."""
    w = plan.weights
    size = w.itemsize
    src, copier, outs = ChunkSources(folder, meta, paths or {}, checked or {}), Copier(), {}
    crcs: dict[str, list[tuple[int, int, int]]] = {}
    try:
        for i, lo, hi in share:
            f = w.files[i]
            outs[f.name] = open_output(root / f.name)
            first = len(f.prefix) + lo * size  # bytes of the file, header included
            crc = 0
            for piece, a, b in runs(f, size, lo, hi):
                crc = _tensor(src, copier, plan, piece.name, a, b, outs[f.name],
                              piece.offset + a * size, crc)
            crcs.setdefault(f.name, []).append((first, (hi - lo) * size, crc))
        copier.drain()
        fsync_close(outs)
    finally:
        copier.close()
        close_all(outs)
        src.close()
    return crcs


def _tensor(src: ChunkSources, copier: Copier, plan: DcpHfPlan, name: str, a: int, b: int,
            out: int, at: int, crc: int) -> int:
    """Elements [a, b) of output tensor `name` written at byte `at` of out; the CRC on."""
    fqn, dtype = plan.fqn_of[name], plan.weights.dtype
    have = plan.source_dtype[name]
    rs, starts = src.tensor_runs(fqn)
    if have == dtype:  # bytes as they are
        size = DTYPES[dtype].itemsize
        for chunk, first, n in pieces(rs, starts, a, b):
            fd, loc = src.chunk(fqn, chunk)
            crc = copier.copy(fd, loc.offset + first * size, n * size, out, at, crc,
                              str(loc.file))
            at += n * size
        return crc

    def fill(lo: int, into) -> None:
        fill_fp32(src, fqn, have, rs, starts, lo, into)
    return copier.cast(fill, a, b, dtype, out, at, crc)


def fill_fp32(src: ChunkSources, fqn: str, have: str, rs: list[Run], starts: list[int], lo: int,
          into) -> None:
    """Copier.cast's fill: tensor fqn's elements from lo on, as fp32, into `into`."""
    import numpy as np

    from mpitailor.formats.torch import cast, numpy_dtype
    size, pos = DTYPES[have].itemsize, 0
    for chunk, first, n in pieces(rs, starts, lo, lo + into.size):
        fd, loc = src.chunk(fqn, chunk)
        raw = bytearray(n * size) if have != "fp32" else None
        view = memoryview(raw) if raw is not None else \
            memoryview(into[pos:pos + n]).cast("B")
        done = 0
        while done < len(view):
            done += pread_into(fd, view[done:], loc.offset + first * size + done,
                               str(loc.file), len(view) - done)
        if raw is not None:
            cast(np.frombuffer(raw, dtype=numpy_dtype(have)), have, "fp32",
                 out=into[pos:pos + n])
        pos += n
