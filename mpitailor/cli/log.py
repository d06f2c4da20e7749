"""Logging setup: one owner, a rank prefix, INFO from rank 0 only."""
from __future__ import annotations

import logging
import sys


def setup_logging(rank: int, size: int, verbosity: int = 0) -> None:
    """verbosity: -1 quiet (warnings), 0 info on rank 0, 1 debug on rank 0, 2 debug on all."""
    level = {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)
    if rank != 0 and verbosity < 2:
        level = max(level, logging.WARNING)
    prefix = f"[rank {rank}/{size}] " if size > 1 else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("mpitailor")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
