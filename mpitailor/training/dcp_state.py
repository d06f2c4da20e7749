"""The state a DCP save holds, as FSDP2 users save it: `get_state_dict` of model and optimizer
(`{"model": ..., "optim": ...}`, with the trainer's own entries beside them), `dcp.save`d,
`dcp.load`ed and `set_state_dict` back; and a partial save's part of it, the chosen layers'
entries. An asynchronous save is `dcp.async_save`'s two halves: the state staged into host
memory by DCP's own stager (`stage`), then `dcp.save`d from there on a gloo group of its own
(`writer_group`) in a background thread. Besides the training comm, the one module of the training side that calls
torch.distributed: its checkpoint package, which a DCP save is (tests/test_layering.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from mpitailor.training import dependencies

with dependencies(__name__):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.tensor import DTensor


def model_entry_names(model) -> list[str]:
    """The names `get_state_dict` gives the model's entries (parameters and persistent
    buffers; wrappers' prefixes removed), without gathering anything."""
    return list(get_model_state_dict(model).keys())


def full_state(model, optimizer, options: StateDictOptions | None,
               extra: Mapping | None) -> dict:
    """Collective: what a full save holds: {"model": ..., "optim": ..., **extra}."""
    msd, osd = get_state_dict(model, optimizer, options=options)
    return {"model": msd, "optim": osd, **(extra or {})}


def chosen_part(state: dict, layers: frozenset[str], classify: Callable[[str], str]) -> dict:
    """A partial save's state: the model and optimizer entries of the parameters whose
    layer key is in `layers` (the optimizer's state keyed by parameter name, nested or
    flattened; its param groups listed by index are kept whole: they are small and say
    which parameters the groups hold); the trainer's own entries whole."""
    def chosen(name: str) -> bool:
        return classify(name) in layers

    out = dict(state)
    out["model"] = {k: v for k, v in state["model"].items() if chosen(k)}
    osd = state["optim"]
    if isinstance(osd.get("state"), dict):  # torch's nested layout
        out["optim"] = {**osd, "state": {k: v for k, v in osd["state"].items() if chosen(k)}}
    else:  # flatten_optimizer_state_dict: state.<param>.<field>, param_groups.<param>.<field>
        out["optim"] = {k: v for k, v in osd.items() if _flat_kept(k, chosen)}
    return out


def _flat_kept(key: str, chosen: Callable[[str], bool]) -> bool:
    """A flattened optimizer key is kept unless it is a parameter's (`state.<param>.<field>`,
    `param_groups.<param>.<field>`) of a layer not chosen; a group's index (torch's nested
    groups flattened: `param_groups.0.lr`) is no parameter's name."""
    head, _, rest = key.partition(".")
    if head not in ("state", "param_groups"):
        return True
    param = rest.rpartition(".")[0]
    return not param or param.isdigit() or chosen(param)


def save(state: dict, path: Path, group=None) -> None:
    """Collective over group (None: the default one): dcp.save of state into path (DCP's own
    writer: each rank its data file, rank 0 the `.metadata`)."""
    dcp.save(state, checkpoint_id=str(path), process_group=group)


def stager() -> DefaultStager:
    """DCP's stager as `dcp.async_save` makes its own: a copy into plain host memory, taken
    while the caller waits. It keeps the copy's buffers for the next save of the same
    tensors (torch caches them by source storage): no fresh pages faulted in at every save."""
    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def stage(state: dict, by: DefaultStager) -> dict:
    """state with every tensor (a DTensor's local shard) copied into host memory: what the
    background writes, while training changes the live tensors."""
    return by.stage(state)


def writer_group():
    """Collective (every rank, once): a gloo group of its own for the collectives of the
    background saves (DCP's planning, the records, the publish), so that they never run
    concurrently with training's on the default group (a gloo group is not safe under
    concurrent collectives from two threads); None when torch.distributed is not
    initialised (a world of one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo")


def load_dcp(model, optimizer, path: Path, options: StateDictOptions | None = None,
         extra: dict | None = None) -> dict:
    """Collective: model and optimizer loaded from the DCP checkpoint at path, at this job's
    world size (DCP reshards); `extra`, the trainer's own entries to read (filled in place,
    as dcp.load does), returned."""
    msd, osd = get_state_dict(model, optimizer, options=options)
    state = {"model": msd, "optim": osd, **(extra or {})}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)
    return {k: v for k, v in state.items() if k not in ("model", "optim")}


def local_parameters(model) -> dict[str, torch.Tensor]:
    """Each parameter's part held by this rank (an FSDP2 DTensor's local shard)."""
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach()
            for n, p in model.named_parameters()}


def entry_names(path: Path) -> set[str]:
    """The entries (DCP's flattened names: `rng.0.python`) of the DCP checkpoint at path, as
    torch's reader lists them: the job's own save or composite, which its dcp.load reads
    with the same reader."""
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load_entries(state: dict, path: Path) -> dict:
    """Collective: dcp.load of just these entries (the trainer's own, without the model and
    optimizer), filled in place and returned."""
    dcp.load(state, checkpoint_id=str(path))
    return state
