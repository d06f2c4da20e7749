"""What the training side uses of the merge side: the one door from `mpitailor.training` to
the layers below it (`tests/test_layering.py` lets training import only it, the public API,
`formats/` and the base modules).

A sibling of `api.py`, not a part of it: `api.py` is the public Python API (`merge`,
`recover`), a promise to users, and these names are the training side's own needs (a
classifier, a publication primitive, the resume's orchestration), free to change with it.
Each name says what training needs, not where it lives:

- `Comm`: mpitailor's guarded collectives; training wraps its torch.distributed group in one
  (training/distcomm.py), and every call here that takes a `comm` runs on it.
- `LayerClassifier`, `classify`, `layer_index`, `sort_keys`: the layer key of a parameter
  name (with a run's own patterns, or the built-in rules), a key's layer number, model order.
- `parse_size`: "2GB", "512MiB" as `--max-shard-size` reads them (max_host_bytes).
- `publish_file`: a single file published whole or not at all (a full save's record).
- `publishing`: a partial save's dir staged, locked and published by rename (the one way
  mpitailor publishes a dir).
- `discard_dir`: what a killed save left at a path, renamed aside and removed.
- `keep_last_saves`: retention after a save (`prune --keep-last`).
- `recover_in_job`, `reshard_in_job` (a `ResumePoint` each), `RESUME_DIR`: the in-job
  resume, planned and written on the training ranks (jobs/in_job_resume.py).

Collective where a function takes a `comm`: call it on every rank of that comm.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.jobs.in_job_resume import ResumePoint, recover_in_job, reshard_in_job
from mpitailor.jobs.prune import RESUME_DIR, prune
from mpitailor.planning.hf_layout import parse_size
from mpitailor.planning.layers import LayerClassifier, classify, layer_index, sort_keys
from mpitailor.publish.leftovers import DISCARD, discard, path_of
from mpitailor.publish.staging import Staging, holding, write_replacing

__all__ = ["RESUME_DIR", "Comm", "LayerClassifier", "ResumePoint", "classify", "discard_dir",
           "keep_last_saves", "layer_index", "parse_size", "publish_file", "publishing",
           "recover_in_job", "reshard_in_job", "sort_keys"]


def publish_file(path: Path, data: bytes) -> None:
    """The whole file or nothing: written beside path, fsynced, renamed over it."""
    write_replacing(path, data)


@contextlib.contextmanager
def publishing(output: Path, leader: bool) -> Iterator[Staging]:
    """A dir to publish at output, replacing what is there (a partial save of a step that
    training reached again after a resume): on the leader, `acquire(None)` takes the lock and
    makes the staging dir (`.dir`), `commit(manifest)` writes the manifest last and publishes
    by rename. Anything raised inside abandons the staging dir; the lock is released at the
    end either way (publish/staging.py's `holding`)."""
    with holding(Staging(output, replace=True), leader) as staging:
        yield staging


def discard_dir(path: Path) -> None:
    """Remove what is at path (a killed save's files): renamed aside first, so that a removal
    killed half-way leaves a `.NAME.mpitailor-discard` that `mpitailor clean` takes."""
    discard(path, path_of(path, DISCARD))


def keep_last_saves(comm: Comm, save_dir: str | os.PathLike, keep_last: int) -> tuple[str, ...]:
    """Collective: `prune --keep-last K` of save_dir, without its CRC pass (the saves were
    just written, and are checked by size and structure); one line per path (removed, kept,
    and why). Raises what prune raises (MpitailorError)."""
    return prune(comm, save_dir, keep_last, crc=False).lines
