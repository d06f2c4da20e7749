"""A layer-wise merge of PyTorch Distributed Checkpoints, planned: which source each entry of
the output comes from, and where each output item's bytes are copied from.

A recipe names a source per layer (and per embed, norm, lm_head, other), as for ZeRO
(plan.py's rules). Each parameter's weights (`model.<param>`), its optimizer state
(`optim.state.<param>.*`: exp_avg, exp_avg_sq and its own Adam `step`) and its
hyper-parameters where they are saved per parameter (`optim.param_groups.<param>.*`) come
from its layer's source; everything else (param groups saved by index, the trainer's own
entries) from the base. The sources must have been saved alike (same entries, dtypes, sizes
and chunks): an item, DCP's serialised chunk, is then copied whole from the chosen source
into the output's data file of the same name (the same rank's), and the output's metadata
is the base's with every item's new place. Pure: no I/O, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpitailor.errors import UserError
from mpitailor.formats.dcp import DcpMetadata, Item, split_key
from mpitailor.planning.layers import AUX_KEYS, OTHER, LayerClassifier, sort_keys
from mpitailor.planning.plan import count_layers, layer_sources
from mpitailor.planning.recipe import Recipe


@dataclass(frozen=True, slots=True)
class Copy:
    """One item of the output: entry `fqn` (chunk at `offsets`, of `sizes`; None for a
    bytes entry), copied from `source`'s `item` into output data file `file` at `offset`."""

    fqn: str
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...] | None
    source: str
    item: Item
    file: str
    offset: int


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
            out[c.file] = max(out.get(c.file, 0), c.offset + c.item.length)
        return out


def plan_dcp(recipe: Recipe, metas: dict[str, DcpMetadata]) -> DcpPlan:
    names = [n for n, _ in recipe.sources]
    base = recipe.base or names[-1]
    ref = metas[base]
    classify = LayerClassifier(dict(recipe.layer_patterns))
    params = sorted({split_key(f).param for f in ref.tensors if split_key(f).role == "model"})
    if not params:
        raise UserError(f"{recipe.origin}: {recipe.source_path(base)} holds no `model.` "
                        f"entries (get_state_dict + dcp.save writes model.<param>); mpitailor "
                        f"merges DCP checkpoints of that layout only")
    keys = {p: classify(p) for p in params}
    key_source = layer_sources(recipe, count_layers(recipe, keys))
    aux = dict(recipe.aux)
    for k in set(keys.values()):
        if k in AUX_KEYS or k == OTHER:
            key_source[k] = aux.get(k, base)
    for name in names:
        _check_alike(recipe, name, metas[name], base, ref)
    chosen: dict[tuple[str, tuple[int, ...] | None], str] = {}
    for index in ref.items:
        key = split_key(index[0])
        param_source = key_source.get(keys.get(key.param, ""), base) \
            if key.role in ("model", "optim_state", "param_group") else base
        chosen[index] = param_source
    sizes = {(fqn, c.offsets): c.sizes for fqn, t in ref.tensors.items() for c in t.chunks}
    copies, items, ends = [], {}, {}
    for index in sorted(ref.items, key=lambda i: (ref.items[i].file, ref.items[i].offset)):
        src = chosen[index]
        item = metas[src].items[index]
        at = ends.get(item.file, 0)
        copies.append(Copy(index[0], index[1], sizes.get(index), src, item, item.file, at))
        ends[item.file] = at + item.length
        items[index] = Item(item.fqn, item.offsets, item.file, at, item.length, item.transforms)
    output = DcpMetadata(ref.tensors, ref.bytes_entries, items, ref.version, ref.save_id,
                         ref.planner_data)
    used = {c.source for c in copies} | {base}
    return DcpPlan(base, tuple((n, metas[n]) for n in names if n in used),
                   tuple((k, key_source[k]) for k in sort_keys(key_source)), tuple(copies),
                   output)


def _check_alike(recipe: Recipe, name: str, meta: DcpMetadata, base: str,
                 ref: DcpMetadata) -> None:
    """Every source saved as the base was: the same entries, each tensor of the same dtype,
    size and chunks, each item in the data file of the same name (the same rank's)."""
    path = recipe.source_path(name)
    if set(meta.tensors) != set(ref.tensors) or set(meta.bytes_entries) != set(
            ref.bytes_entries):
        odd = sorted(set(meta.tensors) ^ set(ref.tensors)
                     or set(meta.bytes_entries) ^ set(ref.bytes_entries))
        raise UserError(f"{recipe.origin}: {path} and {recipe.source_path(base)} hold other "
                        f"entries (e.g. {odd[0]!r:.100}); merge saves of one model and "
                        f"optimizer")
    for fqn, t in ref.tensors.items():
        if meta.tensors[fqn] != t:
            raise UserError(f"{recipe.origin}: {path}: {fqn!r:.100} is saved with another "
                            f"dtype, size or sharding than in {recipe.source_path(base)}; "
                            f"merge saves of the same world size and parallelism")
    for index, item in ref.items.items():
        if meta.items[index].file != item.file:
            raise UserError(f"{recipe.origin}: {path}: {index[0]!r:.100} lies in "
                            f"{meta.items[index].file}, in {item.file} in "
                            f"{recipe.source_path(base)}; merge saves of the same ranks")
