"""The two kinds of failure mpitailor reports, and their exit codes.

A `UserError` is something the user can fix (a recipe key, a missing file, checkpoints that
disagree): one line, exit 2. A `MergeFailed` is a runtime failure (I/O, a rank died): exit 1.
"""
from __future__ import annotations


class MpitailorError(Exception):
    exit_code = 1


class UserError(MpitailorError):
    """Bad input: the message names the file or key and what to do."""
    exit_code = 2


class CheckpointError(UserError):
    """A checkpoint that cannot be read as a DeepSpeed ZeRO-3 checkpoint."""


class NothingToRecover(MpitailorError):
    """`recover` found no finished save at all: a first start, not a failure (exit 3)."""
    exit_code = 3


class MergeFailed(MpitailorError):
    """A runtime failure during a merge; nothing was published."""
