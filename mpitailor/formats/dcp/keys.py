"""What the keys of a DCP state dict say. FSDP2's `get_state_dict` + `dcp.save` (and
Accelerate FSDP, mpitailor's DcpCheckpointer) save `{"model": ..., "optim": ...}`, flattened
by DCP into `model.<param>`, `optim.state.<param>.<exp_avg|exp_avg_sq|step>` and
`optim.param_groups.<param or group index>.<hyper-parameter>`; anything else is the
trainer's own. torchtitan's CheckpointManager (0.3) saves the model's entries at the top
level under their own names (`layers.0.attention.wo.weight`), its OptimizersContainer as
`optimizer.state.<param>.<field>` and `optimizer.param_groups.<param>.<field>`, beside
`lr_scheduler`, `dataloader` and `train_state` (dev/torchtitan/README.md): `split_keys`
tells the two layouts apart by the whole key set."""
from __future__ import annotations

from dataclasses import dataclass

OPTIM_STATE = ("exp_avg", "exp_avg_sq", "step", "max_exp_avg_sq", "momentum_buffer")


@dataclass(frozen=True, slots=True)
class Key:
    role: str   # "model", "optim_state", "param_group" or "other"
    param: str  # the parameter's name ("" for "other"; a group's index for torch's default
    #             param_groups, e.g. "0")
    field: str  # the optimizer state or hyper-parameter ("" for "model" and "other")


def split_key(fqn: str) -> Key:
    if fqn.startswith("model."):
        return Key("model", fqn[len("model."):], "")
    if fqn.startswith("optim.state."):
        param, _, field = fqn[len("optim.state."):].rpartition(".")
        if param and field:
            return Key("optim_state", param, field)
    if fqn.startswith("optim.param_groups."):
        rest = fqn[len("optim.param_groups."):]
        param, _, field = rest.rpartition(".")
        if param and field:
            return Key("param_group", param, field)
    return Key("other", "", "")


# torchtitan's own top-level entries besides the model's (components/checkpointer/base.py)
TITAN_OPTIMIZER = "optimizer."
TITAN_TRAINER = ("lr_scheduler", "dataloader", "train_state")


def is_torchtitan(fqns) -> bool:
    """torchtitan's layout: no `model.` entry, and torchtitan's optimizer or trainer entries
    (Megatron's `optimizer.state.` keys are told apart first, by its common_state)."""
    fqns = list(fqns)
    return not any(f.startswith("model.") for f in fqns) and any(
        f.startswith(TITAN_OPTIMIZER + "state.") or _titan_trainer(f) for f in fqns)


def split_keys(fqns) -> dict[str, Key]:
    """Every key of one checkpoint split as its layout says (torchtitan's or get_state_dict's)."""
    fqns = list(fqns)
    split = _split_titan if is_torchtitan(fqns) else split_key
    return {f: split(f) for f in fqns}


def _titan_trainer(fqn: str) -> bool:
    return any(fqn == t or fqn.startswith(t + ".") for t in TITAN_TRAINER)


def _split_titan(fqn: str) -> Key:
    for prefix, role in (("optimizer.state.", "optim_state"),
                         ("optimizer.param_groups.", "param_group")):
        if fqn.startswith(prefix):
            param, _, field = fqn[len(prefix):].rpartition(".")
            return Key(role, param, field) if param and field else Key("other", "", "")
    if fqn.startswith(TITAN_OPTIMIZER) or _titan_trainer(fqn):
        return Key("other", "", "")
    return Key("model", fqn, "")
