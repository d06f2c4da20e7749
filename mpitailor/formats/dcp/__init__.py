"""PyTorch Distributed Checkpoints (DCP: FSDP2, torchtitan, Accelerate FSDP, Megatron's
`torch_dist`), read without torch: a second checkpoint family beside `zero/`.

The face (lazyface.py): what the rest of the package imports from here, by name."""
from __future__ import annotations

from mpitailor.formats.lazyface import face

EXPORTS = {
    "DATA_SUFFIX": "metadata", "METADATA": "metadata", "Chunk": "metadata",
    "DcpMetadata": "metadata", "Item": "metadata", "TensorEntry": "metadata",
    "is_dcp_dir": "metadata", "read_metadata": "metadata",
    "Located": "items", "check_bytes_item": "items", "check_data_files": "items",
    "locate": "items",
    "Key": "keys", "split_key": "keys", "split_keys": "keys", "is_torchtitan": "keys",
    "COMMON_STATE": "megatron", "is_megatron": "megatron", "layer_key": "megatron",
    "optimizer_sharding": "megatron", "split_megatron": "megatron", "is_stacked": "megatron",
    "metadata_bytes": "metadata_write",
    "ZipItem": "safetensors_items", "zip_item": "safetensors_items",
    "DCP_SAVE_FORMAT": "save_record", "DcpSaveMeta": "save_record",
    "DcpSaveRecord": "save_record", "read_dcp_save_record": "save_record",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = face(__name__, EXPORTS)
