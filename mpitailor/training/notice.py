"""The training side's few lines a user must see (where a resume came from, a start from
scratch) reach stderr even where the training script configured no logging.

A library leaves handlers to the application, and the CLI sets up its own (cli/log.py). But
a training script rarely configures Python's logging, and then INFO lines vanish: as
DeepSpeed and transformers do for their loggers, the training side gives the `mpitailor`
logger one stderr handler at INFO when no handler exists anywhere up its hierarchy. A script
that configures logging (any handler on the root logger) is left as it is.
"""
from __future__ import annotations

import logging
import sys

from mpitailor.display import LineFormatter

_TOP = "mpitailor"


def make_visible() -> None:
    """Call just before logging what a user must see (not at import: a script may set up its
    logging after importing mpitailor, and would then get every line twice)."""
    top = logging.getLogger(_TOP)
    if top.hasHandlers():
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter())  # `mpitailor: ...`, `mpitailor: warning: ...`
    top.addHandler(handler)
    if top.level == logging.NOTSET:
        top.setLevel(logging.INFO)
