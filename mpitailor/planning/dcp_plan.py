"""A layer-wise merge of PyTorch Distributed Checkpoints, planned: which source each entry of
the output comes from, and where each output item's bytes are copied from.

A recipe names a source per layer (and per embed, norm, lm_head, other), as for ZeRO
(plan.py's rules). Each parameter's weights (`model.<param>`), its optimizer state
(`optim.state.<param>.*`: exp_avg, exp_avg_sq and its own Adam `step`) and its
hyper-parameters where they are saved per parameter (`optim.param_groups.<param>.*`) come
from its layer's source; everything else (param groups saved by index, the trainer's own
entries) from the base. The sources must have been saved alike (dtypes, sizes and chunks;
the same entries, or, a partial save, some of them): an item, DCP's serialised chunk, is
then copied whole from the chosen source into the output's data file of the same name (the
same rank's). The output holds every entry any source holds, each from the source the
recipe names for it, which must hold it. Pure: no I/O, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpitailor.errors import UserError
from mpitailor.formats.dcp import (
    DcpMetadata,
    Item,
    TensorEntry,
    is_megatron,
    layer_key,
    optimizer_sharding,
    split_keys,
    zip_item,
)
from mpitailor.planning.layers import AUX_KEYS, OTHER, LayerClassifier, sort_keys
from mpitailor.planning.plan import count_layers, layer_sources
from mpitailor.planning.recipe import Recipe


@dataclass(frozen=True, slots=True)
class Copy:
    """One item of the output: entry `fqn` (chunk at `offsets`, of `sizes`; None for a
    bytes entry), copied from `source`'s `item` into output data file `file` at `offset`,
    `length` bytes: the item's own, or, for a chunk of a safetensors blob
    (item.safetensors), the torch.save item it is written as (formats/dcp zip_item)."""

    fqn: str
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...] | None
    source: str
    item: Item
    file: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class DcpPlan:
    base: str
    sources: tuple[tuple[str, DcpMetadata], ...]
    layer_source: tuple[tuple[str, str], ...]   # layer key -> source name
    copies: tuple[Copy, ...]                    # in output order: by file, then offset
    output: DcpMetadata                         # what the output's .metadata says

    def files(self) -> dict[str, int]:
        """Output data file -> its size."""
        out: dict[str, int] = {}
        for c in self.copies:
            out[c.file] = max(out.get(c.file, 0), c.offset + c.length)
        return out


def plan_dcp(recipe: Recipe, metas: dict[str, DcpMetadata]) -> DcpPlan:
    names = [n for n, _ in recipe.sources]
    base = recipe.base or names[-1]
    # who places each entry: the base where it holds it (its order is the output's), else
    # the first source in the recipe that does (a partial save holds some entries only)
    order = [base, *(n for n in names if n != base)]
    tensors, holder = _union(recipe, order, metas)
    if is_megatron(metas[base]):
        layer_of = _megatron_layers(recipe, metas, tensors, holder)
    else:
        layer_of = _param_layers(recipe, base, tensors, holder)
    key_source = layer_sources(recipe, count_layers(
        recipe, {i: k for i, k in layer_of.items() if k is not None}))
    aux = dict(recipe.aux)
    for k in set(layer_of.values()) - {None}:
        if k in AUX_KEYS or k == OTHER:
            key_source[k] = aux.get(k, base)
    sizes = {(fqn, c.offsets): c.sizes for fqn, t in tensors.items() for c in t.chunks}

    def placed(index):
        item = metas[holder[index]].items[index]
        return item.file, order.index(holder[index]), item.offset
    copies, items, ends = [], {}, {}
    for index in sorted(holder, key=placed):
        layer = layer_of[index]
        src = key_source.get(layer, base) if layer is not None else base
        item = metas[src].items.get(index)
        if item is None:
            _lacks(recipe, src, index[0], layer)
        at = ends.get(item.file, 0)
        # a safetensors chunk is written as the default writer's torch.save item, which
        # dcp.load reads (torch 2.13 reads no safetensors chunk: formats/dcp)
        length = zip_item(tensors[index[0]].dtype, sizes[index]).length \
            if item.safetensors else item.length
        copies.append(Copy(index[0], index[1], sizes.get(index), src, item, item.file, at,
                           length))
        ends[item.file] = at + length
        items[index] = Item(item.fqn, item.offsets, item.file, at, length, item.transforms)
    planner_data = {}
    for n in order:  # the base's word where two differ
        for k, v in metas[n].planner_data.items():
            planner_data.setdefault(k, v)
    output = DcpMetadata(
        tensors, tuple(dict.fromkeys(b for n in order for b in metas[n].bytes_entries)), items,
        metas[base].version, metas[base].save_id,
        {k: v for k, v in planner_data.items() if k in tensors or (k, None) in holder})
    used = {c.source for c in copies} | {base}
    return DcpPlan(base, tuple((n, metas[n]) for n in names if n in used),
                   tuple((k, key_source[k]) for k in sort_keys(key_source)), tuple(copies),
                   output)


def _param_layers(recipe: Recipe, base: str, tensors: dict, holder: dict) -> dict:
    """get_state_dict's keys, or torchtitan's (formats/dcp/keys.py): each item's layer key by
    its parameter's name (None: the base's). The optimizer's entries are classified by their
    own parameter name: torchtitan's fused `wqkv` is one in the optimizer, three in the model."""
    classify = LayerClassifier(dict(recipe.layer_patterns))
    split = split_keys({i[0] for i in holder} | set(tensors))
    if not any(k.role == "model" for k in split.values()):
        raise UserError(f"{recipe.origin}: {recipe.source_path(base)} holds no model entries "
                        f"(get_state_dict + dcp.save writes model.<param>, torchtitan its "
                        f"parameters by name); mpitailor merges DCP checkpoints of those "
                        f"layouts only")
    out = {}
    for index in holder:
        key = split[index[0]]
        named = key.role in ("model", "optim_state") or (key.role == "param_group"
                                                         and not key.param.isdigit())
        out[index] = classify(key.param) if named else None
    return out


def _megatron_layers(recipe: Recipe, metas: dict, tensors: dict, holder: dict) -> dict:
    """Megatron-Core torch_dist keys (formats/dcp/megatron.py): each item's layer key, a
    stacked tensor's by its chunk's offset on the layer axis (None: the base's)."""
    for name, path in recipe.sources:
        if optimizer_sharding(metas[name]) == "dp_reshardable":
            raise UserError(f"{recipe.origin}: {path}: its optimizer state is Megatron's "
                            f"dp_reshardable flat buffers, whose parameter map is stored "
                            f"nowhere, so its layers cannot be told apart; save with "
                            f"fully_reshardable (Megatron-LM --dist-ckpt-optim-fully-reshardable) "
                            f"and merge those")
        if not is_megatron(metas[name]):
            raise UserError(f"{recipe.origin}: {path} is not a Megatron-Core torch_dist "
                            f"checkpoint (no common_state), the base is; merge saves of one run")
    out = {}
    for index in holder:
        try:
            out[index] = layer_key(index[0], index[1], tensors.get(index[0]))
        except ValueError as e:
            raise UserError(f"{recipe.origin}: {e}; mpitailor merges stacked layers saved one "
                            f"layer a chunk (Megatron's own layout)") from None
    return out


def _union(recipe: Recipe, order: list[str], metas: dict[str, DcpMetadata]) -> tuple[dict, dict]:
    """Every tensor entry the sources hold (saved alike wherever held: the same dtype,
    size and chunks, each item in the data file of the same name, the same rank's), and who
    places each item: the first source in `order` that holds it."""
    tensors: dict[str, tuple[str, TensorEntry]] = {}
    holder: dict[tuple, str] = {}
    kinds: dict[str, str] = {}
    for name in order:
        meta, path = metas[name], recipe.source_path(name)
        for fqn in (*meta.tensors, *meta.bytes_entries):
            kind = "tensor" if fqn in meta.tensors else "bytes"
            if kinds.setdefault(fqn, kind) != kind:
                raise UserError(f"{recipe.origin}: {path}: {fqn!r:.100} is a {kind} entry, "
                                f"another source holds it as a {kinds[fqn]} one; merge saves "
                                f"of one model and optimizer")
        for fqn, t in meta.tensors.items():
            first, seen = tensors.setdefault(fqn, (name, t))
            if seen != t:
                raise UserError(f"{recipe.origin}: {path}: {fqn!r:.100} is saved with another "
                                f"dtype, size or sharding than in {recipe.source_path(first)}; "
                                f"merge saves of the same world size and parallelism")
        for index, item in meta.items.items():
            first = holder.setdefault(index, name)
            if metas[first].items[index].file != item.file:
                raise UserError(f"{recipe.origin}: {path}: {index[0]!r:.100} lies in "
                                f"{item.file}, in {metas[first].items[index].file} in "
                                f"{recipe.source_path(first)}; merge saves of the same ranks")
    return {f: t for f, (_, t) in tensors.items()}, holder


def _lacks(recipe: Recipe, src: str, fqn: str, layer: str | None) -> None:
    what = f"layer {layer}" if layer is not None else "the entries outside the layers"
    raise UserError(f"{recipe.origin}: {what} comes from {recipe.source_path(src)}, which "
                    f"does not hold {fqn!r:.100} (a partial save of other layers?); take "
                    f"{what} from a save that holds it")
