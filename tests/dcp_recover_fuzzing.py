"""The DCP recovery fuzzer: seeded damage to a real save dir of DCP saves (a full save and
partial saves of one timeline, written by DcpCheckpointer), each input recovered in-process
as `mpitailor recover` does. Every outcome must be one of

- "composite": the output equals torch's own reader's composite (format_utils.
  dcp_to_torch_save), entry by entry, each layer from its newest save;
- "skipped": the same, without the damaged save, which the recovery line names as skipped;
- "error": one MpitailorError line, nothing at the output path;

never a traceback, a hang, a wrong composite, or an input modified. A save that cannot be
read now (a FIFO, a dir or a link where a file is, a link for a save dir, EACCES, EIO) must
be an error, never a skip: a failure to read is not an absence.

Used by tests/test_dcp_recover_fuzz.py (a sample) and bench/dcp_recover_fuzz.py (at scale).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path

RECORD = "mpitailor_save.json"
JUNK = [None, True, -1, 2 ** 64, 1.5, "", "x", "../x", "/etc/passwd", "a\0b", "a/b", [],
        ["layers.0"], {}, {"a": 1}, "\u2028", "..", "layers.0"]
# damage the readers refuse with no OSError behind it, or an OSError: "cannot read now"
UNREADABLE = ("fifo", "dir_for_file", "link_for_file", "link_for_save", "eacces", "eio")
KINDS = ("rec_field", "rec_bytes", "rec_layers", "rec_files", "lineage", "meta_swap",
         "meta_flip", "meta_flip_forged", "data_flip", "data_flip_forged", "data_truncate",
         "data_swap", "remove", "stray_file", *UNREADABLE)


class Hang(Exception):
    pass


@dataclass
class Stats:
    inputs: int = 0
    outcomes: dict = field(default_factory=dict)      # outcome -> count
    by_kind: dict = field(default_factory=dict)       # kind -> {outcome: count}
    violations: list = field(default_factory=list)    # (seed, kind, detail, why)

    def add(self, kind: str, outcome: str) -> None:
        self.inputs += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        per = self.by_kind.setdefault(kind, {})
        per[outcome] = per.get(outcome, 0) + 1


def saves_of(run: Path) -> list[str]:
    return sorted((p.name for p in run.iterdir() if p.name.startswith("step-")),
                  key=lambda n: int(n.split("-")[1]))


def _rec(save: Path) -> dict:
    return json.loads((save / RECORD).read_text())


def _forge(save: Path, name: str) -> None:
    """The record made to agree with the file as it is now (a forger's, or a bug's)."""
    doc, data = _rec(save), (save / name).read_bytes()
    doc["files"][name] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (save / RECORD).write_text(json.dumps(doc))


def _flip(path: Path, rng: random.Random) -> int:
    data = bytearray(path.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return at


def mutate(run: Path, rng: random.Random, kind: str) -> tuple[str, str]:
    """Damage run in place; (the save damaged, what was done)."""
    names = saves_of(run)
    name = rng.choice(names)
    save = run / name
    data = sorted(p.name for p in save.iterdir() if p.name.endswith(".distcp"))
    files = [".metadata", RECORD, *data]
    if kind == "rec_field":
        doc = _rec(save)
        key = rng.choice([*doc, "format", "global_steps", "layers", "save_id"])
        doc[key] = rng.choice(JUNK)
        (save / RECORD).write_text(json.dumps(doc))
        return name, f"record {key} = {doc[key]!r:.40}"
    if kind == "rec_bytes":
        raw = bytearray((save / RECORD).read_bytes())
        at = rng.randrange(len(raw))
        how = rng.choice(("flip", "cut", "insert"))
        if how == "flip":
            raw[at] ^= 1 << rng.randrange(8)
        elif how == "cut":
            del raw[at:]
        else:
            raw[at:at] = bytes(rng.choice(b'{}[]",:0\\\x00 '.split()) or b"{")
        (save / RECORD).write_bytes(bytes(raw))
        return name, f"record {how} at {at}"
    if kind == "rec_layers":
        doc = _rec(save)
        layers = doc.get("layers") or []
        if layers and rng.random() < 0.5:
            layers.remove(rng.choice(layers))
        else:
            layers.append(rng.choice(["layers.0", "layers.1", "layers.2", "layers.3",
                                      "layers.9", "embed", "norm"]))
        doc["layers"] = sorted(set(layers)) or None
        (save / RECORD).write_text(json.dumps(doc))
        return name, f"record layers = {doc['layers']}"
    if kind == "rec_files":
        doc = _rec(save)
        f = rng.choice(sorted(doc["files"]))
        how = rng.choice(("drop", "add", "bytes", "crc"))
        if how == "drop":
            del doc["files"][f]
        elif how == "add":
            doc["files"][rng.choice(["zz.distcp", "../step-2/.metadata", "/etc/hostname",
                                     "a\0b", ".", "x/y"])] = {"bytes": 0, "crc32": "00000000"}
        elif how == "bytes":
            doc["files"][f]["bytes"] += rng.choice([-1, 1, 2 ** 40])
        else:
            doc["files"][f]["crc32"] = f"{rng.getrandbits(32):08x}"
        (save / RECORD).write_text(json.dumps(doc))
        return name, f"record files {how} {f}"
    if kind == "lineage":
        doc, other = _rec(save), _rec(run / rng.choice(names))
        key = rng.choice(["parent", "chain", "save_id"])
        doc[key] = rng.choice([doc["save_id"], other["save_id"], "f" * 32, None])
        (save / RECORD).write_text(json.dumps(doc))
        return name, f"lineage {key} = {doc[key]}"
    if kind == "meta_swap":
        other = run / rng.choice([n for n in names if n != name])
        shutil.copyfile(other / ".metadata", save / ".metadata")
        if rng.random() < 0.5:
            _forge(save, ".metadata")
        return name, f".metadata of {other.name}"
    if kind in ("meta_flip", "meta_flip_forged", "data_flip", "data_flip_forged"):
        f = ".metadata" if kind.startswith("meta") else rng.choice(data)
        at = _flip(save / f, rng)
        if kind.endswith("forged"):
            _forge(save, f)
        return name, f"{f} bit flip at {at}"
    if kind == "data_truncate":
        f = rng.choice(data)
        size = (save / f).stat().st_size
        os.truncate(save / f, rng.randrange(size))
        if rng.random() < 0.5:
            _forge(save, f)
        return name, f"{f} truncated"
    if kind == "data_swap":
        a, b = (run / n for n in rng.sample(names, 2))
        f = rng.choice(data)
        if (a / f).exists() and (b / f).exists():
            tmp = a / "swap.tmp"
            os.rename(a / f, tmp)
            os.rename(b / f, a / f)
            os.rename(tmp, b / f)
        return a.name, f"{f} swapped with {b.name}'s"
    if kind == "remove":
        f = rng.choice(files)
        (save / f).unlink()
        return name, f"{f} removed"
    if kind == "stray_file":
        (save / rng.choice(["__7_0.distcp", "notes.txt", ".tmp"])).write_bytes(b"junk")
        return name, "stray file"
    return _unreadable(run, save, rng, kind, files)


def _unreadable(run: Path, save: Path, rng: random.Random, kind: str,
                files: list[str]) -> tuple[str, str]:
    f = rng.choice(files)
    if kind == "link_for_save":
        away = run.parent / f"away-{save.name}"
        os.rename(save, away)
        os.symlink(away, save)
        return save.name, "save dir is a symlink"
    if kind in ("eacces", "eio"):  # injected() makes os.open fail there
        FAIL[str(save / f)] = errno.EACCES if kind == "eacces" else errno.EIO
        return save.name, f"{f} {kind} at open"
    away = run.parent / f"away-{f}"
    os.rename(save / f, away)
    if kind == "fifo":
        os.mkfifo(save / f)
    elif kind == "dir_for_file":
        (save / f).mkdir()
    else:
        os.symlink(away, save / f)
    return save.name, f"{f} replaced ({kind})"


FAIL: dict[str, int] = {}  # path -> the errno os.open fails with there (the next run)


@contextlib.contextmanager
def injected():
    """os.open fails (EACCES or EIO) for the files FAIL names, for one recovery."""
    fail = dict(FAIL)
    FAIL.clear()
    real = os.open

    def fake(path, *a, **kw):
        code = fail.get(os.fspath(path))
        if code is not None:
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real(path, *a, **kw)
    os.open = fake
    try:
        yield
    finally:
        os.open = real


def tree_hash(root: Path, outputs=("out", "done")) -> str:
    """Every entry under root but the outputs: its path, type, mode and (a regular file's)
    bytes; a link's target. Opens no FIFO. (A staging dir left beside the output counts.)"""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in outputs]
            filenames = [f for f in filenames if f not in outputs]
        dirnames.sort()
        for n in sorted([*dirnames, *filenames]):
            p = Path(dirpath) / n
            st = os.lstat(p)
            h.update(f"{p.relative_to(root)}\0{st.st_mode}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode())
            elif stat.S_ISREG(st.st_mode):
                h.update(p.read_bytes())
    return h.hexdigest()


def recover(run: Path, out: Path, seconds: int = 60) -> tuple[str, str]:
    """(outcome, line): "ok" and the recovery's line, or "error" and the error's text; a
    traceback or a hang raises."""
    from mpitailor.cluster.comm import Comm
    from mpitailor.errors import MpitailorError
    from mpitailor.jobs.dcp_merge import run_dcp_merge
    from mpitailor.jobs.dcp_recovery import recover_dcp_chain, recovered_dcp

    def alarm(*_):
        raise Hang(f"no outcome in {seconds} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        with injected():
            recipe, chain, checked = recover_dcp_chain(Comm(None), run, out)
            run_dcp_merge(Comm(None), recipe, checked=checked)
        return "ok", recovered_dcp(recipe, chain)
    except MpitailorError as e:
        return "error", str(e)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def skipped_names(line: str) -> set[str]:
    tail = line.partition("; skipped ")[2]
    return set(re.findall(r"(?:^|, )(step-\d+) \(", tail))


def output_bytes(out: Path) -> bytes:
    return b"".join(n.encode() + (out / n).read_bytes()
                    for n in sorted(os.listdir(out)) if n != "mpitailor_manifest.json")
