"""Resume from layer-wise saves inside the training job: recover, then load as usual.

Collective over the training ranks (torch.distributed): they check the saves and write the
composite checkpoint together, as `mpiexec python -m mpitailor recover` would, into a hidden
dir under the save dir (`.mpitailor-resume/`), where later recoveries do not mistake it for
a save. A composite of the same newest save is reused.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from mpitailor.formats.manifest import MANIFEST
from mpitailor.jobs.merge import plan_recipe, write_merge
from mpitailor.jobs.recovery import plan_recovery
from mpitailor.planning.recovery import recovery_recipe
from mpitailor.training.distcomm import training_comm

log = logging.getLogger(__name__)
RESUME_DIR = ".mpitailor-resume"


def recover_for_resume(save_dir: str | Path, until_step: int | None = None,
                       output_root: str | Path | None = None) -> Path:
    """Collective: the checkpoint to resume from: the newest full save itself when no
    partial save follows it, else a composite of its timeline (saves after `until_step` left
    out). Raises NothingToRecover when no save ever finished."""
    comm = training_comm()
    save_dir = Path(save_dir).resolve()
    chain = plan_recovery(comm, save_dir, until_step=until_step)
    if not chain.partials:
        _say(comm, f"resuming from the full save {chain.full.name} (step {chain.full.step}) "
                   f"itself: no partial save follows it")
        return chain.full.path
    base = chain.partials[-1]
    out_root = Path(output_root) if output_root is not None else save_dir / RESUME_DIR
    out = out_root / f"recovered-{base.name}-{base.lineage.save_id[:12] if base.lineage else 'x'}"
    used = f"the full save {chain.full.name} and the partial saves " \
           f"{', '.join(p.name for p in chain.partials)} (newest copy of every layer)"
    if comm.root_step(_is_recovery_of, out, base.path):
        _say(comm, f"resuming from {out}, recovered before from {used}")
        return out
    recipe = comm.root_step(recovery_recipe, save_dir, chain, out)
    _, plan = plan_recipe(comm, recipe)
    write_merge(comm, plan, recipe.text, progress=False)
    _say(comm, f"resuming from {out}, recovered from {used}")
    return out


def _say(comm, line: str) -> None:
    if comm.rank == 0:
        log.info("%s", line)


def _is_recovery_of(out: Path, base: Path) -> bool:
    """A published composite (manifest last) whose base is that very save."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest["sources"][manifest["base"]]["path"] == str(base)
