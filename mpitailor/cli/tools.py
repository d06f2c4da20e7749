"""The commands that read, clean or prune: inspect, diff, verify, stats plot, clean, prune,
paths, slurm-prologue. Options in from argparse, one report out (rank 0). Jobs are imported when
a command runs, so that `--help` and argument errors cost no more than the parser."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mpitailor.errors import MpitailorError


def cmd_inspect(args: argparse.Namespace) -> int:
    from mpitailor.cli.reports import format_dcp_saves, format_dcp_table, format_table
    from mpitailor.formats.dcp import (
        check_data_files,
        is_dcp_dir,
        read_dcp_save_record,
        read_metadata,
    )
    from mpitailor.formats.zero import open_all_shards, read_meta
    from mpitailor.jobs.inspect import composite_manifest, newer_saves, report

    if is_dcp_dir(Path(args.checkpoint)):  # a PyTorch Distributed Checkpoint (issue 43)
        from mpitailor.jobs.inspect_dcp import dcp_report, saved_as
        meta = read_metadata(Path(args.checkpoint))
        check_data_files(Path(args.checkpoint), meta)  # as a ZeRO inspect opens every shard
        rep = dcp_report(Path(args.checkpoint), meta)
        rep["save"] = saved_as(read_dcp_save_record(Path(args.checkpoint)))
        print(json.dumps(rep, indent=2) if args.json else format_dcp_table(rep))
        return 0
    from mpitailor.jobs.dcp_recovery import holds_dcp_saves
    if holds_dcp_saves(Path(args.checkpoint)):  # a dir of them: the timeline
        from mpitailor.jobs.inspect_dcp import saves_report
        rep = saves_report(Path(args.checkpoint).resolve())
        print(json.dumps(rep, indent=2) if args.json else format_dcp_saves(rep))
        return 0

    meta = read_meta(args.checkpoint)
    with open_all_shards(meta):  # every rank's files of this one save, or a one-line error
        pass
    rep = report(meta, composite_manifest(meta))
    rep["newer_saves"] = newer_saves(args.checkpoint, meta)
    print(json.dumps(rep, indent=2) if args.json else format_table(rep))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from mpitailor.cli.reports import format_diff
    from mpitailor.jobs.diff import diff
    rep = diff(args.comm, args.a, args.b)
    if args.comm.rank == 0:
        print(json.dumps(rep, indent=2) if args.json else format_diff(rep), flush=True)
    return 0 if rep["identical"] else 1


def cmd_verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mpitailor.display import shown
    from mpitailor.errors import UserError
    from mpitailor.jobs.verify import run_verify
    if not args.path:
        raise UserError("verify: give a PATH (an output, a partial save or a dir of them)")
    rep = run_verify(args.comm, Path(args.path).resolve())
    if args.comm.rank == 0:
        for line in rep.differ:
            print(f"mpitailor: differs: {line}")
        for line in rep.not_verified:
            print(f"mpitailor: not verified: {line}")
        gb = rep.bytes / 1e9
        verdict = f"{len(rep.differ)} difference(s) (listed above)" if rep.differ \
            else "every file as recorded"
        if rep.not_verified:
            verdict += f"; {len(rep.not_verified)} not verified (no record covers them)"
        print(f"mpitailor: verified {rep.files} file(s), {gb:.3f} GB, of "
              f"{len(rep.outputs)} output(s) under {shown(args.path)} with "
              f"{args.comm.size} rank(s) in {rep.seconds:.2f} s "
              f"({gb / max(rep.seconds, 1e-9):.2f} GB/s): {verdict}", flush=True)
    return 1 if rep.differ else 0


def cmd_stats_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mpitailor.training.plot import plot_stats
    plot_stats(Path(args.stats_file), Path(args.output))
    print(f"mpitailor: wrote {args.output}")
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mpitailor.cli.log import write_line
    from mpitailor.display import shown
    from mpitailor.jobs.clean import clean
    folder = Path(args.directory)
    result = clean(folder)
    for line in result.done:
        print(f"mpitailor: {line}", flush=True)
    for line in result.failed:
        write_line(f"mpitailor: not cleaned: {line}")
    if result.failed:
        raise MpitailorError(f"{len(result.failed)} path(s) under {shown(folder)} could not "
                             f"be looked at or removed (listed above); fix their permissions "
                             f"or mount, then run `clean` again")
    if not result.done:
        print(f"mpitailor: nothing to clean in {shown(folder)}")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    from mpitailor.jobs.prune import prune
    rep = prune(args.comm, args.save_dir, args.keep_last, args.composites, args.dry_run)
    if args.comm.rank == 0:
        for line in rep.lines:
            print(f"mpitailor: {line}")
        gone = rep.plan.removals
        saves = sum(v.kind == "save" for v in gone)
        print(f"mpitailor: {'would remove' if rep.dry_run else 'removed'} {saves} save(s), "
              f"{sum(v.kind == 'composite' for v in gone)} composite(s) and "
              f"{sum(v.kind == 'tombstone' for v in gone)} tombstone(s); the newest save is "
              f"{rep.plan.newest}", flush=True)
    return 0



def cmd_paths(args: argparse.Namespace) -> int:
    from mpitailor.cli.shipped import KINDS, shipped_dir
    for kind in KINDS:
        print(f"{kind:<8} {shipped_dir(kind)}")
    return 0


def cmd_slurm_prologue(args: argparse.Namespace) -> int:
    """Run the shipped resume prologue (bash) with the given arguments; its exit code."""
    from mpitailor.cli.shipped import shipped_dir
    script = shipped_dir("slurm") / "resume-prologue.sh"
    env = dict(os.environ)
    env.setdefault("MPITAILOR_PYTHON", sys.executable)  # this installation's python
    sys.stdout.flush()
    from mpitailor.publish import interrupt
    interrupt.restore()
    os.execvpe("bash", ["bash", str(script), *args.prologue_args], env)
    return 1  # not reached
