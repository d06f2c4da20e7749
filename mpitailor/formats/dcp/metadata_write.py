"""A DCP `.metadata` written without torch: the pickle `torch.distributed.checkpoint` writes
for the same checkpoint, which torch's FileSystemReader (and any DCP loader) reads back into
its own classes.

The values of metadata.py are written as DCP pickles them: each dataclass as NEWOBJ of its
class and BUILD of its fields, TensorProperties' tuple state, torch.Size, a dtype as its
global, the layout through `torch.serialization._get_layout`; through the torch writer's
pickler of stand-ins (formats/torch: opaque), so no class of DCP's is imported or built.
Tensor properties are written as DCP records a plain tensor's (strided, contiguous, no
grad, not pinned): what `get_state_dict` saves.
"""
from __future__ import annotations

import io
import pickle

from mpitailor.formats.dcp.metadata import DcpMetadata, TensorEntry
from mpitailor.formats.dtypes import DTYPES
from mpitailor.formats.torch import Size, StandInPickler, stand_in

_META = "torch.distributed.checkpoint.metadata."
VERSION = "1.0.0"  # DCP's metadata version (torch 2.4 to 2.13)


def _new(cls: str, state):
    return stand_in(cls).new(state)


def _properties(dtype: str):
    layout = stand_in("torch.serialization._get_layout")("torch.strided")
    contiguous = stand_in(_META + "_MEM_FORMAT_ENCODING")(0)
    obj = _new(_META + "TensorProperties", None)
    obj.__setstate__((stand_in(f"torch.{DTYPES[dtype].torch}"), layout, False, contiguous,
                      False))
    return obj


def _tensor(t: TensorEntry):
    chunks = [_new(_META + "ChunkStorageMetadata", {"offsets": Size(c.offsets),
                                                   "sizes": Size(c.sizes)})
              for c in t.chunks]
    return _new(_META + "TensorStorageMetadata", {"properties": _properties(t.dtype),
                                                 "size": Size(t.size), "chunks": chunks})


class _Pairs(list):
    """A dict's items, written as the dict (EMPTY_DICT, SETITEMS): storage_data's keys are
    stand-ins that compare by value, which a real dict of them would hash alike and compare
    with one another, N**2/2 times."""


class _Pickler(StandInPickler):
    dispatch = dict(StandInPickler.dispatch)

    def save_pairs(self, obj: _Pairs) -> None:
        self.write(pickle.EMPTY_DICT)
        self.memoize(obj)
        for start in range(0, len(obj), self._BATCHSIZE):
            self.write(pickle.MARK)
            for k, v in obj[start: start + self._BATCHSIZE]:
                self.save(k)
                self.save(v)
            self.write(pickle.SETITEMS)

    dispatch[_Pairs] = save_pairs


def metadata_bytes(meta: DcpMetadata) -> bytes:
    """The `.metadata` of a checkpoint whose entries, chunks and items `meta` describes."""
    entries = {fqn: _tensor(t) for fqn, t in meta.tensors.items()}
    entries.update({fqn: _new(_META + "BytesStorageMetadata", None)
                    for fqn in meta.bytes_entries})
    storage = _Pairs()
    for (fqn, offsets), item in meta.items.items():
        index = _new(_META + "MetadataIndex", {
            "fqn": fqn, "offset": None if offsets is None else Size(offsets), "index": None})
        info = {"relative_path": item.file, "offset": item.offset, "length": item.length}
        if item.transforms:
            info["transform_descriptors"] = list(item.transforms)
        storage.append((index, _new("torch.distributed.checkpoint.filesystem._StorageInfo",
                                    info)))
    storage_meta = _new(_META + "StorageMeta", {
        "checkpoint_id": None, "save_id": meta.save_id, "load_id": None, "modules": []})
    top = _new(_META + "Metadata", {
        "state_dict_metadata": entries, "planner_data": dict(meta.planner_data) or None,
        "storage_data": storage, "storage_meta": storage_meta,
        "version": meta.version or VERSION})
    buf = io.BytesIO()
    _Pickler(buf, protocol=4).dump(top)
    return buf.getvalue()
