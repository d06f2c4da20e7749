"""Where the files that ship with mpitailor are: the example recipes and the Slurm scripts.

In a wheel they are package data (`mpitailor/recipes/`, `mpitailor/slurm/`); in a checkout
they stay at the repository's top level, where the tests and `make` use them.
"""
from __future__ import annotations

from pathlib import Path

from mpitailor.errors import MpitailorError

KINDS = ("recipes", "slurm")


def shipped_dir(kind: str) -> Path:
    package = Path(__file__).resolve().parents[1]  # mpitailor/ (this file is in mpitailor/cli/)
    for folder in (package / kind, package.parent / kind):
        if folder.is_dir():
            return folder
    raise MpitailorError(f"mpitailor's {kind}/ is missing from this installation "
                         f"({package}); reinstall mpitailor")
