"""Recipe + source metadata -> MergePlan. No MPI, no tensors, no reads of checkpoint data
(the one file-system call: output and source paths are resolved to compare them).

The plan says, for every sub-group of the input layout, which contiguous element runs of the
flat buffers come from which source, which Adam `step` the sub-group keeps, and where frozen
parameters and buffers come from. Every source has the same layout and world size, so the
runs are the same for every rank's part of a sub-group; how they land in the output (stage 3
per-parameter slices, stage 1/2 flat partitions, another world size) is the copy program's
business (program.py), built from this plan and the target layout.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from mpitailor.errors import UserError
from mpitailor.formats.dtypes import canonical
from mpitailor.formats.zero import OPTIM_BYTES_PER_ELEMENT, CheckpointMeta
from mpitailor.planning.layers import (
    AUX_KEYS,
    OTHER,
    LayerClassifier,
    layer_index,
    layer_runs,
    sort_keys,
)
from mpitailor.planning.recipe import SELECTOR_RE, Recipe
from mpitailor.planning.reshard import Target, target_layout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CopyRun:
    source: str
    start: int   # element offset in the sub-group's flat buffer (stage 3: the same on every
    length: int  # rank; stages 1/2: in the whole group's buffer, which the ranks cut up)


@dataclass(frozen=True, slots=True)
class SubgroupPlan:
    runs: tuple[CopyRun, ...]
    step: float
    step_source: str
    step_rule: str   # "single source" when exact, else the recipe's adam_step rule


@dataclass(frozen=True, slots=True)
class MergePlan:
    sources: tuple[tuple[str, CheckpointMeta], ...]   # only the sources the plan reads
    base: str
    output: Path
    layer_source: tuple[tuple[str, str], ...]          # layer key -> source, model order
    subgroups: tuple[SubgroupPlan, ...]
    frozen_source: tuple[tuple[str, str], ...]
    layer_patterns: tuple[tuple[str, str], ...]
    param_source: tuple[tuple[str, str], ...]          # every parameter -> source
    target: Target | None = None                       # set when resharding

    @property
    def source_world_size(self) -> int:
        """The sources' world size (all sources have it)."""
        return self.sources[0][1].world_size

    @property
    def out_world_size(self) -> int:
        """The output's: the sources', or the one it is resharded to."""
        return self.target.world_size if self.target else self.source_world_size

    def meta(self, name: str) -> CheckpointMeta:
        return dict(self.sources)[name]

    @property
    def base_meta(self) -> CheckpointMeta:
        return self.meta(self.base)

    def classifier(self) -> LayerClassifier:
        return LayerClassifier(dict(self.layer_patterns))

    def bytes_per_partition(self) -> dict[str, int]:
        """Optimizer-state bytes each output partition reads from each source."""
        out = {name: 0 for name, _ in self.sources}
        for sg in self.subgroups:
            for run in sg.runs:
                out[run.source] += run.length * OPTIM_BYTES_PER_ELEMENT
        if self.base_meta.layout.flat:  # runs span the whole group: a partition reads 1/W
            return {name: n // self.source_world_size for name, n in out.items()}
        return out


def make_plan(recipe: Recipe, metas: dict[str, CheckpointMeta]) -> MergePlan:
    """Validate the recipe against the sources and compute the copy plan."""
    names = [n for n, _ in recipe.sources]
    _check_agree(recipe, names, metas)
    classify = LayerClassifier(dict(recipe.layer_patterns))
    all_names = [s.name for s in metas[names[0]].layout.slots] + \
        [n for n, _ in metas[names[0]].frozen_shapes]
    keys = {n: classify(n) for n in all_names}
    n_layers = count_layers(recipe, keys)
    base = recipe.base or max(names, key=lambda n: (metas[n].global_steps, names.index(n)))
    key_source = layer_sources(recipe, n_layers)
    aux = dict(recipe.aux)
    for k in sort_keys(keys.values()):
        if k in AUX_KEYS or k == OTHER:
            key_source[k] = aux.get(k, base)
    _check_held(recipe, {k: key_source[k] for k in set(keys.values())}, metas)
    output = _check_output(recipe, metas)
    param_source = {n: key_source[keys[n]] for n in all_names}
    ref = metas[names[0]].layout
    subgroups = tuple(
        _subgroup_plan(ref.subgroup_slots(g), param_source, metas, g, recipe.adam_step, base)
        for g in range(len(ref.subgroup_sizes)))
    used = {param_source[n] for n in all_names} | {base}
    target = None
    if recipe.world_size is not None:
        _check_world_size(recipe, metas[names[0]])
    if recipe.world_size is not None and recipe.world_size != metas[names[0]].world_size:
        target = target_layout(metas[names[0]], recipe.world_size,
                               _step_rule(param_source, metas, recipe.adam_step, base))
    return MergePlan(
        sources=tuple((n, metas[n]) for n in names if n in used), base=base, output=output,
        layer_source=tuple((k, key_source[k]) for k in sort_keys(keys.values())),
        subgroups=subgroups,
        frozen_source=tuple((n, param_source[n]) for n, _ in metas[names[0]].frozen_shapes),
        layer_patterns=recipe.layer_patterns, param_source=tuple(param_source.items()),
        target=target)


def _step_rule(param_source, metas, rule: str, base: str):
    """step_of(new sub-group, its names) for resharding: exact when every parameter's old
    sub-group step agrees, else by the recipe's adam_step rule."""
    old_subgroup = {s.name: s.subgroup for s in next(iter(metas.values())).layout.slots}

    def step_of(_g: int, names: list[str]) -> float:
        cands = [(param_source[n], metas[param_source[n]].subgroup_steps[old_subgroup[n]])
                 for n in names]
        if len({step for _, step in cands}) == 1:
            return cands[0][1]
        if rule == "base":  # as in a plain merge: the base's step, whoever contributes
            return metas[base].subgroup_steps[old_subgroup[names[0]]]
        src = step_source({s for s, _ in cands}, metas, rule, base)
        return (min if rule == "oldest" else max)(step for s, step in cands if s == src)
    return step_of


def step_source(sources: set[str], metas: dict[str, CheckpointMeta], rule: str,
                base: str) -> str:
    """The one Adam-step rule, for a sub-group whose parameters come from several sources:
    the source whose step it keeps. newest/oldest by the sources' global steps (ties: the
    source name, so the choice never depends on the order of the recipe); base: the base."""
    if rule == "base":
        return base
    key = lambda name: (metas[name].global_steps, name)  # noqa: E731
    return (min if rule == "oldest" else max)(sources, key=key)


def _check_world_size(recipe: Recipe, meta: CheckpointMeta) -> None:
    """Refuse an output world size with more partitions than elements; warn when padding
    would make up most of every partition."""
    numels = [s.numel for s in meta.layout.slots]
    total, w = sum(numels), recipe.world_size
    if w > total:
        raise UserError(f"{recipe.origin}: world size {w} is larger than the model's "
                        f"{total} trainable elements; choose the number of ranks that will "
                        f"resume (--world-size / output.world_size)")
    padded = sum(-(-n // w) for n in numels) * w
    if padded > 2 * total:
        log.warning("world size %d: padding is %.0f%% of every partition (parameters smaller "
                    "than the world size are padded to one element per rank); is %d the "
                    "number of ranks that will resume?", w, 100 * (1 - total / padded), w)


def _check_agree(recipe: Recipe, names: list[str], metas: dict[str, CheckpointMeta]) -> None:
    first = metas[names[0]]
    for n in names[1:]:
        m = metas[n]
        if m.world_size != first.world_size:
            raise UserError(
                f"{recipe.origin}: sources have different world sizes ({names[0]}: "
                f"{first.world_size} ranks, {n}: {m.world_size}); merge checkpoints of one run")
        for what, a, b in (("dtype", first.dtype, m.dtype),
                           ("parameters, shapes or optimizer sub-groups", first.layout, m.layout),
                           ("frozen parameters", first.frozen_shapes, m.frozen_shapes),
                           ("optimizer param groups", first.param_groups, m.param_groups)):
            if a != b:
                raise UserError(f"{recipe.origin}: sources {names[0]} and {n} differ in {what}; "
                                f"merge checkpoints of one run (same model and optimizer layout)")
    if recipe.dtype is not None and canonical(recipe.dtype) != first.dtype:
        raise UserError(f"{recipe.origin}: dtype: {recipe.dtype!r} but the sources are "
                        f"{first.dtype}; remove `dtype` or set it to {first.dtype}")


def _check_held(recipe: Recipe, key_source: dict[str, str],
                metas: dict[str, CheckpointMeta]) -> None:
    """A partial checkpoint can supply only the layers it saved."""
    for key in sort_keys(key_source):
        src = key_source[key]
        held = metas[src].held_layers
        if held is not None and key not in held:
            raise UserError(f"{recipe.origin}: {key} is taken from {src}, a partial checkpoint "
                            f"that did not save it (it holds {', '.join(sort_keys(held))}); "
                            f"take {key} from a checkpoint that has it")


def count_layers(recipe: Recipe, keys: dict[str, str]) -> int:
    idx = sorted({i for k in keys.values() if (i := layer_index(k)) is not None})
    if not idx:
        raise UserError(f"{recipe.origin}: no decoder layers recognised in the parameter names; "
                        f"add `layer_patterns:` (regex -> 'layers.{{i}}')")
    if idx != list(range(len(idx))):
        raise UserError(f"{recipe.origin}: layer indices {idx[0]}..{idx[-1]} have gaps; "
                        f"check `layer_patterns`")
    return len(idx)


def layer_sources(recipe: Recipe, n_layers: int) -> dict[str, str]:
    """Layer key -> source from the recipe's selectors; each layer exactly once."""
    chosen: dict[int, tuple[str, str]] = {}
    rest = None
    for sel, src in recipe.layer_rules:
        if sel == "rest":
            rest = src
            continue
        for i in _select(sel, n_layers, recipe.origin):
            if i in chosen:
                raise UserError(f"{recipe.origin}: layer {i} is chosen twice ({chosen[i][0]!r} "
                                f"and {sel!r}); each layer comes from exactly one source")
            chosen[i] = (sel, src)
    for i in range(n_layers):
        if i not in chosen and rest is not None:
            chosen[i] = ("rest", rest)
    missing = [i for i in range(n_layers) if i not in chosen]
    if missing:
        ranges = ", ".join(r for r, _ in layer_runs((i, None) for i in missing))
        raise UserError(f"{recipe.origin}: layers {ranges} have no source (the model "
                        f"has layers 0-{n_layers - 1}); cover them or add `rest: SOURCE`")
    return {f"layers.{i}": src for i, (_, src) in chosen.items()}


def _select(sel: str, n_layers: int, origin: str) -> list[int]:
    if sel in ("even", "odd"):
        return list(range(0 if sel == "even" else 1, n_layers, 2))
    m = SELECTOR_RE.fullmatch(sel)
    a = int(m.group(1))
    b = int(m.group(2)) if m.group(2) is not None else a
    if b < a or b >= n_layers:
        raise UserError(f"{origin}: layers {sel!r} is outside the model's layers "
                        f"0-{n_layers - 1}")
    return list(range(a, b + 1))


def _subgroup_plan(slots, param_source: dict[str, str], metas: dict[str, CheckpointMeta],
                   g: int, rule: str, base: str) -> SubgroupPlan:
    runs: list[CopyRun] = []
    for s in slots:
        src = param_source[s.name]
        if runs and runs[-1].source == src:
            last = runs[-1]
            runs[-1] = CopyRun(src, last.start, last.length + s.length)
        else:
            runs.append(CopyRun(src, s.offset, s.length))
    contributors = {r.source for r in runs}
    if len(contributors) <= 1:
        src = next(iter(contributors), base)
        how = "single source"
    else:
        src = step_source(contributors, metas, rule, base)
        how = rule
    return SubgroupPlan(tuple(runs), metas[src].subgroup_steps[g], src, how)


def _check_output(recipe: Recipe, metas: dict[str, CheckpointMeta]) -> Path:
    if recipe.output is None:
        raise UserError(f"{recipe.origin}: no output; set `output:` in the recipe or pass -o")
    out = recipe.output
    for name, meta in metas.items():
        for src in {meta.files.tag_dir.resolve(), recipe.source_path(name)}:
            if out == src or src in out.parents or out in src.parents:
                raise UserError(f"{recipe.origin}: output {out} overlaps source {name} ({src}); "
                                f"write the merged checkpoint somewhere else")
    return out
