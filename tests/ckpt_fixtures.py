"""Real DeepSpeed ZeRO-3 checkpoints for the tests, built once and cached on disk.

Every variant is a real multi-process DeepSpeed run (`dev.tinytrain`) that saves at
steps 5 and 10. The cache key is the run's spec plus FIXTURE_VERSION, so changing a spec
rebuilds just that variant. `make fixtures` (`PYTHONPATH=. python tests/ckpt_fixtures.py`: dev/ is
the repo's) builds them all (the Makefile
does this before the MPI tests, whose ranks must not race to build).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from dev.tinytrain import TrainSpec, launch

FIXTURE_VERSION = 5  # 2: saves record their lineage; 3: resume guards, HF per-layer groups;
# 5: full saves record their files
CACHE = Path(os.environ.get("MPITAILOR_FIXTURES",
                            Path(__file__).resolve().parents[1] / ".cache" / "fixtures"))
FROZEN = ("model.layers.1.mlp.up_proj.weight",)
HF_MODULE = "dev.tinytrain.hf_worker"

# name -> (spec overrides, worker module)
VARIANTS: dict[str, tuple[dict, str | None]] = {
    "w2_fp32_one": (dict(world_size=2), None),
    "w3_bf16_decay_tied_frozen": (dict(world_size=3, dtype="bf16", grouping="decay", tie=True,
                                       frozen=FROZEN), None),
    "w4_fp32_per_layer": (dict(world_size=4, grouping="per_layer"), None),
    "w2_bf16_small_subgroups_tied_frozen": (dict(world_size=2, dtype="bf16", tie=True,
                                                 sub_group_size=6000, frozen=FROZEN), None),
    "w3_qwen2_fp32_decay": (dict(world_size=3, arch="qwen2", grouping="decay"), None),
    "w2_bf16_per_layer": (dict(world_size=2, dtype="bf16", grouping="per_layer"), None),
    "hf_w2_fp32": (dict(world_size=2), HF_MODULE),
    "hf_w2_bf16": (dict(world_size=2, dtype="bf16"), HF_MODULE),
    "hf_w3_bf16_weights_tied": (dict(world_size=3, dtype="bf16", tie=True, save_16bit=True),
                                HF_MODULE),
    # ZeRO stages 1 and 2: flat partitions, one model-states file.
    "s2_w2_bf16_per_layer": (dict(world_size=2, zero_stage=2, dtype="bf16",
                                  grouping="per_layer"), None),
    "s2_w3_fp32_decay_tied_frozen": (dict(world_size=3, zero_stage=2, grouping="decay",
                                          tie=True, frozen=FROZEN), None),
    "s1_w2_fp32_one": (dict(world_size=2, zero_stage=1), None),
    "hf_s2_w2_bf16": (dict(world_size=2, zero_stage=2, dtype="bf16"), HF_MODULE),
    # Big enough (~12 MB of optimizer state per rank) that per-file metadata is noise.
    "w2_fp32_wide": (dict(world_size=2, hidden=256, intermediate=512, vocab=2048,
                          steps=6, save_at=(3, 6)), None),
}
# Layer-wise saving runs (full save at step 2, policy-chosen partial saves at 4, 6, 8), and a
# twin of the first that saves everything, to compare partial slices with full saves.
LAYERWISE = dict(world_size=2, grouping="per_layer", steps=8, save_at=(2, 4, 6, 8))
SAVING_VARIANTS: dict[str, tuple[dict, str | None]] = {
    "w2_parity": (dict(LAYERWISE, policy={"name": "parity"}, stats="stats.h5"), None),
    "w2_parity_twin_full": (dict(LAYERWISE), None),
    "w2_adaptive": (dict(LAYERWISE, policy={"name": "adaptive", "top_fraction": 0.5,
                                            "max_staleness": 2}, stats="stats.h5"), None),
    # An ordinary training script: Namespace, numpy scalar and a dataclass in client_state.
    "w2_client_state": (dict(LAYERWISE, policy={"name": "parity"}, client_state=True), None),
    "hf_w2_parity": (dict(world_size=2, steps=8, save_at=(2, 4, 6, 8),
                          policy={"name": "parity"}), HF_MODULE),
    # ZeRO stage 2 (bf16, W=3: parameters straddle ranks), its full-saving twin, and HF.
    "s2_w3_bf16_parity": (dict(LAYERWISE, world_size=3, zero_stage=2, dtype="bf16",
                               policy={"name": "parity"}, stats="stats.h5"), None),
    "s2_w3_bf16_parity_twin_full": (dict(LAYERWISE, world_size=3, zero_stage=2,
                                         dtype="bf16"), None),
    "hf_s2_w2_parity": (dict(world_size=2, zero_stage=2, steps=8, save_at=(2, 4, 6, 8),
                             policy={"name": "parity"}), HF_MODULE),
    "s1_w2_parity": (dict(LAYERWISE, zero_stage=1, policy={"name": "parity"}), None),
}
# The same runs with partial saves written in the background: their saves must hold what the
# synchronous runs' saves hold (tests/test_async_save.py). Rank 0's copy of the slices into
# host buffers, overlapped with the next step, starts a second late: long after that step's
# forward and backward, so its optimizer step would change the state under the copy if the
# step guard (training/overlap.py) did not hold it.
ASYNC_TWINS = {f"{name}_async": name for name in
               ("w2_parity", "s2_w3_bf16_parity", "s1_w2_parity", "hf_s2_w2_parity")}
COPY_LATE = {"env": {"MPITAILOR_FAILPOINT": "snapshot-copy:0:sleep=1"}}
SAVING_VARIANTS.update({twin: (dict(SAVING_VARIANTS[name][0], async_save=True,
                                    extra=COPY_LATE),
                               SAVING_VARIANTS[name][1]) for twin, name in ASYNC_TWINS.items()})
STAGE12_VARIANTS = ["s2_w2_bf16_per_layer", "s2_w3_fp32_decay_tied_frozen", "s1_w2_fp32_one",
                    "hf_s2_w2_bf16"]
ZERO3_VARIANTS = [n for n in VARIANTS if n not in ("w2_fp32_wide", *STAGE12_VARIANTS)]
VARIANTS.update(SAVING_VARIANTS)
# PyTorch Distributed Checkpoints (issue 43), by real FSDP2 runs (dev/tinytrain/fsdp2_worker.py:
# fully_shard per decoder layer, AdamW, get_state_dict + dcp.save at steps 2 and 4 into
# step-N/): 2 ranks with the optimizer keyed by parameter names (torchtitan's), 3 ranks
# (uneven chunks) with torch's default keys (param_groups by index).
DCP_MODULE = "dev.tinytrain.fsdp2_worker"
DCP_VARIANTS = {
    "dcp_w2_fsdp2": (dict(world_size=2, steps=4, save_at=(2, 4),
                          extra={"flatten_optimizer": True}), DCP_MODULE),
    "dcp_w3_fsdp2_groups": (dict(world_size=3, steps=4, save_at=(2, 4)), DCP_MODULE),
}
VARIANTS.update(DCP_VARIANTS)
# Layer-wise DCP saves (DcpCheckpointer, Parity: full 2, odd layers 4, even 6, odd 8), for
# retention (tests/test_dcp_prune.py); not DCP_VARIANTS, whose saves are all full.
VARIANTS["dcp_w2_parity"] = (dict(world_size=2, steps=8, save_at=(2, 4, 6, 8),
                                  policy={"name": "parity"},
                                  extra={"flatten_optimizer": True}), DCP_MODULE)
# Other writers (tests/test_dcp_safetensors.py; not DCP_VARIANTS: torch's FileSystemReader
# reads neither): dcp_w2_fsdp2's run saved by FileSystemWriter(serialization_format=
# SAFETENSORS), each data file's chunks one safetensors blob
DCP_SAFETENSORS_VARIANTS = {
    "dcp_w2_fsdp2_safetensors": (dict(world_size=2, steps=4, save_at=(2, 4),
                                      extra={"flatten_optimizer": True,
                                             "writer": "safetensors"}), DCP_MODULE),
    # ... and its model by HuggingFaceStorageWriter(save_distributed=True): per-rank
    # shard-*.safetensors files, no .metadata (refused by name)
    "dcp_w2_fsdp2_hf": (dict(world_size=2, steps=4, save_at=(2, 4),
                             extra={"flatten_optimizer": True, "writer": "hf"}), DCP_MODULE),
}
VARIANTS.update(DCP_SAFETENSORS_VARIANTS)
# Saved before the first optimizer step (accelerate's save_state before training): one rank,
# no Adam state, one save. Not a merge source: only tests/test_zero3_errors.py uses it.
VARIANTS["w1_step0"] = (dict(world_size=1, steps=0, save_at=(0,)), None)


def spec_for(name: str, save_dir: Path) -> TrainSpec:
    overrides = dict(VARIANTS[name][0])
    if overrides.get("stats"):  # the stats log lives in the save dir
        overrides["stats"] = str(Path(save_dir) / overrides["stats"])
    return replace(TrainSpec(save_dir=str(save_dir)), **overrides)


def fixture_dir(name: str) -> Path:
    spec = spec_for(name, Path("."))
    text = json.dumps(spec.changes(), sort_keys=True, default=list)
    key = hashlib.sha256(f"{FIXTURE_VERSION}{text}{VARIANTS[name][1]}".encode()).hexdigest()[:12]
    return CACHE / f"{name}-{key}"


def build(name: str) -> Path:
    """The save dir of variant `name`, trained now if not cached. Safe to interrupt."""
    final = fixture_dir(name)
    if (final / "DONE").exists():
        return final
    if int(os.environ.get("PMI_SIZE", "1")) > 1:  # ranks of an MPI test must not race
        raise RuntimeError(f"fixture {name} is not built; run `make fixtures` first")
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    launch(spec_for(name, tmp), module=VARIANTS[name][1] or "dev.tinytrain.worker")
    (tmp / "DONE").write_text("ok\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def tag_dir(name: str, step: int) -> Path:
    """The checkpoint of variant `name` saved at `step` (tag dir or HF checkpoint-N)."""
    root = build(name)
    return root / f"checkpoint-{step}" if VARIANTS[name][1] == HF_MODULE \
        else root / f"global_step{step}"


def remove_stale() -> None:
    """Drop cached runs whose spec changed (their hash no longer names a variant)."""
    current = {fixture_dir(n).name for n in VARIANTS}
    for p in CACHE.glob("*") if CACHE.exists() else []:
        if p.is_dir() and p.name not in current:
            shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    if not sys.argv[1:]:
        remove_stale()
    for n in sys.argv[1:] or VARIANTS:
        t = time.time()
        built = (fixture_dir(n) / "DONE").exists()
        build(n)
        print(f"fixture {n}: {'cached' if built else f'built in {time.time() - t:.1f}s'}",
              flush=True)
