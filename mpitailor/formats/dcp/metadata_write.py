"""A DCP `.metadata` written without torch: the pickle `torch.distributed.checkpoint` writes
for the same checkpoint, which torch's FileSystemReader (and any DCP loader) reads back into
its own classes.

The values of metadata.py are written as DCP pickles them: each dataclass as NEWOBJ of its
class and BUILD of its fields, TensorProperties' tuple state, torch.Size, a dtype as its
global, the layout through `torch.serialization._get_layout`. Tensor properties are written
as DCP records a plain tensor's (strided, contiguous, no grad, not pinned): what
`get_state_dict` saves.

Python's C pickler writes it (a 2,646-item checkpoint's in tens of milliseconds, where the
pure one took 0.2 s), over small records of this module: no class of DCP's is imported or
built. The C pickler names a global only by importing it, so the globals the file names are
written first, by hand, each memoized and popped (`module name STACK_GLOBAL MEMOIZE POP`),
and the pickler is given them as already in its memo: every later use is a memo get.
"""
from __future__ import annotations

import copyreg
import io
import pickle

from mpitailor.formats.dcp.metadata import DcpMetadata
from mpitailor.formats.dtypes import DTYPES

_META = "torch.distributed.checkpoint.metadata."
VERSION = "1.0.0"  # DCP's metadata version (torch 2.4 to 2.13)


class _Global(type):
    """A global the output names (a class of DCP's, a function it calls, a dtype): a class
    of this metaclass per name, so that the C pickler can make it (NEWOBJ needs a type) and
    call it (REDUCE needs a callable); written only as a memo get (_Pickler)."""

    def __repr__(cls) -> str:
        return f"<global {cls.global_name}>"


class _Record:
    """An instance of a DCP class: NEWOBJ of its class, BUILD of `state` (None: no BUILD).
    Hashes by identity, as storage_data's MetadataIndex keys must (each is its own key)."""

    __slots__ = ("state",)

    def __init__(self, state) -> None:
        self.state = state


class _Call:
    """`func(*args)` as the pickle writes it: REDUCE."""

    __slots__ = ("args", "func")

    def __init__(self, func: _Global, args: tuple) -> None:
        self.func, self.args = func, args


_GLOBALS: dict[str, _Global] = {}


def _global(name: str) -> _Global:
    cls = _GLOBALS.get(name)
    if cls is None:
        cls = _GLOBALS[name] = _Global(name.rpartition(".")[2], (_Record,),
                                       {"__slots__": (), "global_name": name})
    return cls


class _Names:
    """The globals one output names, in the order first used (so the same metadata always
    gives the same bytes)."""

    def __init__(self) -> None:
        self.used: dict[_Global, None] = {}

    def __call__(self, name: str) -> _Global:
        cls = _global(name)
        self.used.setdefault(cls)
        return cls



class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        kind = type(obj)
        if kind is _Call:
            return obj.func, obj.args
        if type(kind) is _Global:
            return copyreg.__newobj__, (kind,), obj.state
        if kind is _Global:  # every global is in the memo before the dump
            raise TypeError(f"internal error: {obj.global_name} was not named first")
        return NotImplemented


def _dumps(top: _Record, names: _Names) -> bytes:
    """The pickle of top (protocol 4, as DCP writes): the globals first, then the pickler's
    own output after its PROTO."""
    head = bytearray(pickle.PROTO + b"\x04")
    memo = {}
    for i, cls in enumerate(names.used):
        for part in cls.global_name.rpartition(".")[::2]:
            data = part.encode()
            head += pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
        head += pickle.STACK_GLOBAL + pickle.MEMOIZE + pickle.POP
        memo[id(cls)] = (i, cls)
    buf = io.BytesIO()
    p = _Pickler(buf, protocol=4)
    p.memo = memo
    p.dump(top)
    body = buf.getvalue()
    if body[:2] != pickle.PROTO + b"\x04":
        raise AssertionError("internal error: the pickler wrote no protocol 4 header")
    return bytes(head) + body[2:]


def metadata_bytes(meta: DcpMetadata) -> bytes:
    """The `.metadata` of a checkpoint whose entries, chunks and items `meta` describes."""
    names = _Names()
    top = names(_META + "Metadata")(None)
    size, chunk = names("torch.Size"), names(_META + "ChunkStorageMetadata")
    tensor, properties = names(_META + "TensorStorageMetadata"), names(_META + "TensorProperties")
    # one layout and one memory format for all (torch's pickler memoizes them so)
    strided = _Call(names("torch.serialization._get_layout"), ("torch.strided",))
    contiguous = _Call(names(_META + "_MEM_FORMAT_ENCODING"), (0,))
    entries = {}
    for fqn, t in meta.tensors.items():
        dtype = names(f"torch.{DTYPES[t.dtype].torch}")
        entries[fqn] = tensor({
            "properties": properties((dtype, strided, False, contiguous, False)),
            "size": _Call(size, (tuple(t.size),)),  # torch.Size pickles as Size(a tuple)
            "chunks": [chunk({"offsets": _Call(size, (tuple(c.offsets),)),
                              "sizes": _Call(size, (tuple(c.sizes),))}) for c in t.chunks]})
    if meta.bytes_entries:
        blob = names(_META + "BytesStorageMetadata")
        entries.update({fqn: blob(None) for fqn in meta.bytes_entries})
    index, info_of = names(_META + "MetadataIndex"), names(
        "torch.distributed.checkpoint.filesystem._StorageInfo")
    storage = {}
    for (fqn, offsets), item in meta.items.items():
        info = {"relative_path": item.file, "offset": item.offset, "length": item.length}
        if item.transforms:
            info["transform_descriptors"] = list(item.transforms)
        storage[index({"fqn": fqn, "offset": None if offsets is None else _Call(
            size, (tuple(offsets),)), "index": None})] = info_of(info)
    storage_meta = names(_META + "StorageMeta")({
        "checkpoint_id": None, "save_id": meta.save_id, "load_id": None, "modules": []})
    top.state = {
        "state_dict_metadata": entries, "planner_data": dict(meta.planner_data) or None,
        "storage_data": storage, "storage_meta": storage_meta,
        "version": meta.version or VERSION}
    return _dumps(top, names)
