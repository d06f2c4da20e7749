"""What the keys of a Megatron-Core `torch_dist` checkpoint say (dev/megatron/FORMAT.md).

Megatron saves ShardedTensors under their own keys, with no `model.` prefix: the GPT model's
`embedding.*`, `decoder.*`, `output_layer.*`. By default (`singleton_local_shards=False`,
Megatron-LM's) a decoder layer's tensors are *stacked*: one DCP tensor
`decoder.layers.<name>` of global shape `[num_layers, ...]`, every chunk one layer thick,
so layer i is every chunk at offset i of axis 0; its `_extra_state` is one bytes entry per
layer, `decoder.layers.<name>._extra_state/shard_<i>_<n>`. NeMo's older per-layer keys
(`decoder.layers.<i>.<name>`) are read too. The DistributedOptimizer's state is either
`fully_reshardable`, stacked and chunked as its model tensor
(`optimizer.state.<param|exp_avg|exp_avg_sq>.<model key>`), or `dp_reshardable`, DDP's flat
buckets (`optimizer.distributed.*`), whose parameter map is stored nowhere. The non-sharded
state (args, iteration, param groups) is the bytes entry `common_state/shard_0_1`. Pure: no I/O.
"""
from __future__ import annotations

import re

from mpitailor.formats.dcp.keys import Key
from mpitailor.formats.dcp.metadata import DcpMetadata, TensorEntry

COMMON_STATE = "common_state"  # a ShardedObject: the entry is `common_state/shard_0_1`
OPTIM_STATE = "optimizer.state."
OPTIM_FLAT = "optimizer.distributed."
STATE_FIELDS = ("param", "exp_avg", "exp_avg_sq")
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
STACKED = "decoder.layers."
_PER_LAYER = re.compile(r"decoder\.layers\.(\d+)\..+")
_SHARD = re.compile(r"(.+)/shard_(\d+(?:\.\d+)*)_(\d+(?:\.\d+)*)")


def is_megatron(meta: DcpMetadata) -> bool:
    """Saved by Megatron-Core's dist_checkpointing (0.14+: its common state inside the DCP)."""
    return any(b.startswith(COMMON_STATE + "/shard_") for b in meta.bytes_entries)


def optimizer_sharding(meta: DcpMetadata) -> str | None:
    """`dp_reshardable`, `fully_reshardable`, or None (no optimizer state), from the keys."""
    keys = (*meta.tensors, *meta.bytes_entries)
    if any(k.startswith(OPTIM_FLAT) for k in keys):
        return "dp_reshardable"
    if any(k.startswith(OPTIM_STATE) for k in keys):
        return "fully_reshardable"
    return None


def split_megatron(fqn: str) -> Key:
    """A key as keys.Key: `model` (param = the model key, a ShardedObject's `/shard_...`
    left on), `optim_state` (param = the model key, field = param|exp_avg|exp_avg_sq),
    `optim_flat` (dp_reshardable's buckets) or `other` (common_state, rng_state, ...)."""
    if fqn.startswith(OPTIM_STATE):
        field, _, param = fqn[len(OPTIM_STATE):].partition(".")
        if field in STATE_FIELDS and param.startswith(MODEL_PREFIXES):
            return Key("optim_state", param, field)
        return Key("other", "", "")
    if fqn.startswith(OPTIM_FLAT):
        return Key("optim_flat", "", "")
    if fqn.startswith(MODEL_PREFIXES):
        return Key("model", fqn, "")
    return Key("other", "", "")


def is_stacked(param: str) -> bool:
    """`decoder.layers.<name>` with no layer number: a tensor with a leading layer axis."""
    return param.startswith(STACKED) and not _PER_LAYER.fullmatch(param) and \
        param != STACKED.rstrip(".")


def layer_key(fqn: str, offsets: tuple[int, ...] | None,
              tensor: TensorEntry | None) -> str | None:
    """The layer key (`layers.{i}`, `embed`, `norm`, `lm_head`) an item belongs to: for a
    stacked tensor, its chunk's offset on axis 0; for a stacked bytes entry, its shard's
    first offset; None for anything not the model's or its optimizer state's (the base's).
    ValueError for a stacked tensor's chunk that spans layers (no item copy can split it)."""
    key = split_megatron(fqn)
    if key.role not in ("model", "optim_state"):
        return None
    param, shard = key.param, None
    if tensor is None and (m := _SHARD.fullmatch(param)):
        param, shard = m.group(1), int(m.group(2).split(".")[0])
    if m := _PER_LAYER.fullmatch(param):
        return f"layers.{int(m.group(1))}"
    if is_stacked(param):
        if tensor is not None and offsets is not None and offsets:
            sizes = {c.offsets: c.sizes for c in tensor.chunks}.get(offsets)
            if sizes is None or sizes[0] != 1:
                raise ValueError(f"{fqn!r:.100}: a chunk at {offsets} spanning several layers")
            return f"layers.{offsets[0]}"
        if shard is not None:
            return f"layers.{shard}"
        raise ValueError(f"{fqn!r:.100}: a stacked entry without a layer axis")
    if param.startswith("embedding."):
        return "embed"
    if param.startswith("decoder.final_layernorm.") or param.startswith("decoder.final_norm."):
        return "norm"
    if param.startswith("output_layer."):
        return "lm_head"
    return None
