"""`verify PATH`: every file an mpitailor output recorded, read back and checked against its
record (size and CRC-32), MPI-parallel: the recorded bytes of all files are cut into one
contiguous range per rank, balanced by bytes, each rank takes the CRC-32 of its ranges and
rank 0 joins them per file (as the executor joins its outputs' CRCs).

What PATH can be: an output with a manifest (a merge, a recover, an export:
mpitailor_manifest.json), a partial save (a tag dir with mpitailor_partial.json), or a dir
holding such outputs one or two levels down (a save dir: global_stepN/, checkpoint-N/ and
the tag dir inside it; a dir of composites). An output's manifest records every file it
published: a file it records that is missing, not a regular file, of another size or
another CRC-32 differs, and so does a file in the output that it does not record. A
node-local composite is checked for the files of the node whose manifest it is. What no
mpitailor record covers (a full save by DeepSpeed or the HF Trainer, a staging dir of a run
in progress or killed) is named as not verified, never passed as clean.

The manifests are files anyone could have written: a recorded name must be a plain relative
path inside the output (no `..`, no absolute path, no link on the way), and a file is
opened without following a link and read only if it is a regular file.
"""
from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.display import shown
from mpitailor.engine.copyio import join_crcs
from mpitailor.errors import UserError
from mpitailor.formats.io import FILE_CHUNK, crc32
from mpitailor.formats.manifest import MANIFEST, PARTIAL_MANIFEST, read_manifest

_RECORDS = (MANIFEST, PARTIAL_MANIFEST)
_DEPTH = 2  # levels below PATH searched for outputs (save dir -> checkpoint-N -> tag dir)


@dataclass(frozen=True, slots=True)
class Recorded:
    """One file an output records: its path, and its recorded size and CRC-32."""

    path: str     # absolute
    size: int
    crc: int
    root: str = ""  # the output's dir, and the path's parts under it (opened one by one,
    parts: tuple[str, ...] = ()  # none followed if it is a link)


@dataclass
class VerifyResult:
    outputs: list[str] = field(default_factory=list)         # verified outputs (their dirs)
    files: int = 0
    bytes: int = 0
    differ: list[str] = field(default_factory=list)          # "path: what differs"
    not_verified: list[str] = field(default_factory=list)    # "dir: why"
    seconds: float = 0.0


def run_verify(comm: Comm, path: Path) -> VerifyResult:
    """Collective: verify every recorded file under `path` (see the module's doc)."""
    t0 = time.perf_counter()
    result, files = comm.root_step(_survey, path)
    work = _split([f.size for f in files], comm.size)
    mine = comm.step(_crc_ranges, files, work[comm.rank])
    if comm.rank == 0:
        _judge(files, comm.gather(mine), result)
    else:
        comm.gather(mine)
    result = comm.bcast(result if comm.rank == 0 else None)
    result.seconds = time.perf_counter() - t0
    return result


def _survey(path: Path) -> tuple[VerifyResult, list[Recorded]]:
    """Rank 0: the outputs under path and every file they record; what differs already
    (unsafe names, files not recorded) and what no record covers."""
    if not path.is_dir():
        raise UserError(f"{shown(path)}: not a directory; give an output of mpitailor (a "
                        f"merge, an export, a partial save) or a dir that holds some")
    result, files = VerifyResult(), []
    found = _outputs(path, _DEPTH, result)
    if not found:
        raise UserError(f"{shown(path)}: no mpitailor output here or up to {_DEPTH} levels "
                        f"down (none holds {MANIFEST} or {PARTIAL_MANIFEST}); nothing to verify")
    for out, record in found:
        result.outputs.append(str(out))
        manifest = read_manifest(out / record)
        skip = _other_nodes(manifest)
        recorded = set()
        for name, rec in sorted(manifest.files.items()):
            where = _inside(out, name)
            if where is None:
                result.differ.append(f"{shown(out / record)}: records {name!r:.80}, which is "
                                     f"not a plain path inside the output")
                continue
            if name in skip:
                continue
            recorded.add(name)
            size, crc = _record(rec)
            if size is None:
                result.differ.append(f"{shown(where)}: its record in {record} is not "
                                     f"{{bytes, crc32}}")
                continue
            files.append(Recorded(str(where), size, crc, str(out), tuple(name.split("/"))))
        for extra in _unrecorded(out, recorded | {record}, set(skip)):
            result.differ.append(f"{shown(out / extra)}: in the output but not in its {record}")
    return result, files


def _outputs(folder: Path, depth: int, result: VerifyResult) -> list[tuple[Path, str]]:
    """(dir, its record's name) of every output at or below folder, `depth` levels down;
    a dir an output's record covers is not searched further."""
    for record in _RECORDS:
        if (folder / record).is_file():
            return [(folder, record)]
    if depth == 0:
        return []
    found = []
    for child in sorted(folder.iterdir()):
        if child.is_symlink() or not child.is_dir():
            continue
        if child.name.startswith(".") and "mpitailor" in child.name:
            result.not_verified.append(f"{shown(child)}: a staging dir (a run in progress, "
                                       f"or left by a killed one: `mpitailor clean`)")
            continue
        inner = _outputs(child, depth - 1, result)
        found += inner
        if not inner and _is_full_save(child):
            result.not_verified.append(f"{shown(child)}: a full save, whose files DeepSpeed "
                                       f"wrote and nothing recorded")
    return found


def _is_full_save(folder: Path) -> bool:
    """A tag dir of DeepSpeed's (stage 3's per-rank or stage 1/2's optimizer files)."""
    return any(folder.glob("*optim_states.pt"))


def _other_nodes(manifest) -> set[str]:
    """A node-local composite's manifest: the files other nodes hold (not here)."""
    node_local = manifest.get("node_local")
    if not isinstance(node_local, dict):
        return set()
    node, by_node = node_local.get("node"), node_local.get("files_of_node")
    if not isinstance(by_node, dict):
        return set()
    mine = set(by_node.get(node) or ())
    return {f for n, names in by_node.items() if n != node and isinstance(names, list)
            for f in names if isinstance(f, str) and f not in mine}


def _inside(out: Path, name: object) -> Path | None:
    """out/name if name is a plain relative path inside out, as mpitailor writes them
    (parts joined by single `/`, none empty, `.` or `..`) with no link among its folders,
    else None. Its last part is opened without following a link (_crc_ranges)."""
    if not isinstance(name, str) or "\\" in name or "\0" in name:
        return None
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return None
    where = out.joinpath(*parts)
    folder = out
    for p in parts[:-1]:
        folder = folder / p
        if folder.is_symlink():
            return None
    return where


def _record(rec: object) -> tuple[int | None, int]:
    try:
        size, crc = rec["bytes"], int(rec["crc32"], 16)
        if type(size) is not int or size < 0 or not 0 <= crc < 1 << 32:
            raise ValueError
        return size, crc
    except (TypeError, KeyError, ValueError):
        return None, 0


def _unrecorded(out: Path, recorded: set[str], elsewhere: set[str]) -> list[str]:
    """Files under out that its record does not name (nor places on another node)."""
    extra = []
    for dirpath, dirs, names in os.walk(out):
        rel = Path(dirpath).relative_to(out)
        dirs.sort()
        for n in sorted(names):
            name = str(rel / n) if str(rel) != "." else n
            if name not in recorded and name not in elsewhere:
                extra.append(name)
    return extra


def _split(sizes: list[int], ranks: int) -> list[list[tuple[int, int, int]]]:
    """rank -> [(file index, first byte, end byte)]: the files' bytes one after the other,
    cut into `ranks` contiguous ranges of nearly equal size; a file of 0 bytes (nothing to
    read, its size and type still checked) goes to rank index % ranks."""
    total = sum(sizes)
    cuts = [total * m // ranks for m in range(ranks)] + [total]
    work: list[list[tuple[int, int, int]]] = [[] for _ in range(ranks)]
    start = 0
    for i, n in enumerate(sizes):
        if n == 0:
            work[i % ranks].append((i, 0, 0))
            continue
        end = start + n
        for m in range(ranks):
            lo, hi = max(cuts[m], start), min(cuts[m + 1], end)
            if lo < hi:
                work[m].append((i, lo - start, hi - start))
        start = end
    return work


def _crc_ranges(files: list[Recorded], tasks) -> tuple[dict, dict]:
    """This rank's ranges: ({file index: [(first byte, bytes, CRC-32)]}, {file index: what
    is wrong with it}); a file that cannot be read as recorded is said, not raised."""
    crcs: dict[int, list[tuple[int, int, int]]] = {}
    wrong: dict[int, str] = {}
    buf = bytearray(FILE_CHUNK)
    for i, lo, hi in tasks:
        f = files[i]
        try:
            fd = _open_under(f.root, f.parts)
        except FileNotFoundError:
            wrong[i] = "missing"
            continue
        except OSError as e:
            wrong[i] = "a symbolic link (mpitailor never writes one)" if os.path.islink(f.path) \
                else f"cannot be opened ({e.strerror})"
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                wrong[i] = "not a regular file"
                continue
            if st.st_size != f.size:
                wrong[i] = f"{st.st_size} bytes, {f.size} recorded"
                continue
            crc, pos = 0, lo
            view = memoryview(buf)
            while pos < hi:
                n = os.preadv(fd, [view[:min(hi - pos, len(buf))]], pos)
                if n <= 0:
                    break
                crc = crc32(view[:n], crc)
                pos += n
            if pos < hi:
                wrong[i] = f"ends at byte {pos}, {f.size} recorded"
                continue
            crcs.setdefault(i, []).append((lo, hi - lo, crc))
        except OSError as e:
            wrong[i] = f"read failed ({e.strerror})"
        finally:
            os.close(fd)
    return crcs, wrong


def _open_under(root: str, parts: tuple[str, ...]) -> int:
    """The file root/parts..., each part opened from the one before without following a
    link (a folder swapped for a link after the survey is not followed either); OSError
    (ELOOP, ENOTDIR, ENOENT) as os.open raises it."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(root, flags | os.O_DIRECTORY)
    try:
        for p in parts[:-1]:
            inner = os.open(p, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        os.close(fd)


def _judge(files: list[Recorded], parts, result: VerifyResult) -> None:
    """Rank 0: every file's CRC-32 joined from the ranks' ranges and compared."""
    ranges: dict[int, list[tuple[int, int, int]]] = {}
    wrong: dict[int, str] = {}
    for crcs, bad in parts:
        for i, rs in crcs.items():
            ranges.setdefault(i, []).extend(rs)
        for i, why in bad.items():
            wrong.setdefault(i, why)
    for i, f in enumerate(files):
        result.files += 1
        result.bytes += f.size
        if i in wrong:
            result.differ.append(f"{shown(f.path)}: {wrong[i]}")
            continue
        crc, end = join_crcs(ranges.get(i, []))
        if end != f.size:
            raise RuntimeError(f"internal error: {f.path}: bytes from {end} on read by no rank")
        if crc != f.crc:
            result.differ.append(f"{shown(f.path)}: CRC-32 {crc:08x}, {f.crc:08x} recorded")
