"""The command line's parser: subcommands, their options, and the checks made before any
I/O (path lengths; `RECIPE.yml` short for `merge RECIPE.yml`)."""
from __future__ import annotations

import argparse
import os
import sys

from mpitailor.cli.commands import cmd_export, cmd_merge, cmd_recover
from mpitailor.cli.tools import (
    cmd_clean,
    cmd_diff,
    cmd_inspect,
    cmd_paths,
    cmd_prune,
    cmd_slurm_prologue,
    cmd_stats_plot,
    cmd_verify,
)
from mpitailor.errors import UserError


def program_name() -> str:
    """`mpitailor` when run as the installed command, else `python -m mpitailor`."""
    called = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "mpitailor" if called == "mpitailor" else "python -m mpitailor"


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
                   help="check the sources first, as merge --verify does (a recorded save's "
                        "files whole against its record, else every zip record read)")
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

    v = sub.add_parser("verify", help="read back every file mpitailor recorded and check its "
                                      "size and CRC-32 (exit 0: as recorded, 1: differs; "
                                      "MPI-parallel)")
    v.add_argument("path", help="a merge, recover or export output, a partial save, or a dir "
                                "that holds some (a save dir)")
    common(v)
    v.set_defaults(func=cmd_verify, uses_mpi=True)

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
    p.add_argument("--link", action="store_true",
                   help="PyTorch Distributed Checkpoints: hard-link the sources' data files "
                        "into the output and write only a new .metadata (no copy; the output "
                        "on the sources' file system)")
    p.add_argument("--stats", metavar="FILE",
                   help="write per-rank timings, bytes read/written and peak RSS as JSON")
    p.add_argument("--verify", action="store_true",
                   help="check the sources first: a partial save's and a recorded full "
                        "save's files whole against their record; a save by DeepSpeed itself, "
                        "every zip record read against its CRC-32")
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
               "slurm-prologue", "clean", "prune", "verify")


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
