"""Python entry points: `from mpitailor import merge, recover`.

The same code path as the command line (recipe or save dir -> plan -> copy program ->
commit), returning a `MergeResult` instead of printing, and raising mpitailor's errors
(`UserError` for bad input, `NothingToRecover`, ...) instead of exiting. Under MPI every
rank calls them (collective); in a plain process they run as a world of one.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from mpitailor.comm import Comm
from mpitailor.errors import UserError
from mpitailor.job import MergeOptions, MergeResult, execute, plan_merge, plan_recipe
from mpitailor.layers import check_patterns
from mpitailor.plan import MergePlan
from mpitailor.recipe import Recipe, parse_recipe
from mpitailor.recovery import plan_recovery, recovery_recipe

__all__ = ["MergeResult", "merge", "recover"]


def merge(recipe: str | os.PathLike, output: str | os.PathLike | None = None, *,
          world_size: int | None = None, export: Iterable[str] = (),
          export_dtype: str | None = None, max_shard_size: int | str | None = None,
          verify: bool = False, progress: bool = False, comm: Comm | None = None) -> MergeResult:
    """Merge checkpoints as the YAML recipe at `recipe` says (`python -m mpitailor merge`).

    output: overrides the recipe's `output`; world_size: reshard for that many ranks;
    export: "safetensors" and/or "universal"; max_shard_size: bytes or "5GB" as HF spells it.
    """
    comm = comm or Comm.world()
    opts = _options(export, export_dtype, max_shard_size, verify, progress)
    recipe_, plan = plan_merge(comm, str(recipe), None if output is None else str(output),
                               world_size)
    return execute(comm, recipe_, plan, opts)


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
    recipe, plan = plan_recover(comm, save_dir, output, layer_patterns, world_size)
    return execute(comm, recipe, plan, opts)


def recover_recipe(comm: Comm, save_dir: str | os.PathLike, output: str | os.PathLike | None,
                   layer_patterns: Mapping[str, str] | None = None,
                   where: str = "layer_patterns") -> str:
    """Collective: the recipe text `recover` merges (the saves checked, the chain chosen);
    `where` names the patterns' origin in errors."""
    if layer_patterns:
        check_patterns(dict(layer_patterns), where=where)
    save_dir = Path(save_dir).resolve()
    chain = plan_recovery(comm, save_dir)
    return recovery_recipe(save_dir, chain, None if output is None else Path(output).resolve(),
                           dict(layer_patterns) if layer_patterns else None)


def plan_recover(comm: Comm, save_dir: str | os.PathLike, output: str | os.PathLike,
                 layer_patterns: Mapping[str, str] | None = None,
                 world_size: int | None = None,
                 where: str = "layer_patterns") -> tuple[Recipe, MergePlan]:
    """Collective: the recipe and plan of `recover`."""
    text = recover_recipe(comm, save_dir, output, layer_patterns, where)
    save_dir = Path(save_dir).resolve()
    recipe = comm.root_step(parse_recipe, text, origin=f"recover {save_dir}",
                            base_dir=save_dir, world_size=world_size)
    return plan_recipe(comm, recipe)


def _options(export, export_dtype, max_shard_size, verify, progress) -> MergeOptions:
    if isinstance(export, str):
        export = (export,)
    if isinstance(max_shard_size, str):
        from mpitailor.export.hf_layout import parse_size
        try:
            max_shard_size = parse_size(max_shard_size)
        except ValueError as e:
            raise UserError(f"max_shard_size: {e}") from None
    return MergeOptions(frozenset(export), export_dtype, max_shard_size, verify, progress)
