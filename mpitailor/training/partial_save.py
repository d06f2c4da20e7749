"""`save_layers`: a partial checkpoint of some layers from a live DeepSpeed ZeRO engine.

Every rank writes only the chosen layers' slices of its fp32 master weights and both Adam
moments (safetensors), plus what a resume needs and which is small: DeepSpeed's own
model-states dict (counters, lr scheduler, shapes, client state), the optimizer's non-tensor
state (param groups, loss scaler, every sub-group's Adam `step`) and the rng states.
ZeRO stages 1/2 keep the whole model's 16-bit weights in their model states: a partial save
keeps empty placeholders there instead (as ZeRO-3 does), and a merge rebuilds the weights
from the fp32 master weights, which DeepSpeed keeps them equal to. The
checkpoint is staged in a hidden dir and published by rank 0 with one rename once every rank
has written and fsynced its files; its manifest is the last file written.

Collective over the engine's data-parallel group: call on every rank.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from mpitailor.training import dependencies

with dependencies(__name__):
    import torch

from mpitailor import failpoints
from mpitailor.facade import LayerClassifier
from mpitailor.formats.manifest import PARTIAL_FORMAT, PartialFields
from mpitailor.formats.zero import (
    KINDS,
    STAGE12_MODEL,
    Lineage,
    compute_layout,
    model_file,
    partial_files,
    without_flat_buffers,
)
from mpitailor.training.distcomm import training_comm
from mpitailor.training.overlap import StepGuard
from mpitailor.training.snapshot import (
    HostBuffers,
    Snapshot,
    agree,
    torch_bytes,
    write,
)

VERSION = 1  # the partial layout (files and keys), beside the manifest's format_version


class PartialCheckpointError(RuntimeError):
    """DeepSpeed was asked to resume from a partial checkpoint alone."""


def refuse_partial_resume(tag_dir: str):
    """Raise the error that tells a user DeepSpeed is loading a partial checkpoint.

    Each rank of a partial save also writes a guard file where DeepSpeed looks for its model
    states; DeepSpeed's own loader unpickles it and so calls this (mpitailor's loaders never
    read it). Without it, a plain Trainer or engine pointed at a partial checkpoint fails
    deep inside DeepSpeed (`assert len(self.ckpt_list) > 0`) with no hint."""
    raise PartialCheckpointError(
        f"{tag_dir} is a partial checkpoint (only some layers were saved): DeepSpeed cannot "
        f"resume from it alone. Assemble a full one first with `python -m mpitailor recover "
        f"SAVE_DIR -o OUT` (SAVE_DIR: the dir of the run's saves) and resume from OUT, or use "
        f"mpitailor's LayerwiseTrainer.train(resume_from_checkpoint=True)")


class _ResumeGuard:
    def __init__(self, tag_dir: str) -> None:
        self.tag_dir = tag_dir

    def __reduce__(self):
        return (refuse_partial_resume, (self.tag_dir,))


def flat_engine(engine) -> bool:
    """Does the engine run ZeRO stage 1 or 2 (flat partitions, one model-states file)?"""
    return engine.zero_optimization_stage() in (1, 2)


def model_states(engine, client_state: dict | None = None) -> dict:
    """The dict DeepSpeed itself writes as its model states (small: stage 1/2 parameters
    become empty placeholders in the model dtype, as ZeRO-3 writes them)."""
    module = engine.module_state_dict()
    if flat_engine(engine):
        params = {n for n, _ in engine.module.named_parameters()}
        module = type(module)((n, t.new_empty(0) if n in params else t)
                              for n, t in module.items())
    else:
        module = _zero3_placeholders(engine, module)
    state = _checkpoint_state(engine, module)
    state.update(client_state or {})
    return state


def _zero3_placeholders(engine, module: dict) -> dict:
    """The module state dict as ZeRO-3's engine.save_checkpoint writes it, without its
    partitioning round trip. DeepSpeed partitions every parameter first (the small,
    persistent ones too, which stay gathered between steps), so each entry is a
    parameter's empty `data` (free_param: torch.empty(0) of its dtype and device), and then
    all-gathers the persistent ones back: a collective per save that costs more than the
    rest of an asynchronous save's blocked time. The same placeholders are made here
    directly, one storage per parameter and a tensor per entry (tied weights: two entries,
    one storage), as `param.detach()` of a freed parameter gives; torch.save then writes the
    same bytes (tests/test_async_save.py checks them against DeepSpeed's own)."""
    by_name = dict(engine.module.named_parameters(remove_duplicate=False))
    empty: dict[int, torch.Tensor] = {}
    out = type(module)()
    for name, t in module.items():
        p = by_name.get(name)
        if p is None or not hasattr(p, "ds_id"):
            out[name] = t
            continue
        if id(p) not in empty:
            empty[id(p)] = torch.empty(0, dtype=p.dtype, device=p.device)
        out[name] = empty[id(p)].detach()
    if hasattr(module, "_metadata"):
        out._metadata = module._metadata
    return out


def _checkpoint_state(engine, module: dict) -> dict:
    """DeepSpeed's model-states dict for `module`, a ZeRO save with frozen parameters.
    Newer releases build it in `_common_checkpoint_state`; 0.17.6 and older build the same
    dict inline in `_save_checkpoint` (with sparse_tensor_module_names, without the parallel
    metadata), copied here key for key so that a partial save matches that release's own."""
    if hasattr(engine, "_common_checkpoint_state"):
        return engine._common_checkpoint_state(module, True, True)
    from deepspeed import version
    shapes, fragments = engine._get_param_shape_func, engine._get_param_fragment_func
    loader = engine.training_dataloader
    return {
        "module": module, "buffer_names": engine._get_buffer_names(), "optimizer": None,
        "param_shapes": engine._get_zero_param_shapes() if engine.optimizer else None,
        "frozen_param_shapes": engine._get_zero_frozen_param_attributes(shapes),
        "shared_params": engine._get_shared_params() if engine.optimizer else None,
        "frozen_param_fragments": engine._get_zero_frozen_param_attributes(fragments),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None
        else None,
        "data_sampler": loader.data_sampler.state_dict()
        if loader is not None and engine.curriculum_learning_enabled() else None,
        "random_ltd": engine.random_ltd_scheduler.state_dict() if engine.random_ltd_enabled()
        else None,
        "sparse_tensor_module_names": engine.sparse_tensor_module_names,
        "skipped_steps": engine.skipped_steps, "global_steps": engine.global_steps,
        "global_samples": engine.global_samples, "dp_world_size": engine.seq_dp_world_size,
        "mp_world_size": engine.mp_world_size, "ds_config": engine.config, "ds_version": version}


def layer_slices(engine, param_shapes, layers: set[str],
                 classify: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """`{kind}/{name}` -> this rank's slice for the chosen layers (stage 3: padding
    included; stages 1/2: the part of the parameter in this rank's partition, if any)."""
    flat = flat_engine(engine)
    osd = engine.optimizer.state_dict()
    flats = osd["single_partition_of_fp32_groups" if flat else "fp32_flat_groups"]
    state = osd["base_optimizer_state" if flat else "optimizer_state_dict"]["state"]
    layout = compute_layout(param_shapes, engine.dp_world_size, flat=flat)
    out = {}
    for slot in layout.slots:
        if classify(slot.name) not in layers:
            continue
        at, n = layout.span(slot, engine.global_rank)
        if n == 0:
            continue
        for kind in KINDS:
            buf = flats[slot.subgroup] if kind == "fp32" else state[slot.subgroup][kind]
            # A view, not a copy: written before the engine takes another step.
            out[f"{kind}/{slot.name}"] = buf.detach()[at: at + n]
    return out


def all_slices_elements(engine) -> int:
    """Elements of this rank's slices of every layer (fp32 master and both moments): what
    the largest partial save can hold. From the layout alone (no optimizer state needed)."""
    layout = compute_layout(engine._get_zero_param_shapes(), engine.dp_world_size,
                            flat=flat_engine(engine))
    return len(KINDS) * sum(layout.span(slot, engine.global_rank)[1] for slot in layout.slots)


def slice_elements_by_layer(engine, classify: Callable[[str], str]) -> dict[str, int]:
    """Layer key -> elements of this rank's slices of it (fp32 master and both moments, as
    `layer_slices` takes them): what a partial save holding it copies into host buffers."""
    layout = compute_layout(engine._get_zero_param_shapes(), engine.dp_world_size,
                            flat=flat_engine(engine))
    out: dict[str, int] = {}
    for slot in layout.slots:
        key = classify(slot.name)
        out[key] = out.get(key, 0) + len(KINDS) * layout.span(slot, engine.global_rank)[1]
    return out


def optimizer_meta(engine) -> dict:
    """The optimizer states file of DeepSpeed minus its flat buffers and moments."""
    osd = without_flat_buffers(engine.optimizer.state_dict())
    import deepspeed
    return {"optimizer_state_dict": osd, "ds_config": engine.config,
            "ds_version": deepspeed.__version__}


def rng_state() -> dict:
    """Same keys as HF Trainer's rng_state_{rank}.pth."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state()}


def save_layers(engine, save_dir: str | os.PathLike, tag: str, layers: Iterable[str],
                client_state: dict | None = None,
                classify: LayerClassifier | None = None,
                lineage: Lineage | None = None) -> Path:
    """Collective: publish `save_dir/tag` holding `layers` (layer keys, e.g. 'layers.3',
    'embed'). Returns the published path. Raises PartialSaveFailed on every rank if any
    rank failed; then nothing is published.
    lineage: the save's chain and parent (rank 0's is recorded), so that `recover` never
    combines saves of two timelines; LayerwiseCheckpointer passes it.
    classify: parameter name -> layer key; its patterns are recorded, so `recover` finds the
    same layers without being told."""
    snap = take(engine, save_dir, tag, layers, client_state, classify, lineage)
    return write(snap, training_comm())


def take(engine, save_dir: str | os.PathLike, tag: str, layers: Iterable[str],
         client_state: dict | None = None, classify: LayerClassifier | None = None,
         lineage: Lineage | None = None, host: HostBuffers | None = None,
         on_published=None, step_guard: StepGuard | None = None) -> Snapshot:
    """Collective: what the partial save of `layers` holds, from the live engine. host: copy
    the slices into these buffers (an asynchronous save); else they stay views of the
    engine's buffers, to be written before the engine takes another step. step_guard (with host,
    installed): overlap the copy with the next step (overlap.py): it is left to the writer
    (Snapshot.copy) and the guard holds the engine's next optimizer step until it is done;
    the caller must hand the snapshot to the writer, or call its copy."""
    classify = classify or LayerClassifier()
    layers = set(layers)
    final = Path(save_dir) / tag
    comm = training_comm()
    t0 = time.perf_counter()

    def states_and_slices():
        states = model_states(engine, client_state)
        return states, layer_slices(engine, states["param_shapes"], layers, classify)
    states, slices = agree(comm, states_and_slices)
    t1 = time.perf_counter()
    overlapped = host is not None and step_guard is not None and step_guard.installed
    if host is not None:
        agree(comm, host.check, host.need(slices))
        if not overlapped:
            slices = host.copy(slices)
    else:  # written now, from host memory: slices of GPU buffers are copied down first
        slices = {k: v if v.device.type == "cpu" else v.cpu() for k, v in slices.items()}
    t2 = time.perf_counter()
    rank, leader, flat = engine.global_rank, save_leader(engine), flat_engine(engine)
    names = partial_files(rank)
    guard = STAGE12_MODEL if flat and leader else None if flat else model_file(rank)
    blobs = {guard: torch_bytes(_ResumeGuard(str(final)))} if guard is not None else {}
    blobs[names["model"]] = torch_bytes(states)
    blobs[names["optim"]] = torch_bytes(optimizer_meta(engine))
    blobs[names["rng"]] = torch_bytes(rng_state())
    fields = PartialFields(
        format=PARTIAL_FORMAT, version=VERSION, tag=tag,
        global_steps=engine.global_steps, world_size=engine.dp_world_size,
        dtype="bf16" if engine.bfloat16_enabled() else
              "fp16" if engine.fp16_enabled() else "fp32",
        layers=sorted(layers),
        zero_stage=engine.zero_optimization_stage(),
        layout_sha256=_layout_hash(states["param_shapes"]),
        lineage=lineage.to_json() if lineage else None,
        layer_patterns=classify.patterns)
    t3 = time.perf_counter()
    snap = Snapshot(final, rank, leader, blobs, slices, fields, on_published,
                    seconds={"gather": t1 - t0, "copy": t2 - t1, "serialise": t3 - t2})
    if overlapped:
        snap.copy = _overlapped_copy(snap, host, step_guard)
    return snap


def _overlapped_copy(snap: Snapshot, host: HostBuffers, guard: StepGuard):
    """The host copy of snap's live slices, to run in the writer while the next step runs:
    armed here (the next optimizer step waits from now on), released once copied or failed."""
    live = snap.slices
    after = None
    if any(t.device.type == "cuda" for t in live.values()):
        after = torch.cuda.Event()
        after.record()  # the state is final once the training stream gets here
    guard.arm()

    def copy() -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            failpoints.hit("snapshot-copy", snap.final.name)
            return host.copy(live, after)
        finally:
            guard.release()
            snap.seconds["copy_overlapped"] = time.perf_counter() - t0
    return copy


def save_leader(engine) -> bool:
    """Does this rank stage and publish saves? Rank 0; with DeepSpeed's node-local storage
    (each node its own disk; HF: save_on_each_node), the first rank of every node."""
    use = getattr(engine, "use_node_local_storage", None)
    return engine.global_rank == 0 or (bool(use()) if callable(use) else False) \
        and engine.local_rank == 0


def _layout_hash(param_shapes) -> str:
    text = json.dumps([[(n, list(s)) for n, s in g.items()] for g in param_shapes])
    return hashlib.sha256(text.encode()).hexdigest()
