"""DeepSpeed ZeRO checkpoints of stages 1-3: layouts, rank files, the checkpoint record (meta),
full and partial shards, the files around a tag dir."""
