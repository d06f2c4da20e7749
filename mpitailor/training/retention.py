"""The training side's retention: after each published save, `prune --keep-last K` of the
save dir (jobs/prune.py, through the facade), for the DeepSpeed and the DCP checkpointers
alike. Without prune's CRC pass: the saves were just written, read back and checked by
size and structure."""
from __future__ import annotations

import logging
import os

from mpitailor.errors import MpitailorError, UserError
from mpitailor.facade import keep_last_saves
from mpitailor.training.distcomm import training_comm

log = logging.getLogger(__name__)


def check_keep_last(keep_last: int | None) -> int | None:
    """keep_last as given, or UserError (every rank, before any collective)."""
    if keep_last is not None and (isinstance(keep_last, bool) or
                                  not isinstance(keep_last, int) or keep_last < 0):
        raise UserError(f"keep_last={keep_last!r}: give a count >= 0 (the newest saves kept "
                        f"whatever they hold), or None to keep every save")
    return keep_last


def retain(save_dir: str | os.PathLike, keep_last: int) -> None:
    """Collective: prune save_dir keeping the keep_last newest saves. What cannot be
    deleted, or a save dir prune refuses now, is said, not raised: retention must not stop
    training (the next save's retention tries again)."""
    comm = training_comm()
    try:
        lines = keep_last_saves(comm, save_dir, keep_last)
    except MpitailorError as e:
        if comm.rank == 0:
            log.warning("retention (keep_last=%d): nothing more pruned: %s", keep_last, e)
        return
    if comm.rank == 0:
        for line in lines:
            if line.startswith("removed"):
                log.info("retention (keep_last=%d): %s", keep_last, line)
