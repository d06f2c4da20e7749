"""Python entry points: `from mpitailor import merge, recover`.

The same code path as the command line (recipe or save dir -> plan -> copy program ->
commit), returning a `MergeResult` instead of printing, and raising mpitailor's errors
(`UserError` for bad input, `NothingToRecover`, ...) instead of exiting. Under MPI every
rank calls them (collective); in a plain process they run as a world of one.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from mpitailor.cluster.comm import Comm
from mpitailor.errors import UserError
from mpitailor.jobs.merge import MergeOptions, MergeResult, plan_merge, plan_recipe, run_merge
from mpitailor.jobs.recovery import recover_chain

__all__ = ["MergeResult", "merge", "recover"]


def merge(recipe: str | os.PathLike, output: str | os.PathLike | None = None, *,
          world_size: int | None = None, export: Iterable[str] = (),
          export_dtype: str | None = None, max_shard_size: int | str | None = None,
          verify: bool = False, progress: bool = False, comm: Comm | None = None) -> MergeResult:
    """Merge checkpoints as the YAML recipe at `recipe` says (`python -m mpitailor merge`).

    output: overrides the recipe's `output`; world_size: reshard for that many ranks;
    export: "hf" and/or "universal" (the CLI's --export; "safetensors", the old name of "hf",
    still works); export_dtype: the HF export's dtype (--dtype); max_shard_size: bytes or
    "5GB" as HF spells it.
    """
    comm = comm or Comm.world()
    opts = _options(export, export_dtype, max_shard_size, verify, progress)
    return run_merge(comm, plan_merge(comm, str(recipe), None if output is None
                                      else str(output), world_size), opts)


def recover(save_dir: str | os.PathLike, output: str | os.PathLike, *,
            world_size: int | None = None, layer_patterns: Mapping[str, str] | None = None,
            export: Iterable[str] = (), export_dtype: str | None = None,
            max_shard_size: int | str | None = None, verify: bool = False,
            progress: bool = False, comm: Comm | None = None) -> MergeResult:
    """The newest saved copy of every layer of the run in `save_dir`, as one checkpoint at
    `output` (`python -m mpitailor recover`). layer_patterns: {regex: layer key}, as
    --layer-pattern; by default the patterns the saves recorded."""
    comm = comm or Comm.world()
    opts = _options(export, export_dtype, max_shard_size, verify, progress)
    recipe, _, place = recover_chain(comm, save_dir, output, layer_patterns,
                                     world_size=world_size)
    return run_merge(comm, plan_recipe(comm, recipe, place), opts)


def _options(export, export_dtype, max_shard_size, verify, progress) -> MergeOptions:
    if isinstance(export, str):
        export = (export,)
    export = ["hf" if name == "safetensors" else name for name in export]  # its old name
    if isinstance(max_shard_size, str):
        from mpitailor.planning.hf_layout import parse_size
        try:
            max_shard_size = parse_size(max_shard_size)
        except ValueError as e:
            raise UserError(f"max_shard_size: {e}") from None
    return MergeOptions(frozenset(export), export_dtype, max_shard_size, verify, progress)
