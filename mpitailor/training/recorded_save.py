"""The files of a save that others write, made durable: a full save's files recorded as
DeepSpeed writes them (below), and a partial save's loop files fsynced (sync_loop_files).

A full save's files recorded as DeepSpeed writes them: size and CRC-32 of each, the file
fsynced, for the save record (`mpitailor_save.json`) that `verify` and `recover --verify`
check them against.

DeepSpeed writes every file of a save through its engine's checkpoint engine
(`checkpoint_engine.save(state_dict, path)`); for the length of one full save the engine's
is wrapped so that each file, once written, is read back and fsynced on the rank that wrote
it (formats/io: synced_record). It is read back, not taken as it is written: torch.save
writes a path itself, and given a stream instead it lays the zip out differently, and
DeepSpeed's files must stay the bytes DeepSpeed writes. The read comes from the page cache
the file was just written to (bench/save_bench.py measures what it costs a full save).
Only DeepSpeed's default engine (TorchCheckpointEngine: torch.save by path, done when save
returns) is wrapped; another (a decoupled or Nebula engine, which persist in the background)
is left as it is: its files are not recorded, and `verify` says so.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mpitailor.formats.io import fsync_dir, fsync_file, synced_record
from mpitailor.formats.zero import SAVE_RECORD
from mpitailor.training.distcomm import training_comm
from mpitailor.training.partial_save import save_leader


class _Recording:
    """The engine's checkpoint engine, with every file it saves recorded."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.files: dict[str, dict | str] = {}  # absolute path -> {"bytes", "crc32"} or
        # why it could not be read back (said on every rank by gathered_records)

    def save(self, state_dict, path: str) -> None:
        self.inner.save(state_dict, path)
        try:
            self.files[os.path.abspath(path)] = synced_record(path)
        except OSError as e:
            self.files[os.path.abspath(path)] = e.strerror or str(e)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@contextmanager
def recording(engine) -> Iterator[dict[str, dict] | None]:
    """While the block runs, every file the engine's checkpoint engine saves is recorded
    (and fsynced) into the dict yielded; None for an engine other than DeepSpeed's default."""
    inner = getattr(engine, "checkpoint_engine", None)
    if type(inner).__name__ != "TorchCheckpointEngine":
        yield None
        return
    rec = _Recording(inner)
    engine.checkpoint_engine = rec
    try:
        yield rec.files
    finally:
        engine.checkpoint_engine = inner


def gathered_records(engine, files: dict[str, dict | str] | None,
                     tag_dir: Path) -> dict[str, dict] | None:
    """Collective: on rank 0, the records of every rank's files in tag_dir, by name in it
    (None where any rank recorded nothing); None on the others. With node-local storage
    (each node its own disk) rank 0's record lists its own node's files: they are the ones
    beside it. A file some rank could not read back or fsync fails the save on every rank
    (OSError naming it): a record must not promise what is not on disk."""
    comm = training_comm()
    root = os.path.abspath(tag_dir)
    mine = None if files is None else {
        os.path.relpath(p, root): r for p, r in files.items() if os.path.dirname(p) == root}
    parts = comm.allgather((socket.gethostname(), mine))
    failed = [(name, why) for _, m in parts for name, why in (m or {}).items()
              if isinstance(why, str)]
    if failed:
        name, why = failed[0]
        raise OSError(f"full save {tag_dir}: {name} could not be read back and fsynced "
                      f"({why}); the save is not recorded")
    if any(m is None for _, m in parts):
        return None
    records, why = None, None
    if comm.rank == 0:
        use = getattr(engine, "use_node_local_storage", None)
        node_local = bool(use()) if callable(use) else False
        records = {name: r for host, m in parts if not node_local or host == parts[0][0]
                   for name, r in m.items()}
        try:
            records = {**_others(Path(root), records), **records}
        except OSError as e:
            why = f"{e.filename}: {e.strerror or e}"
    why = comm.bcast(why, 0)  # every rank fails alike, or none
    if why is not None:
        raise OSError(f"full save {tag_dir}: {why}; could not be read back and fsynced, the "
                      f"save is not recorded")
    return records


def _others(root: Path, recorded: dict) -> dict[str, dict]:
    """Rank 0: the files in the tag dir no rank's checkpoint engine saved (DeepSpeed copies
    NVMe offload's `offloaded_tensors/` in with copytree), read back and fsynced here."""
    out = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if name not in recorded and name != SAVE_RECORD and path.is_file() \
                and not path.is_symlink():
            out[name] = synced_record(path)
    return out


def sync_loop_files(engine, out: Path, mine: str) -> None:
    """A partial save's loop files beside its tag dir (the trainer's state, config, rng
    states, written in place by the framework's own functions), made durable before
    `latest` names the save: each rank fsyncs its own file `mine` (its rng state), a save
    leader every other regular file at the top of out, and out itself. Without it a crash
    of the machine could leave a `latest` naming a checkpoint whose trainer state is
    empty."""
    if (out / mine).is_file():
        fsync_file(out / mine)
    if save_leader(engine):
        for path in sorted(out.iterdir()):
            if path.name != mine and path.is_file() and not path.is_symlink():
                fsync_file(path)
        fsync_dir(out)
