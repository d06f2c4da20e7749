"""The commands that write checkpoints: merge, recover, export. Options in from argparse,
the jobs run, one line out (rank 0). Jobs are imported when a command runs, so that
`--help` and argument errors cost no more than the parser."""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.display import escaped, shown
from mpitailor.errors import UserError


def cmd_merge(args: argparse.Namespace) -> int:
    from mpitailor.planning.recipe import load_recipe
    comm: Comm = args.comm
    recipe = comm.root_step(load_recipe, args.recipe, args.output, args.world_size)
    if comm.root_step(_is_dcp, recipe):
        return _merge_dcp(comm, recipe, args)
    from mpitailor.jobs.merge import plan_recipe  # (the ZeRO merge's: a DCP one needs none)
    _refuse_link(args)
    return run_planned(comm, plan_recipe(comm, recipe), args)


def _refuse_link(args: argparse.Namespace) -> None:
    if getattr(args, "link", False):
        raise UserError("--link: hard links stand in for copies of PyTorch Distributed "
                        "Checkpoint data files only; a DeepSpeed merge rewrites every rank's "
                        "files: leave --link out")


def _is_dcp(recipe) -> bool:
    from mpitailor.formats.dcp import is_dcp_dir
    return bool(recipe.sources) and is_dcp_dir(recipe.sources[0][1])


def _merge_dcp(comm: Comm, recipe, args: argparse.Namespace) -> int:
    """A merge of PyTorch Distributed Checkpoints ([DCP](docs/dcp.md#merge)): copy or link
    mode, at the sources' own world size."""
    _refuse_for_dcp(recipe.origin, args)
    return _run_dcp(comm, recipe, args, "merged")


def _run_dcp(comm: Comm, recipe, args: argparse.Namespace, verb: str, checked=None,
             more: Callable[[], str] | None = None) -> int:
    """Collective: a DCP merge as the command line says: planned (every check a merge makes
    before it writes), then the plan printed (--dry-run, nothing written), or merged,
    summed up, its --stats written and its output checked (--verify)."""
    import time

    from mpitailor.jobs.dcp_merge import (
        check_output_free,
        plan_dcp_merge,
        run_dcp_merge,
    )
    from mpitailor.jobs.readable import refuse_inside_sources
    from mpitailor.publish.staging import check_writable_file
    t0 = time.perf_counter()
    stats = Path(os.path.abspath(args.stats)) if args.stats else None  # links unresolved
    if stats is not None:  # written at the end: a bad path must fail before anything is merged
        comm.root_step(check_writable_file, stats, "--stats")
        comm.root_step(refuse_inside_sources, stats, recipe.sources, "--stats")
    planned = plan_dcp_merge(comm, recipe, args.link, checked)
    if args.dry_run:
        comm.root_step(check_output_free, planned)
        if comm.rank == 0:
            print(_dcp_plan_text(planned), flush=True)
        return 0
    result = run_dcp_merge(comm, recipe, args.link, checked, planned)
    _said_dcp(comm, args, verb, result, time.perf_counter() - t0, more)
    if stats is not None:
        comm.root_step(write_stats, stats, result)
    if args.verify:
        from mpitailor.jobs.dcp_verify import verify_dcp_merge
        _said_verified(comm, args, verify_dcp_merge(comm, planned, checked))
    return 0


def _dcp_plan_text(planned) -> str:
    from mpitailor.planning.dcp_report import format_dcp_plan
    recipe = planned.recipe
    return format_dcp_plan(planned.plan, recipe.output, dict(recipe.sources), planned.saves,
                           planned.linked, planned.shares)


def _said_verified(comm: Comm, args: argparse.Namespace, verified) -> None:
    if comm.rank == 0 and not args.quiet:
        print(f"mpitailor: verified: {verified.files} files as the manifest records them "
              f"(size, CRC-32) and {verified.items} items equal to the source items the plan "
              f"names ({verified.bytes / 1e9:.3f} GB read back)", flush=True)


def cmd_recover(args: argparse.Namespace) -> int:
    from mpitailor.jobs.merge import plan_recipe
    from mpitailor.jobs.recovery import recover_chain, recovered

    comm = args.comm
    save_dir = Path(args.save_dir).resolve()
    out = Path(args.output).resolve() if args.output else None
    if out is None and not (args.emit_recipe or args.dry_run):
        raise UserError("recover: give -o OUTPUT (or --emit-recipe to only print the recipe)")
    patterns = None
    if args.layer_pattern:
        patterns = {}
        for item in args.layer_pattern:
            regex, eq, key = item.rpartition("=")
            if not eq or not regex:
                raise UserError(f"--layer-pattern {item!r}: write REGEX=KEY, e.g. "
                                f"'model\\.decoder\\.layers\\.(\\d+)\\..*=layers.{{i}}'")
            patterns[regex] = key
    if comm.root_step(_holds_dcp, save_dir):
        return _recover_dcp(comm, save_dir, out, patterns, args)
    _refuse_link(args)
    if args.emit_recipe:
        recipe = recover_chain(comm, save_dir, out, patterns, "--layer-pattern")[0]
        if comm.rank == 0:
            print(recipe.text, end="", flush=True)
        return 0
    if out is None:  # a dry run needs no output: plan for a default one
        out = save_dir.parent / f"{save_dir.name}-recovered"
    recipe, chain, place = recover_chain(comm, save_dir, out, patterns, "--layer-pattern",
                                         args.world_size)
    if args.stats:  # (not in a save the timeline needs either: its full save, say)
        from mpitailor.jobs.readable import refuse_inside_sources
        comm.root_step(refuse_inside_sources, Path(os.path.abspath(args.stats)),
                       [(s.name, s.path) for s in (chain.full, *chain.partials)], "--stats")
    planned = plan_recipe(comm, recipe, place)
    return run_planned(comm, planned, args, lambda: recovered(planned.plan, chain))


def _holds_dcp(save_dir: Path) -> bool:
    from mpitailor.formats.dcp import is_dcp_dir
    from mpitailor.jobs.dcp_recovery import holds_dcp_saves
    return is_dcp_dir(save_dir) or holds_dcp_saves(save_dir)


def _recover_dcp(comm: Comm, save_dir: Path, out: Path | None, patterns,
                 args: argparse.Namespace) -> int:
    """`recover` of a save dir of PyTorch Distributed Checkpoint saves ([DCP](docs/dcp.md)):
    the chain's recipe, merged as a DCP merge is (loads at any world size)."""
    from mpitailor.jobs.dcp_recovery import recover_dcp_chain, recovered_dcp
    _refuse_for_dcp(str(save_dir), args)
    if out is None and args.dry_run:  # a dry run needs no output: plan for a default one
        out = save_dir.parent / f"{save_dir.name}-recovered"
    recipe, chain, checked = recover_dcp_chain(comm, save_dir, out, patterns)
    if args.stats:  # (not in a save the timeline needs either: its full save, say)
        from mpitailor.jobs.readable import refuse_inside_sources
        comm.root_step(refuse_inside_sources, Path(os.path.abspath(args.stats)),
                       [(s.name, s.path) for s in (chain.full, *chain.partials)], "--stats")
    if args.emit_recipe:
        if comm.rank == 0:
            print(recipe.text, end="", flush=True)
        return 0
    return _run_dcp(comm, recipe, args, "recovered", checked,
                    lambda: recovered_dcp(recipe, chain))


def _refuse_for_dcp(origin: str, args: argparse.Namespace) -> None:
    """The options a DCP merge or recovery does not take, refused in one line (--world-size:
    DCP reshards when it loads; the others are not built for DCP yet)."""
    unsupported = [o for o, on in (("--export", args.export), ("--world-size", args.world_size),
                                   ("--ranks-per-node", getattr(args, "ranks_per_node", None)),
                                   ("--safe-globals", getattr(args, "safe_globals", None)))
                   if on]
    if unsupported:
        raise UserError(f"{origin}: holds PyTorch Distributed Checkpoints, which "
                        f"{', '.join(unsupported)} does not support yet; leave it out")


def _said_dcp(comm: Comm, args: argparse.Namespace, verb: str, result, seconds: float,
              more: Callable[[], str] | None = None) -> None:
    if comm.rank == 0 and not args.quiet:
        gb = result.bytes / 1e9
        how = "linked (hard links: no byte copied)" if args.link else "written"
        print(f"mpitailor: {verb} a PyTorch Distributed Checkpoint into "
              f"{shown(result.output)}: {result.files} files, {gb:.3f} GB {how} by "
              f"{comm.size} rank(s) in {seconds:.2f} s", flush=True)
        if more is not None:
            print(f"mpitailor: {more()}", flush=True)


def merge_options(args: argparse.Namespace):
    from mpitailor.jobs.merge import MergeOptions
    return MergeOptions(frozenset(args.export or ()), args.dtype, args.max_shard_size, args.verify,
                        not args.no_progress, getattr(args, "ranks_per_node", None))


def run_planned(comm: Comm, planned, args: argparse.Namespace,
                more: Callable[[], str] | None = None) -> int:
    """Collective: dry-run report or merge + summary, as the command line says; `more`,
    a second line of summary (rank 0)."""
    from mpitailor.engine.universal import plan_limits
    from mpitailor.jobs.merge import run_merge
    from mpitailor.planning.plan_report import format_plan
    from mpitailor.publish.staging import check_writable_file

    opts, plan = merge_options(args), planned.plan
    if args.dry_run:  # (a merge checks them in run_merge, before anything is written)
        opts.check(plan)
    stats = Path(os.path.abspath(args.stats)) if args.stats else None  # links unresolved
    if stats is not None:  # written at the end: a bad path must fail before anything is merged
        comm.root_step(check_writable_file, stats, "--stats")
        from mpitailor.jobs.readable import refuse_inside_sources
        comm.root_step(refuse_inside_sources, stats, planned.recipe.sources, "--stats")
    if args.dry_run:
        limits = comm.root_step(plan_limits, plan) if "universal" in opts.export else None
        if comm.rank == 0:
            print(format_plan(plan, comm.size))
            if limits is not None:
                print("universal    " + ("; ".join(limits) if limits else
                                         "load_universal restores it exactly"))
        return 0
    result = run_merge(comm, planned, opts)
    if comm.rank == 0 and not args.quiet:  # -q: warnings and errors only
        gb = result.bytes_written / 1e9
        print(f"mpitailor: merged {len(plan.layer_source)} layers from {len(plan.sources)} "
              f"source(s) into {shown(result.output)}: {gb:.3f} GB written by {result.ranks} rank(s) "
              f"in {result.seconds:.2f} s ({gb / max(result.seconds, 1e-9):.2f} GB/s)",
              flush=True)
        if more is not None:
            print(f"mpitailor: {escaped(more())}", flush=True)
    if stats is not None:
        comm.root_step(write_stats, stats, result)
    return 0


def write_stats(path: Path, result) -> None:
    """Rank 0: the --stats file, written whole or not at all (a temporary file beside it,
    renamed over it); a failure is one line, exit 1, saying the merge stands."""
    from mpitailor.errors import MpitailorError
    from mpitailor.publish.staging import check_writable_file, write_replacing
    text = json.dumps({"output": str(result.output), "seconds": result.seconds,
                       "bytes_written": result.bytes_written,
                       "ranks": list(result.rank_stats)}, indent=2)
    try:
        check_writable_file(path, "--stats")  # no link or device put there while merging
        write_replacing(path, text.encode())
    except (OSError, UserError) as e:
        why = e.strerror if isinstance(e, OSError) else str(e)
        raise MpitailorError(f"--stats {shown(path)}: not written ({why}); the merge itself "
                             f"was published to {shown(result.output)}") from None


def cmd_export(args: argparse.Namespace) -> int:
    from mpitailor.jobs.export import run_export
    comm: Comm = args.comm
    source = Path(args.source).resolve()
    config = Path(args.config).resolve() if args.config else None
    if comm.root_step(_holds_dcp, source):  # a PyTorch Distributed Checkpoint, or their dir
        return _export_dcp(comm, source, config, args)
    out = run_export(comm, source, Path(args.output).resolve(), args.format, args.dtype,
                     args.max_shard_size, not args.no_progress, config, args.verify)
    if comm.rank == 0 and not args.quiet:
        gb = out.bytes_written / 1e9
        print(f"mpitailor: exported {shown(source)} (step {out.step}, from "
              f"{', '.join(out.saves)}) as {args.format} into {shown(out.output)}: "
              f"{gb:.3f} GB written by {comm.size} rank(s) in {out.seconds:.2f} s",
              flush=True)
    return 0


def _export_dcp(comm: Comm, source: Path, config: Path | None,
                args: argparse.Namespace) -> int:
    """`export` of a DCP checkpoint ([DCP](docs/dcp.md#export)): HF weights only."""
    from mpitailor.jobs.dcp_export import run_dcp_export
    out = run_dcp_export(comm, source, Path(args.output).resolve(), args.format, args.dtype,
                         args.max_shard_size, config, args.verify)
    if comm.rank == 0 and not args.quiet:
        where = f" (DCP, the newest copy of every layer from {', '.join(out.saves)})" \
            if out.saves else " (DCP)"
        print(f"mpitailor: exported {shown(source)}{where} as hf into {shown(out.output)}: "
              f"{out.files} weights file(s), {out.bytes_written / 1e9:.3f} GB written by "
              f"{comm.size} rank(s) in {out.seconds:.2f} s", flush=True)
    if out.verified is not None and comm.rank == 0 and not args.quiet:
        v = out.verified
        print(f"mpitailor: verified: {v.files} files as the manifest records them (size, "
              f"CRC-32) and {v.items} tensors equal to the checkpoint's ({v.bytes / 1e9:.3f} "
              f"GB read back)", flush=True)
    return 0
