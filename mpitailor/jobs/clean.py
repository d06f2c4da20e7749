"""`python -m mpitailor clean DIR`: remove what killed runs left in DIR (staging dirs, locks,
the dirs a killed `prune` had renamed away) and in its subdirectories one level down (a save dir's HF `checkpoint-N/` stages its partial
saves there). Never follows a symbolic link; never touches what a live run holds.

Serial: no MPI.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mpitailor.display import shown
from mpitailor.errors import UserError
from mpitailor.publish.leftovers import SUFFIXES, reclaim


@dataclass(frozen=True, slots=True)
class Cleaned:
    """What was removed (or put back), and what could not be looked at or removed: one
    phrase per path each."""

    done: list[str]
    failed: list[str]


def not_a_dir(path: Path) -> str | None:
    """Why path is no directory to work in (a link is never followed), or None: it is one."""
    if os.path.islink(path):
        return "a symbolic link"
    if not path.is_dir():
        return "not a directory" if os.path.lexists(path) else "does not exist"
    return None


def clean(folder: Path) -> Cleaned:
    if (what := not_a_dir(folder)) is not None:
        raise UserError(f"{shown(folder)}: {what}; give the directory that holds the outputs "
                        f"(mpitailor clean DIR)")
    failed: list[str] = []
    done = reclaim(folder, failed=failed)
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        entries = []  # reclaim said it cannot list the folder
    for e in entries:
        try:
            sub = e.is_dir(follow_symlinks=False)
        except OSError:
            sub = False
        if sub and not e.name.endswith(SUFFIXES):
            done += reclaim(Path(e.path), failed=failed)
    return Cleaned(done, failed)
