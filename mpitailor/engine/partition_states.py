"""The two state dicts of one output partition, as DeepSpeed will load them, minus the bytes
of the flat buffers.

The optimizer dict comes from the base source's files with its flat buffers (fp32 master,
exp_avg, exp_avg_sq of every sub-group) replaced by placeholders: tensors of the right size
with no bytes at all (tensorref.Tensor.empty), so pickling the dict costs no buffer. The
executor fills their bytes in the output file from the copy program. At a new world size the
optimizer's fields are rewritten for it (steps per new sub-group, renumbered param groups,
partition count); the model states get new parameter shapes, re-sliced frozen fragments and
tied aliases on rank 0 only.
"""
from __future__ import annotations

import math
from contextlib import ExitStack
from types import SimpleNamespace

from mpitailor.formats.torch import Size, Tensor, contiguous_stride, load, materialize
from mpitailor.formats.zero import KINDS, Layout, full_tensor, open_all_shards
from mpitailor.planning.plan import MergePlan

Placeholders = dict[tuple[str, int], Tensor]  # (kind, sub-group) -> placeholder


# Where each layout keeps the torch optimizer's state dict and the fp32 master partitions.
INNER = {False: "optimizer_state_dict", True: "base_optimizer_state"}
FP32 = {False: "fp32_flat_groups", True: "single_partition_of_fp32_groups"}


def placeholders(layout: Layout, rank: int) -> Placeholders:
    """fp32 placeholders, one per (kind, sub-group) of rank's file."""
    return {(k, g): Tensor.empty(layout.buffer_size(k, g, rank), "fp32")
            for g in range(len(layout.subgroup_sizes)) for k in KINDS}


def merged_optim(plan: MergePlan, base, flats: Placeholders) -> dict:
    """Output partition's optimizer dict (same world size): the base's, with the plan's Adam
    step per sub-group and the flat buffers `flats`."""
    flat = plan.base_meta.layout.flat
    osd = dict(base.optim["optimizer_state_dict"])
    inner = dict(osd[INNER[flat]])
    inner["state"] = {g: {"step": step_like(inner["state"][g]["step"], sg.step),
                          "exp_avg": flats["exp_avg", g], "exp_avg_sq": flats["exp_avg_sq", g]}
                      for g, sg in enumerate(plan.subgroups)}
    osd[INNER[flat]] = inner
    osd[FP32[flat]] = [flats["fp32", g] for g in range(len(plan.subgroups))]
    return {**base.optim, "optimizer_state_dict": osd}


def resharded_optim(plan: MergePlan, base0, flats: Placeholders, rank: int) -> dict:
    """Output partition `rank`'s optimizer dict at the target world size, from the base's
    rank 0."""
    target = plan.target
    flat = target.layout.flat
    osd = dict(base0.optim["optimizer_state_dict"])
    inner = dict(osd[INNER[flat]])
    step_t = inner["state"][0]["step"]
    n_groups = len(target.layout.subgroup_sizes)
    inner["state"] = {g: {"step": step_like(step_t, target.steps[g]),
                          "exp_avg": flats["exp_avg", g], "exp_avg_sq": flats["exp_avg_sq", g]}
                      for g in range(n_groups)}
    inner["param_groups"] = [{**pg, "params": list(ids)}
                             for pg, ids in zip(inner["param_groups"], target.param_groups)]
    osd.update({INNER[flat]: inner, FP32[flat]: [flats["fp32", g] for g in range(n_groups)]})
    if not flat:
        osd["partition_count"] = target.world_size
        return {**base0.optim, "optimizer_state_dict": osd}
    layout = target.layout
    osd["partition_count"] = [target.world_size] * n_groups
    osd["group_paddings"] = [layout.subgroup_sizes[g] - layout.lean_size(g, rank)
                             for g in range(n_groups)]
    if osd.get("param_slice_mappings") is not None:
        osd["param_slice_mappings"] = _slice_mappings(layout, rank,
                                                      osd["param_slice_mappings"])
    return {**base0.optim, "optimizer_state_dict": osd}


def _slice_mappings(layout: Layout, rank: int, like: list) -> list:
    """Stage 1/2 `param_slice_mappings` of rank at the new world size: per group, name ->
    (numel, start) of the rank's fragment, in the record type (and mapping type) of `like`."""
    record = next((type(v) for group in like for v in group.values()), None)
    out = []
    for g in range(len(layout.subgroup_sizes)):
        group = type(like[0])() if like else {}
        for s in layout.subgroup_slots(g):
            at, _, n = layout.held(s, rank)
            if n:
                # DeepSpeed's fragment_address dataclass, as its stand-in (opaque.py)
                group[s.name] = record.new({"numel": n, "start": at})
        out.append(group)
    return out


def step_like(template, value: float):
    """An Adam step of `value` in the form the source stores it (0-d tensor, int or float)."""
    if isinstance(template, Tensor):
        return Tensor.scalar(value if template.is_floating_point() else int(value),
                             template.dtype)
    return type(template)(value)


def merged_model_states(plan: MergePlan, shards: dict) -> dict:
    """The base's model states with frozen fragments and buffers from their layers' sources;
    `shards`: source name -> an object with `.model` (that source's model states)."""
    base = shards[plan.base].model
    model = dict(base)
    if plan.base_meta.layout.flat:
        model["module"] = _flat_module(plan, shards)
    if plan.frozen_source:
        model["frozen_param_fragments"] = type(base["frozen_param_fragments"])(
            (name, shards[src].model["frozen_param_fragments"][name])
            for name, src in plan.frozen_source)
    buffers = set(base.get("buffer_names") or ())
    if buffers and not plan.base_meta.layout.flat:
        key_source = dict(plan.layer_source)
        classify = plan.classifier()
        module = type(base["module"])()
        for name in base["module"]:
            src = key_source.get(classify(name), plan.base) if name in buffers else plan.base
            module[name] = shards[src].model["module"][name]
        model["module"] = module
    return model


def _flat_module(plan: MergePlan, shards: dict):
    """Stage 1/2 model states hold the whole model (16-bit weights, buffers): each entry
    from the source of its layer, a tied alias from the source of the parameter it names.
    DeepSpeed keeps the 16-bit weights equal to its fp32 master weights cast down, so a full
    save's own are the merged fp32 weights cast down; where a source holds a placeholder (a
    partial save), they are rebuilt so from its fp32 master weights (frozen parameters:
    from its frozen fragments, which stage 1/2 keeps whole)."""
    base = shards[plan.base].model["module"]
    key_source = dict(plan.layer_source)
    classify = plan.classifier()
    aliases = dict(plan.base_meta.shared_params)
    frozen = dict(plan.base_meta.frozen_shapes)
    module = type(base)()
    opened: dict[str, list] = {}  # source -> all its ranks' shards, opened when needed
    slots: dict[str, dict] = {}   # source -> its slot table by name
    with ExitStack() as stack:
        for name in base:
            target = aliases.get(name, name)
            src = key_source.get(classify(target), plan.base)
            have = shards[src].model["module"][name]
            if src not in slots:
                slots[src] = plan.meta(src).layout.by_name()
            slot = slots[src].get(target)
            if slot is not None and have.numel() != slot.numel:
                if src not in opened:
                    opened[src] = stack.enter_context(open_all_shards(plan.meta(src)))
                have = _cast_down(full_tensor(opened[src], slot, "fp32").reshape(-1),
                                  have.dtype, slot.shape)
            elif target in frozen and have.numel() != math.prod(frozen[target]):
                have = _as(shards[src].model["frozen_param_fragments"][target], have.dtype,
                           frozen[target])
            module[name] = have
    return module


def _cast_down(fp32, dtype: str, shape: tuple[int, ...]) -> Tensor:
    """A new tensor of `shape`: the fp32 numpy array cast to dtype (torch's .to(dtype))."""
    from mpitailor.formats.torch import cast
    return Tensor.of_bytes(cast(fp32, "fp32", dtype).tobytes(), dtype, shape)


def _as(t: Tensor, dtype: str, shape: tuple[int, ...]) -> Tensor:
    """t.to(dtype).reshape(shape) as torch does it: the same storage when no cast is needed
    (a view of it, as reshape of a contiguous tensor gives), else a new one."""
    if t.dtype == dtype:
        return Tensor(t.storage, t.storage_offset, shape, contiguous_stride(shape))
    from mpitailor.formats.torch import cast
    return Tensor.of_bytes(cast(t.raw(), t.dtype, dtype).tobytes(), dtype, shape)


def rank0_model_states(plan: MergePlan) -> dict:
    """Every source's rank-0 model states, in the form merged_model_states takes (in memory:
    they may travel to ranks that cannot read the files)."""
    return {name: SimpleNamespace(model=materialize(load(meta.files.model_path(0),
                                                         opaque_ok=True)))
            for name, meta in plan.sources}


def resharded_model_states(plan: MergePlan, rank: int, base0, rank0: dict) -> dict:
    """Output partition `rank`'s model states at the target world size; rank0: the sources'
    rank-0 model states (rank0_model_states)."""
    target = plan.target
    model = merged_model_states(plan, rank0)
    model["dp_world_size"] = target.world_size
    if target.layout.flat:  # one file for all ranks; frozen parameters are kept whole
        return model
    model["param_shapes"] = [
        type(base0.model["param_shapes"][0])((s.name, Size(s.shape))
                                             for s in target.layout.subgroup_slots(g))
        for g in range(len(target.layout.subgroup_sizes))]
    if rank != 0:
        model["shared_params"] = {}
    if plan.frozen_source:
        states: dict[tuple[str, int], dict] = {}
        model["frozen_param_fragments"] = type(base0.model["frozen_param_fragments"])(
            (name, _frozen_slice(plan, name, src, rank, states))
            for name, src in plan.frozen_source)
    return model


def _frozen_slice(plan: MergePlan, name: str, src: str, rank: int,
                  states: dict[tuple[str, int], dict]) -> Tensor:
    """Rank `rank`'s fragment of a frozen parameter at the new world size (zero padded),
    copied from the source ranks whose fragments overlap it (only those bytes are read)."""
    meta = plan.meta(src)
    numel = math.prod(dict(meta.frozen_shapes)[name])
    pn1 = math.ceil(numel / meta.world_size)
    pn2 = math.ceil(numel / plan.target.world_size)
    lo, hi = rank * pn2, min((rank + 1) * pn2, numel)
    out, dtype = None, None
    e = lo
    while e < hi:
        r1, within = divmod(e, pn1)
        n = min(hi - e, pn1 - within)
        if (src, r1) not in states:
            states[src, r1] = load(meta.files.model_path(r1), opaque_ok=True)
        frag = states[src, r1]["frozen_param_fragments"][name]
        if out is None:
            dtype, out = frag.dtype, bytearray(pn2 * frag.itemsize)
        size = frag.itemsize
        out[(e - lo) * size: (e - lo + n) * size] = frag.raw_bytes(within, n)
        e += n
    if out is None:  # this rank holds only padding of it
        first = load(meta.files.model_path(0), opaque_ok=True)["frozen_param_fragments"][name]
        dtype, out = first.dtype, bytearray(pn2 * first.itemsize)
    return Tensor.of_bytes(out, dtype, (pn2,))
