"""What mpitailor reports, and its exit codes.

A `UserError` is something the user can fix (a recipe key, a missing file, checkpoints that
disagree): one line, exit 2; a `CheckpointError` is the kind about a checkpoint's files. A
`MergeFailed` is a runtime failure (I/O, a rank died): exit 1. `NothingToRecover` is no
failure: a save dir without a finished save (a first start), exit 3.
"""
from __future__ import annotations


class MpitailorError(Exception):
    exit_code = 1


class UserError(MpitailorError):
    """Bad input: the message names the file or key and what to do."""
    exit_code = 2


class CheckpointError(UserError):
    """A checkpoint whose files cannot be read as what they claim to be (a ZeRO save of any
    stage, a partial save, a safetensors or torch file): the message names the file."""


class NothingToRecover(MpitailorError):
    """`recover` found no finished save at all: a first start, not a failure (exit 3)."""
    exit_code = 3


class MergeFailed(MpitailorError):
    """A runtime failure during a merge; nothing was published."""
