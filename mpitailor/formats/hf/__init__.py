"""Hugging Face files: safetensors files written whole, and the config and tokenizer files
an export carries (the safetensors header itself: formats/safetensors_header.py).

The face (lazyface.py): what the rest of the package imports from here, by name."""
from __future__ import annotations

from mpitailor.formats.lazyface import face

EXPORTS = {
    "NO_CONFIG_HINT": "hf_side", "given_dir_files": "hf_side", "has_config": "hf_side",
    "read_config": "hf_side", "side_files": "hf_side", "warn_if_another_model": "hf_side",
    "write_safetensors": "stwrite",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = face(__name__, EXPORTS)
