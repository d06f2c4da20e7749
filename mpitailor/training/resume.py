"""Resume from layer-wise saves inside the training job: recover, then load as usual.

Collective over the training ranks (torch.distributed): they check the saves and write the
composite checkpoint together, as `mpiexec python -m mpitailor recover` would, into a hidden
dir under the save dir (`.mpitailor-resume/`), where later recoveries do not mistake it for
a save. The composite is written for the world size of the job that resumes (a job requeued
on another number of GPUs resumes as it is); a composite of the same newest save at the same
world size is reused. The work is the merge side's (jobs/in_job_resume.py, through
mpitailor/facade.py); this module runs it on the training ranks and says, on rank 0, what
the job resumes from.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from mpitailor.facade import Comm, ResumePoint, recover_in_job, reshard_in_job
from mpitailor.training.distcomm import training_comm
from mpitailor.training.notice import make_visible

log = logging.getLogger(__name__)


def recover_for_resume(save_dir: str | os.PathLike, until_step: int | None = None,
                       output_root: str | os.PathLike | None = None) -> Path | None:
    """Collective: the checkpoint to resume from, for this job's world size: the newest full
    save itself when no partial save follows it and the world size is the same, else a
    composite of its timeline (saves after `until_step` left out), resharded when the job
    came back at another size. None when no save ever finished (a first start, or a job
    killed during its first save): training starts from scratch; what such a save left
    behind is removed, with one warning."""
    comm = training_comm()
    make_visible()  # what it resumes from, and the saves it skips, reach the job's log
    return _said(comm, recover_in_job(comm, save_dir, until_step, output_root))


def reshard_for_resume(checkpoint: str | os.PathLike, output_root: str | os.PathLike) -> Path:
    """Collective: a checkpoint (a full save, or a composite) to resume from as it is when it
    was written for this job's world size; else resharded for it into output_root (reused
    when already there)."""
    comm = training_comm()
    make_visible()
    return _said(comm, reshard_in_job(comm, checkpoint, output_root))


def _said(comm: Comm, point: ResumePoint) -> Path | None:
    """The point's path, its line said on rank 0."""
    if point.line is not None and comm.rank == 0:
        log.log(point.level, "%s", point.line)
    return point.path
