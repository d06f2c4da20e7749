"""Facts about checkpoint files, one subpackage a job, each importing only those before it:

- `io/`: bounded reads of small files, the one loop that fills a buffer from a byte range,
  whole files written with their manifest record, CRC-32 arithmetic, the file system a job
  sees (one node's, or the union of every node's).
- `torch/`: torch's files without torch: its pickle read through an allow-list
  (pickle_read.py, opaque.py, rebuild.py) and written back byte for byte (pickle_write.py),
  its zip container (zip_read.py, zip_write.py), tensors as references to bytes
  (tensorref.py, rawio.py), the checked load (safeload.py), torch's float casts in numpy.
- `zero/`: DeepSpeed ZeRO checkpoints of stages 1-3: layouts, rank files, the checkpoint
  record, full and partial shards, the files around a tag dir.
- `hf/`: safetensors headers and files, the config and tokenizer files an HF export carries.

Beside them, leaves every family shares: the dtype table (dtypes.py) and the manifest, the
commit marker of every output (manifest.py).
"""
