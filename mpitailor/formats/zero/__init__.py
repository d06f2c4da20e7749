"""DeepSpeed ZeRO checkpoints of stages 1-3: layouts, rank files, the checkpoint record (meta),
full and partial shards, the files around a tag dir.

The face (lazyface.py): what the rest of the package imports from here, by name."""
from __future__ import annotations

from mpitailor.formats.lazyface import face

EXPORTS = {
    "frozen_tensor": "consolidate", "full_tensor": "consolidate", "read_range": "consolidate",
    "Extras": "extras", "MODEL_FILE": "extras", "extras_dir": "extras", "read_extras": "extras",
    "weight_files": "extras",
    "LATEST": "files", "LATEST_UNIVERSAL": "files", "Lineage": "files", "MAX_TAG_BYTES": "files",
    "PARTIAL_MANIFEST": "files", "SAVE_RECORD": "files", "STAGE12_MODEL": "files",
    "SaveRecord": "files", "hf_checkpoint_step": "files", "is_tag_dir": "files",
    "model_file": "files", "optim_file": "files", "partial_files": "files",
    "read_file_records": "files", "read_latest": "files", "read_save_record": "files",
    "resolve": "files",
    "ELEMENT": "layout", "KINDS": "layout", "Layout": "layout",
    "OPTIM_BYTES_PER_ELEMENT": "layout", "Slot": "layout", "compute_layout": "layout",
    "CheckpointMeta": "meta",
    "check_partial_rank": "partial_shard",
    "read_meta": "read",
    "open_all_shards": "shard", "open_shard": "shard", "without_flat_buffers": "shard",
    "Shard": "shard_protocol", "ShardStates": "shard_protocol",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = face(__name__, EXPORTS)
