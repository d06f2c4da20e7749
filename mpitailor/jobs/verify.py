"""`verify PATH`: every file an mpitailor output recorded, read back and checked against its
record (size and CRC-32), MPI-parallel: the recorded bytes of all files are cut into one
contiguous range per rank, balanced by bytes, each rank takes the CRC-32 of its ranges and
rank 0 joins them per file (as the executor joins its outputs' CRCs).

What PATH can be: an output with a manifest (a merge, a recover, an export:
mpitailor_manifest.json), a partial save (a tag dir with mpitailor_partial.json), a full save
made through mpitailor's checkpointers (a tag dir whose mpitailor_save.json records
DeepSpeed's files), or a dir holding such outputs one or two levels down (a save dir:
global_stepN/, checkpoint-N/ and the tag dir inside it; a dir of composites). A record names
every file of its output: a file it records that is missing, not a regular file, of another
size or another CRC-32 differs, and so does a file in the output that it does not record. A
node-local composite is checked for the files of the node whose manifest it is. What no
mpitailor record covers (a full save by DeepSpeed or the HF Trainer themselves, or one whose
record predates its files' records; a staging dir of a run in progress or killed) is named
as not verified, never passed as clean.

The manifests are files anyone could have written: a recorded name must be a plain relative
path inside the output (no `..`, no absolute path, no link on the way), and a file is
opened without following a link and read only if it is a regular file.
"""
from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.display import shown
from mpitailor.engine.copyio import join_crcs
from mpitailor.errors import MpitailorError, UserError
from mpitailor.formats.io import crc32_range, open_under
from mpitailor.formats.manifest import ABSENT, MANIFEST, PARTIAL_MANIFEST, read_manifest
from mpitailor.formats.zero import SAVE_RECORD, read_file_records
from mpitailor.planning.retention import PRUNED_DIR
from mpitailor.publish.leftovers import SUFFIXES

_RECORDS = (MANIFEST, PARTIAL_MANIFEST)  # and a full save's SAVE_RECORD, when it has files
_DEPTH = 2  # levels below PATH searched for outputs (save dir -> checkpoint-N -> tag dir)
_CRC = re.compile(r"[0-9a-f]{8}")


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
    result, files, seen = comm.root_step(_survey, path)
    comm.step(_same_view, comm, path, seen)
    work = _split([f.size for f in files], comm.size)
    parts = comm.gather(comm.step(_crc_ranges, files, work[comm.rank]))
    if comm.rank == 0:
        _judge(files, parts, result)
    result = comm.bcast(result if comm.rank == 0 else None)
    result.seconds = time.perf_counter() - t0
    return result


def _survey(path: Path) -> tuple[VerifyResult, list[Recorded], dict[str, tuple]]:
    """Rank 0: the outputs under path and every file they record; what differs already
    (unreadable records, unsafe names, files not recorded) and what no record covers; and
    what rank 0 saw of path and the records (_same_view)."""
    if not path.is_dir():
        what = "not a directory" if os.path.lexists(path) else "no such directory"
        raise UserError(f"{shown(path)}: {what}; give an output of mpitailor (a merge, an "
                        f"export, a partial save) or a dir that holds some")
    result, files = VerifyResult(), []
    found = _outputs(path, _DEPTH, result)
    if not found:
        raise UserError(f"{shown(path)}: no mpitailor output here or up to {_DEPTH} levels "
                        f"down (none holds {MANIFEST}, {PARTIAL_MANIFEST} or a {SAVE_RECORD} "
                        f"that records files); nothing to verify")
    for out, record in found:
        result.outputs.append(str(out))
        try:
            recorded_files, (here, elsewhere, bad) = _read_record(out, record)
        except MpitailorError as e:  # (it names the file)
            result.differ.append(str(e))
            continue
        if not recorded_files:
            result.differ.append(f"{shown(out / record)}: records no file (every output "
                                 f"mpitailor publishes has some)")
        if bad:
            result.differ.append(f"{shown(out / record)}: {bad}")
        recorded = set()
        for name, rec in sorted(recorded_files.items()):
            where = _inside(out, name)
            if where is None:
                result.differ.append(f"{shown(out / record)}: records {_brief(name)}, which "
                                     f"is not a plain path inside the output")
                continue
            if name in elsewhere and name not in here and not os.path.lexists(where):
                continue  # another node's file (node-local output)
            recorded.add(name)
            size, crc = _record(rec)
            if size is None:
                result.differ.append(f"{shown(where)}: its record in {record} is not "
                                     f"{{bytes, crc32}}")
                continue
            files.append(Recorded(str(where), size, crc, str(out), tuple(name.split("/"))))
        for extra, why in _unrecorded(out, recorded | {record}):
            result.differ.append(f"{shown(out / extra)}: {why or f'in the output but not in its {record}'}")
    seen = {str(o / r): _ident(o / r) for o, r in found}
    seen[str(path)] = _ident(path)[:1]  # its inode (a save dir's times change as it is saved to)
    return result, files, seen


def _read_record(out: Path, record: str) -> tuple[dict, tuple[set[str], set[str], str | None]]:
    """The files an output's record names, and its nodes (_nodes); MpitailorError (naming
    the record) if it cannot be read."""
    if record == SAVE_RECORD:
        return read_file_records(out) or {}, (set(), set(), None)
    manifest = read_manifest(out / record)
    return dict(manifest.files), _nodes(manifest)


def _records_files(folder: Path) -> bool:
    """Does folder's SAVE_RECORD make it an output: it records files, or cannot be read
    (reading it again says what is wrong)? False for a record of no files (an older one)."""
    try:
        return read_file_records(folder) is not None
    except MpitailorError:
        return True


def _ident(path: Path) -> tuple:
    try:
        st = os.lstat(path)
    except OSError:
        return (None,)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _same_view(comm: Comm, path: Path, seen: dict[str, tuple]) -> None:
    """Every rank must see what rank 0 surveyed (path's inode; inode, size and times of each
    record: on separate disks they differ even where the bytes agree). A node-local
    composite's copies are each checked by the ranks of their own node."""
    if all(_ident(Path(p))[:len(ident)] == tuple(ident) for p, ident in seen.items()):
        return
    raise UserError(f"{shown(path)}: rank {comm.rank} sees other files there than rank 0 "
                    f"(node-local disks); verify each node's copy with the ranks of that node "
                    f"(srun -N 1 -w NODE ...)")


def _brief(name: object) -> str:
    return shown(name[:120]) if isinstance(name, str) else type(name).__name__


def _outputs(folder: Path, depth: int, result: VerifyResult) -> list[tuple[Path, str]]:
    """(dir, its record's name) of every output at or below folder, `depth` levels down;
    a dir an output's record covers is not searched further (a record that is there but not
    a regular file makes an output: reading it says what is wrong). Every searched dir that
    no record covers is named as not verified: a full save as one, the entries of any other
    (the files beside outputs, an HF checkpoint's trainer files), a dir past the depth."""
    for record in _RECORDS:
        if os.path.lexists(folder / record):
            return [(folder, record)]
    if os.path.lexists(folder / SAVE_RECORD) and _records_files(folder):
        return [(folder, SAVE_RECORD)]
    try:
        children = sorted(folder.iterdir())
    except OSError as e:
        result.differ.append(f"{shown(folder)}: cannot be listed ({e.strerror})")
        return []
    if any(folder.glob("*optim_states.pt")):
        why = f"its {SAVE_RECORD} records no files (written before a full save's files were " \
              f"recorded)" if os.path.lexists(folder / SAVE_RECORD) else \
              "whose files DeepSpeed wrote and nothing recorded"
        result.not_verified.append(f"{shown(folder)}: a full save, {why}")
        return []
    found, loose = [], []
    for child in children:
        if child.is_symlink() or not child.is_dir():
            loose.append(child.name + ("@" if child.is_symlink() else ""))
        elif child.name.endswith(SUFFIXES):
            result.not_verified.append(f"{shown(child)}: a staging dir (a run in progress, "
                                       f"or left by a killed one: `mpitailor clean`)")
        elif child.name == PRUNED_DIR:
            result.not_verified.append(f"{shown(child)}: the tombstones of pruned saves "
                                       f"(prune's own records; recovery reads them)")
        elif depth == 0:
            result.not_verified.append(f"{shown(child)}: not searched (deeper than "
                                       f"{_DEPTH} levels below the path given)")
        else:
            found += _outputs(child, depth - 1, result)
    if loose:
        result.not_verified.append(f"{shown(folder)}: {len(loose)} entr"
                                   f"{'y' if len(loose) == 1 else 'ies'} no record covers "
                                   f"({', '.join(shown(n) for n in loose[:5])}"
                                   f"{', ...' if len(loose) > 5 else ''})")
    elif not found and not children:
        result.not_verified.append(f"{shown(folder)}: empty")
    return found


def _nodes(manifest) -> tuple[set[str], set[str], str | None]:
    """A node-local composite's manifest: (the files of the node it is, the files of the
    other nodes, what is malformed in its node_local record or None)."""
    node_local = manifest.get("node_local")
    if node_local is ABSENT or node_local is None:  # (a manifest of shared storage)
        return set(), set(), None
    node = node_local.get("node") if isinstance(node_local, dict) else None
    by_node = node_local.get("files_of_node") if isinstance(node_local, dict) else None
    if not (isinstance(node, str) and isinstance(by_node, dict) and node in by_node
            and all(isinstance(v, list) and all(isinstance(f, str) for f in v)
                    for v in by_node.values())):
        return set(), set(), ("its node_local record is not {node, files_of_node} naming "
                              "this node's files; every file it records is checked here")
    here = set(by_node[node])
    return here, {f for n, v in by_node.items() if n != node for f in v}, None


def _inside(out: Path, name: object) -> Path | None:
    """out/name if name is a plain relative path inside out, as mpitailor writes them
    (parts joined by single `/`, none empty, `.` or `..`, each a file name the system can
    hold) with no link among its folders, else None. Its last part is opened without
    following a link (_crc_ranges)."""
    if not isinstance(name, str) or "\\" in name or "\0" in name:
        return None
    try:
        parts = [os.fsencode(p) for p in name.split("/")]
    except UnicodeEncodeError:
        return None
    if any(p in (b"", b".", b"..") or len(p) > 255 for p in parts) or len(name) > 4000:
        return None
    folder = out
    try:
        for p in name.split("/")[:-1]:
            folder = folder / p
            if folder.is_symlink():
                return None
    except OSError:
        return None
    return out.joinpath(*name.split("/"))


def _record(rec: object) -> tuple[int | None, int]:
    """(bytes, CRC-32) of a record as mpitailor writes it: a size below 2**63 and eight
    lower-case hex digits; (None, 0) for anything else."""
    try:
        size, crc = rec["bytes"], rec["crc32"]
        if type(size) is not int or not 0 <= size < 1 << 63 or type(crc) is not str \
                or not _CRC.fullmatch(crc):
            raise ValueError
        return size, int(crc, 16)
    except (TypeError, KeyError, ValueError):
        return None, 0


def _unrecorded(out: Path, recorded: set[str]) -> list[tuple[str, str | None]]:
    """Entries under out that its record does not name, with why when it is more than that
    (a folder that cannot be listed); a link is an entry (never followed). Walked with a
    stack: any depth."""
    extra: list[tuple[str, str | None]] = []
    folders = {"/".join(n.split("/")[:i]) for n in recorded for i in range(1, n.count("/") + 1)}
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(out / rel if rel else out) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            extra.append((rel, f"a folder that cannot be listed ({e.strerror})"))
            continue
        for e in entries:
            name = f"{rel}/{e.name}" if rel else e.name
            if e.is_dir(follow_symlinks=False):
                if name in folders:
                    stack.append(name)
                else:  # (its contents, if any, are not walked: one line for all of it)
                    extra.append((name, "a folder that holds no recorded file"))
            elif name not in recorded:
                extra.append((name, None))
    return sorted(extra)


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
    for i, lo, hi in tasks:
        f = files[i]
        try:
            fd = open_under(f.root, f.parts)
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
            crc, got = crc32_range(fd, lo, hi - lo)
            if got < hi - lo:
                wrong[i] = f"ends at byte {lo + got}, {f.size} recorded"
                continue
            crcs.setdefault(i, []).append((lo, hi - lo, crc))
        except OSError as e:
            wrong[i] = f"read failed ({e.strerror})"
        finally:
            os.close(fd)
    return crcs, wrong


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
        if i in wrong:
            result.differ.append(f"{shown(f.path)}: {wrong[i]}")
            continue
        crc, end = join_crcs(ranges.get(i, []))
        if end != f.size:
            raise RuntimeError(f"internal error: {f.path}: bytes from {end} on read by no rank")
        result.bytes += f.size  # read: as many as recorded
        if crc != f.crc:
            result.differ.append(f"{shown(f.path)}: CRC-32 {crc:08x}, {f.crc:08x} recorded")
