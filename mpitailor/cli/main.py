"""Command line: `python -m mpitailor RECIPE.yml` merges; subcommands do the rest.

Exit codes: 0 ok, 1 runtime failure, 2 bad input, 141 stdout's reader left (`| head`).
An error is one line: once, from rank 0, when every rank failed alike; else one per rank,
prefixed `[rank r]` (cli/log.py report_error). Tracebacks only with -v.
"""
from __future__ import annotations

import io
import logging
import os
import sys

from mpitailor.cli.parser import build_parser, check_path_lengths, with_subcommand
from mpitailor.errors import MpitailorError

log = logging.getLogger(__name__)

SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for `cat big | head -1`'s cat


def quiet_broken_pipe() -> int:
    """stdout's reader left (`... | head -1`): end without a traceback, as CPython's docs
    advise (stdout onto /dev/null, so that the interpreter's last flush fails no more).
    The status is that of a Unix tool ended by SIGPIPE: a pipeline with `pipefail` treats
    it as any other, and it is neither success (the output was cut short) nor 1 (a
    failure, or `diff`'s "different"). Only rank 0 writes stdout, after the collectives:
    the other ranks end as usual."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_EXIT


def main(argv: list[str] | None = None) -> int:
    from mpitailor.publish import interrupt
    interrupt.install()  # before MPI starts threads: they must all block SIGINT/SIGTERM
    argv = list(sys.argv[1:] if argv is None else argv)
    # A path that is not UTF-8 (display.py) must never end a summary line in a traceback.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    argv = with_subcommand(argv)
    args = build_parser().parse_args(argv)
    verbosity = -1 if args.quiet else args.verbose
    from mpitailor.publish.leftovers import set_holder
    set_holder(f"mpitailor {args.command}")  # named in the locks it takes
    comm = None
    try:
        if args.uses_mpi:
            from mpitailor.cli.log import setup_logging
            from mpitailor.cluster.comm import Comm

            comm = Comm.world()
            interrupt.set_rank(comm.rank, comm.size)
            setup_logging(comm.rank, verbosity)
            args.comm = comm
        else:
            from mpitailor.cli.log import setup_logging
            setup_logging(0, verbosity)
        check_path_lengths(args)
        if getattr(args, "safe_globals", None):
            from mpitailor.formats.torch import trust
            trust([n.strip() for n in args.safe_globals.split(",") if n.strip()])
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return quiet_broken_pipe()
    except MpitailorError as e:
        from mpitailor.cli.log import report_error
        from mpitailor.cluster.comm import CommFailed
        if isinstance(e, CommFailed):  # this rank's own line; the others may be dead
            if verbosity > 0:
                log.debug("the traceback of the error below", exc_info=True)
            from mpitailor.cli.log import write_line
            prefix = f"[rank {comm.rank}] " if comm is not None and comm.size > 1 else ""
            write_line(f"{prefix}mpitailor: error: {e}")
        if isinstance(e, CommFailed) or not report_error(e, comm, verbosity):
            # MPI_Finalize would wait forever for a dead peer, or one busy elsewhere
            sys.stdout.flush()
            os._exit(e.exit_code)
        return e.exit_code
    except Exception:
        # Outside a guarded step peers may wait forever on a collective: kill them all.
        log.critical("unexpected failure", exc_info=True)
        if comm is not None:
            comm.abort(1)
        return 1
