"""Consolidated HF weights (safetensors) from a ZeRO-3 checkpoint, written by all ranks.

Parameters are split, in model order, into one contiguous chunk per MPI rank of about equal
bytes; each rank reads its parameters' slices from every partition file (byte ranges only),
casts them to the target dtype and writes its own safetensors file. Rank 0 writes the index
when there is more than one file. Tied aliases are left out, as `save_pretrained` does.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from mpitailor.comm import Comm
from mpitailor.commit import copy_synced, write_synced
from mpitailor.export import contiguous_chunks
from mpitailor.stwrite import write_safetensors
from mpitailor.zero3 import CheckpointMeta
from mpitailor.zero3.consolidate import frozen_tensor, full_tensor
from mpitailor.zero3.shard import open_all_shards

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HF_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def chunk_names(meta: CheckpointMeta, parts: int) -> list[list[str]]:
    """Parameter names (trainable and frozen, model order) in `parts` contiguous chunks."""
    return contiguous_chunks([(s.name, s.numel) for s in meta.layout.slots] +
                             [(n, int(torch.Size(shape).numel()))
                              for n, shape in meta.frozen_shapes], parts)


def file_name(i: int, n: int) -> str:
    return SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_hf_weights(comm: Comm, meta: CheckpointMeta, dest: Path, dtype: str) -> dict:
    """Collective: write consolidated weights of `meta` into dest; {file: manifest record}."""
    chunks = chunk_names(meta, comm.size)
    dt = DTYPES[dtype]

    def write_mine() -> dict[str, dict]:
        if comm.rank >= len(chunks):
            return {}
        name = file_name(comm.rank, len(chunks))
        return {name: _write_chunk(meta, chunks[comm.rank], dest / name, dt)}

    records = {k: v for part in comm.allgather(comm.step(write_mine)) for k, v in part.items()}
    if len(chunks) > 1:
        def write_index() -> dict[str, dict]:
            weight_map = {n: file_name(i, len(chunks)) for i, c in enumerate(chunks) for n in c}
            total = sum(r["tensor_bytes"] for r in records.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            return {INDEX: write_synced(dest / INDEX, json.dumps(index, indent=2).encode())}
        records.update(comm.root_step(write_index))
    return records


def _write_chunk(meta: CheckpointMeta, names: list[str], path: Path, dtype) -> dict:
    slots = meta.layout.by_name()
    frozen = dict(meta.frozen_shapes)
    tensors = {}
    with open_all_shards(meta) as shards:
        for n in names:
            t = full_tensor(shards, slots[n], "fp32") if n in slots else \
                frozen_tensor(shards, n, frozen[n])
            tensors[n] = t.to(dtype).contiguous()
    rec = write_safetensors(path, tensors, metadata={"format": "pt"})  # CRC in the same pass
    rec["tensor_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    return rec


SAFETENSORS_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


def weights_dtype(path: Path) -> str:
    """dtype ('bf16', 'fp16', 'fp32') of an existing safetensors file, or of an index's first."""
    from safetensors import safe_open
    if path.name.endswith(".index.json"):
        path = path.parent / next(iter(json.loads(path.read_text())["weight_map"].values()))
    with safe_open(str(path), "pt") as f:
        key = next(iter(f.keys()))
        return SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype(), "fp32")


HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def export_hf(comm: Comm, staged: CheckpointMeta, side_dir: Path | None, dest: Path,
              dtype: str) -> dict:
    """Collective: `--export safetensors`: consolidated weights in `dtype` into dest (one
    file per rank, with an index), plus config and tokenizer files from side_dir."""
    def prepare() -> dict:
        dest.mkdir()
        records = {}
        for name in HF_SIDE_FILES:
            src = side_dir / name if side_dir is not None else None
            if src is None or not src.is_file() or src.is_symlink():
                continue
            if name == "config.json":  # the config says which dtype the weights are in
                config = json.loads(src.read_text())
                for key in ("torch_dtype", "dtype"):
                    if key in config or key == "dtype":
                        config[key] = HF_DTYPE_NAMES[dtype]
                records[name] = write_synced(dest / name, json.dumps(config, indent=2).encode())
            else:
                records[name] = copy_synced(src, dest / name)
        return records
    records = comm.root_step(prepare)
    records.update(write_hf_weights(comm, staged, dest, dtype))
    return records
