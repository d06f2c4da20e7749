"""`python -m mpitailor export SRC -o OUT --format hf|fp32|universal`: a checkpoint straight to
another format, on any number of MPI ranks.

SRC is a checkpoint (tag dir, save dir, HF `checkpoint-N/`) or a save dir of layer-wise saves,
whose newest copy of every layer (`recover`'s chain) is exported without assembling it first.
- hf:   consolidated HF safetensors weights in the model's dtype (or --dtype), sharded as
        `save_pretrained` cuts them, with the source's config and tokenizer files;
- fp32: the fp32 master weights as safetensors (what DeepSpeed's `zero_to_fp32.py
        --safe_serialization` writes), weights only;
Both are written straight from the source's partition files, every rank casting and writing
its share of every file in bounded chunks (export/hf_weights.py): no native copy, no
consolidated model in memory.
- universal: DeepSpeed's Universal checkpoint. `load_universal` also reads the model-states
        files of the tag dir, so this writes the checkpoint (native files included) as
        `merge --export universal` does.
Published like a merge: staged beside OUT, one rename, a manifest.

Collective: every rank calls run_export.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.engine.hf_weights import export_hf
from mpitailor.errors import UserError
from mpitailor.formats.extras import MANIFEST, extras_dir
from mpitailor.formats.files import PARTIAL_MANIFEST, resolve
from mpitailor.jobs.merge import MergeOptions, execute, plan_recipe
from mpitailor.planning.hf_layout import DEFAULT_MAX_SHARD_SIZE
from mpitailor.planning.plan import MergePlan
from mpitailor.planning.recipe import parse_recipe
from mpitailor.publish.staging import Staging, write_synced
from mpitailor.version import __version__

FORMATS = ("hf", "fp32", "universal")


def source_recipe(comm: Comm, source: Path, output: Path) -> str:
    """Collective: the recipe whose plan says where every parameter comes from: the one
    checkpoint SRC names, or the chain `recover` would assemble from a save dir of
    layer-wise saves."""
    def single() -> bool:
        try:
            files = resolve(source)
        except UserError:
            return False  # not one checkpoint: a save dir of several (recover decides)
        if files.partial:
            return False
        # A tag dir is one checkpoint; a save dir may hold layer-wise saves newer than the
        # full save its `latest` names: then recover's chain takes each layer's newest copy.
        return files.tag_dir == source or not any(
            (c / PARTIAL_MANIFEST).exists() for c in source.iterdir() if c.is_dir())
    if comm.root_step(single):
        return f"sources:\n  src: {json.dumps(str(source))}\nlayers:\n  rest: src\n" \
               f"output: {json.dumps(str(output))}\n"
    from mpitailor.jobs.recover import recover_recipe  # imports the merge job
    return recover_recipe(comm, source, output)


def run_export(comm: Comm, source: Path, output: Path, fmt: str, dtype: str | None,
               max_shard_size: int | None, progress: bool = False) -> dict:
    """Collective: export SRC to OUT; returns {"output", "bytes_written", "seconds"}."""
    t0 = time.perf_counter()
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: choose among {', '.join(FORMATS)}")
    if fmt == "fp32" and dtype not in (None, "fp32"):
        raise UserError(f"--format fp32 writes fp32; --dtype {dtype} goes with --format hf")
    text = source_recipe(comm, source, output)
    recipe = comm.root_step(parse_recipe, text, origin=f"export {source}", base_dir=source)
    _, plan = plan_recipe(comm, recipe)
    if fmt == "universal":
        if dtype is not None or max_shard_size is not None:
            raise UserError("--dtype and --max-shard-size go with --format hf or fp32")
        result = execute(comm, recipe, plan, MergeOptions(frozenset({"universal"}),
                                                          progress=progress))
        return {"output": str(result.output), "bytes_written": result.bytes_written,
                "seconds": time.perf_counter() - t0}
    return _export_weights(comm, plan, fmt, dtype, max_shard_size, t0)


def _export_weights(comm: Comm, plan: MergePlan, fmt: str, dtype: str | None,
                    max_shard_size: int | None, t0: float) -> dict:
    base = plan.base_meta
    dtype = "fp32" if fmt == "fp32" else (dtype or base.dtype)
    sources = {name: plan.meta(src)
               for name, src in (*plan.param_source, *plan.frozen_source)}
    staging = Staging(plan.output)
    try:
        root = comm.root_step(staging.acquire, None)
        files = export_hf(comm, base, extras_dir(base) if fmt == "hf" else None, root, dtype,
                          max_shard_size or DEFAULT_MAX_SHARD_SIZE, sources)

        def finish() -> int:
            manifest = {"mpitailor_version": __version__, "format": fmt, "dtype": dtype,
                        "created": datetime.datetime.now(datetime.timezone.utc)
                        .isoformat(timespec="seconds"),
                        "sources": {name: {"path": str(m.path),
                                           "global_steps": m.global_steps}
                                    for name, m in plan.sources},
                        "layers": {k: s for k, s in plan.layer_source},
                        "mpi_ranks": comm.size, "files": dict(sorted(files.items()))}
            write_synced(root / MANIFEST, json.dumps(manifest, indent=2).encode())
            staging.publish()
            return sum(r["bytes"] for r in files.values())
        written = comm.root_step(finish)
    except BaseException:
        if comm.rank == 0:
            staging.abandon()
        raise
    finally:
        if comm.rank == 0:
            staging.release()
    return {"output": str(plan.output), "bytes_written": written,
            "seconds": time.perf_counter() - t0}


def run_export_cli(args: argparse.Namespace) -> int:
    comm: Comm = args.comm
    source = Path(args.source).resolve()
    if (source / PARTIAL_MANIFEST).exists():
        raise UserError(f"{source}: one partial save holds only some layers; export its save "
                        f"dir ({source.parent}) to take every layer's newest copy")
    out = run_export(comm, source, Path(args.output).resolve(), args.format, args.dtype,
                     args.max_shard_size, not args.no_progress)
    if comm.rank == 0:
        gb = out["bytes_written"] / 1e9
        print(f"mpitailor: exported {source} as {args.format} into {out['output']}: "
              f"{gb:.3f} GB written by {comm.size} rank(s) in {out['seconds']:.2f} s",
              flush=True)
    return 0
