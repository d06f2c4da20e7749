"""`python -m mpitailor clean DIR`: remove what killed runs left in DIR (staging dirs, locks,
the dirs a killed `prune` had renamed away) and in its subdirectories one level down (a save dir's HF `checkpoint-N/` stages its partial
saves there). Never follows a symbolic link; never touches what a live run holds.

Serial: no MPI.
"""
from __future__ import annotations

import os
from pathlib import Path

from mpitailor.errors import UserError
from mpitailor.publish.leftovers import SUFFIXES, reclaim


def clean(folder: Path) -> list[str]:
    """What was removed (or put back), one phrase each."""
    if os.path.islink(folder) or not folder.is_dir():
        what = "a symbolic link" if os.path.islink(folder) else \
            "not a directory" if os.path.lexists(folder) else "does not exist"
        raise UserError(f"{folder}: {what}; give the directory that holds the outputs "
                        f"(mpitailor clean DIR)")
    done = reclaim(folder)
    for e in sorted(os.scandir(folder), key=lambda e: e.name):
        if e.is_dir(follow_symlinks=False) and not e.name.endswith(SUFFIXES):
            done += reclaim(Path(e.path))
    return done
