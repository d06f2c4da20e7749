"""What the keys of a DCP state dict say: FSDP2's `get_state_dict` + `dcp.save` (and
torchtitan, Accelerate FSDP) save `{"model": ..., "optim": ...}`, flattened by DCP into
`model.<param>`, `optim.state.<param>.<exp_avg|exp_avg_sq|step>` and
`optim.param_groups.<param or group index>.<hyper-parameter>`; anything else (torchtitan's
`train_state`, `dataloader`, `lr_scheduler`) is the trainer's own."""
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
