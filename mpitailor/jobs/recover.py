"""`recover`: the recipe and plan that assemble the newest copy of every layer of a run."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from mpitailor.cluster.comm import Comm
from mpitailor.cluster.nodes import Placement
from mpitailor.jobs.merge import Planned, plan_recipe
from mpitailor.jobs.saves import plan_recovery_at
from mpitailor.planning.layers import check_patterns
from mpitailor.planning.plan import MergePlan
from mpitailor.planning.recipe import Recipe
from mpitailor.planning.recovery import Chain, recovery_recipe


def recover_recipe(comm: Comm, save_dir: str | os.PathLike, output: str | os.PathLike | None,
                   layer_patterns: Mapping[str, str] | None = None,
                   where: str = "layer_patterns", world_size: int | None = None) -> Recipe:
    """Collective: the recipe `recover` merges (the saves checked, the chain chosen);
    `where` names the patterns' origin in errors."""
    return recover_chain(comm, save_dir, output, layer_patterns, where, world_size)[0]


def recover_chain(comm: Comm, save_dir: str | os.PathLike, output: str | os.PathLike | None,
                  layer_patterns: Mapping[str, str] | None = None,
                  where: str = "layer_patterns",
                  world_size: int | None = None) -> tuple[Recipe, Chain, Placement]:
    """Collective: recover_recipe's recipe, the chain of saves it was made from (what the
    command line reports: the saves used and those skipped), and where the save dir's files
    lie (for plan_recipe: surveyed once)."""
    if layer_patterns:
        check_patterns(dict(layer_patterns), where=where)
    save_dir = Path(save_dir).resolve()
    chain, place = plan_recovery_at(comm, save_dir)
    return comm.root_step(recovery_recipe, save_dir, chain,
                          None if output is None else Path(output).resolve(),
                          dict(layer_patterns) if layer_patterns else None,
                          world_size), chain, place


def plan_recover(comm: Comm, save_dir: str | os.PathLike, output: str | os.PathLike,
                 layer_patterns: Mapping[str, str] | None = None,
                 world_size: int | None = None,
                 where: str = "layer_patterns") -> Planned:
    """Collective: the recipe and plan of `recover`."""
    recipe, _, place = recover_chain(comm, save_dir, output, layer_patterns, where, world_size)
    return plan_recipe(comm, recipe, place)


def recovered(plan: MergePlan, chain: Chain) -> str:
    """What a recovery produced, in words: the step and world size of the checkpoint, the
    saves it took layers from, and the saves it left out and why."""
    line = (f"recovered step {plan.base_meta.global_steps} for world size "
            f"{plan.out_world_size} from {', '.join(name for name, _ in plan.sources)}")
    if chain.skipped:
        line += "; skipped " + ", ".join(f"{name} ({why})" for name, why in chain.skipped)
    return line
