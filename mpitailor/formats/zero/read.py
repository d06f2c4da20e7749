"""Read a checkpoint's `CheckpointMeta` (meta.py) from its rank-0 files, and check them.

Apart from the record so that the record stays small: reading parses the files' pickles
(formats/torch/pickle_read.py); big tensors are never touched.
"""
from __future__ import annotations

import logging
from pathlib import Path

from mpitailor.display import bounded
from mpitailor.errors import CheckpointError
from mpitailor.formats.io import LOCAL
from mpitailor.formats.manifest import read_manifest
from mpitailor.formats.torch import Tensor, load, materialize, read_slice
from mpitailor.formats.zero import files as zfiles
from mpitailor.formats.zero.files import CheckpointFiles
from mpitailor.formats.zero.layout import compute_layout
from mpitailor.formats.zero.meta import DEFAULT_SUB_GROUP_SIZE, CheckpointMeta
from mpitailor.formats.zero.names import check_model_names, check_name
from mpitailor.formats.zero.partial_shard import check_partial_claims

log = logging.getLogger(__name__)


def read_meta(path: Path | str, view=LOCAL) -> CheckpointMeta:
    """Read a checkpoint's metadata from its rank-0 files (memory-mapped, tensors untouched).
    view: where the checkpoint's other files are looked up (fsview.py); the rank-0 files
    must be readable here."""
    files = zfiles.resolve(path, view)
    model = load(files.model_path(0), opaque_ok=True)
    optim = load(files.optim_path(0))  # structure only: tensors are read where needed
    _require_keys(files.model_path(0), model, ("param_shapes", "dp_world_size", "global_steps"))
    _require_keys(files.optim_path(0), optim, ("optimizer_state_dict",))
    for key in ("global_steps", "dp_world_size", "global_samples", "mp_world_size"):
        value = model.get(key)
        optional = key in ("global_samples", "mp_world_size")  # DeepSpeed may leave them out
        if not (optional and value is None) and (type(value) is not int or value < 0):
            raise CheckpointError(f"{files.model_path(0)}: {key} is {shown_value(value)}, not a "
                                  f"count; a damaged or foreign model-states file")
    try:
        return _read_meta(files, view, model, optim)
    except (TypeError, ValueError, OverflowError, AttributeError, KeyError, IndexError) as e:
        # A field of the wrong type or shape somewhere in DeepSpeed's metadata: one line.
        raise CheckpointError(f"{files.model_path(0)}: malformed DeepSpeed metadata "
                              f"({type(e).__name__}: {str(e)[:120]}); a damaged or foreign "
                              f"checkpoint") from None


def shown_value(value) -> str:
    """A pickled value as an error shows it: its type, and a short repr."""
    return f"{type(value).__name__} {repr(value)[:40]}"


def _read_meta(files, view, model: dict, optim: dict) -> CheckpointMeta:
    osd = optim["optimizer_state_dict"]
    stage = _stage(files, osd)
    if int(model.get("mp_world_size") or 1) > 1:
        raise CheckpointError(f"{files.model_path(0)}: mp_world_size="
                              f"{model['mp_world_size']}: a tensor/pipeline-parallel checkpoint; "
                              f"mpitailor merges data-parallel ZeRO checkpoints only")
    world = int(model["dp_world_size"])
    if world > files.world_size:
        raise CheckpointError(
            f"{files.tag_dir}: the files of ranks 0-{files.world_size - 1}, but the checkpoint "
            f"was saved by {world} ranks: {_rank_file(files, files.world_size)} and those "
            f"after it are missing (node-local storage: run on every node that holds the "
            f"checkpoint's files)")
    counts = osd.get("partition_count", world)
    counts = set(counts) if isinstance(counts, (list, tuple)) else {counts}
    if world != files.world_size or {int(c) for c in counts} != {world}:
        raise CheckpointError(
            f"{files.tag_dir}: {files.world_size} rank files but dp_world_size={world} and "
            f"partition_count={osd.get('partition_count')}; files from different runs?")
    shapes = _checked_shapes(files.model_path(0), model["param_shapes"])
    check_model_names(files.model_path(0), model)
    layout = compute_layout(shapes, world, flat=files.flat)
    inner = osd["base_optimizer_state"] if files.flat else osd["optimizer_state_dict"]
    n_sub = len(layout.subgroup_sizes)
    if files.flat:
        _check_flat_optimizer(files.optim_path(0), osd, layout)
    flat = osd.get("single_partition_of_fp32_groups" if files.flat else "fp32_flat_groups", [])
    sizes = [layout.lean_size(g, 0) if files.flat else n
             for g, n in enumerate(layout.subgroup_sizes)]
    if not files.partial and (len(flat) != n_sub or any(
            t.numel() != n for t, n in zip(flat, sizes))):
        raise CheckpointError(f"{files.optim_path(0)}: fp32 flat groups do not match the "
                              f"param_shapes of {files.model_path(0)}; files from different runs?")
    strided = next((g for g, t in enumerate(flat) if isinstance(t, Tensor)
                    and not t.is_contiguous()), None)
    if strided is not None:
        raise CheckpointError(f"{files.optim_path(0)}: fp32 flat group {strided} is a strided "
                              f"view, not a contiguous flat buffer as DeepSpeed saves it; save "
                              f"the file again with the buffer made contiguous "
                              f"(tensor.contiguous())")
    if files.flat and not files.partial:
        _check_16bit_current(files, model, flat, layout)
    frozen = _names_to(files.model_path(0), model, "frozen_param_shapes", tuple)
    _check_frozen(files.model_path(0), model, frozen, layout)
    groups = _param_groups(files.optim_path(0), inner, n_sub)
    lineage, patterns = zfiles.read_save_record(files.tag_dir, files.partial, view)
    manifest_of = _partial_manifest(files, view, model, shapes) if files.partial else None
    return CheckpointMeta(
        files=files, layout=layout, dtype=_model_dtype(model), zero_stage=stage,
        global_steps=int(model["global_steps"]),
        global_samples=int(model.get("global_samples", 0)),
        param_groups=groups,
        subgroup_steps=_read_steps(files.optim_path(0), inner["state"], n_sub),
        frozen_shapes=tuple((n, tuple(int(d) for d in s)) for n, s in frozen),
        shared_params=tuple(sorted(_names_to(files.model_path(0), model, "shared_params",
                                             str))),
        ds_version=str(model.get("ds_version", "")),
        held_layers=manifest_of[0] if files.partial else None,
        file_records=manifest_of[1] if files.partial else _full_records(files, view),
        lineage=lineage, layer_patterns=tuple(patterns.items()),
        sub_group_size=int(((model.get("ds_config") or {}).get("zero_optimization") or {})
                           .get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)),
    )


def _full_records(files: CheckpointFiles, view) -> tuple[tuple[str, object], ...]:
    """A full save's file records, as its SAVE_RECORD holds them (none: not recorded)."""
    return tuple(sorted((zfiles.read_file_records(files.tag_dir, view) or {}).items()))


SAMPLED_PARAMS, SAMPLED_ELEMENTS = 32, 16
_warned: set[Path] = set()  # say it once per file, however often the checkpoint is read


def _check_16bit_current(files: CheckpointFiles, model: dict, flat: list, layout) -> None:
    """Warn if a stage 1/2 model-states file's 16-bit weights are not rank 0's fp32 master
    weights cast down. DeepSpeed copies the master weights into them after every step, so
    in a save they are equal bit for bit (every stage 1/2 fixture: 0 of all parameters
    differ); merges carry them as they are, so a model-states file older than the optimizer
    files (copied in from another save, a rebuilt save) would carry stale weights. A sample:
    the first elements of up to SAMPLED_PARAMS parameters rank 0 holds, a few small reads."""
    path = files.model_path(0)
    module = model.get("module") or {}
    held = [s for s in layout.slots if layout.held(s, 0)[2] > 0 and isinstance(
        module.get(s.name), Tensor) and module[s.name].numel() == s.numel]
    if path in _warned or not held:
        return
    from mpitailor.formats.torch import cast
    with open(files.optim_path(0), "rb") as f:
        for s in held[::max(1, len(held) // SAMPLED_PARAMS)]:
            at, first, n = layout.held(s, 0)
            k = min(n, SAMPLED_ELEMENTS)
            bit16 = module[s.name]
            master = cast(read_slice(f.fileno(), flat[s.subgroup], at, k), "fp32", bit16.dtype)
            if not _same_or_nan(master, bit16.raw(first, k), bit16.dtype):
                _warned.add(path)
                log.warning("%s: its model weights (module, %s) are not the fp32 master "
                            "weights of %s cast down (%s differs): this model-states file was "
                            "not saved with those optimizer files (older, or files mixed) and "
                            "a merge carries its weights as they are; put back the save's own "
                            "model-states file", path, bit16.dtype,
                            files.optim_path(0).name, s.name)
                return


def _same_or_nan(a, b, dtype: str) -> bool:
    """Equal bits, or both NaN (what torch.allclose(..., equal_nan=True) accepts)."""
    import numpy as np

    from mpitailor.formats.torch import cast
    fa, fb = (cast(x, dtype, "fp32") for x in (a, b))
    return bool(np.all((fa == fb) | (np.isnan(fa) & np.isnan(fb))))


def _rank_file(files: CheckpointFiles, rank: int) -> str:
    """The file that names a rank: its model states (stage 3), its optimizer file (1/2)."""
    return files.optim_path(rank).name if files.flat else zfiles.model_file(rank)


def _stage(files: CheckpointFiles, osd: dict) -> int:
    """The ZeRO stage the optimizer file says, checked against the file names."""
    if files.flat and "zero_stage" not in osd and "single_partition_of_fp32_groups" in osd:
        raise CheckpointError(
            f"{files.optim_path(0)}: saved by DeepSpeed's BF16_Optimizer (bf16 with ZeRO stage "
            f"1 and fp32 gradient accumulation); mpitailor reads the ZeRO optimizer's stage 1/2 "
            f"files: train with data_types.grad_accum_dtype bf16, or with ZeRO stage 2 or 3")
    try:
        stage = int(osd.get("zero_stage", 3))
    except (TypeError, ValueError):
        raise CheckpointError(f"{files.optim_path(0)}: zero_stage is "
                              f"{bounded(osd.get('zero_stage'))}; not a DeepSpeed ZeRO optim file") from None
    if files.partial and stage in (1, 2, 3) and (stage == 3) == files.flat:
        raise CheckpointError(f"{files.tag_dir / zfiles.PARTIAL_MANIFEST}: zero_stage says "
                              f"{'1 or 2' if files.flat else '3'}, but "
                              f"{files.optim_path(0).name} is of ZeRO stage {stage}; the "
                              f"manifest is damaged")
    if stage not in (1, 2, 3) or (stage == 3) == files.flat:
        raise CheckpointError(
            f"{files.optim_path(0)}: a ZeRO stage {stage} optimizer file beside "
            f"{files.model_path(0).name}; files from different runs?")
    return stage


def _check_flat_optimizer(path: Path, osd: dict, layout) -> None:
    """Stage 1/2 layouts mpitailor does not rebuild, refused by name."""
    if not isinstance(osd.get("base_optimizer_state"), dict):
        raise CheckpointError(f"{path}: an elastic ZeRO checkpoint (zero_optimization."
                              f"elastic_checkpoint true); save with elastic_checkpoint false")
    paddings = osd.get("param_alignment_paddings") or []
    if any(any(int(x) for x in group) for group in paddings):
        raise CheckpointError(f"{path}: parameters padded for alignment (zero_optimization."
                              f"parameter_alignment or round_robin_gradients); save without them")
    mappings = osd.get("param_slice_mappings")
    if mappings is not None and not flat_mappings_agree(mappings, layout, 0):
        raise CheckpointError(f"{path}: param_slice_mappings disagree with param_shapes "
                              f"(parameters reordered, e.g. round_robin_gradients); save "
                              f"with zero_optimization.round_robin_gradients false")


def flat_mappings_agree(mappings, layout, rank: int) -> bool:
    """Does a stage 1/2 file's `param_slice_mappings` (per group: name -> (numel, start) of
    this rank's fragment) place every parameter where the layout does?"""
    try:
        for g, group in enumerate(mappings):
            want = {}
            for s in layout.subgroup_slots(g):
                off, _, n = layout.held(s, rank)
                if n:
                    want[s.name] = (n, off)
            got = {name: (int(a.numel), int(a.start)) for name, a in group.items()}
            if got != want:
                return False
        return len(mappings) == len(layout.subgroup_sizes)
    except (AttributeError, TypeError, ValueError):
        return False


def _partial_manifest(files: CheckpointFiles, view, model: dict,
                      shapes: list[dict]) -> tuple[frozenset[str], tuple]:
    """(layers held, file records) of a partial checkpoint's manifest, its claims checked
    against rank 0's model states (resolve checked its fields' bounds)."""
    path = files.tag_dir / zfiles.PARTIAL_MANIFEST
    try:
        manifest = read_manifest(path, view)
        check_partial_claims(manifest, files, dtype=_model_dtype(model),
                             global_steps=int(model["global_steps"]), shapes=shapes,
                             keys_at_most=sum(map(len, shapes)) + len(
                                 model.get("frozen_param_shapes") or {}))
        return frozenset(manifest["layers"]), tuple(sorted(manifest.files.items()))
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); the partial save is damaged") \
            from None


def _names_to(path: Path, model: dict, key: str, kind: type) -> list[tuple[str, object]]:
    """model[key] (absent: empty) as (parameter name, value) pairs, each value a `kind`
    (a shape: a tuple of counts)."""
    got = model.get(key) or {}
    items = list(got.items()) if isinstance(got, dict) else None
    if items is None or not all(type(n) is str and isinstance(v, kind) for n, v in items) or (
            kind is tuple and not all(_elements(v) is not None for _, v in items)):
        raise CheckpointError(f"{path}: {key} is not a mapping of parameter names to "
                              f"{'shapes' if kind is tuple else 'names'}; a damaged or foreign "
                              f"model-states file")
    for name, value in items:
        check_name(path, key, name)
        if kind is str:
            check_name(path, key, value)
    return items


def _check_frozen(path: Path, model: dict, frozen: list, layout) -> None:
    """Frozen parameters as DeepSpeed saves them: none also trainable, each with its
    fragment in the model states (what a merge copies)."""
    trainable = {s.name for s in layout.slots}
    fragments = model.get("frozen_param_fragments") or {}
    for name, _ in frozen:
        if name in trainable:
            raise CheckpointError(f"{path}: {bounded(name)} is both trainable (param_shapes) "
                                  f"and frozen (frozen_param_shapes); a damaged or crafted file")
        if not isinstance(fragments, dict) or name not in fragments:
            raise CheckpointError(f"{path}: frozen parameter {bounded(name)} has no entry in "
                                  f"frozen_param_fragments; a damaged or crafted file")


def _param_groups(path: Path, inner: dict, n_sub: int) -> tuple[tuple[int, ...], ...]:
    """The optimizer's param groups as the ids of their sub-groups (flat buffers), each one
    of the n_sub that param_shapes lays out."""
    try:
        groups = tuple(tuple(int(i) for i in g["params"]) for g in inner["param_groups"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: param_groups are malformed; a damaged or foreign "
                              f"optimizer-states file") from None
    if not all(0 <= i < n_sub for g in groups for i in g):
        raise CheckpointError(f"{path}: param_groups name sub-groups past the {n_sub} "
                              f"param_shapes lays out; a damaged or crafted file")
    return groups


def _require_keys(path: Path, obj, keys: tuple[str, ...]) -> None:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a DeepSpeed checkpoint dict")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise CheckpointError(f"{path}: missing key {missing[0]!r}; not a DeepSpeed ZeRO-3 "
                              f"checkpoint file")


MAX_ELEMENTS = 1 << 48  # far beyond any parameter: a larger one is a damaged or crafted file


def _elements(dims) -> int | None:
    """The element count of a shape of non-negative ints; None for anything else, or past
    MAX_ELEMENTS (stopped there: the product of thousands of huge dims costs quadratic
    time)."""
    if not isinstance(dims, (tuple, list)) or not all(
            type(d) is int and 0 <= d <= MAX_ELEMENTS for d in dims):
        return None
    if 0 in dims:
        return 0
    n = 1
    for d in dims:
        n *= d
        if n > MAX_ELEMENTS:
            return None
    return n


def _checked_shapes(path: Path, raw) -> list[dict[str, tuple[int, ...]]]:
    """param_shapes as DeepSpeed writes it (a list of name -> shape mappings), or a clear
    CheckpointError: a crafted or damaged file must not reach the partition arithmetic."""
    bad = f"{path}: param_shapes is malformed"
    if not isinstance(raw, (list, tuple)):
        raise CheckpointError(f"{bad} (not a list); not a DeepSpeed ZeRO-3 checkpoint file")
    out, seen = [], set()
    for g, shapes in enumerate(raw):
        if not isinstance(shapes, dict):
            raise CheckpointError(f"{bad} (sub-group {g} is not a mapping)")
        group = {}
        for name, shape in shapes.items():
            if not isinstance(name, str) or name in seen:
                raise CheckpointError(f"{bad} (parameter {bounded(name)} is not a unique name)")
            check_name(path, "param_shapes", name)
            seen.add(name)
            try:
                dims = tuple(int(d) for d in shape)
            except (TypeError, ValueError):
                raise CheckpointError(f"{bad} ({name}: shape {bounded(shape)})") from None
            if _elements(dims) is None:
                raise CheckpointError(f"{bad} ({name}: shape {bounded(list(dims))})")
            group[name] = dims
        out.append(group)
    return out


def _model_dtype(model: dict) -> str:
    for t in model.get("module", {}).values():
        if isinstance(t, Tensor) and t.is_floating_point():
            return t.dtype
    return "fp32"


def _read_steps(path: Path, state: dict, n_sub: int) -> tuple[float, ...]:
    if n_sub == 0:
        return ()
    state = materialize({i: state.get(i, {}).get("step", 0) for i in range(n_sub)})
    return tuple(float(s.item() if isinstance(s, Tensor) else s) for s in state.values())
