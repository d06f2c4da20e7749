"""The tiny Llama config of the DCP fixtures, saved as from_pretrained reads it (what
`export --format hf --config DIR` of them takes)."""
from __future__ import annotations

from pathlib import Path

from ckpt_fixtures import build, spec_for


def tiny_config_dir(folder: Path, name: str = "dcp_w2_parity") -> Path:
    from dev.tinytrain.model import tiny_config
    tiny_config(spec_for(name, build(name))).save_pretrained(folder)
    return folder
