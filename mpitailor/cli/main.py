"""Command line: `python -m mpitailor RECIPE.yml` merges; subcommands do the rest.

Exit codes: 0 ok, 1 runtime failure, 2 bad input, 141 stdout's reader left (`| head`).
An error is one line: once, from rank 0, when every rank failed alike; else one per rank,
prefixed `[rank r]` (cli/log.py report_error). Tracebacks only with -v.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys

from mpitailor.cli.commands import cmd_export, cmd_merge, cmd_recover
from mpitailor.errors import MpitailorError, UserError

log = logging.getLogger(__name__)


def cmd_inspect(args: argparse.Namespace) -> int:
    from mpitailor.cli.reports import format_table
    from mpitailor.formats.read import read_meta
    from mpitailor.formats.shard import open_all_shards
    from mpitailor.jobs.inspect import composite_manifest, newer_saves, report

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


def program_name() -> str:
    """`mpitailor` when run as the installed command, else `python -m mpitailor`."""
    called = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "mpitailor" if called == "mpitailor" else "python -m mpitailor"


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=program_name(),
        description="Assemble composite DeepSpeed ZeRO checkpoints (stages 1-3) layer by layer, "
                    "with MPI. "
                    "`python -m mpitailor RECIPE.yml` is short for `merge RECIPE.yml`.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-vv: from every rank); tracebacks on errors")
        sp.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")

    m = sub.add_parser("merge", help="merge checkpoints as a recipe says (MPI-parallel)")
    m.add_argument("recipe", help="YAML recipe (MergeKit slices or the short `layers:` form)")
    m.add_argument("-o", "--output", help="output dir (overrides the recipe's `output`)")
    merge_run_options(m, "overrides the recipe's output.world_size")
    trust_option(m)
    common(m)
    m.set_defaults(func=cmd_merge, uses_mpi=True)

    r = sub.add_parser("recover", help="merge the newest copy of every layer in a save dir")
    r.add_argument("save_dir", help="dir of full and partial checkpoints (global_stepN/, "
                                    "checkpoint-N/)")
    r.add_argument("-o", "--output", help="output dir of the composite checkpoint")
    r.add_argument("--emit-recipe", action="store_true", help="print the recipe, merge nothing")
    r.add_argument("--layer-pattern", action="append", metavar="REGEX=KEY",
                   help="parameter names -> layer key (layers.{i}, embed, norm, lm_head, "
                        "other), tried before the built-in rules; repeatable. Default: the "
                        "patterns the saves recorded")
    merge_run_options(r, "the job came back at another size")
    trust_option(r)
    common(r)
    r.set_defaults(func=cmd_recover, uses_mpi=True)

    e = sub.add_parser("export", help="a checkpoint (or a run's newest layers) straight to HF "
                                      "safetensors, fp32 weights or Universal (MPI-parallel)")
    e.add_argument("source", help="tag dir, save dir with `latest`, HF checkpoint-N/, or a save "
                                  "dir of layer-wise saves (their newest layers)")
    e.add_argument("-o", "--output", required=True, help="output dir (must not exist)")
    e.add_argument("--format", choices=["hf", "fp32", "universal"], default="hf",
                   help="hf: safetensors in the model's dtype + config and tokenizer (default); "
                        "fp32: the fp32 master weights, as zero_to_fp32 writes them; "
                        "universal: DeepSpeed's Universal checkpoint")
    e.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="dtype of --format hf (default: the model's)")
    e.add_argument("--max-shard-size", type=_shard_size, metavar="SIZE",
                   help="largest safetensors file, as save_pretrained cuts them (default 5GB)")
    e.add_argument("--config", metavar="DIR|FILE",
                   help="--format hf: the model's config.json, or a model dir whose config, "
                        "generation config and tokenizer files go with the weights; wins over "
                        "the source's own (needed when the source has none: a plain DeepSpeed "
                        "save)")
    e.add_argument("--verify", action="store_true",
                   help="check every source record read against its zip CRC-32 first (reads "
                        "them whole), as merge --verify does")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    trust_option(e)
    common(e)
    e.set_defaults(func=cmd_export, uses_mpi=True)

    st = sub.add_parser("stats", help="update statistics of layer-wise saving")
    st_sub = st.add_subparsers(dest="stats_command", required=True)
    sp = st_sub.add_parser("plot", help="heatmaps of per-layer updates and saves (PNG)")
    sp.add_argument("stats_file", help="HDF5 file written by LayerwiseCheckpointer(stats=...)")
    sp.add_argument("-o", "--output", default="stats.png", help="PNG to write")
    common(sp)
    sp.set_defaults(func=cmd_stats_plot, uses_mpi=False)

    cl = sub.add_parser("clean", help="remove what killed runs left in a directory (staging "
                                      "dirs, locks nobody holds)")
    cl.add_argument("directory", help="the directory that holds the outputs (and its "
                                      "subdirectories, one level down)")
    common(cl)
    cl.set_defaults(func=cmd_clean, uses_mpi=False)

    pr = sub.add_parser("prune", help="delete the saves and composites the newest composite "
                                      "of a save dir no longer needs (retention)")
    pr.add_argument("save_dir", help="dir of full and partial checkpoints (global_stepN/, "
                                     "checkpoint-N/)")
    pr.add_argument("--keep-last", type=int, required=True, metavar="K",
                    help="keep the K newest saves of the recovered timeline whatever they hold "
                         "(0: only what recovery needs)")
    pr.add_argument("--composites", metavar="DIR",
                    help="also remove the older recovered-* composites in DIR (the Slurm "
                         "prologue's OUT_PARENT); SAVE_DIR/.mpitailor-resume/ always")
    pr.add_argument("--dry-run", action="store_true",
                    help="say what would be removed and why; delete nothing")
    common(pr)
    pr.set_defaults(func=cmd_prune, uses_mpi=True)

    pa = sub.add_parser("paths", help="where the shipped recipes and Slurm scripts are")
    common(pa)
    pa.set_defaults(func=cmd_paths, uses_mpi=False)

    sl = sub.add_parser("slurm-prologue",
                        help="run the shipped Slurm resume prologue (recover before resuming)",
                        description="Runs slurm/resume-prologue.sh SAVE_DIR [OUT_PARENT]: "
                                    "prints MPITAILOR_RESUME_FROM=<dir> (empty: nothing to "
                                    "resume). Settings: MPITAILOR_LAUNCH, "
                                    "MPITAILOR_MERGE_RANKS, MPITAILOR_PYTHON (default: this "
                                    "python).")
    sl.add_argument("prologue_args", nargs="*", metavar="SAVE_DIR [OUT_PARENT]")
    common(sl)
    sl.set_defaults(func=cmd_slurm_prologue, uses_mpi=False)

    d = sub.add_parser("diff", help="which layers of two checkpoints differ, and by how much "
                                    "(exit 0: identical, 1: different)")
    d.add_argument("a", help="checkpoint A (tag dir, save dir with `latest`, HF checkpoint-N/)")
    d.add_argument("b", help="checkpoint B (any world size; partial saves: the layers held)")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    trust_option(d)
    common(d)
    d.set_defaults(func=cmd_diff, uses_mpi=True)

    i = sub.add_parser("inspect", help="describe a ZeRO checkpoint (stages 1-3) layer by layer")
    i.add_argument("checkpoint", help="tag dir, save dir with `latest`, or HF checkpoint-N/")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    trust_option(i)
    common(i)
    i.set_defaults(func=cmd_inspect, uses_mpi=False)
    return p


def merge_run_options(p: argparse.ArgumentParser, world_size_why: str) -> None:
    """The options of every command that writes a composite checkpoint (merge, recover)."""
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and the bytes each rank would read and write")
    p.add_argument("--world-size", type=int, metavar="W2",
                   help=f"write the checkpoint for W2 ranks (reshard; {world_size_why})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--stats", metavar="FILE",
                   help="write per-rank timings, bytes read/written and peak RSS as JSON")
    p.add_argument("--verify", action="store_true",
                   help="check every source record read against its zip CRC-32 (reads "
                        "those records whole)")
    export_options(p)
    placement_option(p)


def trust_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--safe-globals", metavar="MODULE.NAME,...",
                   help="classes outside mpitailor's allow-list to accept in every file (you "
                        "trust them); like client state, they are carried through unbuilt, "
                        "exactly as written")


def placement_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks-per-node", type=int, metavar="N",
                   help="node-local output (each node sees its own disk there): output rank "
                        "r's files go to the (r // N)-th node of this job. Default: to the "
                        "node of this job's rank r when the world size stays, else "
                        "consecutive blocks over the nodes")


def export_options(p: argparse.ArgumentParser) -> None:
    """merge's and recover's exports, named as `export` names them: the HF export is `hf`,
    its dtype `--dtype`. The old names (`--export safetensors`, `--export-dtype`) still
    work, out of --help (docs/commands.md#old-names)."""
    p.add_argument("--export", type=_export_name, choices=["hf", "universal"],
                   action="append",
                   help="also write: `hf`, consolidated HF safetensors weights (+ config, "
                        "tokenizer) to OUT/hf/; `universal`, DeepSpeed's Universal "
                        "checkpoint (load_universal, any world size) to OUT/TAG/zero/ and "
                        "OUT/latest_universal. Repeat the option for both")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="dtype of the HF weights of --export hf (default: the model's); the "
                        "merged checkpoint itself keeps its own")
    p.add_argument("--export-dtype", choices=["bf16", "fp16", "fp32"], dest="dtype",
                   help=argparse.SUPPRESS)  # the old name of --dtype
    p.add_argument("--max-shard-size", type=_shard_size, metavar="SIZE",
                   help="largest safetensors shard of --export hf, as transformers' "
                        "save_pretrained cuts them: 5GB (the default), 500MB, 2GiB or bytes")


def _export_name(text: str) -> str:
    """`safetensors`, the old name of `--export hf`, as `hf`."""
    return "hf" if text == "safetensors" else text


def _shard_size(text: str) -> int:
    from mpitailor.planning.hf_layout import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


PATH_ARGS = ("recipe", "output", "save_dir", "source", "checkpoint", "a", "b", "stats_file",
             "stats", "composites")
PATH_MAX = 4096  # bytes in a path (Linux), the terminating NUL included


def check_path_lengths(args: argparse.Namespace) -> None:
    """A path the file system cannot name is bad input, said before any I/O (else a raw
    ENAMETOOLONG deep inside, and MPI_Abort)."""
    for key in PATH_ARGS:
        value = getattr(args, key, None)
        if not isinstance(value, str) or not value:
            continue
        raw = os.fsencode(value)
        longest = max((len(part) for part in raw.split(b"/")), default=0)
        if len(raw) >= PATH_MAX or longest > 255:
            what = f"{len(raw)} bytes (at most {PATH_MAX - 1})" if len(raw) >= PATH_MAX \
                else f"a name of {longest} bytes (at most 255)"
            raise UserError(f"{key.replace('_', ' ')} {value[:60]}...: the path has {what}; "
                            f"the file system cannot open it")


SUBCOMMANDS = ("merge", "recover", "export", "diff", "inspect", "stats", "paths",
               "slurm-prologue", "clean", "prune")


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


def with_subcommand(argv: list[str]) -> list[str]:
    """`RECIPE.yml ...` is short for `merge RECIPE.yml ...`; options may come before either
    (`-q RECIPE.yml`, `-v recover DIR`): the subcommand is moved to the front."""
    if not argv or argv[0] in SUBCOMMANDS or argv[0] in ("-h", "--help"):
        return argv
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if first is None:
        return argv  # options alone: argparse says what is missing
    if argv[first] in SUBCOMMANDS:
        return [argv[first], *argv[:first], *argv[first + 1:]]
    return ["merge", *argv]


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
            from mpitailor.formats.safeload import trust
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
