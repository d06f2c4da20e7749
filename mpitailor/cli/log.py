"""Logging setup: one owner, a rank prefix, INFO from rank 0 only; and the error line."""
from __future__ import annotations

import logging
import os
import sys

from mpitailor.display import LineFormatter, escaped


def setup_logging(rank: int, verbosity: int = 0) -> None:
    """verbosity: -1 quiet (warnings), 0 info on rank 0, 1 debug on rank 0, 2 debug on all."""
    level = {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)
    if rank != 0 and verbosity < 2:
        level = max(level, logging.WARNING)
    # Rank 0 speaks for the job, as its error line does; another rank's lines say whose.
    prefix = f"[rank {rank}] " if rank != 0 else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter(prefix))
    root = logging.getLogger("mpitailor")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


# How long a failed rank waits for the others to fail too before it speaks for itself alone.
AGREE_S = 5.0


def report_error(error: Exception, comm, verbosity: int) -> bool:
    """Write `mpitailor: error: ...` once for the job: by rank 0 alone, unprefixed, when every
    rank failed with the same message (an error of a guarded collective, which every rank
    raises alike, or the same bad input found by every rank); else by each rank, with its
    `[rank r]` prefix. Returns False when this rank failed alone (the others did not come
    within AGREE_S: they are busy or stuck elsewhere), after writing its line: the caller
    must end the process at once, as MPI_Finalize would wait for them forever."""
    size = comm.size if comm is not None else 1
    text = f"mpitailor: error: {escaped(str(error))}"
    if size == 1 or getattr(error, "raised_on", None) == size:
        same, alone = True, False  # known without asking: no wait on a cleanup elsewhere
    else:
        same = comm.same_everywhere(f"{error.exit_code} {text}", AGREE_S)
        alone = same is None
    if verbosity > 0:
        logging.getLogger(__name__).debug("the traceback of the error below", exc_info=True)
    if same and comm is not None and comm.rank != 0:
        return True  # rank 0 says it for every rank
    prefix = "" if same else f"[rank {comm.rank}] "
    write_line(f"{prefix}{text}")
    return not alone


def write_line(line: str) -> None:
    """One write of one line to stderr (lines of several ranks interleave otherwise), with
    anything that would break it or reach the terminal raw escaped (display.py)."""
    sys.stderr.flush()
    os.write(2, (escaped(line) + "\n").encode("utf-8", "backslashreplace"))
