"""The files around a ZeRO-3 tag dir that a resume also needs (rank 0 copies them).

From the base source's save dir (an HF `checkpoint-N/` or a DeepSpeed save dir): trainer
state, rng states, scheduler, training args, config, generation config, tokenizer files,
`zero_to_fp32.py`. Torch files among them are safe-loaded first, so one carrying a pickle
payload is refused rather than passed on. 16-bit weight files are not copied: they hold the
base's weights, not the merged ones: the merge rebuilds them (export/hf_weights.py).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

from mpitailor.commit import copy_synced
from mpitailor.zero3 import CheckpointMeta
from mpitailor.zero3.safeload import load

log = logging.getLogger(__name__)

MANIFEST = "mpitailor_manifest.json"
SKIP = {"latest", "latest_universal", MANIFEST}  # ours name our tags, not the base's
WEIGHT_FILE = re.compile(r"(model|pytorch_model|adapter_model)([-.].*)?\.(safetensors|bin)"
                         r"(\.index\.json)?")
TORCH_SUFFIXES = (".pt", ".pth")


def extras_dir(base: CheckpointMeta) -> Path | None:
    """The save dir around the base's tag dir, when it belongs to that very tag."""
    if base.files.save_dir is not None:
        return base.files.save_dir
    parent = base.files.tag_dir.parent
    latest = parent / "latest"
    if latest.is_file() and latest.read_text().strip() == base.files.tag:
        return parent
    return None


def extra_files(base: CheckpointMeta) -> list[Path]:
    """The files to carry over from the base source's save dir, in name order."""
    save_dir = extras_dir(base)
    if save_dir is None:
        return []
    out = []
    for p in sorted(save_dir.iterdir()):
        if p.name in SKIP or WEIGHT_FILE.fullmatch(p.name) or p.is_dir():
            continue
        if p.is_symlink():
            log.warning("not copying %s: a symbolic link", p)
            continue
        out.append(p)
    return out


def weight_files(base: CheckpointMeta) -> list[Path]:
    """16-bit weight files beside the base's tag dir (to be rebuilt from merged weights)."""
    save_dir = extras_dir(base)
    if save_dir is None:
        return []
    return sorted(p for p in save_dir.iterdir() if WEIGHT_FILE.fullmatch(p.name))


def copy_extras(base: CheckpointMeta, dest: Path) -> dict[str, dict]:
    """Rank 0 only. Copy the extras into dest; {name: manifest record}."""
    records = {}
    for p in extra_files(base):
        if p.suffix in TORCH_SUFFIXES:
            load(p, allow=("numpy", "deepspeed"))  # refuses pickle payloads
        records[p.name] = copy_synced(p, dest / p.name)
    return records
